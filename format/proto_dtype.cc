// proto_dtype.cc: v1::DType <-> OutputDType, v1::Checksum <-> ChecksumKind.
#include "format/proto_dtype.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace hsx {

v1::DType OutputDTypeToProto(OutputDType dtype) {
  switch (dtype) {
    case OutputDType::kBf16: return v1::DTYPE_BF16;
    case OutputDType::kFp16: return v1::DTYPE_FP16;
    case OutputDType::kFp32: return v1::DTYPE_FP32;
    case OutputDType::kFp8: return v1::DTYPE_FP8_E4M3;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<OutputDType> OutputDTypeFromProto(int value) {
  switch (value) {
    case v1::DTYPE_UNSPECIFIED:
    case v1::DTYPE_BF16: return OutputDType::kBf16;
    case v1::DTYPE_FP16: return OutputDType::kFp16;
    case v1::DTYPE_FP32: return OutputDType::kFp32;
    case v1::DTYPE_FP8_E4M3: return OutputDType::kFp8;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "dtype: unknown enum value ", value, " (expected DTYPE_BF16 = 1, DTYPE_FP16 = 2, DTYPE_FP32 = 3 or DTYPE_FP8_E4M3 = 4; "
          "0 means bf16)"));
  }
}

v1::Checksum ChecksumKindToProto(ChecksumKind kind) {
  return kind == ChecksumKind::kXxh3 ? v1::CHECKSUM_XXH3_64 : v1::CHECKSUM_XXH64;
}

absl::StatusOr<ChecksumKind> ChecksumKindFromProto(int value) {
  switch (value) {
    case v1::CHECKSUM_UNSPECIFIED:
    case v1::CHECKSUM_XXH64: return ChecksumKind::kXxh64;
    case v1::CHECKSUM_XXH3_64: return ChecksumKind::kXxh3;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "checksum: unknown enum value ", value, " (expected CHECKSUM_XXH64 = 1 or CHECKSUM_XXH3_64 = 2; "
          "0 means XXH64)"));
  }
}

}  // namespace hsx
