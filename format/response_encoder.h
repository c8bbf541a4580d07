// response_encoder.h: one sample's captured rows as the Extract response
// stream, produced one message at a time.
//
// Order: a Header; then, per tensor (capture ids ascending, then the final
// norm as capture id -1), Chunks of whole rows in row order, each holding at
// most max_chunk_bytes of data (at least one row); then a Trailer with the
// checksum (XXH64, or XXH3 when asked) of every tensor's [T, H] bytes in the
// output dtype and the token-id hash. In summary mode: the Header, one Summary (per tensor mean, std, min,
// max over the dtype-rounded values and the first values of row 0) and the
// same Trailer.
//
// Encoding happens once, in Create: EncodeSample (sample_encoding.h) makes
// the rows the bytes to send, in the output dtype, checked and hashed, and
// decides whether that takes a buffer of their own (from `allocate`, the
// server's pool) or the rows are sent from where they are. Next() then only
// frames: a Chunk is a few bytes of hand-encoded protobuf framing plus a
// slice aliasing its rows (response_framing.h), so the bytes the socket sends
// are never copied again. The memory returns to its pool when the encoder
// and the last slice gRPC holds are gone.
//
// A sample that fails verification gets no message at all: Create returns
// INTERNAL when a tensor holds a non-finite value, a value the output dtype
// cannot represent (fp16 overflow), or only zeros.
#ifndef HSX_FORMAT_RESPONSE_ENCODER_H_
#define HSX_FORMAT_RESPONSE_ENCODER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/support/byte_buffer.h>

#include "absl/status/statusor.h"
#include "format/encoding.h"
#include "format/sample_encoding.h"
#include "format/sample_tensors.h"
#include "format/tensor_hash.h"
#include "hsx/v1/hsx.pb.h"
#include "kernels/backend.h"

namespace hsx {

// Values of row 0 reported per tensor in summary mode.
inline constexpr int kSummaryFirstValues = 8;

struct EncoderOptions {
  std::string sample_id;
  OutputDType dtype = OutputDType::kBf16;
  ChecksumKind checksum = ChecksumKind::kXxh64;  // of the Trailer's TensorChecksums
  bool summary = false;
  int64_t max_chunk_bytes = 1 << 20;
  uint64_t token_ids_hash = 0;
  std::string model_name;
  int64_t num_layers = 0;
  std::string layer_convention;
};

class ResponseEncoder {
 public:
  using Allocator = BufferAllocator;

  // `rows` must hold exactly the tensors asked for (SelectCaptures did
  // this), one piece each; what the encoder does not keep of them is released
  // before Create returns. `allocate` gives the encoded buffer.
  static absl::StatusOr<std::unique_ptr<ResponseEncoder>> Create(SampleTensors rows, EncoderOptions options,
                                                                 const Allocator& allocate);
  ResponseEncoder(const ResponseEncoder&) = delete;
  ResponseEncoder& operator=(const ResponseEncoder&) = delete;

  // Sets `out` to the next message: true, or false once the Trailer has been
  // produced (out untouched).
  bool Next(grpc::ByteBuffer* out);

  // Bytes of encoded states held (the whole sample in the output dtype).
  int64_t held_bytes() const;

 private:
  enum class Stage { kHeader, kSummary, kBody, kTrailer, kDone };

  ResponseEncoder(EncoderOptions options, SampleTensors sample);
  int num_tensors() const { return static_cast<int>(sample_.tensors.size()); }
  int capture_id(int tensor) const { return sample_.tensors[tensor].capture_id; }
  const char* tensor_data(int tensor) const;
  void FillSummary(v1::Summary* summary) const;

  const EncoderOptions options_;
  // In the output dtype, every tensor in one piece with its findings; its
  // owner keeps the bytes alive (the encoded buffer, or the engine's).
  const SampleTensors sample_;
  int64_t rows_per_chunk_ = 1;
  Stage stage_ = Stage::kHeader;
  int tensor_ = 0;        // body: the tensor in progress
  int64_t next_row_ = 0;  // body: its next row
};

}  // namespace hsx

#endif  // HSX_FORMAT_RESPONSE_ENCODER_H_
