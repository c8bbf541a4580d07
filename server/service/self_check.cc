// self_check.cc: solo vs batched, bit for bit.
#include "server/service/self_check.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "format/sample_tensors.h"
#include "format/tensor_encoding.h"
#include "server/model/capture_views.h"

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

absl::StatusOr<SampleTensors> RunOne(Engine& engine, const std::vector<std::vector<int32_t>>& samples, size_t which,
                                     const CaptureSpec& capture) {
  Batch batch;
  for (const auto& sample : samples) batch.AddSample(sample);
  absl::StatusOr<Captures> captures = engine.Run(batch, capture);
  if (!captures.ok()) return captures.status();
  std::vector<SampleTensors> split = ViewBySample(*std::move(captures));
  return std::move(split[which]);
}

bool SameBits(const SampleTensors& a, const SampleTensors& b) {
  if (a.tensors.size() != b.tensors.size()) return false;
  for (size_t k = 0; k < a.tensors.size(); ++k) {
    if (TensorString(a.tensors[k]) != TensorString(b.tensors[k])) return false;
  }
  return true;
}

// The values are finite, and neither the layers together nor the final norm
// are all zeros.
absl::Status CheckValues(const SampleTensors& sample) {
  bool layers_nonzero = false;
  for (size_t k = 0; k < sample.tensors.size(); ++k) {
    const SampleTensor& tensor = sample.tensors[k];
    const TensorFindings found = CheckTensor(tensor.pieces[0].data(), sample.tokens * sample.hidden, sample.dtype);
    if (found.bad_index >= 0) return absl::InternalError("self-check: non-finite hidden state");
    layers_nonzero |= found.nonzero;
    const bool last_layer = k + 1 == sample.capture_ids.size();
    const bool final_norm = k == sample.capture_ids.size();
    if ((last_layer && !layers_nonzero) || (final_norm && !found.nonzero)) {
      return absl::InternalError("self-check: all hidden states are zero");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> RunSelfCheck(Engine& engine) {
  const ModelConfig& config = engine.config();
  const int64_t vocab = config.vocab_size;
  const CaptureSpec capture = CaptureSpec::All(static_cast<int>(config.num_hidden_layers), /*final_norm=*/true);
  const std::vector<int32_t> probe = Tokens(17, vocab, 17);
  const std::vector<std::vector<int32_t>> solo = {probe};
  const std::vector<std::vector<int32_t>> mixed = {Tokens(5, vocab, 5), probe, Tokens(30, vocab, 30)};

  absl::StatusOr<SampleTensors> alone = RunOne(engine, solo, 0, capture);
  if (!alone.ok()) return absl::InternalError(absl::StrCat("self-check: solo run failed: ", alone.status().message()));
  absl::StatusOr<SampleTensors> batched = RunOne(engine, mixed, 1, capture);
  if (!batched.ok()) {
    return absl::InternalError(absl::StrCat("self-check: batched run failed: ", batched.status().message()));
  }
  if (alone->tokens != 17 || batched->tokens != 17 || alone->capture_ids != capture.ids() ||
      batched->capture_ids != capture.ids()) {
    return absl::InternalError("self-check: the 17-token sample came back with the wrong shape");
  }
  if (!SameBits(*alone, *batched)) {
    return absl::InternalError(
        "self-check: a 17-token sample's hidden states differ between a solo run and a batch of 3 samples; "
        "results would depend on batch composition");
  }
  if (absl::Status values = CheckValues(*alone); !values.ok()) return values;
  return absl::StrCat("self-check passed: a 17-token sample alone and in a batch of 3 (5+17+30 tokens) agree bit "
                      "for bit on all ", capture.ids().size(), " capture ids and the final norm");
}

}  // namespace hsx
