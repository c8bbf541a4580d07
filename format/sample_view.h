// sample_view.h: one sample's captured rows, in place in its batch's host
// buffers.
//
// The engine returns each sample's captures in a buffer of its own
// ([tensors][T][H]), so a view is one pointer per tensor and no byte is
// copied (server/model/capture_views.h makes them). `owner` keeps the rows
// alive (the sample's buffer, which goes back to its pool when the last
// owner lets go) and `held_bytes` says how much memory it keeps: a consumer
// can send the rows themselves when they are already in the output dtype and
// the owner holds nothing else. This is what lets the CUDA backend's pinned
// capture buffers reach the socket untouched.
#ifndef HSX_FORMAT_SAMPLE_VIEW_H_
#define HSX_FORMAT_SAMPLE_VIEW_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "format/sample_states.h"
#include "format/tensor_encoding.h"
#include "kernels/backend.h"

namespace hsx {

// What the engine's capture copy found while it wrote a sample's rows (the
// CPU backend, Model::Run): per tensor of the view, the checks and checksum
// CheckTensor would give for `check`, so that a consumer
// sending the rows as they are need not read them once more.
struct CheckedRows {
  RowCheck check;
  std::vector<TensorEncoding> tensors;  // layers, then the final norm
};

struct SampleView {
  std::vector<int> capture_ids;  // ascending
  int64_t tokens = 0;
  int64_t hidden = 0;
  ElementType type = ElementType::kF32;  // of the rows (the activation type)
  std::vector<const void*> layers;      // per capture id: [tokens, hidden] rows
  const void* final_norm = nullptr;     // [tokens, hidden], or null
  std::shared_ptr<const void> owner;    // keeps the rows alive
  int64_t held_bytes = 0;               // the memory `owner` keeps alive
  std::optional<CheckedRows> checked;   // when the capture copy checked the rows

  int64_t row_bytes() const { return hidden * static_cast<int64_t>(ElementSize(type)); }
  int num_tensors() const { return static_cast<int>(layers.size()) + (final_norm != nullptr ? 1 : 0); }
  // Bytes of the rows the view shows (every tensor, in the view's type).
  int64_t view_bytes() const { return num_tensors() * tokens * row_bytes(); }
  // The float32 [T, layers, H] copy, for consumers that want SampleStates.
  SampleStates ToStates() const;
};

}  // namespace hsx

#endif  // HSX_FORMAT_SAMPLE_VIEW_H_
