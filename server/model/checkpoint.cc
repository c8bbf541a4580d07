// checkpoint.cc: shard resolution and whole-checkpoint validation.
#include "server/model/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "absl/status/status.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/file_util.h"
#include "format/xxh64_stream.h"
#include "kernels/cpu/int4_dequant.h"

namespace hsx {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr char kIndexFile[] = "model.safetensors.index.json";
constexpr char kSingleFile[] = "model.safetensors";

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::StatusOr<std::map<std::string, std::string>> ReadIndex(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) return text.status();
  return ParseCheckpointIndex(*text, path);
}

// Appends `size` bytes of `file` from `offset` (fewer at the end of the file).
absl::Status AppendRange(std::ifstream& in, const std::string& path, uint64_t offset, uint64_t size,
                         std::string* out) {
  std::string buffer(size, '\0');
  in.clear();
  in.seekg(static_cast<std::streamoff>(offset));
  in.read(buffer.data(), static_cast<std::streamsize>(size));
  if (in.bad()) return absl::InternalError(absl::StrCat(path, ": read failed"));
  buffer.resize(static_cast<size_t>(in.gcount()));
  out->append(buffer);
  return absl::OkStatus();
}

}  // namespace

std::string CheckpointName(const std::string& dir) {
  fs::path path(dir);
  if (!path.has_filename()) path = path.parent_path();  // trailing slash
  const std::string name = path.filename().string();
  return name.empty() ? dir : name;
}

absl::StatusOr<std::map<std::string, std::string>> ParseCheckpointIndex(const std::string& text,
                                                                     const std::string& path) {
  json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON"));
  if (!root.is_object() || !root.contains("weight_map") || !root["weight_map"].is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": missing object 'weight_map'"));
  }
  std::map<std::string, std::string> map;
  for (const auto& [tensor, file] : root["weight_map"].items()) {
    if (!file.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": weight_map entry '", tensor, "' is not a file name"));
    }
    const std::string name = file.get<std::string>();
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
      return absl::InvalidArgumentError(absl::StrCat(path, ": weight_map entry '", tensor,
                                                     "' names file '", name,
                                                     "' outside the checkpoint directory"));
    }
    map[tensor] = name;
  }
  return map;
}

// The config and index text, and the sorted shard file names.
absl::StatusOr<std::vector<std::string>> RevisionPreamble(const std::string& dir, std::string* material) {
  absl::StatusOr<std::string> config = ReadFileToString((fs::path(dir) / "config.json").string());
  if (!config.ok()) return config.status();
  *material += *config;
  std::vector<std::string> shards;
  const fs::path index_path = fs::path(dir) / kIndexFile;
  if (fs::exists(index_path)) {
    absl::StatusOr<std::string> index = ReadFileToString(index_path.string());
    if (!index.ok()) return index.status();
    *material += *index;
    absl::StatusOr<std::map<std::string, std::string>> map = ReadIndex(index_path.string());
    if (!map.ok()) return map.status();
    for (const auto& [tensor, file] : *map) shards.push_back(file);
    std::sort(shards.begin(), shards.end());
    shards.erase(std::unique(shards.begin(), shards.end()), shards.end());
  } else {
    shards.push_back(kSingleFile);
  }
  return shards;
}

