// layer_convention.h: what a capture id means, in the words every output
// records (sample files' metadata, GetModelInfo, the response header).
// docs/design.md, "Layer convention".
#ifndef HSX_FORMAT_LAYER_CONVENTION_H_
#define HSX_FORMAT_LAYER_CONVENTION_H_

namespace hsx {

// The convention string recorded in every output.
inline constexpr char kLayerConvention[] =
    "capture id k = residual stream entering decoder layer k (HF output_hidden_states[k] for k < N); "
    "k = N = last layer output before the final norm";

}  // namespace hsx

#endif  // HSX_FORMAT_LAYER_CONVENTION_H_
