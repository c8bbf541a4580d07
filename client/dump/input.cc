// input.cc: JSONL parsing with per-line errors.
#include "client/dump/input.h"

#include <fstream>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace hsx {
namespace {

using json = nlohmann::json;

absl::Status Bad(const std::string& what) { return absl::InvalidArgumentError(what); }

}  // namespace

absl::StatusOr<InputSample> ParseInputLine(const std::string& text, const InputLimits& limits) {
  const json line = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (line.is_discarded()) return Bad("not valid JSON");
  if (!line.is_object()) return Bad("not a JSON object");
  if (!line.contains("input_ids") || !line["input_ids"].is_array()) {
    return Bad("missing list 'input_ids'");
  }
  const json& ids = line["input_ids"];
  if (ids.empty()) return Bad("'input_ids' is empty");
  if (limits.max_tokens_per_sample > 0 && static_cast<int64_t>(ids.size()) > limits.max_tokens_per_sample) {
    return Bad(absl::StrCat("sample has ", ids.size(), " tokens, over the maximum of ",
                            limits.max_tokens_per_sample));
  }
  InputSample sample;
  sample.input_ids.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!ids[i].is_number_integer()) {
      return Bad(absl::StrCat("input_ids[", i, "] = ", ids[i].dump(), " is not an integer"));
    }
    const int64_t id = ids[i].get<int64_t>();
    if (id < 0 || id >= limits.vocab_size) {
      return Bad(absl::StrCat("input_ids[", i, "] = ", id, " is outside the vocabulary [0, ",
                              limits.vocab_size, ")"));
    }
    sample.input_ids.push_back(static_cast<int32_t>(id));
  }
  if (line.contains("loss_mask") && !line["loss_mask"].is_null()) {
    const json& mask = line["loss_mask"];
    if (!mask.is_array() || mask.size() != ids.size()) {
      return Bad(absl::StrCat("'loss_mask' must be a list as long as 'input_ids' (", ids.size(), ")"));
    }
    std::vector<int64_t> values;
    for (size_t i = 0; i < mask.size(); ++i) {
      if (!mask[i].is_number_integer() || (mask[i] != 0 && mask[i] != 1)) {
        return Bad(absl::StrCat("loss_mask[", i, "] = ", mask[i].dump(), " is not 0 or 1"));
      }
      values.push_back(mask[i].get<int64_t>());
    }
    sample.loss_mask = std::move(values);
  }
  if (line.contains("id")) {
    const json& id = line["id"];
    if (id.is_string()) {
      sample.id = id.get<std::string>();
    } else if (id.is_number_integer()) {
      sample.id = id.dump();
    } else {
      return Bad("'id' must be a string or an integer");
    }
  }
  return sample;
}

absl::StatusOr<std::vector<InputSample>> ReadInputFile(const std::string& path,
                                                       const InputLimits& limits) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::vector<InputSample> samples;
  std::string text;
  int64_t line_number = 0;
  while (std::getline(in, text)) {
    ++line_number;
    if (absl::StripAsciiWhitespace(text).empty()) continue;
    absl::StatusOr<InputSample> sample = ParseInputLine(text, limits);
    if (!sample.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", line_number, ": ", sample.status().message()));
    }
    sample->line = line_number;
    sample->index = static_cast<int64_t>(samples.size());
    if (sample->id.empty()) sample->id = std::to_string(sample->index);
    samples.push_back(*std::move(sample));
  }
  if (samples.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no samples"));
  return samples;
}

}  // namespace hsx
