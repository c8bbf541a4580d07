// safetensors.cc: header validation and memory mapping.
#include "format/safetensors.h"

#include <algorithm>
#include <array>
#include <cstring>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "format/mapped_file.h"

namespace hsx {
namespace {

using json = nlohmann::json;

struct DTypeEntry {
  DType dtype;
  absl::string_view name;
  int64_t size;
};

constexpr std::array<DTypeEntry, 15> kDTypes = {{
    {DType::kBool, "BOOL", 1}, {DType::kU8, "U8", 1},     {DType::kI8, "I8", 1},
    {DType::kI16, "I16", 2},   {DType::kU16, "U16", 2},   {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2}, {DType::kI32, "I32", 4},   {DType::kU32, "U32", 4},
    {DType::kF32, "F32", 4},   {DType::kF64, "F64", 8},   {DType::kI64, "I64", 8},
    {DType::kU64, "U64", 8},   {DType::kF8E4M3, "F8_E4M3", 1}, {DType::kF8E5M2, "F8_E5M2", 1},
}};

absl::Status HeaderError(absl::string_view file, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(file, ": ", what));
}

absl::Status TensorError(absl::string_view file, absl::string_view tensor, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(file, ": tensor '", tensor, "': ", what));
}

// Reads a non-negative JSON integer that fits in uint64_t.
bool ReadUnsigned(const json& value, uint64_t* out) {
  if (value.is_number_unsigned()) {
    *out = value.get<uint64_t>();
    return true;
  }
  if (value.is_number_integer() && value.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(value.get<int64_t>());
    return true;
  }
  return false;
}

absl::StatusOr<TensorInfo> ParseTensorEntry(const std::string& name, const json& entry,
                                            uint64_t data_size, absl::string_view file) {
  if (!entry.is_object()) return TensorError(file, name, "entry is not a JSON object");
  TensorInfo info;
  info.name = name;
  if (!entry.contains("dtype") || !entry["dtype"].is_string()) {
    return TensorError(file, name, "missing string 'dtype'");
  }
  absl::StatusOr<DType> dtype = ParseDType(entry["dtype"].get<std::string>());
  if (!dtype.ok()) return TensorError(file, name, std::string(dtype.status().message()));
  info.dtype = *dtype;
  if (!entry.contains("shape") || !entry["shape"].is_array()) {
    return TensorError(file, name, "missing list 'shape'");
  }
  uint64_t bytes = static_cast<uint64_t>(DTypeSize(info.dtype));
  for (const json& dim : entry["shape"]) {
    uint64_t size;
    if (!ReadUnsigned(dim, &size) || size > static_cast<uint64_t>(INT64_MAX)) {
      return TensorError(file, name, absl::StrCat("shape entry ", dim.dump(),
                                                  " is not a non-negative integer"));
    }
    if (__builtin_mul_overflow(bytes, size, &bytes)) {
      return TensorError(file, name, "shape is too large (byte size overflows)");
    }
    info.shape.push_back(static_cast<int64_t>(size));
  }
  if (!entry.contains("data_offsets") || !entry["data_offsets"].is_array() ||
      entry["data_offsets"].size() != 2 || !ReadUnsigned(entry["data_offsets"][0], &info.begin) ||
      !ReadUnsigned(entry["data_offsets"][1], &info.end)) {
    return TensorError(file, name, "'data_offsets' must be two non-negative integers");
  }
  if (info.begin > info.end) {
    return TensorError(file, name, absl::StrCat("data_offsets [", info.begin, ", ", info.end,
                                                "] are reversed"));
  }
  if (info.end > data_size) {
    return TensorError(file, name,
                       absl::StrCat("data_offsets [", info.begin, ", ", info.end,
                                    "] run past the end of the data section (", data_size,
                                    " bytes; file truncated?)"));
  }
  if (info.end - info.begin != bytes) {
    return TensorError(file, name,
                       absl::StrCat("holds ", info.end - info.begin, " bytes but shape [",
                                    absl::StrJoin(info.shape, ", "), "] of ",
                                    DTypeName(info.dtype), " needs ", bytes));
  }
  return info;
}

