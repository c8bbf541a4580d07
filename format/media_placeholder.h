// media_placeholder.h: the token ids a multimodal model (Kimi-K2.5) puts where
// an image, a video or audio goes, and the check that keeps them out of a
// sample.
//
// hsx runs the text model only (it never loads vision_tower.* weights): at a
// placeholder it would compute the states of a bare reserved token, not of the
// media, and every later position would attend to that. Such a sample is
// refused unless the operator allows it (--allow-media-placeholder): the
// server's request validator and hsx-dump --model's input check share this
// function, so both paths refuse alike.
#ifndef HSX_FORMAT_MEDIA_PLACEHOLDER_H_
#define HSX_FORMAT_MEDIA_PLACEHOLDER_H_

#include <cstdint>
#include <span>
#include <string>

#include "absl/strings/string_view.h"

namespace hsx {

// A token id that stands for media, and the config.json key that names it
// (e.g. "media_placeholder_token_id").
struct MediaPlaceholder {
  int32_t id = 0;
  std::string field;
  bool operator==(const MediaPlaceholder&) const = default;
};

// "" when no id of `ids` is one of `placeholders`; else, for the first such
// position P: "LIST[P] = ID is the model's media placeholder (FIELD); hsx
// extracts text only: ..." (`list` names the ids: "token_ids", "input_ids").
std::string FindMediaPlaceholder(std::span<const int32_t> ids, std::span<const MediaPlaceholder> placeholders,
                                 absl::string_view list);

}  // namespace hsx

#endif  // HSX_FORMAT_MEDIA_PLACEHOLDER_H_
