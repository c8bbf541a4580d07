// sample_file_checker.h: re-checks one written sample file against its journal
// line (and, when given, its input line) from the bytes alone: the reader side
// of format/sample_file.h, used by hsx-verify.
//
// Checks: the file's size and XXH64 equal the journal's; the safetensors
// header is valid (ParseSafetensors, the one reader); hidden_states is
// [T, L, H] in the journaled dtype, token_ids [T] int64, loss_mask [T] int64
// of 0/1 when journaled, final_norm_hidden_states [T, H] when journaled, and
// nothing else; the metadata (format version, index, id, dtype, model,
// revision, precision, capture ids) agrees with the journal and its per-tensor
// checksums with the data; the token and loss-mask hashes equal the journal's;
// every value is finite and no layer is all zeros; with an input line, the
// token ids, loss mask and id equal it.
#ifndef HSX_FORMAT_SAMPLE_FILE_CHECKER_H_
#define HSX_FORMAT_SAMPLE_FILE_CHECKER_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "format/input_sample.h"
#include "format/journal_entry.h"

namespace hsx {

// Every problem with the file whose contents are `bytes` (`file_name` names it in
// parser errors); empty when it verifies. `input` may be null.
std::vector<std::string> CheckSampleFileBytes(std::span<const uint8_t> bytes, absl::string_view file_name,
                                              const JournalEntry& entry, const InputSample* input);

// The same for the file at `path` (mapped, not read).
std::vector<std::string> CheckSampleFile(const std::string& path, const JournalEntry& entry,
                                         const InputSample* input);

// N, the decoder layers of the model that wrote the sample file at `path`
// (its num_layers metadata).
absl::StatusOr<int> SampleFileNumLayers(const std::string& path);

}  // namespace hsx

#endif  // HSX_FORMAT_SAMPLE_FILE_CHECKER_H_
