// capture_check.cc: one TensorChecker per checked tensor, or one
// Fp8TensorEncoder per tensor of a sample sent as fp8, fed piece by piece.
#include "server/runtime/capture_check.h"

#include <algorithm>
#include <utility>

namespace hsx {

CaptureCheck::CaptureCheck(const std::vector<std::optional<RowCheck>>& checks, ElementType type, size_t tensors,
                           std::vector<int64_t> values)
    : checked_(checks.size()), checks_(checks), values_(std::move(values)), type_(type), fp8_(checks.size()) {
  for (size_t s = 0; s < checks.size(); ++s) {
    if (!checks[s].has_value() || !SentAsIs(type, checks[s]->dtype)) continue;
    checked_[s].resize(tensors);
    for (Checked& c : checked_[s]) c.checker = std::make_unique<TensorChecker>(*checks[s]);
  }
}

void CaptureCheck::EncodeFp8(int64_t s, const CaptureSpec& batch, const CaptureSpec& wanted, int64_t tokens,
                             int64_t hidden, BufferAllocator allocate) {
  if (static_cast<size_t>(s) >= fp8_.size() || !checks_[s].has_value() || checks_[s]->dtype != OutputDType::kFp8) {
    return;
  }
  auto f = std::make_unique<Fp8Sample>();
  int wanted_count = 0;
  for (int id : batch.ids()) {
    const bool sent = std::find(wanted.ids().begin(), wanted.ids().end(), id) != wanted.ids().end();
    f->slot.push_back(sent ? wanted_count++ : -1);
  }
  if (batch.final_norm()) f->slot.push_back(wanted.final_norm() ? wanted_count++ : -1);
  f->ids = wanted.ids();
  f->final_norm = wanted.final_norm();
  f->tokens = tokens;
  f->hidden = hidden;
  f->allocate = std::move(allocate);
  f->encoders.resize(wanted_count);
  fp8_[s] = std::move(f);
}

void CaptureCheck::Written(int64_t sample, size_t tensor, const void* rows, int64_t values) {
  if (static_cast<size_t>(sample) < fp8_.size() && fp8_[sample] != nullptr) {
    WrittenFp8(sample, *fp8_[sample], tensor, rows, values);
    return;
  }
  if (static_cast<size_t>(sample) >= checked_.size() || tensor >= checked_[sample].size()) return;
  Checked& c = checked_[sample][tensor];
  c.checker->Update(rows, values);
  c.fed += values;
}

void CaptureCheck::WrittenFp8(int64_t sample, Fp8Sample& f, size_t tensor, const void* rows, int64_t values) {
  if (f.failed || tensor >= f.slot.size() || f.slot[tensor] < 0) return;
  const size_t tensor_bytes = static_cast<size_t>(f.tokens * RowBytes(OutputDType::kFp8, f.hidden));
  if (f.buffer == nullptr) {
    absl::StatusOr<std::unique_ptr<HostBuffer>> buffer = f.allocate(f.encoders.size() * tensor_bytes);
    if (!buffer.ok()) {
      f.failed = true;
      return;
    }
    f.buffer = *std::move(buffer);
    for (size_t j = 0; j < f.encoders.size(); ++j) {
      char* dst = static_cast<char*>(f.buffer->data()) + j * tensor_bytes;
      f.encoders[j] = std::make_unique<Fp8TensorEncoder>(type_, f.hidden, checks_[sample]->checksum, dst);
    }
  }
  Fp8TensorEncoder& encoder = *f.encoders[f.slot[tensor]];
  if (values % f.hidden != 0 || encoder.rows() + values / f.hidden > f.tokens) {
    f.failed = true;  // not whole rows of this sample
    return;
  }
  encoder.Update(rows, values / f.hidden);
}

bool CaptureCheck::TakeFp8(Fp8Sample& f, SampleTensors& sample) {
  if (f.failed || f.buffer == nullptr || sample.tokens != f.tokens || sample.hidden != f.hidden) return false;
  for (const std::unique_ptr<Fp8TensorEncoder>& encoder : f.encoders) {
    if (encoder->rows() != f.tokens) return false;
  }
  SampleTensors out;
  out.capture_ids = f.ids;
  out.tokens = f.tokens;
  out.hidden = f.hidden;
  out.dtype = OutputDType::kFp8;
  const size_t tensor_bytes = static_cast<size_t>(f.tokens * out.row_bytes());
  for (size_t j = 0; j < f.encoders.size(); ++j) {
    out.AddTensor(j < f.ids.size() ? f.ids[j] : -1, static_cast<char*>(f.buffer->data()) + j * tensor_bytes);
    out.tensors.back().findings = f.encoders[j]->Finish();
  }
  out.held_bytes = static_cast<int64_t>(f.buffer->bytes());
  out.owner = std::move(f.buffer);
  sample = std::move(out);  // the capture buffer goes back to its pool
  return true;
}

void CaptureCheck::AttachFindings(int64_t s, SampleTensors& sample) {
  if (static_cast<size_t>(s) < fp8_.size() && fp8_[s] != nullptr) {
    TakeFp8(*fp8_[s], sample);
    return;
  }
  if (static_cast<size_t>(s) >= checked_.size() || checked_[s].size() != sample.tensors.size()) return;
  if (sample.dtype != checks_[s]->dtype) return;  // findings about other bytes than these
  for (size_t k = 0; k < sample.tensors.size(); ++k) {
    const Checked& c = checked_[s][k];
    if (c.fed == values_[s]) sample.tensors[k].findings = c.checker->Finish();
  }
}

}  // namespace hsx
