// encoding.h: how hidden states become bytes, and the hashes that prove a
// sample arrived intact. Shared by the server (response chunks and trailer),
// the clients (verification) and the file writer, so all agree by construction.
//
//   dtype bytes:   little-endian bf16 (round to nearest even), IEEE fp16, or fp32;
//                  fp8: per row a float32 scale, then e4m3 bytes (format/fp8.h)
//   token hash:    XXH64 (seed 0) of the token ids as little-endian int64
//   layer checksum: XXH64 (seed 0) of one captured layer's [T, H] bytes in the
//                   output dtype, rows in order
#ifndef HSX_FORMAT_ENCODING_H_
#define HSX_FORMAT_ENCODING_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "format/safetensors.h"

namespace hsx {

enum class OutputDType { kBf16, kFp16, kFp32, kFp8 };

absl::StatusOr<OutputDType> ParseOutputDType(const std::string& name);
std::string OutputDTypeName(OutputDType dtype);
DType ToSafetensorsDType(OutputDType dtype);
// Bytes per value (fp8: 1, its row's scale not counted).
int64_t OutputDTypeSize(OutputDType dtype);
// Bytes of one encoded row of `hidden` values: hidden * OutputDTypeSize, and
// for fp8 the row's 4-byte scale before them.
int64_t RowBytes(OutputDType dtype, int64_t hidden);

// Appends float32 values converted to the output dtype's bytes. For fp8 the
// values are one row (its scale, then its bytes).
void AppendEncoded(std::span<const float> values, OutputDType dtype, std::string* out);
// The same into `out`, which holds RowBytes(dtype, values.size()) bytes.
void EncodeValues(std::span<const float> values, OutputDType dtype, char* out);
// The inverse (exact for values that came from AppendEncoded; fp8: one row,
// dequantized).
std::vector<float> DecodeValues(std::span<const uint8_t> bytes, OutputDType dtype);

uint64_t Xxh64(const void* data, size_t size);
// xxh64 as 16 lowercase hex digits.
std::string Xxh64Hex(const void* data, size_t size);
uint64_t TokenIdsHash(std::span<const int32_t> token_ids);

}  // namespace hsx

#endif  // HSX_FORMAT_ENCODING_H_
