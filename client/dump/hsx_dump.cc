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
          "max_position_embeddings).");
ABSL_FLAG(int, threads, 0, "CPU threads (0: all cores).");

namespace {

// Checks what a consumer relies on before the sample is written.
absl::Status VerifySample(const hsx::InputSample& input, const hsx::SampleStates& states) {
  const int64_t layers = static_cast<int64_t>(states.capture_ids.size());
  if (states.tokens != static_cast<int64_t>(input.input_ids.size()) ||
      static_cast<int64_t>(states.hidden_states.size()) != states.tokens * layers * states.hidden) {
    return absl::InternalError(absl::StrCat("sample ", input.index, ": states shape does not match ",
                                            input.input_ids.size(), " tokens"));
  }
  for (int64_t l = 0; l < layers; ++l) {
    bool all_zero = true;
    for (int64_t t = 0; t < states.tokens; ++t) {
      const float* row = &states.hidden_states[(t * layers + l) * states.hidden];
      for (int64_t i = 0; i < states.hidden; ++i) {
        if (!std::isfinite(row[i])) {
          return absl::InternalError(absl::StrCat("sample ", input.index, ": non-finite value in "
                                                  "capture id ", states.capture_ids[l]));
        }
        all_zero &= row[i] == 0.0f;
      }
    }
    if (all_zero) {
      return absl::InternalError(absl::StrCat("sample ", input.index, ": capture id ",
                                              states.capture_ids[l], " is all zeros"));
    }
  }
  return absl::OkStatus();
}

// Consecutive samples packed under the token budget (a longer sample runs alone).
std::vector<std::pair<size_t, size_t>> PlanBatches(const std::vector<hsx::InputSample>& samples,
                                                   int64_t budget) {
  std::vector<std::pair<size_t, size_t>> batches;
  size_t begin = 0;
  int64_t tokens = 0;
  for (size_t i = 0; i < samples.size(); ++i) {
    const int64_t size = static_cast<int64_t>(samples[i].input_ids.size());
    if (i > begin && tokens + size > budget) {
      batches.push_back({begin, i});
      begin = i;
      tokens = 0;
    }
    tokens += size;
  }
  batches.push_back({begin, samples.size()});
  return batches;
}

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

  absl::StatusOr<hsx::ModelWeights> weights = hsx::LoadModelWeights(**checkpoint, 0, 1);
  if (!weights.ok()) return weights.status();
  std::unique_ptr<hsx::Backend> backend = hsx::MakeCpuBackend(precision, absl::GetFlag(FLAGS_threads));
  hsx::Model model(config, *weights, *backend, nullptr);
  const hsx::SampleFileInfo info{std::filesystem::path(model_dir).filename().string(),
                                 config.num_hidden_layers};

  const auto start = std::chrono::steady_clock::now();
  int64_t total_tokens = 0;
  for (const auto& [first, last] : PlanBatches(*samples, absl::GetFlag(FLAGS_max_batch_tokens))) {
    hsx::Batch batch;
    for (size_t i = first; i < last; ++i) batch.AddSample((*samples)[i].input_ids);
    absl::StatusOr<hsx::Captures> captures = model.Run(batch, *capture);
    if (!captures.ok()) return captures.status();
    std::vector<hsx::SampleStates> states = hsx::SplitBySample(*captures, batch.cu_seqlens);
    for (size_t i = first; i < last; ++i) {
      const hsx::InputSample& sample = (*samples)[i];
      if (absl::Status s = VerifySample(sample, states[i - first]); !s.ok()) return s;
      const std::string path = (std::filesystem::path(out) / hsx::SampleFileName(sample.index)).string();
      if (absl::Status s = hsx::WriteSampleFile(path, sample, states[i - first], *dtype, info); !s.ok()) return s;
    }
    total_tokens += static_cast<int64_t>(batch.tokens.size());
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "hsx-dump: %zu/%zu samples, %lld tokens, %.1f tokens/s\n", last,
                 samples->size(), static_cast<long long>(total_tokens), total_tokens / seconds);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("hsx-dump: wrote %zu samples (%lld tokens) to %s in %.2f s, %.1f tokens/s\n",
              samples->size(), static_cast<long long>(total_tokens), out.c_str(), seconds,
              total_tokens / seconds);
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
