// sample_view.h: one sample's captured rows, in place in its batch's host
// buffers.
//
// The engine returns a batch's captures as [layers, T_batch, H] (plus the
// final norm as [T_batch, H]), so the rows of one sample for one layer are
// contiguous: a view is one pointer per tensor and no byte is copied
// (server/model/capture_views.h makes them). The views of a batch share
// ownership of its buffers through `owner`; the last one destroyed releases
// them (back to their pool). This is what lets the CUDA backend's pinned
// capture buffers reach the response encoder untouched.
#ifndef HSX_FORMAT_SAMPLE_VIEW_H_
#define HSX_FORMAT_SAMPLE_VIEW_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "format/sample_states.h"
#include "kernels/backend.h"

namespace hsx {

struct SampleView {
  std::vector<int> capture_ids;  // ascending
  int64_t tokens = 0;
  int64_t hidden = 0;
  ElementType type = ElementType::kF32;  // of the rows (the activation type)
  std::vector<const void*> layers;      // per capture id: [tokens, hidden] rows
  const void* final_norm = nullptr;     // [tokens, hidden], or null
  std::shared_ptr<const void> owner;    // keeps the rows alive

  int64_t row_bytes() const { return hidden * static_cast<int64_t>(ElementSize(type)); }
  // The float32 [T, layers, H] copy, for consumers that want SampleStates.
  SampleStates ToStates() const;
};

}  // namespace hsx

#endif  // HSX_FORMAT_SAMPLE_VIEW_H_
