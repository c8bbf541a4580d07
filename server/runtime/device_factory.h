// device_factory.h: which backend and communicators an engine's ranks get.
//
// The engine never names a backend class: it asks a DeviceFactory, chosen by
// the device name ("cpu", "cuda"), for one backend per rank (built on that
// rank's own thread, which then owns it) and for the communicator group that
// joins them. Adding a device means adding a factory here; tests inject their
// own (for example one whose backend fails an op on purpose).
#ifndef HSX_SERVER_RUNTIME_DEVICE_FACTORY_H_
#define HSX_SERVER_RUNTIME_DEVICE_FACTORY_H_

#include <memory>
#include <span>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "kernels/cuda_attention.h"
#include "server/model/config.h"

namespace hsx {

enum class Device { kCpu, kCuda };

// "cpu" or "cuda"; anything else is an InvalidArgument naming the value.
absl::StatusOr<Device> ParseDevice(absl::string_view name);
const char* DeviceName(Device device);

// The attention kernel of --device cuda (kernels/cuda_attention.h):
// "reference" (the default) or "cudnn". Anything else is an InvalidArgument.
absl::StatusOr<CudaAttention> ParseAttentionKernel(absl::string_view name);
const char* AttentionKernelName(CudaAttention kernel);

class DeviceFactory {
 public:
  virtual ~DeviceFactory() = default;
  // The backend of rank `rank`; called on that rank's thread.
  virtual absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(int rank) = 0;
  // The group joining the ranks' backends (backends[r] is rank r's), made once
  // every backend exists.
  virtual absl::StatusOr<std::unique_ptr<CommunicatorGroup>> MakeGroup(std::span<Backend* const> backends) = 0;
  // Called once before any backend exists: checks that the model and a batch
  // of max_batch_tokens fit the devices (the CUDA factory's memory plan,
  // server/runtime/memory_plan.h) and logs the plan. The CPU has none.
  virtual absl::Status PlanMemory(const ModelConfig& config, int64_t max_batch_tokens) { return absl::OkStatus(); }
};

// The factory for `device`: `tp` ranks sharing `threads` CPU threads (0: all
// cores). On CUDA, rank r runs on GPU r / ranks_per_device (1: one rank per
// GPU; tp: all on GPU 0). Unimplemented, with a message saying so, for a
// device this build cannot drive; FailedPrecondition where it has no GPU.
// `attention` picks the CUDA attention kernel; kCudnn on the CPU is an
// InvalidArgument. With kCudnn, PlanMemory builds the SDPA graph for the
// model's shape on each GPU and refuses start-up with cuDNN's reason when it
// cannot serve (no silent fallback to the reference kernel).
absl::StatusOr<std::unique_ptr<DeviceFactory>> MakeDeviceFactory(
    Device device, ElementType precision, int tp, int threads, int ranks_per_device = 1,
    CudaAttention attention = CudaAttention::kReference);

}  // namespace hsx

#endif  // HSX_SERVER_RUNTIME_DEVICE_FACTORY_H_
