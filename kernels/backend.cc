// backend.cc: the small device-neutral helpers of the backend contract.
#include "kernels/backend.h"

#include <utility>

namespace hsx {

const char* ElementTypeName(ElementType type) { return type == ElementType::kF32 ? "f32" : "bf16"; }

namespace {

class CompletedFence : public CopyFence {
 public:
  explicit CompletedFence(absl::Status status) : status_(std::move(status)) {}
  absl::Status Wait() override { return status_; }

 private:
  const absl::Status status_;
};

}  // namespace

std::shared_ptr<CopyFence> CompletedCopyFence(absl::Status status) {
  return std::make_shared<CompletedFence>(std::move(status));
}

absl::StatusOr<std::shared_ptr<CopyFence>> Backend::FenceCopies() {
  if (absl::Status s = Synchronize(); !s.ok()) return s;
  return CompletedCopyFence();
}

int64_t LinearWeight::bytes() const {
  if (kind == Kind::kBf16) return out * in * 2;
  return out * in / 2 + out * (in / group_size) * 2;  // packed nibbles + bf16 scales
}

}  // namespace hsx
