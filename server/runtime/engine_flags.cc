// engine_flags.cc: the engine flags and their checks.
#include "server/runtime/engine_flags.h"

#include <algorithm>
#include <memory>

#include "absl/flags/flag.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/runtime/device_factory.h"

ABSL_FLAG(std::string, device, "cpu",
          "cpu or cuda: the backend every tensor-parallel rank runs on (a build without the CUDA backend says so "
          "at start-up). hsx-dump: --model only.");
ABSL_FLAG(int, tp, 1,
          "Tensor-parallel ranks, each holding a slice of the weights (threads on the CPU backend; with --device "
          "cuda, rank r on GPU r). hsx-dump: --model only.");
ABSL_FLAG(int, ranks_per_device, 1,
          "--device cuda: ranks per GPU, 1 (rank r on GPU r) or the --tp value (every rank on GPU 0: tensor "
          "parallelism tested on one GPU). hsx-dump: --model only.");
ABSL_FLAG(std::string, attention, "reference",
          "--device cuda: the attention kernel, reference (default: the tiled kernel with the CPU reference's "
          "arithmetic, bitwise batch invariant) or cudnn (cuDNN's SDPA, bf16 only; faster, but not yet validated "
          "on a GPU, hence not the default). With cudnn, start-up fails with cuDNN's reason where it cannot serve "
          "the model (no silent fallback). hsx-dump: --model only.");
ABSL_FLAG(std::string, precision, "bf16",
          "Arithmetic: bf16 (rounds where the HF BF16 reference rounds) or fp32. hsx-dump --server: the server's "
          "precision is used (a value other than the default must match it).");
ABSL_FLAG(int, threads, 0,
          "CPU threads in all (0: every core; at most 1024), shared among the ranks. hsx-dump: --model only.");
ABSL_FLAG(int64_t, max_batch_tokens, 8192,
          "Token budget of one forward batch (1 to 16777216). hsx-dump: --model only.");
ABSL_FLAG(int64_t, max_tokens_per_sample, 0,
          "Longest sample accepted (0: the model's max_position_embeddings, capped by --max-batch-tokens; "
          "hsx-dump --server: the server's limit).");
ABSL_FLAG(std::string, capture, "eagle3",
          "Capture set: eagle3 ({2, N/2, N-3, N}), all (0..N), a trainer's exact set (speculators = eagle3; "
          "specforge, modelopt = {2, N/2, N-3} + the final norm) or a list like 2,30,58,61. Id k is the residual "
          "stream entering decoder layer k; N is the last layer's output before the final norm. hsx-server: the "
          "set of a request whose capture_ids is empty.");
ABSL_FLAG(bool, final_norm, false,
          "Also capture the post-final-norm state, the lm_head input (capture id -1; hsx-dump writes it as "
          "final_norm_hidden_states). hsx-server: for requests with empty capture_ids.");
ABSL_FLAG(bool, allow_media_placeholder, false,
          "Extract samples that hold the model's media placeholder token (config.json media_placeholder_token_id, "
          "as Kimi-K2.5 has, or image_token_id, image_token_index, video_token_id, audio_token_id). Off by default: "
          "hsx runs the text model only, never the vision or audio encoder, so such a sample's states are not what "
          "the model computes on it (silently wrong training data); it is refused naming the position "
          "(hsx-server: INVALID_ARGUMENT; hsx-dump: an input error, or quarantined with --max-failures). Allow it "
          "only for samples where the placeholder id is meant as a plain token. hsx-dump: --model only (a server "
          "decides with its own flag).");

