// capture_views.cc: samples by cu_seqlens, capture selection.
#include "server/model/capture_views.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "format/tensor_encoding.h"

namespace hsx {

std::vector<SampleTensors> ViewBySample(Captures captures) {
  std::vector<SampleTensors> samples(captures.num_samples());
  for (int64_t s = 0; s < captures.num_samples(); ++s) {
    SampleTensors& v = samples[s];
    v.tokens = captures.cu_seqlens[s + 1] - captures.cu_seqlens[s];
    v.hidden = captures.hidden;
    const bool fp8 = captures.IsFp8(s);
    v.capture_ids = fp8 ? captures.fp8[s]->ids() : captures.ids;
    v.dtype = fp8 ? OutputDType::kFp8 : DTypeOfRows(captures.type);
    for (size_t l = 0; l <= captures.ids.size(); ++l) {
      if (l == captures.ids.size() && !captures.has_final_norm) break;
      const void* rows = captures.Tensor(s, l);  // null: an fp8 sample does not hold it
      if (rows != nullptr) v.AddTensor(l < captures.ids.size() ? captures.ids[l] : -1, rows);
    }
    v.held_bytes = static_cast<int64_t>(captures.SampleBytes(s));
    v.owner = std::shared_ptr<const HostBuffer>(std::move(captures.samples[s]));
  }
  return samples;
}

SampleTensors SelectCaptures(SampleTensors sample, const CaptureSpec& wanted) {
  std::vector<SampleTensor> tensors;
  for (int id : wanted.ids()) {
    const auto it = std::find(sample.capture_ids.begin(), sample.capture_ids.end(), id);
    tensors.push_back(std::move(sample.tensors[it - sample.capture_ids.begin()]));
  }
  if (sample.has_final_norm() && wanted.final_norm()) tensors.push_back(std::move(sample.tensors.back()));
  sample.capture_ids = wanted.ids();
  sample.tensors = std::move(tensors);
  return sample;
}

}  // namespace hsx