absl::StatusOr<std::string> FullCheckpointDigest(const std::string& dir) {
  std::string material;
  absl::StatusOr<std::vector<std::string>> shards = RevisionPreamble(dir, &material);
  if (!shards.ok()) return shards.status();
  Xxh64Stream hash;
  hash.Update(material.data(), material.size());
  std::vector<char> buffer(8 << 20);
  for (const std::string& shard : *shards) {
    const std::string path = (fs::path(dir) / shard).string();
    std::ifstream in(path, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
    hash.Update(shard.data(), shard.size() + 1);  // the name (and its NUL) separates shards
    while (in.read(buffer.data(), static_cast<std::streamsize>(buffer.size())) || in.gcount() > 0) {
      hash.Update(buffer.data(), static_cast<size_t>(in.gcount()));
    }
    if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read failed"));
  }
  return hash.HexDigest();
}

absl::StatusOr<std::string> CheckpointRevision(const std::string& dir) {
  constexpr uint64_t kSample = 64 << 10;
  std::string material;
  absl::StatusOr<std::vector<std::string>> shards = RevisionPreamble(dir, &material);
  if (!shards.ok()) return shards.status();
  for (const std::string& shard : *shards) {
    const std::string path = (fs::path(dir) / shard).string();
    std::error_code error;
    const uint64_t size = fs::file_size(path, error);
    if (error) return absl::NotFoundError(absl::StrCat(path, ": ", error.message()));
    absl::StrAppend(&material, shard, ":", size, "\n");  // a truncated or grown shard changes the revision
    std::ifstream in(path, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
    // The header (bounded) and the data's two ends.
    const uint64_t head = std::min<uint64_t>(size, 8 + kMaxSafetensorsHeaderBytes);
    std::string prefix;
    if (absl::Status s = AppendRange(in, path, 0, std::min<uint64_t>(head, 8), &prefix); !s.ok()) return s;
    uint64_t header_bytes = 0;
    for (int i = static_cast<int>(prefix.size()) - 1; i >= 0; --i) {
      header_bytes = (header_bytes << 8) | static_cast<uint8_t>(prefix[i]);
    }
    const uint64_t data_start = std::min(size, 8 + std::min(header_bytes, kMaxSafetensorsHeaderBytes));
    material += prefix;
    if (absl::Status s = AppendRange(in, path, 8, data_start - std::min<uint64_t>(size, 8), &material); !s.ok()) return s;
    if (absl::Status s = AppendRange(in, path, data_start, kSample, &material); !s.ok()) return s;
    const uint64_t tail = size > data_start + kSample ? std::max(size - kSample, data_start + kSample) : size;
    if (absl::Status s = AppendRange(in, path, tail, kSample, &material); !s.ok()) return s;
  }
  return absl::StrFormat("%016x", XXH64(material.data(), material.size(), 0));
}

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  std::unique_ptr<Checkpoint> checkpoint(new Checkpoint());
  checkpoint->dir_ = dir;
  absl::StatusOr<ModelConfig> config = ReadModelConfig((fs::path(dir) / "config.json").string());
  if (!config.ok()) return config.status();
  checkpoint->config_ = *std::move(config);
  checkpoint->weights_ = TextModelWeights(checkpoint->config_);
  for (size_t i = 0; i < checkpoint->weights_.size(); ++i) {
    checkpoint->weight_index_.emplace(checkpoint->weights_[i].name, i);
  }
  if (absl::Status s = checkpoint->LoadShards(); !s.ok()) return s;
  if (absl::Status s = checkpoint->Validate(); !s.ok()) return s;
  return checkpoint;
}

absl::Status Checkpoint::LoadShards() {
  const fs::path index_path = fs::path(dir_) / kIndexFile;
  const fs::path single_path = fs::path(dir_) / kSingleFile;
  std::map<std::string, std::string> placement;  // tensor -> shard file name
  std::vector<std::string> files;
  if (fs::exists(index_path)) {
    source_ = index_path.string();
    absl::StatusOr<std::map<std::string, std::string>> index = ReadIndex(source_);
    if (!index.ok()) return index.status();
    placement = *std::move(index);
    for (const auto& [tensor, file] : placement) files.push_back(file);
    std::sort(files.begin(), files.end());
    files.erase(std::unique(files.begin(), files.end()), files.end());
  } else if (fs::exists(single_path)) {
    source_ = single_path.string();
    files.push_back(kSingleFile);
  } else {
    return absl::NotFoundError(absl::StrCat(dir_, ": neither ", kIndexFile, " nor ", kSingleFile,
                                            " exists"));
  }
  std::map<std::string, const SafetensorsFile*> by_name;
  for (const std::string& name : files) {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> shard =
        SafetensorsFile::Open((fs::path(dir_) / name).string());
    if (!shard.ok()) return shard.status();
    by_name[name] = shard->get();
    shards_.push_back(*std::move(shard));
  }
  if (placement.empty()) {
    for (const TensorInfo& info : shards_[0]->header().tensors) {
      tensors_[info.name] = TensorRef{&info, shards_[0].get()};
    }
    return absl::OkStatus();
  }
  for (const auto& [tensor, file] : placement) {
    const SafetensorsFile* shard = by_name.at(file);
    const TensorInfo* info = shard->Find(tensor);
    if (info == nullptr) {
      return absl::NotFoundError(absl::StrCat(source_, ": tensor '", tensor, "' is mapped to ", file,
                                              ", which does not contain it"));
    }
    tensors_[tensor] = TensorRef{info, shard};
  }
  // And the converse: a shard may hold nothing the index does not map to it,
  // or a tensor would be invisible to every check below.
  for (const auto& [name, shard] : by_name) {
    for (const TensorInfo& info : shard->header().tensors) {
      auto it = placement.find(info.name);
      if (it == placement.end() || it->second != name) {
        return absl::InvalidArgumentError(absl::StrCat(shard->path(), ": holds tensor '", info.name, "', which ",
                                                       source_, " does not map to this shard"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Checkpoint::ValidateTensor(const std::string& name, DType dtype,
                                        const std::vector<int64_t>& shape) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat(source_, ": missing tensor '", name, "'"));
  }
  const TensorInfo& info = *it->second.info;
  const std::string& file = it->second.file->path();
  if (info.dtype != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": tensor '", name, "' has dtype ",
                                                   DTypeName(info.dtype), ", expected ",
                                                   DTypeName(dtype)));
  }
  if (info.shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": tensor '", name, "' has shape ",
                                                   ShapeString(info.shape), ", expected ",
                                                   ShapeString(shape)));
  }
  const uint64_t offset = it->second.file->header().data_start + info.begin;
  if (offset % static_cast<uint64_t>(DTypeSize(dtype)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": tensor '", name, "' starts at byte ",
                                                   offset, ", not aligned to its ",
                                                   DTypeSize(dtype), "-byte elements"));
  }
  return absl::OkStatus();
}

