// proto_dtype.h: the one mapping between the API's enums and their
// counterparts here: v1::DType and OutputDType, v1::Checksum and ChecksumKind.
#ifndef HSX_FORMAT_PROTO_DTYPE_H_
#define HSX_FORMAT_PROTO_DTYPE_H_

#include "absl/status/statusor.h"
#include "format/encoding.h"
#include "format/tensor_hash.h"
#include "hsx/v1/hsx.pb.h"

namespace hsx {

v1::DType OutputDTypeToProto(OutputDType dtype);

// A request's dtype field (any int: the enum is open); DTYPE_UNSPECIFIED is
// bf16. An unknown value is INVALID_ARGUMENT naming the field and the values.
absl::StatusOr<OutputDType> OutputDTypeFromProto(int value);

v1::Checksum ChecksumKindToProto(ChecksumKind kind);

// A request's checksum field: CHECKSUM_UNSPECIFIED is XXH64; an unknown value
// is INVALID_ARGUMENT naming the field and the values.
absl::StatusOr<ChecksumKind> ChecksumKindFromProto(int value);

}  // namespace hsx

#endif  // HSX_FORMAT_PROTO_DTYPE_H_
