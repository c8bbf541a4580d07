// sample_view.cc: the float32 copy of a view.
#include "format/sample_view.h"

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

}  // namespace hsx
