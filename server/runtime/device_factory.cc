// device_factory.cc: the CPU factory, and the CUDA factory where the build
// has CUDA (HSX_HAVE_CUDA).
#include "server/runtime/device_factory.h"

#include <algorithm>
#include <cstdio>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/in_process_communicator.h"
#include "server/runtime/memory_plan.h"
#if HSX_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_communicator.h"
#endif

namespace hsx {
namespace {

class CpuFactory : public DeviceFactory {
 public:
  CpuFactory(ElementType precision, int tp, int threads_per_rank)
      : precision_(precision), tp_(tp), threads_per_rank_(threads_per_rank) {}

  absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(int rank) override {
    return MakeCpuBackend(precision_, threads_per_rank_);
  }

  absl::StatusOr<std::unique_ptr<CommunicatorGroup>> MakeGroup(std::span<Backend* const> backends) override {
    return std::make_unique<InProcessGroup>(static_cast<int>(backends.size()));
  }

 private:
  ElementType precision_;
  int tp_;
  int threads_per_rank_;
};

#if HSX_HAVE_CUDA
// Rank r runs on CUDA device layout.device_of(r). Ranks meet through the
// same-device transport when they share GPU 0, else through NCCL
// (kernels/cuda/cuda_communicator.h).
class CudaFactory : public DeviceFactory {
 public:
  CudaFactory(ElementType precision, RankLayout layout, CudaAttention attention)
      : precision_(precision), layout_(layout), attention_(attention) {}

  absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(int rank) override {
    return MakeCudaBackend(layout_.device_of(rank), precision_, attention_);
  }

  absl::StatusOr<std::unique_ptr<CommunicatorGroup>> MakeGroup(std::span<Backend* const> backends) override {
    if (backends.size() == 1) return std::make_unique<InProcessGroup>(1);  // never called into with one rank
    absl::StatusOr<std::unique_ptr<CommunicatorGroup>> group =
        layout_.same_device() ? MakeSameDeviceGroup(backends) : MakeNcclGroup(backends);
    if (!group.ok()) {
      return absl::Status(group.status().code(),
                          absl::StrCat("--device cuda --tp ", layout_.tp, ": ", group.status().message()));
    }
    std::fprintf(stderr, "hsx: --device cuda: %d ranks, %s transport\n", layout_.tp,
                 layout_.same_device() ? "same-device" : "NCCL");
    return group;
  }

  // The start-up line of each GPU, then the up-front plan: each GPU's free
  // memory against its ranks' weights, scratch and batch budget.
  absl::Status PlanMemory(const ModelConfig& config, int64_t max_batch_tokens) override {
    std::vector<int64_t> free;
    for (int d = 0; d < layout_.devices(); ++d) {
      absl::StatusOr<std::string> device = DescribeCudaDevice(d);
      if (!device.ok()) {
        return absl::Status(device.status().code(), absl::StrCat("--device cuda: ", device.status().message()));
      }
      std::fprintf(stderr, "hsx: --device cuda: %s; %s activations; %s attention\n", device->c_str(),
                   precision_ == ElementType::kBf16 ? "bf16" : "fp32", AttentionKernelName(attention_));
      if (absl::Status s = ProbeAttention(config, d, max_batch_tokens); !s.ok()) return s;
      absl::StatusOr<CudaMemory> memory = CudaMemoryInfo(d);
      if (!memory.ok()) return absl::Status(memory.status().code(), absl::StrCat("--device cuda: ", memory.status().message()));
      free.push_back(memory->free);
    }
    std::vector<DevicePlan> plans;
    const absl::Status fits = CheckMemoryPlan(config, layout_, max_batch_tokens, precision_, free, &plans);
    for (const DevicePlan& plan : plans) {
      std::fprintf(stderr, "hsx: memory plan: %s%s\n", DescribeDevicePlan(plan, max_batch_tokens).c_str(),
                   plan.fits() ? "" : " (does not fit)");
    }
    if (!fits.ok()) return absl::Status(fits.code(), absl::StrCat("--device cuda: ", fits.message()));
    return absl::OkStatus();
  }

