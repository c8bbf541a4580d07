// input_sample.h: one sample of a dump's input, a plain value: what the
// sample-file writer records and the checker compares a file with.
// client/dump/input.h reads them from JSON Lines.
#ifndef HSX_FORMAT_INPUT_SAMPLE_H_
#define HSX_FORMAT_INPUT_SAMPLE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace hsx {

struct InputSample {
  int64_t index = 0;  // 0-based among samples: the i of hs_{i}.safetensors
  int64_t line = 0;   // 1-based line in the file
  std::string id;     // the "id" field, or the index as text
  std::vector<int32_t> input_ids;
  std::optional<std::vector<int64_t>> loss_mask;
};

}  // namespace hsx

#endif  // HSX_FORMAT_INPUT_SAMPLE_H_
