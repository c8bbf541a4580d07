// fault_injection.cc: the backend that loses its device on cue.
#include "server/runtime/fault_injection.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/device_lost.h"
#include "kernels/forwarding_backend.h"

namespace hsx {
namespace {

class DeviceLossBackend : public ForwardingBackend {
 public:
  DeviceLossBackend(std::unique_ptr<Backend> inner, int rank, std::shared_ptr<DeviceLossFactory::Countdown> countdown)
      : ForwardingBackend(std::move(inner)), rank_(rank), countdown_(std::move(countdown)) {}

  absl::StatusOr<std::unique_ptr<StagedBatch>> Stage(std::span<const int32_t> tokens,
                                                     std::span<const int64_t> cu_seqlens) override {
    if (!lost_.ok()) return lost_;
    // One Stage per batch: count it; the batch after the last one allowed is lost.
    int64_t left = countdown_->batches.load();
    while (left >= 0 && !countdown_->batches.compare_exchange_weak(left, left - 1)) {
    }
    if (left == 0) {
      lost_ = MarkDeviceLost(
          absl::InternalError(absl::StrCat(
              name(), " (rank ", rank_, ") Synchronize: injected device loss after ", countdown_->armed_with,
              " batches (--inject-device-loss-after-batches): every later call on this device fails")),
          name());
    }
    return ForwardingBackend::Stage(tokens, cu_seqlens);
  }

  absl::Status Synchronize() override {
    absl::Status inner = ForwardingBackend::Synchronize();
    return lost_.ok() ? inner : lost_;
  }

 private:
  const int rank_;
  std::shared_ptr<DeviceLossFactory::Countdown> countdown_;
  absl::Status lost_;  // sticky, as a CUDA context's error is
};

}  // namespace

DeviceLossFactory::DeviceLossFactory(std::unique_ptr<DeviceFactory> inner, int rank)
    : inner_(std::move(inner)), rank_(rank) {}

void DeviceLossFactory::Arm(int64_t batches) {
  countdown_->armed_with = batches;
  countdown_->batches.store(batches);
}

absl::StatusOr<std::unique_ptr<Backend>> DeviceLossFactory::MakeBackend(int rank) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = inner_->MakeBackend(rank);
  if (!backend.ok() || rank != rank_) return backend;
  return std::make_unique<DeviceLossBackend>(*std::move(backend), rank, countdown_);
}

}  // namespace hsx
