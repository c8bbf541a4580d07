// input.cc: JSONL parsing with per-line errors.
#include "client/dump/input.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <set>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "format/xxh64_stream.h"

namespace hsx {
namespace {

using json = nlohmann::json;

absl::Status Bad(const std::string& what) { return absl::InvalidArgumentError(what); }

// Parses `text` and names the first key that appears twice in one object
// (nlohmann keeps the last silently; config.json already refuses duplicates).
json ParseRejectingDuplicateKeys(const std::string& text, std::string* duplicate) {
  std::vector<std::set<std::string>> keys;
  return json::parse(
      text,
      [&](int, json::parse_event_t event, json& parsed) {
        if (event == json::parse_event_t::object_start) {
          keys.emplace_back();
        } else if (event == json::parse_event_t::object_end && !keys.empty()) {
          keys.pop_back();
        } else if (event == json::parse_event_t::key && !keys.empty() &&
                   !keys.back().insert(parsed.get<std::string>()).second && duplicate->empty()) {
          *duplicate = parsed.get<std::string>();
        }
        return true;
      },
      /*allow_exceptions=*/false);
}

}  // namespace

int64_t MaxInputLineBytes(const InputLimits& limits) {
  if (limits.max_tokens_per_sample <= 0) return int64_t{1} << 30;
  // "2147483647, " for an id and "1, " for its mask value, with spaces to spare.
  return (int64_t{64} << 10) + 32 * limits.max_tokens_per_sample;
}

absl::StatusOr<InputSample> ParseInputLine(const std::string& text, const InputLimits& limits) {
  std::string duplicate;
  const json line = ParseRejectingDuplicateKeys(text, &duplicate);
  if (line.is_discarded()) return Bad("not valid JSON");
  if (!duplicate.empty()) return Bad(absl::StrCat("key '", duplicate, "' appears twice"));
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
    if (limits.ids_any_int32 && id != static_cast<int32_t>(id)) {
      return Bad(absl::StrCat("input_ids[", i, "] = ", id, " does not fit a 32-bit token id"));
    }
    if (!limits.ids_any_int32 && (id < 0 || id >= limits.vocab_size)) {
      return Bad(absl::StrCat("input_ids[", i, "] = ", id, " is outside the vocabulary [0, ",
                              limits.vocab_size, ")"));
    }
    sample.input_ids.push_back(static_cast<int32_t>(id));
  }
  if (!limits.ids_any_int32) {
    const std::string media = FindMediaPlaceholder(sample.input_ids, limits.media_placeholders, "input_ids");
    if (!media.empty()) return Bad(media);
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

std::string OutOfLimits(const InputSample& sample, const InputLimits& limits) {
  const std::vector<int32_t>& ids = sample.input_ids;
  if (limits.max_tokens_per_sample > 0 && static_cast<int64_t>(ids.size()) > limits.max_tokens_per_sample) {
    return absl::StrCat("sample has ", ids.size(), " tokens, over the maximum of ", limits.max_tokens_per_sample);
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= limits.vocab_size) {
      return absl::StrCat("input_ids[", i, "] = ", ids[i], " is outside the vocabulary [0, ", limits.vocab_size, ")");
    }
  }
  return FindMediaPlaceholder(ids, limits.media_placeholders, "input_ids");
}

absl::StatusOr<std::vector<InputSample>> ReadInputFile(const std::string& path, const InputLimits& limits,
                                                       std::string* xxh64,
                                                       std::map<int64_t, std::string>* out_of_limits) {
  // With out_of_limits, a well-formed line beyond the model's limits is kept
  // (its index stays taken) and listed; ids must still fit int32.
  InputLimits parse_limits = limits;
  if (out_of_limits != nullptr) {
    parse_limits.ids_any_int32 = true;
    parse_limits.max_tokens_per_sample = 0;
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  Xxh64Stream hash;
  const size_t max_line = static_cast<size_t>(MaxInputLineBytes(limits));
  std::vector<InputSample> samples;
  std::string pending;  // the line being read
  std::vector<char> buffer(1 << 20);
  int64_t line_number = 0;
  absl::Status status;
  auto take_line = [&](std::string text) -> absl::Status {
    ++line_number;
    if (absl::StripAsciiWhitespace(text).empty()) return absl::OkStatus();
    absl::StatusOr<InputSample> sample = ParseInputLine(text, parse_limits);
    if (!sample.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", line_number, ": ", sample.status().message()));
    }
    sample->line = line_number;
    sample->index = static_cast<int64_t>(samples.size());
    if (sample->id.empty()) sample->id = std::to_string(sample->index);
    if (out_of_limits != nullptr) {
      if (const std::string why = OutOfLimits(*sample, limits); !why.empty()) {
        (*out_of_limits)[sample->index] = absl::StrCat(path, ":", line_number, ": ", why);
      }
    }
    samples.push_back(*std::move(sample));
    return absl::OkStatus();
  };
  auto too_long = [&] {
    return absl::InvalidArgumentError(absl::StrCat(path, ":", line_number + 1, ": line longer than ", max_line,
                                                   " bytes, more than ", limits.max_tokens_per_sample,
                                                   " tokens can take (is this JSON Lines?)"));
  };
  while (status.ok()) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      status = absl::DataLossError(absl::StrCat(path, ":", line_number + 1, ": read failed: ", std::strerror(errno)));
      break;
    }
    if (n == 0) break;
    hash.Update(buffer.data(), static_cast<size_t>(n));
    absl::string_view chunk(buffer.data(), static_cast<size_t>(n));
    for (size_t newline; status.ok() && (newline = chunk.find('\n')) != absl::string_view::npos;) {
      pending.append(chunk.data(), newline);
      chunk.remove_prefix(newline + 1);
      status = pending.size() > max_line ? too_long() : take_line(std::move(pending));
      pending.clear();
    }
    if (!status.ok()) break;
    pending.append(chunk.data(), chunk.size());
    if (pending.size() > max_line) status = too_long();
  }
  ::close(fd);
  if (status.ok() && !pending.empty()) status = take_line(std::move(pending));
  if (!status.ok()) return status;
  if (samples.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no samples"));
  if (xxh64 != nullptr) *xxh64 = hash.HexDigest();
  return samples;
}

}  // namespace hsx
