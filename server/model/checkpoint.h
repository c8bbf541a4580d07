// checkpoint.h: a Hugging Face checkpoint directory of a DeepSeek-V3-family
// model, opened, memory-mapped and fully validated.
//
// Open() reads config.json, resolves tensors through
// model.safetensors.index.json (or a single model.safetensors), and checks
// every weight the text model needs (TextModelWeights) for presence, dtype
// and shape, including the INT4 triples of quantized Linears. After a
// successful Open(), every accessor returns data of the validated shape;
// nothing is copied until a caller asks for a dequantized weight.
#ifndef HSX_SERVER_MODEL_CHECKPOINT_H_
#define HSX_SERVER_MODEL_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include "absl/strings/string_view.h"
#include "absl/container/flat_hash_map.h"
#include <vector>

#include "absl/status/statusor.h"
#include "server/model/config.h"
#include "format/safetensors.h"
#include "server/model/tensor_specs.h"

namespace hsx {

// One tensor inside a mapped shard.
struct TensorRef {
  const TensorInfo* info = nullptr;
  const SafetensorsFile* file = nullptr;
  std::span<const uint8_t> bytes() const { return file->Data(*info); }
};

// A pack-quantized INT4 Linear: W [rows, cols] (see kernels/cpu/int4_dequant.h).
struct Int4Weight {
  const int32_t* packed = nullptr;  // [rows, cols / 8]
  const uint16_t* scale = nullptr;  // [rows, cols / group_size], bfloat16 bits
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t group_size = 0;
};

// The name a checkpoint is known by: its directory's base name.
std::string CheckpointName(const std::string& dir);

// A revision id for a checkpoint directory: XXH64 (16 hex digits) of
// config.json, the index, each shard's name and size, and each shard's header
// plus the first and last 64 KiB of its data. Two checkpoints with the same
// config but other weights (another seed, another fine-tune) differ in it;
// reading it costs ~128 KiB per shard, not the model. It does not see a byte
// changed in the middle of a shard: FullCheckpointDigest does. Not a
// cryptographic digest.
absl::StatusOr<std::string> CheckpointRevision(const std::string& dir);

// XXH64 of config.json, the index and every byte of every shard (in name
// order): what `hsx-inspect --full-digest` prints. Reads the whole model.
absl::StatusOr<std::string> FullCheckpointDigest(const std::string& dir);

// Parses the text of model.safetensors.index.json into tensor -> shard file
// name, rejecting names that would leave the checkpoint directory. `path`
// names the file in errors.
absl::StatusOr<std::map<std::string, std::string>> ParseCheckpointIndex(const std::string& text,
                                                                     const std::string& path);

class Checkpoint {
 public:
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const ModelConfig& config() const { return config_; }
  const std::vector<WeightSpec>& weights() const { return weights_; }
  const std::vector<std::unique_ptr<SafetensorsFile>>& shards() const { return shards_; }

  // A tensor by full name; NotFound names the tensor.
  absl::StatusOr<TensorRef> Tensor(absl::string_view name) const;
  // The spec of a weight by name (tensor name, or module name of a Linear).
  const WeightSpec* FindWeight(absl::string_view name) const;
  // The INT4 view of a quantized Linear.
  absl::StatusOr<Int4Weight> QuantizedLinear(const WeightSpec& spec) const;
  // Any weight as float32 with its logical shape; INT4 Linears dequantized
  // exactly as compressed-tensors does (each value rounded to bfloat16).
  absl::StatusOr<std::vector<float>> ReadAsFloat(const WeightSpec& spec) const;

 private:
  Checkpoint() = default;
  absl::Status LoadShards();
  absl::Status Validate() const;
  // A tensor outside the model's weight list: a documented extra part, or an error naming it.
  absl::Status CheckExtraTensor(const std::string& name) const;
  absl::Status ValidateTensor(const std::string& name, DType dtype,
                              const std::vector<int64_t>& shape) const;
  absl::Status ValidateQuantized(const WeightSpec& spec) const;

  std::string dir_;
  std::string source_;  // the index or single file, for error messages
  ModelConfig config_;
  std::vector<WeightSpec> weights_;
  absl::flat_hash_map<std::string, size_t> weight_index_;
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;
  absl::flat_hash_map<std::string, TensorRef> tensors_;
};

}  // namespace hsx

#endif  // HSX_SERVER_MODEL_CHECKPOINT_H_
