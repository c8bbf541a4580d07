// model_info.cc: filling ModelInfo.
#include "server/service/model_info.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "format/encoding.h"
#include "format/layer_convention.h"
#include "server/model/checkpoint.h"

namespace hsx {

std::string ModelNameOf(const std::string& model_dir) { return CheckpointName(model_dir); }

absl::StatusOr<v1::ModelInfo> BuildModelInfo(const ServiceOptions& options, const ModelConfig& config) {
  absl::StatusOr<std::string> revision = CheckpointRevision(options.model_dir);
  if (!revision.ok()) return revision.status();

  v1::ModelInfo info;
  info.set_model_name(ModelNameOf(options.model_dir));
  info.set_model_revision(*revision);
  info.set_architecture(config.architectures.empty() ? "DeepseekV3ForCausalLM" : config.architectures[0]);
  info.set_num_layers(static_cast<int32_t>(config.num_hidden_layers));
  info.set_hidden_size(static_cast<int32_t>(config.hidden_size));
  info.set_vocab_size(static_cast<int32_t>(config.vocab_size));
  info.set_compute_precision(PrecisionName(options.engine_flags.engine.precision));
  info.set_default_dtype(v1::DTYPE_BF16);
  for (int id : options.default_capture.ids()) info.add_default_capture_ids(id);
  info.set_layer_convention(kLayerConvention);
  info.set_last_layer_state("pre-norm");
  info.set_tensor_parallel(options.engine_flags.engine.tp);
  info.set_device(DeviceName(options.engine_flags.engine.device));
  info.set_max_tokens_per_sample(options.engine_flags.max_tokens_per_sample);
  info.set_max_concurrent_requests(options.max_concurrent_requests);
  info.set_max_batch_tokens(options.engine_flags.engine.max_batch_tokens);
  info.set_max_chunk_bytes(options.max_chunk_bytes);
  info.set_server_version(kServerVersion);
  return info;
}

}  // namespace hsx
