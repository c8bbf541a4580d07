// sample_file.h: the on-disk format of one extracted sample (docs/design.md,
// "On-disk format"): hs_{i}.safetensors holding
//   hidden_states            [T, L, H]  bf16 | fp16 | fp32, layers in ascending capture id
//   token_ids                [T]        int64
//   loss_mask                [T]        int64, when the input line has one
//   final_norm_hidden_states [T, H]     when the post-norm state was asked for
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
#include "format/sample_states.h"
#include "format/state_bytes.h"

namespace hsx {

struct SampleFileInfo {
  std::string model_name;
  int64_t num_layers = 0;
  // Recorded in the metadata when set (both modes set them the same way, so
  // that in-process and remote files are byte-identical).
  std::string model_revision;     // CheckpointRevision(): config, layout and sampled weight bytes
  std::string compute_precision;  // "bf16" or "fp32"
};

// CheckEncodedValues' findings, made by a receiver while the bytes were in
// cache (StreamAssembler checks each piece of a chunk as it arrives): one
// entry per tensor of an EncodedSample, its layers in order, then the final
// norm. Self-contained (the bad value is recorded too), so that it holds for
// a sample whose states were not kept.
struct EncodedValueCheck {
  std::vector<char> nonzero;       // some value is neither +0 nor -0
  std::vector<int64_t> first_bad;  // row * hidden + column of the first non-finite value, or -1
  std::vector<float> bad_value;    // that value, decoded (for the error message)
};

// How many bytes of each tensor a receiver verified and dropped (see
// EncodedSample::dropped).
struct DroppedStates {
  int64_t hidden_states_bytes = 0;
  int64_t final_norm_bytes = 0;
};

// The states of a sample as a receiver kept them: the pieces of memory they
// arrived in (StreamAssembler's kKeepReceived mode keeps gRPC's received
// slices), not copied into one block. WriteSampleFile writes the file from
// these pieces, in file order.
struct ReceivedStates {
  // One entry per tensor, in stream order: each capture id's [T, H] rows,
  // then the final norm's; each the tensor's bytes as pieces, in order (a
  // row may be split between two pieces).
  std::vector<std::vector<BytePiece>> tensors;
  // Keeps the pieces' memory alive (the received slices).
  std::shared_ptr<const void> owner;

  int64_t bytes(size_t first, size_t count) const {
    int64_t total = 0;
    for (size_t i = first; i < first + count && i < tensors.size(); ++i) {
      for (const BytePiece& piece : tensors[i]) total += static_cast<int64_t>(piece.size());
    }
    return total;
  }
};

// One sample's states already in the output dtype: what an Extractor
// delivers, so that remote bytes go to disk without a decode/encode round trip.
struct EncodedSample {
  std::vector<int> capture_ids;  // ascending
  int64_t tokens = 0;
  int64_t hidden = 0;
  OutputDType dtype = OutputDType::kBf16;
  StateBytes hidden_states;       // [tokens, capture_ids.size(), hidden], little-endian dtype
  bool has_final_norm = false;
  StateBytes final_norm;          // [tokens, hidden] when has_final_norm
  // Set by a receiver that checked the values on arrival; CheckSampleValues
  // then reports from it instead of reading the states again.
  std::optional<EncodedValueCheck> values_checked;
  // XXH64 (seed 0) of hidden_states / final_norm as they are, when a
  // receiver already computed it (StreamAssembler, from the bytes it
  // verified against the trailer); WriteSampleFile then does not hash them
  // again for the file's checksums. Whoever changes the bytes resets these.
  std::optional<uint64_t> hidden_states_xxh64;
  std::optional<uint64_t> final_norm_xxh64;
  // Set by a receiver that verified the states as they arrived and kept no
  // copy of them (StreamAssembler's verify-only mode, hsx-dump --discard):
  // hidden_states and final_norm are then empty, values_checked holds the
  // value checks, and this the numbers of bytes that arrived.
  std::optional<DroppedStates> dropped;
  // Set by a receiver that kept the states in the memory they arrived in
  // (StreamAssembler's kKeepReceived mode, hsx-dump writing files):
  // hidden_states and final_norm are then empty, values_checked holds the
  // value checks, and this the bytes.
  std::optional<ReceivedStates> received;

  // Bytes of each tensor: held, kept as received, or received and dropped.
  int64_t hidden_states_bytes() const {
    if (received) return received->bytes(0, capture_ids.size());
    return dropped ? dropped->hidden_states_bytes : static_cast<int64_t>(hidden_states.size());
  }
  int64_t final_norm_bytes() const {
    if (received) return has_final_norm ? received->bytes(capture_ids.size(), 1) : 0;
    return dropped ? dropped->final_norm_bytes : static_cast<int64_t>(final_norm.size());
  }
};

// Encodes float32 states (the in-process engine's output) into `dtype`.
EncodedSample EncodeSampleStates(const SampleStates& states, OutputDType dtype);

// Checks the values of `layers` interleaved [tokens, layers, hidden] tensors
// in `dtype`: every value finite, no layer all zeros. `names[l]` names layer l
// in errors (e.g. "capture id 30").
absl::Status CheckEncodedValues(std::span<const uint8_t> bytes, OutputDType dtype, int64_t tokens,
                                int64_t layers, int64_t hidden,
                                const std::vector<std::string>& names);

// CheckEncodedValues of the hidden states (layers named by `names`), then of
// the final norm ("the final-norm state"): the same first error, taken from
// sample.values_checked when it is set.
absl::Status CheckSampleValues(const EncodedSample& sample, const std::vector<std::string>& names);
// The same, each layer named "capture id N" (what hsx-dump and the Python
// client report).
absl::Status CheckSampleValues(const EncodedSample& sample);

// File name of sample `index`: hs_{index}.safetensors.
std::string SampleFileName(int64_t index);

// Writes one sample's file from its encoded states (see EncodeSampleStates),
// straight from their memory: from hidden_states and final_norm, or from the
// pieces of `sample.received` (the same bytes: hidden_states' rows taken
// layer by layer, row by row, from the layers' pieces). When `digest` is set, fills it with the file's
// size and XXH64, computed while writing (equal to hashing the file read back).
absl::Status WriteSampleFile(const std::string& path, const InputSample& input,
                             const EncodedSample& sample, const SampleFileInfo& info,
                             WrittenDigest* digest = nullptr);

// XXH64 (seed 0) of little-endian int64 values, 16 hex digits: the token_ids
// and loss_mask checksums of the file metadata and the journal.
std::string Int64Xxh64Hex(std::span<const int64_t> values);

}  // namespace hsx

#endif  // HSX_FORMAT_SAMPLE_FILE_H_
