// model_info.h: the ModelInfo that GetModelInfo returns, built once at
// start-up from the options and config.json. Every field is filled:
// model_name is the checkpoint directory's base name, model_revision
// CheckpointRevision() (config, index, shard layout and sampled weight bytes;
// server/model/checkpoint.h), architecture config.architectures[0].
#ifndef HSX_SERVER_SERVICE_MODEL_INFO_H_
#define HSX_SERVER_SERVICE_MODEL_INFO_H_

#include <string>

#include "absl/status/statusor.h"
#include "hsx/v1/hsx.pb.h"
#include "server/model/config.h"
#include "server/service/service_options.h"

namespace hsx {

inline constexpr char kServerVersion[] = "0.1.0";

// The base name of a checkpoint directory ("/data/kimi-k2/" -> "kimi-k2").
std::string ModelNameOf(const std::string& model_dir);

// Reads the checkpoint's files for the revision (CheckpointRevision).
absl::StatusOr<v1::ModelInfo> BuildModelInfo(const ServiceOptions& options, const ModelConfig& config);

}  // namespace hsx

#endif  // HSX_SERVER_SERVICE_MODEL_INFO_H_
