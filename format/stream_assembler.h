// stream_assembler.h: turns the messages of one Extract response stream into
// the bytes of an output file, checking the stream as it goes.
//
// Pure (no gRPC calls, no I/O), so that the checks can be unit-tested and
// fuzzed apart from the transport (remote_extractor.cc feeds it). Guarantees,
// for a stream it accepts: the header echoes the request (sample id, token
// count, token-id hash, capture ids, dtype, final norm) and the model (hidden
// size, layers, name, where known); chunks hold whole rows, layer after layer
// in the header's order, each layer's rows in order without gaps or
// overlaps; every tensor's checksum (XXH64, or XXH3 when asked and the
// header says so) equals the trailer's; the trailer's token
// hash equals the request's; nothing follows the trailer. Any violation is a
// DATA_LOSS status naming what was wrong, and the assembler accepts nothing
// more after one.
//
// Four modes share every one of these checks (each piece of a chunk is
// hashed and value-checked in place, in the received slices; Take()'s
// tensors carry the findings) and differ only in where the rows go:
// kAssemble copies them once, from the received slices, into blocks laid
// out as the output file's tensors (a sample of 2 MiB or more with
// non-temporal stores, uncached_copy.h), the Python client's native path:
// hidden_states [T, L, H] and the final norm [T, H], each tensor's pieces its
// rows there; fp8 rows are split as they arrive (ForEachFp8RowPart, fp8.h):
// the values into hidden_states [T, L, H] and the scales into
// hidden_states_scales [T, L, 1] (the final norm's into [T, H] and [T, 1]),
// each row's pieces its scale there, then its values (so tensors[0].pieces[0]
// starts the scales' block and pieces[1] the values'); kAssembleDequantized
// is kAssemble but for fp8, whose values it dequantizes to bf16 as they
// arrive (DequantizeFp8ToBf16, bit for bit), while they are in L1, into
// hidden_states [T, L, H] and the final norm [T, H] in bf16 (a sample of
// 2 MiB or more with the dequantizing loop's own non-temporal stores), each
// tensor's pieces its bf16 rows there, keeping no scales: the Python
// client's default for fp8, which then writes no e4m3 block to read back
// (0.87x its CPU per byte, docs/BENCHMARKS.md); kKeepReceived copies nothing
// and keeps references to the received slices instead (grpc::Slice is
// reference counted): each tensor's pieces are those slices' bytes, in
// stream order (WriteSampleFile writes the file from them, hsx-dump's disk
// path); kVerifyOnly keeps nothing (hsx-dump --discard) and Take() returns
// the sample without its bytes (SampleTensors::dropped, with the byte
// counts that arrived).
#ifndef HSX_FORMAT_STREAM_ASSEMBLER_H_
#define HSX_FORMAT_STREAM_ASSEMBLER_H_

#include <utility>

#include <grpcpp/support/byte_buffer.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "format/sample_tensors.h"
#include "format/state_bytes.h"
#include "hsx/v1/hsx.pb.h"
#include "format/encoding.h"
#include "format/fp8.h"
#include "format/piece_reader.h"
#include "format/proto_dtype.h"
#include "format/state_bytes_pool.h"
#include "format/tensor_hash.h"

namespace hsx {

// What a stream must match: the request and, where known (> 0 / non-empty),
// the model the servers announced.
struct StreamExpectation {
  std::string sample_id;
  int64_t num_tokens = 0;
  uint64_t token_ids_xxh64 = 0;
  std::vector<int> capture_ids;
  // Unset: whatever the server decides (a request without capture ids gets
  // the final norm too when the server runs with --final-norm).
  std::optional<bool> final_norm = false;
  OutputDType dtype = OutputDType::kBf16;
  // Asked for in the request. A header without one (a server older than
  // the field) means XXH64, whatever was asked.
  ChecksumKind checksum = ChecksumKind::kXxh64;
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  std::string model_name;
};

class StreamAssembler {
 public:
  enum class Mode { kAssemble, kAssembleDequantized, kKeepReceived, kVerifyOnly };

  // kAssemble and kAssembleDequantized write the sample into blocks from
  // `pool` when one is given (the Python client's native path), else into
  // new ones.
  explicit StreamAssembler(StreamExpectation expect, Mode mode = Mode::kAssemble,
                           std::shared_ptr<StateBytesPool> pool = nullptr);
  ~StreamAssembler();
  StreamAssembler(const StreamAssembler&) = delete;
  StreamAssembler& operator=(const StreamAssembler&) = delete;

