// device_factory.cc: the CPU factory, and the CUDA factory where the build
// has CUDA (HSX_HAVE_CUDA).
#include "server/runtime/device_factory.h"

#include <algorithm>
#include <cstdio>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/in_process_communicator.h"
#if HSX_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace hsx {
namespace {

class CpuFactory : public DeviceFactory {
 public:
  CpuFactory(Precision precision, int tp, int threads_per_rank)
      : precision_(precision), tp_(tp), threads_per_rank_(threads_per_rank) {}

  absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(int rank) override {
    return MakeCpuBackend(precision_, threads_per_rank_);
  }

  absl::StatusOr<std::unique_ptr<CommunicatorGroup>> MakeGroup(std::span<Backend* const> backends) override {
    return std::make_unique<InProcessGroup>(static_cast<int>(backends.size()));
  }

 private:
  Precision precision_;
  int tp_;
  int threads_per_rank_;
};

#if HSX_HAVE_CUDA
// Rank r runs on CUDA device r. One rank only for now: several ranks need a
// device communicator (the tensor-parallelism issue).
class CudaFactory : public DeviceFactory {
 public:
  explicit CudaFactory(Precision precision) : precision_(precision) {}

  absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(int rank) override {
    return MakeCudaBackend(rank, precision_);
  }

  absl::StatusOr<std::unique_ptr<CommunicatorGroup>> MakeGroup(std::span<Backend* const> backends) override {
    if (backends.size() != 1) {
      return absl::UnimplementedError("tensor parallelism on CUDA arrives with the TP issue; use --tp 1");
    }
    return std::make_unique<InProcessGroup>(1);  // never called into with one rank
  }

 private:
  Precision precision_;
};

// Checks for a device and logs the start-up line (GPU, memory, driver and
// runtime versions). The weights are checked against free memory as they are
// placed (CudaBackend keeps kCudaReservedBytes free for activations).
absl::StatusOr<std::unique_ptr<DeviceFactory>> MakeCudaFactory(Precision precision, int tp) {
  if (tp != 1) {
    return absl::UnimplementedError(
        absl::StrCat("--tp ", tp, " with --device cuda: tensor parallelism on CUDA arrives with the TP issue; use --tp 1"));
  }
  absl::StatusOr<std::string> device = DescribeCudaDevice(0);
  if (!device.ok()) return absl::Status(device.status().code(), absl::StrCat("--device cuda: ", device.status().message()));
  std::fprintf(stderr, "hsx: --device cuda: %s; %s activations\n", device->c_str(),
               precision == Precision::kBf16 ? "bf16" : "fp32");
  return std::make_unique<CudaFactory>(precision);
}
#endif

}  // namespace

absl::StatusOr<Device> ParseDevice(absl::string_view name) {
  if (name == "cpu") return Device::kCpu;
  if (name == "cuda") return Device::kCuda;
  return absl::InvalidArgumentError(absl::StrCat("--device '", name, "': expected cpu or cuda"));
}

const char* DeviceName(Device device) { return device == Device::kCpu ? "cpu" : "cuda"; }

absl::StatusOr<std::unique_ptr<DeviceFactory>> MakeDeviceFactory(Device device, Precision precision, int tp,
                                                                 int threads) {
  if (device == Device::kCuda) {
#if HSX_HAVE_CUDA
    return MakeCudaFactory(precision, tp);
#else
    return absl::UnimplementedError(
        "--device cuda: not available in this build (built without CUDA: nvcc was not found or HSX_ENABLE_CUDA=OFF); "
        "use --device cpu");
#endif
  }
  const int cores = threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::make_unique<CpuFactory>(precision, tp, std::max(1, cores / tp));
}

}  // namespace hsx
