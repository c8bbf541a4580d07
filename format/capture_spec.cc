// capture_spec.cc: the one normalisation of capture sets.
#include "format/capture_spec.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace hsx {
namespace {

void SortUnique(std::vector<int>& ids) {
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
}

}  // namespace

absl::StatusOr<CaptureSpec> CaptureSpec::Make(std::vector<int> ids, bool final_norm, int num_layers,
                                              const std::string& field) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] > num_layers) {
      const std::string name = field.empty() ? absl::StrCat("capture id ", ids[i])
                                             : absl::StrCat(field, "[", i, "] = ", ids[i]);
      return absl::InvalidArgumentError(absl::StrCat(name, " is outside 0..", num_layers, " (the model has ",
                                                     num_layers, " layers; id N is the last layer's output)"));
    }
  }
  SortUnique(ids);
  return CaptureSpec(std::move(ids), final_norm);
}

CaptureSpec CaptureSpec::Eagle3(int num_layers, bool final_norm) {
  std::vector<int> ids;
  for (int id : {2, num_layers / 2, num_layers - 3, num_layers}) {
    if (id >= 0 && id <= num_layers) ids.push_back(id);
  }
  SortUnique(ids);
  return CaptureSpec(std::move(ids), final_norm);
}

CaptureSpec CaptureSpec::All(int num_layers, bool final_norm) {
  std::vector<int> ids;
  for (int i = 0; i <= num_layers; ++i) ids.push_back(i);
  return CaptureSpec(std::move(ids), final_norm);
}

absl::StatusOr<CaptureSpec> CaptureSpec::Trainer(const std::string& name, int num_layers, bool final_norm) {
  const CaptureSpec eagle3 = Eagle3(num_layers, final_norm);
  if (name == "speculators") return eagle3;
  if (name != "specforge" && name != "modelopt") {
    return absl::NotFoundError(absl::StrCat("'", name, "' is not a trainer preset (speculators, specforge, modelopt)"));
  }
  std::vector<int> aux;
  for (int id : eagle3.ids()) {
    if (id < num_layers) aux.push_back(id);
  }
  return CaptureSpec(std::move(aux), /*final_norm=*/true);
}

absl::StatusOr<CaptureSpec> CaptureSpec::Parse(const std::string& text, int num_layers, bool final_norm) {
  absl::StatusOr<CaptureSpec> spec = Trainer(text, num_layers, final_norm);
  if (spec.ok()) return spec;  // never empty
  if (text == "eagle3") {
    spec = Eagle3(num_layers, final_norm);
  } else if (text == "all") {
    spec = All(num_layers, final_norm);
  } else {
    std::vector<int> ids;
    for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
      int id;
      if (!absl::SimpleAtoi(part, &id)) {
        return absl::InvalidArgumentError(absl::StrCat("capture id '", part, "' is not an integer (nor is '", text,
                                                       "' one of ", kNames, ")"));
      }
      ids.push_back(id);
    }
    spec = Make(std::move(ids), final_norm, num_layers);
    if (!spec.ok()) return spec.status();
  }
  if (spec->ids().empty() && !final_norm) {
    return absl::InvalidArgumentError("nothing to capture: give capture ids or the final norm");
  }
  return spec;
}

CaptureSpec CaptureSpec::Union(const std::vector<const CaptureSpec*>& specs) {
  std::vector<int> ids;
  bool final_norm = false;
  for (const CaptureSpec* spec : specs) {
    ids.insert(ids.end(), spec->ids_.begin(), spec->ids_.end());
    final_norm |= spec->final_norm_;
  }
  SortUnique(ids);
  return CaptureSpec(std::move(ids), final_norm);
}

}  // namespace hsx
