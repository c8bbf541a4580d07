// sample_file.h: the on-disk format of one extracted sample (docs/design.md,
// "On-disk format"): hs_{i}.safetensors holding
//   hidden_states            [T, L, H]  bf16 | fp16 | fp32 | F8_E4M3, layers in ascending capture id
//   hidden_states_scales     [T, L, 1]  F32, fp8 only: each row's scale (format/fp8.h)
//   token_ids                [T]        int64
//   loss_mask                [T]        int64, when the input line has one
//   final_norm_hidden_states [T, H]     when the post-norm state was asked for
//   final_norm_hidden_states_scales [T, 1]  F32, with it for fp8
// and string metadata: sample id and index, capture ids, the layer convention,
// pre/post-norm, model name (and, when known, model_revision: xxh64 of the
// checkpoint's config.json, and compute_precision), dtype, xxh64 checksums of
// each tensor's bytes. Written atomically (temporary file, fsync, rename).
// The bytes depend only on the sample, the states and SampleFileInfo, so the
// in-process and remote modes write identical files.
#ifndef HSX_FORMAT_SAMPLE_FILE_H_
#define HSX_FORMAT_SAMPLE_FILE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "format/encoding.h"
#include "format/input_sample.h"
#include "format/layer_convention.h"
#include "format/piece_reader.h"
#include "format/safetensors.h"
#include "format/safetensors_writer.h"
#include "format/sample_tensors.h"

namespace hsx {

struct SampleFileInfo {
  std::string model_name;
  int64_t num_layers = 0;
  // Recorded in the metadata when set (both modes set them the same way, so
  // that in-process and remote files are byte-identical).
  std::string model_revision;     // CheckpointRevision(): config, layout and sampled weight bytes
  std::string compute_precision;  // "bf16" or "fp32"
};

// Checks the values of `layers` interleaved [tokens, layers, hidden] tensors
// in `dtype`: every value finite, no layer all zeros; for fp8 also every one
// of the [tokens, layers] float32 `scales` finite and positive (checked
// before its row's values). `names[l]` names layer l in errors (e.g.
// "capture id 30").
absl::Status CheckEncodedValues(std::span<const uint8_t> bytes, OutputDType dtype, int64_t tokens,
                                int64_t layers, int64_t hidden,
                                const std::vector<std::string>& names, std::span<const uint8_t> scales = {});

// What CheckEncodedValues reports for the sample's hidden states [T, L, H]
// (layers named by `names`), then for its final norm ("the final-norm
// state"): the same first error, from each tensor's findings (a receiver's,
// or the encoder's), or from its bytes where it has none.
absl::Status CheckSampleValues(const SampleTensors& sample, const std::vector<std::string>& names);
// The same, each layer named "capture id N" (what hsx-dump and the Python
// client report).
absl::Status CheckSampleValues(const SampleTensors& sample);

// File name of sample `index`: hs_{index}.safetensors.
std::string SampleFileName(int64_t index);

// Writes one sample's file from its tensors in the file's dtype, straight
// from their pieces (hidden_states' rows taken row by row, layer by layer,
// from the layers' pieces; no copy of the states). A tensor whose findings
// hold its XXH64 and that lies in the file as it is (the final norm; the
// hidden states of one layer) is not hashed again. When `digest` is set,
// fills it with the file's size and XXH64, computed while writing (equal to
// hashing the file read back).
absl::Status WriteSampleFile(const std::string& path, const InputSample& input,
                             const SampleTensors& sample, const SampleFileInfo& info,
                             WrittenDigest* digest = nullptr);

// XXH64 (seed 0) of little-endian int64 values, 16 hex digits: the token_ids
// and loss_mask checksums of the file metadata and the journal.
std::string Int64Xxh64Hex(std::span<const int64_t> values);

}  // namespace hsx

#endif  // HSX_FORMAT_SAMPLE_FILE_H_
