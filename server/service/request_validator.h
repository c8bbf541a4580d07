// request_validator.h: turns an ExtractRequest into what the batcher and the
// encoder need, or an INVALID_ARGUMENT whose message names the field.
//
// Runs before anything is queued: a request that passes can always be
// computed (every token id is in the vocabulary, the sample fits a batch,
// every capture id exists) and is text (no media placeholder, unless the
// operator allows them). Checks, in order: sample_id length, token_ids
// (empty, too long, each id in [0, vocab), no media placeholder: that message
// also names the sample_id, since the fault is in the data, not the client),
// capture_ids (each in 0..N), dtype and checksum (known enum values). Oversized requests never get here: gRPC rejects them
// with RESOURCE_EXHAUSTED first (--max-request-bytes).
#ifndef HSX_SERVER_SERVICE_REQUEST_VALIDATOR_H_
#define HSX_SERVER_SERVICE_REQUEST_VALIDATOR_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "hsx/v1/hsx.pb.h"
#include "format/capture_spec.h"
#include "format/encoding.h"
#include "format/media_placeholder.h"
#include "format/tensor_hash.h"

namespace hsx {

struct RequestLimits {
  int64_t vocab_size = 0;
  int64_t num_layers = 0;
  int64_t max_tokens_per_sample = 0;
  CaptureSpec default_capture;  // used when capture_ids is empty
  // Token ids refused (format/media_placeholder.h); empty with --allow-media-placeholder.
  std::vector<MediaPlaceholder> media_placeholders;
};

struct ValidatedRequest {
  CaptureSpec capture;  // ids ascending and unique; final_norm resolved
  OutputDType dtype = OutputDType::kBf16;
  ChecksumKind checksum = ChecksumKind::kXxh64;
  bool summary = false;
};

absl::StatusOr<ValidatedRequest> ValidateExtractRequest(const v1::ExtractRequest& request,
                                                        const RequestLimits& limits);

}  // namespace hsx

#endif  // HSX_SERVER_SERVICE_REQUEST_VALIDATOR_H_
