// hsx-dump: extracts hidden states for every sample of a JSONL file and writes
// one verified hs_{i}.safetensors per sample. This is the in-process mode
// (--model): the engine runs inside the tool, no server needed.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "client/dump/input.h"
#include "client/dump/sample_file.h"
#include "client/dump/dump_job.h"
#include "client/dump/extractor.h"
#include "kernels/backend.h"
#include "server/model/checkpoint.h"
#include "server/model/forward.h"
#include "server/model/model_weights.h"
#include "server/model/sample_states.h"
#include "server/tools/cli.h"

ABSL_FLAG(std::string, model, "", "Checkpoint directory to run in-process.");
ABSL_FLAG(std::string, input, "", "JSON Lines input: {\"input_ids\": [...], \"loss_mask\": [...]?, "
          "\"id\": ...?} per line.");
ABSL_FLAG(std::string, out, "", "Output directory; sample i (0-based line among samples) goes to "
          "hs_{i}.safetensors.");
ABSL_FLAG(std::string, capture, "eagle3", "Capture ids: eagle3 ({2, N/2, N-3, N}), all (0..N) or a "
          "list like 2,30,58,61. Id k is the residual stream entering layer k; N is the last "
          "layer's output before the final norm.");
ABSL_FLAG(bool, final_norm, false, "Also write final_norm_hidden_states, the post-norm state "
          "(lm_head input).");
ABSL_FLAG(std::string, precision, "bf16", "Arithmetic: bf16 (rounds where the HF BF16 reference "
          "rounds) or fp32.");
ABSL_FLAG(std::string, dtype, "bf16", "Output dtype: bf16, fp16 or fp32.");
ABSL_FLAG(int64_t, max_batch_tokens, 8192, "Token budget of one forward batch.");
ABSL_FLAG(int64_t, max_tokens_per_sample, 0, "Longest sample accepted (0: the model's "
          "max_position_embeddings); never more than --max-batch-tokens.");
ABSL_FLAG(int, threads, 0, "CPU threads in all (0: all cores), shared among the ranks.");
ABSL_FLAG(int, tp, 1, "Tensor-parallel ranks (threads here, each holding a slice of the weights).");
ABSL_FLAG(int, concurrency, 64, "Samples in flight at once.");

namespace {

absl::Status Run() {
  const std::string model_dir = absl::GetFlag(FLAGS_model);
  const std::string input_path = absl::GetFlag(FLAGS_input);
  const std::string out = absl::GetFlag(FLAGS_out);
  if (model_dir.empty() || input_path.empty() || out.empty()) {
    return absl::InvalidArgumentError("--model, --input and --out are required (see --help)");
  }
  absl::StatusOr<hsx::OutputDType> dtype = hsx::ParseOutputDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return absl::InvalidArgumentError(absl::StrCat("--dtype: ", dtype.status().message()));
  const std::string precision_name = absl::GetFlag(FLAGS_precision);
  if (precision_name != "bf16" && precision_name != "fp32") {
    return absl::InvalidArgumentError(absl::StrCat("--precision '", precision_name, "': expected bf16 or fp32"));
  }
  const hsx::Precision precision = precision_name == "bf16" ? hsx::Precision::kBf16 : hsx::Precision::kFp32;
  if (absl::GetFlag(FLAGS_max_batch_tokens) < 1) {
    return absl::InvalidArgumentError("--max_batch_tokens must be at least 1");
  }

  absl::StatusOr<std::unique_ptr<hsx::Checkpoint>> checkpoint = hsx::Checkpoint::Open(model_dir);
  if (!checkpoint.ok()) return checkpoint.status();
  const hsx::ModelConfig& config = (*checkpoint)->config();
  absl::StatusOr<hsx::CaptureSpec> capture =
      hsx::ParseCaptureSpec(absl::GetFlag(FLAGS_capture), config, absl::GetFlag(FLAGS_final_norm));
  if (!capture.ok()) return absl::InvalidArgumentError(absl::StrCat("--capture: ", capture.status().message()));
  hsx::InputLimits limits;
  limits.vocab_size = config.vocab_size;
  limits.max_tokens_per_sample = absl::GetFlag(FLAGS_max_tokens_per_sample) > 0
                                     ? absl::GetFlag(FLAGS_max_tokens_per_sample)
                                     : config.max_position_embeddings;
  if (limits.max_tokens_per_sample > absl::GetFlag(FLAGS_max_batch_tokens)) {
    limits.max_tokens_per_sample = absl::GetFlag(FLAGS_max_batch_tokens);  // a sample must fit a batch
  }
  absl::StatusOr<std::vector<hsx::InputSample>> samples = hsx::ReadInputFile(input_path, limits);
  if (!samples.ok()) return samples.status();

  std::error_code error;
  std::filesystem::create_directories(out, error);
  if (error) return absl::InternalError(absl::StrCat(out, ": cannot create: ", error.message()));
  for (const hsx::InputSample& sample : *samples) {
    const std::string path = (std::filesystem::path(out) / hsx::SampleFileName(sample.index)).string();
    if (std::filesystem::exists(path)) {
      return absl::AlreadyExistsError(absl::StrCat(path, " already exists; refusing to overwrite "
                                                   "(use a new --out directory)"));
    }
  }

  hsx::EngineOptions engine_options;
  engine_options.tp = absl::GetFlag(FLAGS_tp);
  engine_options.precision = precision;
  engine_options.threads = absl::GetFlag(FLAGS_threads);
  absl::StatusOr<std::unique_ptr<hsx::Engine>> engine = hsx::Engine::Create(**checkpoint, engine_options);
  if (!engine.ok()) return engine.status();
  hsx::BatcherOptions batcher_options;
  batcher_options.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  hsx::InProcessExtractor extractor(**engine, batcher_options);
  hsx::DumpOptions dump;
  dump.out_dir = out;
  dump.capture = *capture;
  dump.dtype = *dtype;
  dump.concurrency = absl::GetFlag(FLAGS_concurrency);
  dump.info = {std::filesystem::path(model_dir).filename().string(), config.num_hidden_layers};
  absl::StatusOr<hsx::DumpStats> stats = hsx::RunDump(*samples, extractor, dump);
  if (!stats.ok()) return stats.status();
  std::printf("hsx-dump: wrote %lld samples (%lld tokens) to %s in %.2f s, %.1f tokens/s\n",
              static_cast<long long>(stats->samples), static_cast<long long>(stats->tokens),
              out.c_str(), stats->seconds, stats->tokens / stats->seconds);
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Extracts hidden states for every sample of a JSONL file into one hs_{i}.safetensors each\n"
      "(hidden_states [T, L, H], token_ids [T] int64, loss_mask when given). Flags accept - or _.\n\n"
      "  hsx-dump --model DIR --input samples.jsonl --out OUT [--capture eagle3|all|2,30,58,61]\n"
      "           [--final-norm] [--precision bf16|fp32] [--dtype bf16|fp16|fp32]");
  hsx::AcceptDashedFlags(argc, argv);
  absl::ParseCommandLine(argc, argv);
  return hsx::ExitWithStatus("hsx-dump", Run());
}
