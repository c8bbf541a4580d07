// fault_injection.h: a lost device on demand, for testing what the engine and
// the server do then (hsx-server's hidden flag
// --inject-device-loss-after-batches, tests/python/test_device_loss.py).
//
// DeviceLossFactory wraps the real factory. Rank `rank`'s backend counts the
// batches it stages from Arm(n) on; the batch after the first n fails as a
// sticky CUDA error would: its Synchronize() (the end of Model::Run) returns
// an INTERNAL error marked device-lost (kernels/device_lost.h), and so does
// every later Stage() and Synchronize() of that backend. Before Arm() nothing
// fails (the start-up self-check runs normally). Nothing else differs from
// the wrapped factory.
#ifndef HSX_SERVER_RUNTIME_FAULT_INJECTION_H_
#define HSX_SERVER_RUNTIME_FAULT_INJECTION_H_

#include <atomic>
#include <cstdint>
#include <memory>

#include "server/runtime/device_factory.h"

namespace hsx {

class DeviceLossFactory : public DeviceFactory {
 public:
  DeviceLossFactory(std::unique_ptr<DeviceFactory> inner, int rank);

  // From now on, the batch after the next `batches` ones loses the device.
  void Arm(int64_t batches);

  absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(int rank) override;
  absl::StatusOr<std::unique_ptr<CommunicatorGroup>> MakeGroup(std::span<Backend* const> backends) override {
    return inner_->MakeGroup(backends);
  }
  absl::Status PlanMemory(const ModelConfig& config, int64_t max_batch_tokens) override {
    return inner_->PlanMemory(config, max_batch_tokens);
  }

  // Shared with the faulty rank's backend: batches left before the loss;
  // -1 while not armed.
  struct Countdown {
    std::atomic<int64_t> batches{-1};
    int64_t armed_with = 0;
  };

 private:
  std::unique_ptr<DeviceFactory> inner_;
  const int rank_;
  std::shared_ptr<Countdown> countdown_ = std::make_shared<Countdown>();
};

}  // namespace hsx

#endif  // HSX_SERVER_RUNTIME_FAULT_INJECTION_H_