absl::Status ParseMetadata(const json& value, absl::string_view file,
                           std::map<std::string, std::string>* out) {
  if (!value.is_object()) return HeaderError(file, "'__metadata__' is not a JSON object");
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) {
      return HeaderError(file, absl::StrCat("'__metadata__' value of '", key, "' is not a string"));
    }
    (*out)[key] = item.get<std::string>();
  }
  return absl::OkStatus();
}

absl::Status CheckNoOverlap(const std::vector<TensorInfo>& sorted, absl::string_view file) {
  for (size_t i = 1; i < sorted.size(); ++i) {
    const TensorInfo& before = sorted[i - 1];
    const TensorInfo& after = sorted[i];
    if (after.begin < before.end) {
      return TensorError(file, after.name,
                         absl::StrCat("data_offsets [", after.begin, ", ", after.end,
                                      "] overlap tensor '", before.name, "' [", before.begin, ", ",
                                      before.end, "]"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  for (const DTypeEntry& entry : kDTypes) {
    if (entry.name == name) return entry.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", name, "'"));
}

absl::string_view DTypeName(DType dtype) {
  for (const DTypeEntry& entry : kDTypes) {
    if (entry.dtype == dtype) return entry.name;
  }
  return "?";
}

int64_t DTypeSize(DType dtype) {
  for (const DTypeEntry& entry : kDTypes) {
    if (entry.dtype == dtype) return entry.size;
  }
  return 0;
}

int64_t TensorInfo::num_elements() const {
  int64_t count = 1;
  for (int64_t dim : shape) count *= dim;  // validated against the byte size, cannot overflow
  return count;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensors(std::span<const uint8_t> bytes,
                                                   absl::string_view file) {
  if (bytes.size() < 8) {
    return HeaderError(file, absl::StrCat("file is ", bytes.size(),
                                          " bytes, too short for a safetensors header"));
  }
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | bytes[i];
  if (header_size > kMaxSafetensorsHeaderBytes) {
    return HeaderError(file, absl::StrCat("header length ", header_size, " exceeds the limit of ",
                                          kMaxSafetensorsHeaderBytes, " bytes"));
  }
  if (header_size > bytes.size() - 8) {
    return HeaderError(file, absl::StrCat("header length ", header_size, " runs past the end of the ",
                                          bytes.size(), "-byte file"));
  }
  const char* text = reinterpret_cast<const char*>(bytes.data() + 8);
  json root = json::parse(text, text + header_size, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return HeaderError(file, "header is not valid JSON");
  if (!root.is_object()) return HeaderError(file, "header is not a JSON object");

  SafetensorsHeader header;
  header.data_start = 8 + header_size;
  const uint64_t data_size = bytes.size() - header.data_start;
  for (const auto& [name, entry] : root.items()) {
    if (name == "__metadata__") {
      if (absl::Status s = ParseMetadata(entry, file, &header.metadata); !s.ok()) return s;
      continue;
    }
    absl::StatusOr<TensorInfo> info = ParseTensorEntry(name, entry, data_size, file);
    if (!info.ok()) return info.status();
    header.tensors.push_back(*std::move(info));
  }
  std::sort(header.tensors.begin(), header.tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  if (absl::Status s = CheckNoOverlap(header.tensors, file); !s.ok()) return s;
  return header;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  absl::StatusOr<std::unique_ptr<MappedFile>> mapped = MappedFile::Open(path);
  if (!mapped.ok()) return mapped.status();
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->file_ = *std::move(mapped);
  absl::StatusOr<SafetensorsHeader> header = ParseSafetensors(file->file_->bytes(), path);
  if (!header.ok()) return header.status();
  file->header_ = *std::move(header);
  for (size_t i = 0; i < file->header_.tensors.size(); ++i) {
    file->index_.emplace(file->header_.tensors[i].name, i);
  }
  return file;
}

SafetensorsFile::~SafetensorsFile() = default;

const TensorInfo* SafetensorsFile::Find(absl::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &header_.tensors[it->second];
}

std::span<const uint8_t> SafetensorsFile::Data(const TensorInfo& tensor) const {
  return file_->bytes().subspan(header_.data_start + tensor.begin, tensor.num_bytes());
}

}  // namespace hsx
