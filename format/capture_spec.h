// capture_spec.h: what to capture from one forward pass, as a value: capture
// ids (docs/design.md, "Layer convention") and whether the post-norm state is
// wanted.
//
// Invariant: ids ascending, unique, each in [0, N] for the model's N layers.
// Only Make, Parse, Eagle3, Trainer, All and Union create a non-empty set, so every
// CaptureSpec holds it; they are the one place where capture sets are
// normalised (the server's flag, the request validator, the batcher's union
// and hsx-dump all go through them).
#ifndef HSX_FORMAT_CAPTURE_SPEC_H_
#define HSX_FORMAT_CAPTURE_SPEC_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace hsx {

class CaptureSpec {
 public:
  CaptureSpec() = default;  // nothing captured

  // Sorts and deduplicates `ids`; an id outside [0, num_layers] is
  // INVALID_ARGUMENT naming it as `field`[i] (e.g. "capture_ids[2] = 70 is
  // outside 0..61"), or as "capture id 70" when `field` is empty.
  static absl::StatusOr<CaptureSpec> Make(std::vector<int> ids, bool final_norm, int num_layers,
                                          const std::string& field = "");
  // The EAGLE-3 set {2, N/2, N-3, N} (those in range, deduplicated).
  static CaptureSpec Eagle3(int num_layers, bool final_norm = false);
  // Every id 0..N.
  static CaptureSpec All(int num_layers, bool final_norm = false);
  // Exactly what one trainer's offline loader reads (docs/trainers.md), or
  // NOT_FOUND for a name that is not a trainer preset:
  //   "speculators"           {2, N/2, N-3, N}: hidden_states[:, :-1] are its
  //                           auxiliary layers, hidden_states[:, -1] the last
  //                           layer, normed by the draft itself.
  //   "specforge", "modelopt" {2, N/2, N-3} and the post-final-norm state: the
  //                           target is the lm_head input; layer N is not read.
  // `final_norm` adds the post-norm state where the preset has none.
  static absl::StatusOr<CaptureSpec> Trainer(const std::string& name, int num_layers, bool final_norm = false);
  // "eagle3", "all", a trainer preset (Trainer) or a comma-separated list of
  // ids; errors name the offending id. An empty set without the final norm
  // is an error.
  static absl::StatusOr<CaptureSpec> Parse(const std::string& text, int num_layers, bool final_norm);
  // The names Parse accepts besides lists, for --help texts and errors.
  static constexpr char kNames[] = "eagle3, all, speculators, specforge, modelopt";
  // The union of several sets (what one batch must capture for all of them).
  static CaptureSpec Union(const std::vector<const CaptureSpec*>& specs);

  const std::vector<int>& ids() const { return ids_; }  // ascending, unique
  bool final_norm() const { return final_norm_; }       // also the post-final-norm state
  // The same ids, with the final norm wanted or not (it has no invariant).
  CaptureSpec WithFinalNorm(bool final_norm) const { return CaptureSpec(ids_, final_norm); }

  bool operator==(const CaptureSpec&) const = default;

 private:
  CaptureSpec(std::vector<int> ids, bool final_norm) : ids_(std::move(ids)), final_norm_(final_norm) {}

  std::vector<int> ids_;
  bool final_norm_ = false;
};

}  // namespace hsx

#endif  // HSX_FORMAT_CAPTURE_SPEC_H_
