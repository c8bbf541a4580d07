// capture_views.cc: views by cu_seqlens, capture selection.
#include "server/model/capture_views.h"

#include <algorithm>

namespace hsx {

std::vector<SampleView> ViewBySample(Captures captures) {
  std::vector<SampleView> views(captures.num_samples());
  for (int64_t s = 0; s < captures.num_samples(); ++s) {
    SampleView& v = views[s];
    v.capture_ids = captures.ids;
    v.tokens = captures.cu_seqlens[s + 1] - captures.cu_seqlens[s];
    v.hidden = captures.hidden;
    v.type = captures.type;
    for (size_t l = 0; l < captures.ids.size(); ++l) v.layers.push_back(captures.Tensor(s, l));
    if (captures.has_final_norm) v.final_norm = captures.Tensor(s, captures.ids.size());
    v.held_bytes = static_cast<int64_t>(captures.SampleBytes(s));
    if (static_cast<size_t>(s) < captures.checked.size()) v.checked = std::move(captures.checked[s]);
    v.owner = std::shared_ptr<const HostBuffer>(std::move(captures.samples[s]));
  }
  return views;
}

SampleView SelectCaptures(SampleView view, const CaptureSpec& wanted) {
  if (view.checked && static_cast<int>(view.checked->tensors.size()) != view.num_tensors()) view.checked.reset();
  if (view.capture_ids == wanted.ids() && (view.final_norm == nullptr || wanted.final_norm())) return view;
  std::vector<const void*> layers;
  std::vector<TensorEncoding> checked;  // the capture copy's findings, selected alike
  for (int id : wanted.ids()) {
    const size_t index = std::find(view.capture_ids.begin(), view.capture_ids.end(), id) - view.capture_ids.begin();
    layers.push_back(view.layers[index]);
    if (view.checked) checked.push_back(view.checked->tensors[index]);
  }
  if (view.final_norm != nullptr && wanted.final_norm()) {
    if (view.checked) checked.push_back(view.checked->tensors.back());
  } else {
    view.final_norm = nullptr;
  }
  view.capture_ids = wanted.ids();
  view.layers = std::move(layers);
  if (view.checked) view.checked->tensors = std::move(checked);
  return view;
}

}  // namespace hsx
