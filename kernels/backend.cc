// backend.cc: the small device-neutral helpers of the backend contract.
#include "kernels/backend.h"

namespace hsx {

const char* ElementTypeName(ElementType type) { return type == ElementType::kF32 ? "f32" : "bf16"; }

int64_t LinearWeight::bytes() const {
  if (kind == Kind::kBf16) return out * in * 2;
  return out * in / 2 + out * (in / group_size) * 2;  // packed nibbles + bf16 scales
}

}  // namespace hsx