  // Takes the next message of the stream.
  absl::Status Consume(const v1::ExtractResponse& response);
  // The same, from the message's bytes as gRPC received them: a Chunk's
  // framing is read by hand and its data hashed and value-checked in the
  // received slices (and, when assembling, copied from them straight into
  // the sample in the same pass; when keeping them, referenced; no protobuf
  // string in between); other
  // messages (and a Chunk with fields this code does not know) go through
  // the generated parser.
  absl::Status Consume(const grpc::ByteBuffer& message);
  // True once a valid trailer arrived: the sample is whole and verified.
  bool complete() const { return trailer_; }
  // For a stream whose call ended OK: OK when complete(), else DATA_LOSS
  // "the stream ended without a trailer (N of M tensors complete)".
  absl::Status EndOfStream() const;
  // The sample (see the modes above); call once, after complete().
  SampleTensors Take() { return std::move(sample_); }

 private:
  absl::Status Dispatch(const v1::ExtractResponse& response);
  absl::Status OnHeader(const v1::Header& h);
  absl::Status OnChunk(const v1::Chunk& c);
  // Pieces of a chunk's data, in order, lying in `slices` (received, or a
  // copy of a parsed message's data), which kKeepReceived mode takes over.
  using Pieces = std::vector<BytePiece>;
  absl::Status OnChunkData(int32_t capture_id, int64_t first_row, int64_t num_rows, const Pieces& data,
                           std::vector<grpc::Slice>* slices);
  // kAssemble: the blocks the rows are copied into, which the sample owns.
  struct AssembledBlocks {
    StateBytes hidden_states;  // [T, L, H]
    StateBytes final_norm;     // [T, H], or empty
    StateBytes hidden_scales;  // fp8: [T, L] float32, else empty
    StateBytes final_scales;   // fp8 with the final norm: [T] float32, else empty
  };
  // A block for one of the sample's tensors (kAssemble), from pool_ if any.
  StateBytes Allocate(int64_t bytes) const;
  // kAssemble: the blocks, and each tensor's rows in them as its pieces.
  void AllocateSample();
  // Bytes [offset, offset + length) of the current chunk (kAssemble only).
  void CopyIntoSample(const char* bytes, size_t length, int64_t offset);
  // The same for fp8: values and scales into their blocks, or the values
  // dequantized with their row's scale (kAssembleDequantized).
  void CopyFp8IntoSample(const char* bytes, size_t length, int64_t offset);
  bool assembling() const { return mode_ == Mode::kAssemble || mode_ == Mode::kAssembleDequantized; }
  bool dequantizing() const { return mode_ == Mode::kAssembleDequantized && sample_.dtype == OutputDType::kFp8; }
  // kAssemble: `n` bytes to `to`, uncached for a large sample.
  void CopyBytes(char* to, const char* from, size_t n) const;
  // The next `length` bytes of the current tensor's values, which may start
  // or end inside a value (pieces split anywhere): hashed and checked.
  void HashAndCheck(const char* bytes, size_t length);
  // `count` whole values of the current tensor at `bytes` (any alignment):
  // the first bad one and whether any is non-zero go to the tensor's findings.
  void CheckValues(const char* bytes, int64_t count);
  // HashAndCheck's check for fp8: each row's scale (finite and positive) and
  // values (no NaN), pieces split anywhere.
  void CheckFp8Rows(const char* bytes, size_t length);
  absl::Status OnTrailer(const v1::Trailer& t);

  const StreamExpectation expect_;
  const Mode mode_;
  const std::shared_ptr<StateBytesPool> pool_;
  absl::Status error_;
  bool header_ = false;
  bool trailer_ = false;
  SampleTensors sample_;
  AssembledBlocks* blocks_ = nullptr;  // kAssemble: owned by sample_.owner
  int64_t row_bytes_ = 0;
  std::vector<int> tensors_;  // capture ids in order, then -1 for the final norm
  size_t current_ = 0;        // the tensor being received
  int64_t rows_ = 0;          // rows of it received
  int64_t values_ = 0;        // of it checked (whole values; fp8: bytes)
  char carry_[8];             // the first bytes of a value split between two pieces
  size_t carried_ = 0;
  char row_scale_[kFp8ScaleBytes];  // kAssembleDequantized: the fp8 row being received's scale
  std::optional<TensorHash> hash_;  // of the current tensor's bytes, as the header says
  // kAssemble: the sample is copied with CopyUncached (uncached_copy.h) when
  // its states take at least kUncachedCopyMinBytes: more than a core's L2
  // cache (1-2 MiB), so that its first rows would leave the cache before
  // anyone reads them anyway. Fenced once, when the trailer is accepted.
  static constexpr size_t kUncachedCopyMinBytes = size_t{2} << 20;
  bool uncached_ = false;
  // kKeepReceived: the slices of every chunk message, which hold the
  // tensors' pieces (each message's own vector, so that slices whose bytes
  // are inline in the grpc::Slice never move).
  std::shared_ptr<std::vector<std::vector<grpc::Slice>>> kept_;
};

}  // namespace hsx

#endif  // HSX_FORMAT_STREAM_ASSEMBLER_H_
