// self_check.cc: solo vs batched, bit for bit.
#include "server/service/self_check.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/model/sample_states.h"

namespace hsx {
namespace {

std::vector<int32_t> Tokens(int64_t n, int64_t vocab, uint32_t seed) {
  std::vector<int32_t> tokens;
  uint32_t x = seed;
  for (int64_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    tokens.push_back(static_cast<int32_t>((x >> 8) % static_cast<uint32_t>(vocab)));
  }
  return tokens;
}

absl::StatusOr<SampleStates> RunOne(Engine& engine, const std::vector<std::vector<int32_t>>& samples, size_t which,
                                    const CaptureSpec& capture) {
  Batch batch;
  for (const auto& sample : samples) batch.AddSample(sample);
  absl::StatusOr<Captures> captures = engine.Run(batch, capture);
  if (!captures.ok()) return captures.status();
  std::vector<SampleStates> split = SplitBySample(*captures, batch.cu_seqlens);
  return std::move(split[which]);
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

absl::StatusOr<std::string> RunSelfCheck(Engine& engine) {
  const ModelConfig& config = engine.config();
  const int64_t vocab = config.vocab_size;
  const CaptureSpec capture = CaptureSpec::All(static_cast<int>(config.num_hidden_layers), /*final_norm=*/true);
  const std::vector<int32_t> probe = Tokens(17, vocab, 17);
  const std::vector<std::vector<int32_t>> solo = {probe};
  const std::vector<std::vector<int32_t>> mixed = {Tokens(5, vocab, 5), probe, Tokens(30, vocab, 30)};

  absl::StatusOr<SampleStates> alone = RunOne(engine, solo, 0, capture);
  if (!alone.ok()) return absl::InternalError(absl::StrCat("self-check: solo run failed: ", alone.status().message()));
  absl::StatusOr<SampleStates> batched = RunOne(engine, mixed, 1, capture);
  if (!batched.ok()) {
    return absl::InternalError(absl::StrCat("self-check: batched run failed: ", batched.status().message()));
  }
  if (alone->tokens != 17 || batched->tokens != 17 || alone->capture_ids != capture.ids() ||
      batched->capture_ids != capture.ids()) {
    return absl::InternalError("self-check: the 17-token sample came back with the wrong shape");
  }
  if (!SameBits(alone->hidden_states, batched->hidden_states) || !SameBits(alone->final_norm, batched->final_norm)) {
    return absl::InternalError(
        "self-check: a 17-token sample's hidden states differ between a solo run and a batch of 3 samples; "
        "results would depend on batch composition");
  }
  for (const std::vector<float>* values : {&alone->hidden_states, &alone->final_norm}) {
    bool nonzero = false;
    for (float v : *values) {
      if (!std::isfinite(v)) return absl::InternalError("self-check: non-finite hidden state");
      nonzero |= v != 0.0f;
    }
    if (!nonzero) return absl::InternalError("self-check: all hidden states are zero");
  }
  return absl::StrCat("self-check passed: a 17-token sample alone and in a batch of 3 (5+17+30 tokens) agree bit "
                      "for bit on all ", capture.ids().size(), " capture ids and the final norm");
}

}  // namespace hsx
