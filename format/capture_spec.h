// capture_spec.h: what to capture from one forward pass, as a value: capture
// ids (docs/design.md, "Layer convention") and whether the post-norm state is
// wanted.
//
// Invariant: ids ascending, unique, each in [0, N] for the model's N layers.
// Make, Parse, Eagle3, All and Union establish it; they are the one place
// where capture sets are normalised (the server's flag, the request
// validator, the batcher's union and hsx-dump all go through them). The
// fields stay public so that aggregate code reads them directly; code that
// writes them must keep the invariant.
#ifndef HSX_FORMAT_CAPTURE_SPEC_H_
#define HSX_FORMAT_CAPTURE_SPEC_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace hsx {

struct CaptureSpec {
  std::vector<int> ids;
  bool final_norm = false;

  // Sorts and deduplicates `ids`; an id outside [0, num_layers] is
  // INVALID_ARGUMENT naming it as `field`[i] (e.g. "capture_ids[2] = 70 is
  // outside 0..61"), or as "capture id 70" when `field` is empty.
  static absl::StatusOr<CaptureSpec> Make(std::vector<int> ids, bool final_norm, int num_layers,
                                          const std::string& field = "");
  // The EAGLE-3 set {2, N/2, N-3, N} (those in range, deduplicated).
  static CaptureSpec Eagle3(int num_layers, bool final_norm = false);
  // Every id 0..N.
  static CaptureSpec All(int num_layers, bool final_norm = false);
  // "eagle3", "all" or a comma-separated list of ids; errors name the
  // offending id. An empty set without the final norm is an error.
  static absl::StatusOr<CaptureSpec> Parse(const std::string& text, int num_layers, bool final_norm);
  // The union of several sets (what one batch must capture for all of them).
  static CaptureSpec Union(const std::vector<const CaptureSpec*>& specs);

  bool operator==(const CaptureSpec&) const = default;
};

}  // namespace hsx

#endif  // HSX_FORMAT_CAPTURE_SPEC_H_
