// sample_view.cc: views by cu_seqlens, capture selection, the float32 copy.
#include "server/model/sample_view.h"

#include <algorithm>
#include <cstring>

#include "kernels/bf16.h"

namespace hsx {
namespace {

void WidenRows(ElementType type, const void* rows, int64_t count, float* dst) {
  if (type == ElementType::kF32) {
    std::memcpy(dst, rows, count * sizeof(float));
    return;
  }
  const uint16_t* bits = static_cast<const uint16_t*>(rows);
  for (int64_t i = 0; i < count; ++i) dst[i] = Bf16ToFloat(bits[i]);
}

}  // namespace

SampleStates SampleView::ToStates() const {
  SampleStates out;
  out.capture_ids = capture_ids;
  out.tokens = tokens;
  out.hidden = hidden;
  const int64_t n = static_cast<int64_t>(layers.size());
  out.hidden_states.resize(tokens * n * hidden);
  const size_t element = ElementSize(type);
  for (int64_t l = 0; l < n; ++l) {
    for (int64_t t = 0; t < tokens; ++t) {
      WidenRows(type, static_cast<const char*>(layers[l]) + t * hidden * element, hidden,
                &out.hidden_states[(t * n + l) * hidden]);
    }
  }
  if (final_norm != nullptr) {
    out.final_norm.resize(tokens * hidden);
    WidenRows(type, final_norm, tokens * hidden, out.final_norm.data());
  }
  return out;
}

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
    v.batch = captures;
  }
  return views;
}

SampleView SelectCaptures(SampleView view, const CaptureSpec& wanted) {
  if (!wanted.final_norm) view.final_norm = nullptr;
  if (view.capture_ids == wanted.ids) return view;
  std::vector<const void*> layers;
  for (int id : wanted.ids) {
    const size_t index = std::find(view.capture_ids.begin(), view.capture_ids.end(), id) - view.capture_ids.begin();
    layers.push_back(view.layers[index]);
  }
  view.capture_ids = wanted.ids;
  view.layers = std::move(layers);
  return view;
}

}  // namespace hsx