namespace hsx {
namespace {

absl::StatusOr<ElementType> ParsePrecision(const std::string& name) {
  if (name == "bf16") return ElementType::kBf16;
  if (name == "fp32") return ElementType::kF32;
  return absl::InvalidArgumentError(absl::StrCat("--precision '", name, "': expected bf16 or fp32"));
}

// The ranks' device, layout and attention kernel: refused here, before
// anything is loaded or listens, when this build or machine cannot run them.
absl::Status ReadDeviceFlags(EngineOptions* engine) {
  absl::StatusOr<Device> device = ParseDevice(absl::GetFlag(FLAGS_device));
  if (!device.ok()) return device.status();
  engine->device = *device;
  engine->tp = absl::GetFlag(FLAGS_tp);
  if (engine->tp < 1) return absl::InvalidArgumentError("--tp must be at least 1");
  engine->ranks_per_device = absl::GetFlag(FLAGS_ranks_per_device);
  absl::StatusOr<CudaAttention> attention = ParseAttentionKernel(absl::GetFlag(FLAGS_attention));
  if (!attention.ok()) return attention.status();
  engine->attention = *attention;
  return MakeDeviceFactory(engine->device, ElementType::kBf16, engine->tp, 1, engine->ranks_per_device,
                           engine->attention)
      .status();
}

// The precision, threads and the batch budget.
absl::Status ReadComputeFlags(EngineOptions* engine) {
  absl::StatusOr<ElementType> precision = ParsePrecision(absl::GetFlag(FLAGS_precision));
  if (!precision.ok()) return precision.status();
  engine->precision = *precision;
  engine->threads = absl::GetFlag(FLAGS_threads);
  if (engine->threads < 0 || engine->threads > kMaxThreads) {
    return absl::InvalidArgumentError(
        absl::StrCat("--threads ", engine->threads, ": expected 0 (all cores) to ", kMaxThreads));
  }
  engine->max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  if (engine->max_batch_tokens < 1 || engine->max_batch_tokens > kMaxBatchTokens) {
    return absl::InvalidArgumentError(absl::StrCat("--max-batch-tokens ", engine->max_batch_tokens,
                                                   ": expected 1 to ", kMaxBatchTokens,
                                                   " (the activations of a batch live at once)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<EngineFlags> EngineFlagsFromCommandLine() {
  EngineFlags flags;
  if (absl::Status s = ReadDeviceFlags(&flags.engine); !s.ok()) return s;
  if (absl::Status s = ReadComputeFlags(&flags.engine); !s.ok()) return s;
  flags.capture = absl::GetFlag(FLAGS_capture);
  flags.final_norm = absl::GetFlag(FLAGS_final_norm);
  flags.max_tokens_per_sample = absl::GetFlag(FLAGS_max_tokens_per_sample);
  if (flags.max_tokens_per_sample < 0) {
    return absl::InvalidArgumentError("--max-tokens-per-sample must be 0 (auto) or more");
  }
  flags.allow_media_placeholder = absl::GetFlag(FLAGS_allow_media_placeholder);
  return flags;
}

absl::Status ResolveMaxTokensPerSample(const ModelConfig& config, EngineFlags* flags) {
  const int64_t batch = flags->engine.max_batch_tokens;
  int64_t& limit = flags->max_tokens_per_sample;
  if (limit == 0) limit = std::min(config.max_position_embeddings, batch);
  if (limit > batch) {
    return absl::InvalidArgumentError(absl::StrCat("--max-tokens-per-sample ", limit, " exceeds --max-batch-tokens ",
                                                   batch, ": a sample must fit in one batch"));
  }
  if (limit > config.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("--max-tokens-per-sample ", limit,
                                                   " exceeds the model's max_position_embeddings ",
                                                   config.max_position_embeddings));
  }
  return absl::OkStatus();
}

std::vector<MediaPlaceholder> RefusedMediaPlaceholders(const ModelConfig& config, const EngineFlags& flags) {
  if (flags.allow_media_placeholder) return {};
  return config.media_placeholders;
}

void ListFlagsInHelp(absl::string_view binary_flag_files) {
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [files = std::string(binary_flag_files)](absl::string_view file) {
    return absl::StrContains(file, files) || absl::StrContains(file, "server/runtime/engine_flags.cc");
  };
  absl::SetFlagsUsageConfig(usage);
}

const char* PrecisionName(ElementType precision) { return precision == ElementType::kBf16 ? "bf16" : "fp32"; }

}  // namespace hsx
