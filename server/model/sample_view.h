// sample_view.h: one sample's captured rows, in place in its batch's host
// buffers.
//
// The engine returns a batch's captures as [layers, T_batch, H] (plus the
// final norm as [T_batch, H]), so the rows of one sample for one layer are
// contiguous: a view is one pointer per tensor and no byte is copied. The
// views of a batch share ownership of its Captures; the last one destroyed
// releases the host buffers (back to their pool). This is what lets the
// CUDA backend's pinned capture buffers reach the response encoder untouched.
#ifndef HSX_SERVER_MODEL_SAMPLE_VIEW_H_
#define HSX_SERVER_MODEL_SAMPLE_VIEW_H_

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "server/model/forward.h"
#include "server/model/sample_states.h"

namespace hsx {

struct SampleView {
  std::vector<int> capture_ids;  // ascending
  int64_t tokens = 0;
  int64_t hidden = 0;
  ElementType type = ElementType::kF32;  // of the rows (the activation type)
  std::vector<const void*> layers;      // per capture id: [tokens, hidden] rows
  const void* final_norm = nullptr;     // [tokens, hidden], or null
  std::shared_ptr<const Captures> batch;  // keeps the rows alive

  int64_t row_bytes() const { return hidden * static_cast<int64_t>(ElementSize(type)); }
  // The float32 [T, layers, H] copy, for consumers that want SampleStates.
  SampleStates ToStates() const;
};

// Views of every sample of a batch (by cu_seqlens), each with every captured
// tensor of the batch.
std::vector<SampleView> ViewBySample(std::shared_ptr<const Captures> captures, std::span<const int64_t> cu_seqlens);

// The view restricted to `wanted` (ids a subset of the view's, final norm
// only if the view has it): pointers only, no copy.
SampleView SelectCaptures(SampleView view, const CaptureSpec& wanted);

}  // namespace hsx

#endif  // HSX_SERVER_MODEL_SAMPLE_VIEW_H_
