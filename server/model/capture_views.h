// capture_views.h: a batch's Captures as one SampleView per sample (no
// copy; format/sample_view.h), and a view restricted to what its request
// asked for.
#ifndef HSX_SERVER_MODEL_CAPTURE_VIEWS_H_
#define HSX_SERVER_MODEL_CAPTURE_VIEWS_H_

#include <memory>
#include <span>
#include <vector>

#include "format/capture_spec.h"
#include "format/sample_view.h"
#include "server/model/forward.h"

namespace hsx {

// Views of every sample of a batch (by cu_seqlens), each with every captured
// tensor of the batch; they share ownership of `captures`.
std::vector<SampleView> ViewBySample(std::shared_ptr<const Captures> captures, std::span<const int64_t> cu_seqlens);

// The view restricted to `wanted` (ids a subset of the view's, final norm
// only if the view has it): pointers only, no copy.
SampleView SelectCaptures(SampleView view, const CaptureSpec& wanted);

}  // namespace hsx

#endif  // HSX_SERVER_MODEL_CAPTURE_VIEWS_H_