 private:
  // --attention=cudnn: the SDPA graph for this model's heads per rank and head
  // dims must build on device d, or start-up stops with cuDNN's reason.
  absl::Status ProbeAttention(const ModelConfig& config, int d, int64_t max_batch_tokens) {
    if (attention_ != CudaAttention::kCudnn) return absl::OkStatus();
    absl::StatusOr<std::string> cudnn =
        ProbeCudnnAttention(d, precision_, config.num_attention_heads / layout_.tp, config.qk_head_dim(),
                            config.v_head_dim, max_batch_tokens);
    if (!cudnn.ok()) {
      return absl::Status(cudnn.status().code(), absl::StrCat("--attention=cudnn: ", cudnn.status().message(),
                                                              " (--attention=reference runs the reference kernel)"));
    }
    std::fprintf(stderr, "hsx: --attention=cudnn: %s on GPU %d\n", cudnn->c_str(), d);
    return absl::OkStatus();
  }

  ElementType precision_;
  RankLayout layout_;
  CudaAttention attention_;
};

// Checks for the devices the layout needs. The engine then calls PlanMemory,
// which logs the start-up line of each GPU (name, memory, driver and runtime
// versions) and the plan, before any weight is loaded.
absl::StatusOr<std::unique_ptr<DeviceFactory>> MakeCudaFactory(ElementType precision, int tp, int ranks_per_device,
                                                               CudaAttention attention) {
  absl::StatusOr<int> count = CudaDeviceCount();
  if (!count.ok()) return absl::Status(count.status().code(), absl::StrCat("--device cuda: ", count.status().message()));
  absl::StatusOr<RankLayout> layout = MakeRankLayout(tp, ranks_per_device, *count);
  if (!layout.ok()) return absl::Status(layout.status().code(), absl::StrCat("--device cuda: ", layout.status().message()));
  return std::make_unique<CudaFactory>(precision, *layout, attention);
}
#endif

}  // namespace

absl::StatusOr<Device> ParseDevice(absl::string_view name) {
  if (name == "cpu") return Device::kCpu;
  if (name == "cuda") return Device::kCuda;
  return absl::InvalidArgumentError(absl::StrCat("--device '", name, "': expected cpu or cuda"));
}

const char* DeviceName(Device device) { return device == Device::kCpu ? "cpu" : "cuda"; }

absl::StatusOr<CudaAttention> ParseAttentionKernel(absl::string_view name) {
  if (name == "reference") return CudaAttention::kReference;
  if (name == "cudnn") return CudaAttention::kCudnn;
  return absl::InvalidArgumentError(absl::StrCat("--attention '", name, "': expected reference or cudnn"));
}

const char* AttentionKernelName(CudaAttention kernel) {
  return kernel == CudaAttention::kReference ? "reference" : "cudnn";
}

absl::StatusOr<std::unique_ptr<DeviceFactory>> MakeDeviceFactory(Device device, ElementType precision, int tp,
                                                                 int threads, int ranks_per_device,
                                                                 CudaAttention attention) {
  if (device == Device::kCuda) {
#if HSX_HAVE_CUDA
    return MakeCudaFactory(precision, tp, ranks_per_device, attention);
#else
    return absl::UnimplementedError(
        "--device cuda: not available in this build (built without CUDA: nvcc was not found or HSX_ENABLE_CUDA=OFF); "
        "use --device cpu");
#endif
  }
  if (attention != CudaAttention::kReference) {
    return absl::InvalidArgumentError("--attention=cudnn: applies to --device cuda only");
  }
  if (ranks_per_device != 1) {
    return absl::InvalidArgumentError(absl::StrCat("--ranks-per-device ", ranks_per_device,
                                                   ": applies to --device cuda only (CPU ranks are threads)"));
  }
  const int cores = threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::make_unique<CpuFactory>(precision, tp, std::max(1, cores / tp));
}

}  // namespace hsx
