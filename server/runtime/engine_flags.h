// engine_flags.h: the flags of an engine and its capture set, defined once
// for every binary that runs one (hsx-server; hsx-dump with --model), read
// and checked by one function, so that both binaries accept the same values
// and refuse the others with the same message.
//
// Two steps, because one limit depends on the model: EngineFlagsFromCommandLine()
// checks the flags alone (cheap, before anything is loaded), then
// ResolveMaxTokensPerSample() sets the longest sample against config.json.
// After the first succeeds, `engine` is a usable EngineOptions (its device
// exists in this build and takes the ranks and attention kernel given).
#ifndef HSX_SERVER_RUNTIME_ENGINE_FLAGS_H_
#define HSX_SERVER_RUNTIME_ENGINE_FLAGS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"
#include "server/model/config.h"
#include "server/runtime/engine.h"

namespace hsx {

// Limits past which a flag's value is a mistake, not a configuration.
inline constexpr int kMaxThreads = 1024;
inline constexpr int64_t kMaxBatchTokens = 1LL << 24;

struct EngineFlags {
  // --device, --tp, --ranks-per-device, --attention, --precision, --threads,
  // --max-batch-tokens.
  EngineOptions engine;
  std::string capture = "eagle3";  // --capture, parsed against the model's layer count (CaptureSpec)
  bool final_norm = false;         // --final-norm
  int64_t max_tokens_per_sample = 0;  // --max-tokens-per-sample; 0: the model's limit, once resolved
  bool allow_media_placeholder = false;  // --allow-media-placeholder
};

// The engine flags that only an engine in this process uses (a remote client
// passes the capture set, the precision check and the sample limit on, never
// these), as Abseil names them.
inline constexpr absl::string_view kLocalEngineFlagNames[] = {
    "device", "tp", "ranks_per_device", "attention", "threads", "max_batch_tokens", "allow_media_placeholder"};

// Reads the engine flags (defined in engine_flags.cc) and checks them; the
// error names the flag and what it accepts.
absl::StatusOr<EngineFlags> EngineFlagsFromCommandLine();

// Sets flags->max_tokens_per_sample: 0 becomes the model's
// max_position_embeddings capped by --max-batch-tokens; a value given must
// fit both (a sample runs in one batch).
absl::Status ResolveMaxTokensPerSample(const ModelConfig& config, EngineFlags* flags);

// The media placeholder ids a sample must not hold: the model's
// (config.media_placeholders), none with --allow-media-placeholder.
std::vector<MediaPlaceholder> RefusedMediaPlaceholders(const ModelConfig& config, const EngineFlags& flags);

// Makes --help list the engine flags and those defined in the files whose
// path contains `binary_flag_files` (e.g. "server/service/"). Call before
// parsing the command line.
void ListFlagsInHelp(absl::string_view binary_flag_files);

// "bf16" or "fp32", as --precision spells them.
const char* PrecisionName(ElementType precision);

}  // namespace hsx

#endif  // HSX_SERVER_RUNTIME_ENGINE_FLAGS_H_
