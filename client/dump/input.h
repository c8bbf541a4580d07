// input.h: the JSON Lines input of hsx-dump, read and validated in full
// before any work starts, so bad input never leaves partial output.
//
// One sample per line: {"input_ids": [...], "loss_mask": [...]?, "id": ...?}.
// Blank lines are skipped but counted, so sample i is the i-th non-blank line
// and errors say "FILE:LINE: what".
#ifndef HSX_CLIENT_DUMP_INPUT_H_
#define HSX_CLIENT_DUMP_INPUT_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "format/input_sample.h"
#include "format/media_placeholder.h"

namespace hsx {

struct InputLimits {
  int64_t vocab_size = 0;             // ids must be in [0, vocab_size)
  int64_t max_tokens_per_sample = 0;  // 0: no limit
  // Ids need only fit int32; the vocabulary is checked later (OutOfLimits).
  bool ids_any_int32 = false;
  // Ids refused like those outside the vocabulary: the model's media
  // placeholders (--model; none with --allow-media-placeholder; with --server
  // the server checks).
  std::vector<MediaPlaceholder> media_placeholders;
};

// Reads and validates every line, in one pass (a pipe or FIFO works; it is
// read once). A read error is an error, never an early end of file; a line
// longer than MaxInputLineBytes(limits) is refused without reading it whole.
// `xxh64`, when given, receives the XXH64 of every byte read (hex). Errors
// name the file and line. With `out_of_limits`, a well-formed sample beyond
// `limits` (too many tokens, an id outside the vocabulary, a media
// placeholder) is no error: it is returned like the others and listed there
// (index -> "FILE:LINE: why"), for hsx-dump --max-failures to quarantine.
absl::StatusOr<std::vector<InputSample>> ReadInputFile(const std::string& path, const InputLimits& limits,
                                                       std::string* xxh64 = nullptr,
                                                       std::map<int64_t, std::string>* out_of_limits = nullptr);

// Why `sample` is beyond `limits` ("" if it is not).
std::string OutOfLimits(const InputSample& sample, const InputLimits& limits);

// The longest line accepted: room for max_tokens_per_sample ids and loss-mask
// values at their longest spelling, plus 64 KiB for the rest (1 GiB without a
// token limit).
int64_t MaxInputLineBytes(const InputLimits& limits);

// Parses one line (exposed for tests).
absl::StatusOr<InputSample> ParseInputLine(const std::string& text, const InputLimits& limits);

}  // namespace hsx

#endif  // HSX_CLIENT_DUMP_INPUT_H_
