// libFuzzer target: hsx-dump's JSON Lines input, one line at a time. Whatever
// the text, ParseInputLine returns a status; a sample it accepts respects the
// limits (ids in [0, vocab), length within the maximum, a loss mask of the
// same length).
#include <cstddef>
#include <cstdint>
#include <string>

#include "client/dump/input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  hsx::InputLimits limits;
  limits.vocab_size = 1000;
  limits.max_tokens_per_sample = 64;
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    absl::StatusOr<hsx::InputSample> sample = hsx::ParseInputLine(text.substr(begin, end - begin), limits);
    if (sample.ok()) {
      if (sample->input_ids.empty() || static_cast<int64_t>(sample->input_ids.size()) > 64) __builtin_trap();
      for (int32_t id : sample->input_ids) {
        if (id < 0 || id >= 1000) __builtin_trap();
      }
      if (sample->loss_mask) {
        if (sample->loss_mask->size() != sample->input_ids.size()) __builtin_trap();
        for (int64_t v : *sample->loss_mask) {
          if (v != 0 && v != 1) __builtin_trap();
        }
      }
    }
    begin = end + 1;
  }
  return 0;
}
