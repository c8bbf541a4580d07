// tensor_encoding.h: one captured tensor converted to the output dtype,
// checked and hashed in a single pass.
//
// The values go through the cache in blocks of kEncodeBlock: each block is
// converted (bf16 round-to-nearest-even, IEEE fp16, or fp32, exactly as
// AppendEncoded in encoding.h does, bit for bit), checked (every value finite
// and representable: not rounded to an infinity in bf16 or fp16; whether any
// is non-zero) and fed to the checksum (XXH64 or XXH3, tensor_hash.h) while
// it is still in L1. The conversion loops are plain loops over uint32_t that
// the compiler vectorises (the file is built with -O3; see
// server/CMakeLists.txt). fp16 stays scalar: only bf16 is on the hot path.
#ifndef HSX_FORMAT_TENSOR_ENCODING_H_
#define HSX_FORMAT_TENSOR_ENCODING_H_

#include <cstdint>

#include "kernels/backend.h"
#include "format/encoding.h"
#include "format/tensor_hash.h"

namespace hsx {

inline constexpr int64_t kEncodeBlock = 4096;  // values per block

// What a check of one tensor's values found (EncodeTensor, CheckTensor,
// TensorChecker, the stream assembler): the verdicts and the digest of its
// bytes in the output dtype.
struct TensorFindings {
  ChecksumKind checksum_kind = ChecksumKind::kXxh64;
  uint64_t checksum = 0;  // of the encoded bytes (checksum_kind), seed 0
  bool nonzero = false;  // some value is neither +0 nor -0
  // The first value that cannot be sent (non-finite, or over the output
  // dtype's range), or -1; encoding stops there and checksum is then
  // meaningless.
  int64_t bad_index = -1;
  float bad_value = 0;
  // fp8: the bad value is the scale of row bad_index / hidden (not finite,
  // or not positive); bad_value holds it.
  bool bad_scale = false;
};

// Encodes `count` values at `src` (activation type kF32 or kBf16) into
// `dst`, which holds count * OutputDTypeSize(dtype) bytes.
TensorFindings EncodeTensor(const void* src, ElementType type, int64_t count, OutputDType dtype, char* dst,
                            ChecksumKind checksum = ChecksumKind::kXxh64);

// The same checks and hash over `count` values at `src` that are already in
// `dtype` (bf16 rows for kBf16, float32 rows for kFp32; not kFp16), read in
// place: what EncodeTensor returns for the identity conversion, without the copy.
TensorFindings CheckTensor(const void* src, int64_t count, OutputDType dtype,
                           ChecksumKind checksum = ChecksumKind::kXxh64);

// How rows are checked and hashed before they are sent as they are:
// CheckTensor's `dtype` and `checksum`.
struct RowCheck {
  OutputDType dtype = OutputDType::kBf16;
  ChecksumKind checksum = ChecksumKind::kXxh64;
  bool operator==(const RowCheck&) const = default;
};

// CheckTensor fed piece by piece: the values of one tensor in order, in any
// number of pieces, give what CheckTensor gives over all of them at once. The
// batcher's capture check feeds each piece of rows the CPU engine's capture
// copy has just written, so that the check and the hash read them from cache
// (server/runtime/capture_check.h).
class TensorChecker {
 public:
  // `dtype` as for CheckTensor (kBf16 or kFp32).
  TensorChecker(OutputDType dtype, ChecksumKind checksum);
  explicit TensorChecker(const RowCheck& check) : TensorChecker(check.dtype, check.checksum) {}
  TensorChecker(const TensorChecker&) = delete;
  TensorChecker& operator=(const TensorChecker&) = delete;

  // The next `count` values. After a bad value the rest is skipped.
  void Update(const void* values, int64_t count);
  // Of every value fed so far (bad_index counts from the first).
  TensorFindings Finish() const;

 private:
  OutputDType dtype_;
  TensorHash hash_;
  int64_t fed_ = 0;
  uint32_t nonzero_ = 0;
  int64_t bad_index_ = -1;
  float bad_value_ = 0;
};

// True when rows of activation type `type` are already in `dtype` (bf16 rows
// for kBf16, float32 rows for kFp32): sending them is a copy at most, and
// CheckTensor / TensorChecker check them.
bool SentAsIs(ElementType type, OutputDType dtype);

// The output dtype rows of activation type `type` already are (bf16: kBf16,
// f32: kFp32), and back (kFp16 is no activation type: kF32).
OutputDType DTypeOfRows(ElementType type);
ElementType RowsOfDType(OutputDType dtype);

// The receiving side's check of values already encoded: the index of the
// first of `count` values at `bytes` (little-endian `dtype`; for fp8 e4m3
// bytes without their scales, CheckFp8Bytes) that is not
// finite in its own dtype (all exponent bits set), or -1. ORs into *nonzero
// whether any value is neither +0 nor -0. Vectorised like EncodeTensor;
// `bytes` needs no alignment (values are read where they arrived).
int64_t CheckEncoded(const void* bytes, int64_t count, OutputDType dtype, bool* nonzero);

}  // namespace hsx

#endif  // HSX_FORMAT_TENSOR_ENCODING_H_
