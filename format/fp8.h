// fp8.h: the fp8 output dtype: float8 e4m3 (OCP "e4m3fn": 4 exponent bits,
// bias 7, 3 mantissa bits, no infinities, 0x7f and 0xff are NaN, largest
// finite 448) with one float32 scale per row (per token per layer).
//
// The scale rule (docs/formats.md, "fp8"): a row's scale is its largest
// absolute value divided by 448, at least FLT_MIN (the smallest normal
// float32), and 1 for a row of zeros; each value is stored as
// e4m3(value / scale), rounded to nearest even (a quotient of 448 or more in
// magnitude, which rounding of the division can give, saturates to 448). A
// value is read back as e4m3 * scale (in float32). Every scale is therefore
// finite and positive, which both decoders require. The rule itself is
// defined once, in kernels/fp8_e4m3.h, for this encoder and the CUDA
// backend's (Backend::CopyToHostFp8).
//
// An encoded row is its scale (4 bytes, little-endian float32) followed by
// its `hidden` e4m3 bytes: RowBytes(kFp8, hidden) = hidden + 4 bytes. The
// stream sends rows so (the checksum covers scales and payload); the file
// splits them into hidden_states (F8_E4M3) and hidden_states_scales (F32).
#ifndef HSX_FORMAT_FP8_H_
#define HSX_FORMAT_FP8_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "format/tensor_encoding.h"
#include "format/tensor_hash.h"
#include "kernels/backend.h"
#include "kernels/fp8_e4m3.h"  // the rounding rule, kFp8Max, kFp8ScaleBytes, Fp8RowScale

namespace hsx {

// e4m3 bits of `value` (finite), rounded to nearest even; magnitudes of 448
// or more give +-448.
uint8_t FloatToFp8E4m3(float value);
// The value of e4m3 bits (NaN for 0x7f and 0xff).
float Fp8E4m3ToFloat(uint8_t bits);

// What a decoder accepts as a scale: finite and greater than zero.
inline bool ValidFp8Scale(float scale) { return scale > 0 && scale <= 3.4028234663852886e38f; }

// One row of `hidden` finite values into `out` (RowBytes(kFp8, hidden) bytes).
void EncodeFp8Row(const float* values, int64_t hidden, char* out);
// The inverse: `hidden` values of the encoded row at `row` (any alignment).
void DecodeFp8Row(const uint8_t* row, int64_t hidden, float* out);

// `count` rows of `hidden` e4m3 values at `values` (count * hidden bytes)
// with their scales at `scales` (count float32, valid), the file's layout,
// as bf16 values into `out` (count * hidden): e4m3 * scale in float32,
// rounded to nearest even; what DecodeFp8Row then FloatToBf16 give,
// vectorised (the Python client's native path hands samples on so by
// default). `uncached`: written with non-temporal stores where the CPU's
// loop has them (for a destination far larger than the caches, the stream
// assembler's large samples: 0.82x the cached loop's CPU per value into 58 MB,
// bench/fp8_encode_bench), to be fenced by the caller (FenceUncachedCopies)
// before another thread reads `out`.
void DequantizeFp8ToBf16(const uint8_t* values, const float* scales, int64_t count, int64_t hidden, uint16_t* out,
                         bool uncached = false);

// The one place that splits encoded rows into scales and values: the stream
// assembler's check and its copy into the file's layout, and the sample
// file's writer, walk rows with it. `bytes` are `length` bytes of encoded
// rows of `hidden` values (scale, then values, each) that start `position`
// bytes into them; rows and pieces may be split anywhere. Calls
// part(row, at, bytes, n) for each run of the bytes that lies within one
// row's scale (at < kFp8ScaleBytes) or within one row's values, in order:
// `row` counts from the first row, `at` is the run's offset in its row.
template <typename Part>
void ForEachFp8RowPart(int64_t position, const char* bytes, size_t length, int64_t hidden, Part&& part) {
  const int64_t row_bytes = hidden + kFp8ScaleBytes;
  while (length > 0) {
    const int64_t row = position / row_bytes, at = position % row_bytes;
    const int64_t end = at < kFp8ScaleBytes ? kFp8ScaleBytes : row_bytes;
    const size_t n = std::min(length, static_cast<size_t>(end - at));
    part(row, at, bytes, n);
    bytes += n;
    length -= n;
    position += static_cast<int64_t>(n);
  }
}

// EncodeTensor for fp8: `tokens` rows of `hidden` values at `src` (activation
// type kF32 or kBf16) into `dst`, which holds tokens * (hidden + 4) bytes,
// checked (the first non-finite value stops it, as EncodeTensor) and hashed
// (the encoded bytes, scales included).
TensorFindings EncodeFp8Tensor(const void* src, ElementType type, int64_t tokens, int64_t hidden, char* dst,
                               ChecksumKind checksum);

struct Fp8RowKernels;

// EncodeFp8Tensor fed piece by piece: whole rows of one tensor in order, in
// any number of pieces, encoded into consecutive rows at `dst`; Finish gives
// what EncodeFp8Tensor gives over all of them at once, and the bytes written
// are the same. The batcher's capture check encodes so the pieces of rows the
// CPU engine's capture copy has just written (server/runtime/capture_check.h).
class Fp8TensorEncoder {
 public:
  // Rows of `hidden` values of activation type `type` (kF32 or kBf16); `dst`
  // holds RowBytes(kFp8, hidden) bytes for every row fed. Null `kernels`:
  // BestFp8Kernels().
  Fp8TensorEncoder(ElementType type, int64_t hidden, ChecksumKind checksum, char* dst,
                   const Fp8RowKernels* kernels = nullptr);
  Fp8TensorEncoder(const Fp8TensorEncoder&) = delete;
  Fp8TensorEncoder& operator=(const Fp8TensorEncoder&) = delete;

  // The next `rows` rows at `src`. After a non-finite value the rest is
  // skipped (bad_index counts values from the first row fed).
  void Update(const void* src, int64_t rows);
  int64_t rows() const { return rows_; }
  TensorFindings Finish() const;

 private:
  const Fp8RowKernels& kernels_;
  ElementType type_;
  int64_t hidden_;
  char* dst_;
  TensorHash hash_;
  int64_t rows_ = 0;
  bool nonzero_ = false;
  int64_t bad_index_ = -1;
  float bad_value_ = 0;
};

// The check and hash of `tokens` rows encoded already (RowBytes(kFp8,
// hidden) bytes each at `rows`, any alignment), read in place: for rows
// EncodeFp8Tensor wrote, what it returned. A row a backend marked as holding
// a non-finite value (kernels/fp8_e4m3.h: that value as its scale,
// kFp8NanByte at it) gives that value and its index, as EncodeFp8Tensor
// finds them in the rows before encoding; any other invalid scale is a bad
// scale (bad_scale, at the row's first value), a NaN byte under a valid one
// a NaN value. Stops at the first (the checksum is then meaningless).
TensorFindings CheckFp8Tensor(const void* rows, int64_t tokens, int64_t hidden, ChecksumKind checksum);
// The same check without the checksum (a sample file's writer, whose
// checksums are the file's own).
TensorFindings CheckFp8Rows(const void* rows, int64_t tokens, int64_t hidden);

// The receiver's check of `count` e4m3 bytes: the index of the first NaN
// (0x7f or 0xff), or -1; ORs into *nonzero whether any is neither +0 nor -0.
int64_t CheckFp8Bytes(const void* bytes, int64_t count, bool* nonzero);

}  // namespace hsx

#endif  // HSX_FORMAT_FP8_H_
