// safetensors.h: validated, memory-mapped reading of .safetensors files.
//
// Layout: an 8-byte little-endian header length N, N bytes of JSON
// ({name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}),
// then the data section. The parser trusts nothing: the header length is
// bounded, the JSON must be well formed, every tensor's byte range must lie
// inside the data section, match product(shape) * dtype size, and not overlap
// another tensor. Every error names the file and, where there is one, the
// tensor. A SafetensorsFile that opened successfully can be read anywhere
// inside its tensors' ranges without further checks.
#ifndef HSX_FORMAT_SAFETENSORS_H_
#define HSX_FORMAT_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "format/mapped_file.h"

namespace hsx {

enum class DType { kBool, kU8, kI8, kI16, kU16, kF16, kBF16, kI32, kU32, kF32, kF64, kI64, kU64,
                   kF8E4M3, kF8E5M2 };

// "BF16" -> DType::kBF16 etc.; an unknown name is an error.
absl::StatusOr<DType> ParseDType(absl::string_view name);
absl::string_view DTypeName(DType dtype);
int64_t DTypeSize(DType dtype);

// The largest header accepted (the limit of the reference Rust implementation).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

struct TensorInfo {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets within the data section
  uint64_t end = 0;

  int64_t num_elements() const;
  uint64_t num_bytes() const { return end - begin; }
};

struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;  // in ascending data offset
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // file offset of the data section (8 + N)
};

// Parses and validates the header of a file whose full contents are `bytes`
// (only the first 8 + N bytes are read; the rest bounds the data section).
// `file` names the file in error messages. Never crashes on any input.
absl::StatusOr<SafetensorsHeader> ParseSafetensors(std::span<const uint8_t> bytes,
                                                   absl::string_view file);

// A read-only memory-mapped safetensors file.
class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  // nullptr when the file has no tensor of that name.
  const TensorInfo* Find(absl::string_view name) const;
  // The tensor's bytes (inside the mapping; valid while this object lives).
  std::span<const uint8_t> Data(const TensorInfo& tensor) const;

 private:
  SafetensorsFile() = default;

  std::string path_;
  std::unique_ptr<MappedFile> file_;
  SafetensorsHeader header_;
  absl::flat_hash_map<std::string, size_t> index_;  // name -> position in header_.tensors
};

}  // namespace hsx

#endif  // HSX_FORMAT_SAFETENSORS_H_