absl::Status Checkpoint::ValidateQuantized(const WeightSpec& spec) const {
  const int64_t rows = spec.shape[0];
  const int64_t cols = spec.shape[1];
  const int64_t group = config_.quantization->group_size;
  if (cols % 8 != 0 || cols % group != 0) {
    return absl::InvalidArgumentError(absl::StrCat(spec.name, ": input size ", cols,
                                                   " is not a multiple of 8 and of group size ",
                                                   group));
  }
  if (absl::Status s = ValidateTensor(spec.name + ".weight_packed", DType::kI32, {rows, cols / 8});
      !s.ok()) {
    return s;
  }
  if (absl::Status s = ValidateTensor(spec.name + ".weight_scale", DType::kBF16, {rows, cols / group});
      !s.ok()) {
    return s;
  }
  const std::string shape_name = spec.name + ".weight_shape";
  auto it = tensors_.find(shape_name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat(source_, ": missing tensor '", shape_name, "'"));
  }
  const DType dtype = it->second.info->dtype;
  if (dtype != DType::kI32 && dtype != DType::kI64) {
    return absl::InvalidArgumentError(absl::StrCat(it->second.file->path(), ": tensor '", shape_name,
                                                   "' has dtype ", DTypeName(dtype),
                                                   ", expected I32 or I64"));
  }
  if (absl::Status s = ValidateTensor(shape_name, dtype, {2}); !s.ok()) return s;
  std::span<const uint8_t> bytes = it->second.bytes();
  int64_t stored[2];
  for (int i = 0; i < 2; ++i) {
    stored[i] = dtype == DType::kI32 ? reinterpret_cast<const int32_t*>(bytes.data())[i]
                                     : reinterpret_cast<const int64_t*>(bytes.data())[i];
  }
  if (stored[0] != rows || stored[1] != cols) {
    return absl::InvalidArgumentError(absl::StrCat(it->second.file->path(), ": tensor '", shape_name,
                                                   "' holds [", stored[0], ", ", stored[1],
                                                   "], expected [", rows, ", ", cols, "]"));
  }
  return absl::OkStatus();
}

