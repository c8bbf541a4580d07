// capture_views.h: a batch's Captures as one SampleView per sample (no
// copy; format/sample_view.h), and a view restricted to what its request
// asked for.
#ifndef HSX_SERVER_MODEL_CAPTURE_VIEWS_H_
#define HSX_SERVER_MODEL_CAPTURE_VIEWS_H_

#include <memory>
#include <vector>

#include "format/capture_spec.h"
#include "format/sample_view.h"
#include "server/model/forward.h"

namespace hsx {

// One view per sample of the batch, each with every captured tensor of the
// batch and owning that sample's buffer alone (taken from `captures`).
std::vector<SampleView> ViewBySample(Captures captures);

// The view restricted to `wanted` (ids a subset of the view's, final norm
// only if the view has it): pointers only, no copy.
SampleView SelectCaptures(SampleView view, const CaptureSpec& wanted);

}  // namespace hsx

#endif  // HSX_SERVER_MODEL_CAPTURE_VIEWS_H_
