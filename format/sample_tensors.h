// sample_tensors.h: one sample's captured tensors, wherever their bytes lie.
//
// The one type a sample's states travel in: from the engine's capture
// buffers to the response stream (the server) or to the file (hsx-dump
// --model), and from a received stream to the file (hsx-dump) or to Python
// (the native client). Per tensor (capture ids ascending, then the final norm
// as capture id -1): its [tokens, hidden] rows as byte pieces in row order,
// little-endian in the sample's dtype, and optionally what a check of exactly
// those bytes found (TensorFindings), so that no consumer reads them again
// to check them. The pieces are views: one per tensor in the engine's
// per-sample buffer; the received gRPC slices (a row may be split between two
// pieces); a row each in an assembled [T, L, H] block. `owner` keeps every
// piece alive and `held_bytes` says how much memory it keeps.
//
// A sample verified on arrival and dropped (hsx-dump --discard) has no
// pieces: `dropped` is set, and each tensor keeps its byte count and findings.
#ifndef HSX_FORMAT_SAMPLE_TENSORS_H_
#define HSX_FORMAT_SAMPLE_TENSORS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "format/encoding.h"
#include "format/piece_reader.h"
#include "format/tensor_encoding.h"

namespace hsx {

struct SampleTensor {
  int capture_id = -1;            // -1: the final norm
  std::vector<BytePiece> pieces;  // the rows' bytes, in order; none when dropped
  int64_t bytes = 0;              // of the tensor (what arrived, when dropped)
  // What a check of these bytes found (EncodeTensor, CheckTensor, the stream
  // assembler); unset: not checked.
  std::optional<TensorFindings> findings;
};

struct SampleTensors {
  std::vector<int> capture_ids;  // ascending
  int64_t tokens = 0;
  int64_t hidden = 0;
  OutputDType dtype = OutputDType::kBf16;  // of every tensor's bytes
  std::vector<SampleTensor> tensors;       // capture ids in order, then the final norm
  std::shared_ptr<const void> owner;       // keeps the pieces alive
  int64_t held_bytes = 0;                  // the memory `owner` keeps
  bool dropped = false;                    // verified on arrival, bytes not kept

  bool has_final_norm() const { return tensors.size() > capture_ids.size(); }
  int64_t row_bytes() const { return RowBytes(dtype, hidden); }
  // Bytes of every tensor, or of the layers only (not the final norm).
  int64_t bytes() const;
  int64_t layer_bytes() const;
  // Appends a tensor whose rows lie together at `rows` (tokens * row_bytes()).
  void AddTensor(int capture_id, const void* rows);
};

// The tensor's bytes in one string (tests and small tools).
std::string TensorString(const SampleTensor& tensor);

}  // namespace hsx

#endif  // HSX_FORMAT_SAMPLE_TENSORS_H_
