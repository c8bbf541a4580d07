// response_encoder.h: one sample's SampleStates as the Extract response
// stream, produced one message at a time.
//
// Order: a Header; then, per tensor (capture ids ascending, then the final
// norm as capture id -1), Chunks of whole rows in row order, each holding at
// most max_chunk_bytes of data (at least one row); then a Trailer with the
// XXH64 of every tensor's [T, H] bytes in the output dtype and the token-id
// hash. In summary mode: the Header, one Summary (per tensor mean, std, min,
// max over the dtype-rounded values and the first values of row 0) and the
// same Trailer. Encoding is lazy: Next() converts only the rows of the message
// it returns, so the encoder holds the float32 states plus nothing but the
// checksum state of the tensor in progress.
//
// A sample that fails verification never gets a Trailer: Next() returns an
// INTERNAL error instead when a tensor holds a non-finite value, a value the
// output dtype cannot represent (fp16 overflow), or only zeros.
#ifndef HSX_FORMAT_RESPONSE_ENCODER_H_
#define HSX_FORMAT_RESPONSE_ENCODER_H_

#include <cstdint>
#include <string>
#include <vector>

#include <xxhash.h>

#include "absl/status/statusor.h"
#include "format/encoding.h"
#include "format/sample_states.h"
#include "hsx/v1/hsx.pb.h"

namespace hsx {

// Values of row 0 reported per tensor in summary mode.
inline constexpr int kSummaryFirstValues = 8;

struct EncoderOptions {
  std::string sample_id;
  OutputDType dtype = OutputDType::kBf16;
  bool summary = false;
  int64_t max_chunk_bytes = 1 << 20;
  uint64_t token_ids_hash = 0;
  std::string model_name;
  int64_t num_layers = 0;
  std::string layer_convention;
};

class ResponseEncoder {
 public:
  // `states` must hold exactly the tensors asked for (SelectCaptures did this).
  ResponseEncoder(SampleStates states, EncoderOptions options);
  ~ResponseEncoder();
  ResponseEncoder(const ResponseEncoder&) = delete;
  ResponseEncoder& operator=(const ResponseEncoder&) = delete;

  // Fills `out` with the next message: true, or false once the Trailer has
  // been produced (out untouched). An error ends the stream (see above).
  absl::StatusOr<bool> Next(v1::ExtractResponse* out);

  // Bytes of float32 states held.
  int64_t state_bytes() const;

 private:
  enum class Stage { kHeader, kSummary, kBody, kTrailer, kDone };

  int num_tensors() const;
  int capture_id(int tensor) const;
  const float* row(int tensor, int64_t t) const;
  absl::Status EncodeRows(int tensor, int64_t first, int64_t count, std::string* out);
  absl::Status FinishTensor(int tensor);
  absl::Status FillSummary(v1::Summary* summary);

  SampleStates states_;
  EncoderOptions options_;
  int64_t rows_per_chunk_ = 1;
  Stage stage_ = Stage::kHeader;
  int tensor_ = 0;        // body: the tensor in progress
  int64_t next_row_ = 0;  // body: its next row
  XXH64_state_t* hash_ = nullptr;  // the tensor in progress
  bool tensor_nonzero_ = false;
  std::vector<uint64_t> checksums_;
};

}  // namespace hsx

#endif  // HSX_FORMAT_RESPONSE_ENCODER_H_
