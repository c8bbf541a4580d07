// sample_encoding.h: one sample's rows made the bytes to send or store: in
// the output dtype, every tensor checked and hashed. The one place where it
// is decided whether the rows are converted (into a new buffer) or used where
// they are.
//
// The rows are used where they are when they are in the output dtype already
// (bf16 rows sent as bf16, f32 rows as fp32: the conversion would be a copy;
// fp8 rows a device encoded, Backend::CopyToHostFp8, sent as fp8) and their
// owner holds nothing else (the engine's per-sample buffer holding
// exactly the tensors asked for: keeping it is then the memory bound
// docs/api.md states). Each tensor is then checked and hashed in place
// (CheckTensor, or CheckFp8Tensor for fp8 rows: one read-only pass), unless
// it carries findings made with the asked checksum already (the engine's
// capture check: its findings stand for that pass, and the rows are not
// read at all). Otherwise every tensor is
// converted, checked and hashed in one pass (EncodeTensor) into one buffer
// from `allocate`, and the rows are let go.
#ifndef HSX_FORMAT_SAMPLE_ENCODING_H_
#define HSX_FORMAT_SAMPLE_ENCODING_H_

#include <cstddef>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "format/encoding.h"
#include "format/sample_tensors.h"
#include "format/tensor_hash.h"
#include "kernels/backend.h"

namespace hsx {

using BufferAllocator = std::function<absl::StatusOr<std::unique_ptr<HostBuffer>>(size_t bytes)>;

// `rows` (bf16 or fp32, one piece per tensor) in `dtype`, each tensor with
// findings made with `checksum`, as above. A bad value is a finding, not an
// error: the consumer reports it in its own words. Errors: the allocation's,
// or INTERNAL for rows this cannot read (fp16, or a tensor in pieces).
absl::StatusOr<SampleTensors> EncodeSample(SampleTensors rows, OutputDType dtype, ChecksumKind checksum,
                                           const BufferAllocator& allocate);

}  // namespace hsx

#endif  // HSX_FORMAT_SAMPLE_ENCODING_H_