absl::Status Checkpoint::Validate() const {
  absl::flat_hash_set<std::string> expected;
  for (const WeightSpec& spec : weights_) {
    absl::Status status = spec.quantized ? ValidateQuantized(spec)
                          : spec.is_linear ? ValidateTensor(spec.name + ".weight", spec.dtype, spec.shape)
                                           : ValidateTensor(spec.name, spec.dtype, spec.shape);
    if (!status.ok()) return status;
    if (spec.quantized) {
      for (const char* suffix : {".weight_packed", ".weight_scale", ".weight_shape"}) expected.insert(spec.name + suffix);
    } else {
      expected.insert(spec.is_linear ? spec.name + ".weight" : spec.name);
    }
  }
  std::vector<std::string> extra;
  for (const auto& [name, ref] : tensors_) {
    if (!expected.contains(name)) extra.push_back(name);
  }
  std::sort(extra.begin(), extra.end());  // the same error for the same checkpoint, every time
  for (const std::string& name : extra) {
    if (absl::Status s = CheckExtraTensor(name); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status Checkpoint::CheckExtraTensor(const std::string& name) const {
  const std::string prefix = config_.tensor_prefix();
  // A K2.5 checkpoint also holds its vision tower and projector, outside the language model.
  if (!prefix.empty() && !absl::StartsWith(name, prefix)) {
    for (const char* part : {"vision_tower.", "mm_projector.", "multi_modal_projector."}) {
      if (absl::StartsWith(name, part)) return absl::OkStatus();
    }
  }
  const std::string file = tensors_.at(name).file->path();
  absl::string_view rest = name;
  if (absl::ConsumePrefix(&rest, prefix) && absl::ConsumePrefix(&rest, "model.layers.")) {
    int64_t layer = -1;
    const size_t dot = rest.find('.');
    if (dot != absl::string_view::npos && absl::SimpleAtoi(rest.substr(0, dot), &layer) &&
        layer >= config_.num_hidden_layers) {
      // Multi-token-prediction layers follow the decoder when the config declares them.
      if (layer < config_.num_hidden_layers + config_.num_nextn_predict_layers) return absl::OkStatus();
      return absl::InvalidArgumentError(absl::StrCat(
          file, ": tensor '", name, "' belongs to layer ", layer, ", but config.json says num_hidden_layers ",
          config_.num_hidden_layers, " (and num_nextn_predict_layers ", config_.num_nextn_predict_layers,
          "): does the config under-report the model's layers?"));
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      file, ": unexpected tensor '", name, "': not a weight of this ", config_.model_type,
      " configuration (hsx refuses checkpoints it would silently half-read)"));
}

absl::StatusOr<TensorRef> Checkpoint::Tensor(absl::string_view name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat(source_, ": no tensor '", name, "'"));
  }
  return it->second;
}

const WeightSpec* Checkpoint::FindWeight(absl::string_view name) const {
  auto it = weight_index_.find(name);
  return it == weight_index_.end() ? nullptr : &weights_[it->second];
}

absl::StatusOr<Int4Weight> Checkpoint::QuantizedLinear(const WeightSpec& spec) const {
  if (!spec.quantized) {
    return absl::InvalidArgumentError(absl::StrCat(spec.name, " is not INT4-quantized"));
  }
  absl::StatusOr<TensorRef> packed = Tensor(spec.name + ".weight_packed");
  if (!packed.ok()) return packed.status();
  absl::StatusOr<TensorRef> scale = Tensor(spec.name + ".weight_scale");
  if (!scale.ok()) return scale.status();
  Int4Weight weight;
  weight.packed = reinterpret_cast<const int32_t*>(packed->bytes().data());
  weight.scale = reinterpret_cast<const uint16_t*>(scale->bytes().data());
  weight.rows = spec.shape[0];
  weight.cols = spec.shape[1];
  weight.group_size = config_.quantization->group_size;
  return weight;
}

absl::StatusOr<std::vector<float>> Checkpoint::ReadAsFloat(const WeightSpec& spec) const {
  std::vector<float> out(static_cast<size_t>(spec.num_elements()));
  if (spec.quantized) {
    absl::StatusOr<Int4Weight> w = QuantizedLinear(spec);
    if (!w.ok()) return w.status();
    DequantizeInt4RowsToFloat(w->packed, w->scale, w->cols, w->group_size, 0, w->rows, out.data());
    return out;
  }
  absl::StatusOr<TensorRef> ref = Tensor(spec.is_linear ? spec.name + ".weight" : spec.name);
  if (!ref.ok()) return ref.status();
  const uint8_t* data = ref->bytes().data();
  if (spec.dtype == DType::kF32) {
    const float* values = reinterpret_cast<const float*>(data);
    out.assign(values, values + out.size());
  } else {
    const uint16_t* values = reinterpret_cast<const uint16_t*>(data);
    for (size_t i = 0; i < out.size(); ++i) out[i] = Bf16ToFloat(values[i]);
  }
  return out;
}

}  // namespace hsx
