// media_placeholder.cc: the scan for media placeholders and its message.
#include "format/media_placeholder.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace hsx {

std::string FindMediaPlaceholder(std::span<const int32_t> ids, std::span<const MediaPlaceholder> placeholders,
                                 absl::string_view list) {
  if (placeholders.empty()) return "";  // the common case: a text-only model, or the operator allowed them
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto hit = std::find_if(placeholders.begin(), placeholders.end(),
                                  [id = ids[i]](const MediaPlaceholder& p) { return p.id == id; });
    if (hit == placeholders.end()) continue;
    return absl::StrCat(list, "[", i, "] = ", ids[i], " is the model's media placeholder (", hit->field,
                        "); hsx extracts text only: the media encoder is not run, so these states would not be "
                        "what the model computes on this sample (drop the sample, or allow it with "
                        "--allow-media-placeholder)");
  }
  return "";
}

}  // namespace hsx
