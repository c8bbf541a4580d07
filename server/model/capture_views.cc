// capture_views.cc: views by cu_seqlens, capture selection.
#include "server/model/capture_views.h"

#include <algorithm>

namespace hsx {

std::vector<SampleView> ViewBySample(std::shared_ptr<const Captures> captures, std::span<const int64_t> cu_seqlens) {
  const Captures& c = *captures;
  const size_t element = ElementSize(c.type);
  std::vector<SampleView> views(cu_seqlens.size() - 1);
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    SampleView& v = views[s];
    const int64_t begin = cu_seqlens[s];
    v.capture_ids = c.ids;
    v.tokens = cu_seqlens[s + 1] - begin;
    v.hidden = c.hidden;
    v.type = c.type;
    for (size_t l = 0; l < c.ids.size(); ++l) {
      v.layers.push_back(static_cast<const char*>(c.layers->data()) + ((l * c.tokens + begin) * c.hidden) * element);
    }
    if (c.final_norm != nullptr) {
      v.final_norm = static_cast<const char*>(c.final_norm->data()) + begin * c.hidden * element;
    }
    v.owner = captures;
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
