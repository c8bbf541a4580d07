// device_factory.cc: the CPU factory; CUDA is refused until its backend lands.
#include "server/runtime/device_factory.h"

#include <algorithm>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/in_process_communicator.h"

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
    return absl::UnimplementedError("--device cuda: not available in this build (CPU backend only); use --device cpu");
  }
  const int cores = threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::make_unique<CpuFactory>(precision, tp, std::max(1, cores / tp));
}

}  // namespace hsx
