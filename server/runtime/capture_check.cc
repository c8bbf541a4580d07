// capture_check.cc: one TensorChecker per checked tensor, fed piece by piece.
#include "server/runtime/capture_check.h"

#include <utility>

namespace hsx {

CaptureCheck::CaptureCheck(const std::vector<std::optional<RowCheck>>& checks, ElementType type, size_t tensors,
                           std::vector<int64_t> values)
    : checked_(checks.size()), checks_(checks), values_(std::move(values)) {
  for (size_t s = 0; s < checks.size(); ++s) {
    if (!checks[s].has_value() || !SentAsIs(type, checks[s]->dtype)) continue;
    checked_[s].resize(tensors);
    for (Checked& c : checked_[s]) c.checker = std::make_unique<TensorChecker>(*checks[s]);
  }
}

void CaptureCheck::Written(int64_t sample, size_t tensor, const void* rows, int64_t values) {
  if (static_cast<size_t>(sample) >= checked_.size() || tensor >= checked_[sample].size()) return;
  Checked& c = checked_[sample][tensor];
  c.checker->Update(rows, values);
  c.fed += values;
}

void CaptureCheck::AttachFindings(int64_t s, SampleTensors& sample) const {
  if (static_cast<size_t>(s) >= checked_.size() || checked_[s].size() != sample.tensors.size()) return;
  if (sample.dtype != checks_[s]->dtype) return;  // findings about other bytes than these
  for (size_t k = 0; k < sample.tensors.size(); ++k) {
    const Checked& c = checked_[s][k];
    if (c.fed == values_[s]) sample.tensors[k].findings = c.checker->Finish();
  }
}

}  // namespace hsx
