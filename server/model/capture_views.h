// capture_views.h: a batch's Captures as one SampleTensors per sample (no
// copy; format/sample_tensors.h), and a sample restricted to what its
// request asked for.
#ifndef HSX_SERVER_MODEL_CAPTURE_VIEWS_H_
#define HSX_SERVER_MODEL_CAPTURE_VIEWS_H_

#include <vector>

#include "format/capture_spec.h"
#include "format/sample_tensors.h"
#include "server/model/forward.h"

namespace hsx {

// One sample per sample of the batch, each with every captured tensor of the
// batch (one piece each, in the activation type), or for a sample copied out
// as fp8 (Captures::fp8) with its own tensors as fp8 rows, and owning that
// sample's buffer alone (taken from `captures`).
std::vector<SampleTensors> ViewBySample(Captures captures);

// The sample restricted to `wanted` (ids a subset of the sample's, final
// norm only if the sample has it): the tensors move, with their findings;
// no byte is copied.
SampleTensors SelectCaptures(SampleTensors sample, const CaptureSpec& wanted);

}  // namespace hsx

#endif  // HSX_SERVER_MODEL_CAPTURE_VIEWS_H_
