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
    v.owner = std::shared_ptr<const HostBuffer>(std::move(captures.samples[s]));
  }
  return views;
}

SampleView SelectCaptures(SampleView view, const CaptureSpec& wanted) {
  if (!wanted.final_norm()) view.final_norm = nullptr;
  if (view.capture_ids == wanted.ids()) return view;
  std::vector<const void*> layers;
  for (int id : wanted.ids()) {
    const size_t index = std::find(view.capture_ids.begin(), view.capture_ids.end(), id) - view.capture_ids.begin();
    layers.push_back(view.layers[index]);
  }
  view.capture_ids = wanted.ids();
  view.layers = std::move(layers);
  return view;
}

}  // namespace hsx
