// request_validator.cc: the checks, each with a message naming the field.
#include "server/service/request_validator.h"

#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "format/proto_dtype.h"
#include "server/service/log.h"
#include "server/service/service_options.h"

namespace hsx {

absl::StatusOr<ValidatedRequest> ValidateExtractRequest(const v1::ExtractRequest& request,
                                                        const RequestLimits& limits) {
  if (static_cast<int64_t>(request.sample_id().size()) > kMaxSampleIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("sample_id: ", request.sample_id().size(),
                                                   " bytes, at most ", kMaxSampleIdBytes));
  }
  const int64_t n = request.token_ids_size();
  if (n == 0) {
    return absl::InvalidArgumentError(absl::StrCat("token_ids: empty; a sample needs 1..",
                                                   limits.max_tokens_per_sample, " token ids"));
  }
  if (n > limits.max_tokens_per_sample) {
    return absl::InvalidArgumentError(absl::StrCat("token_ids: ", n, " tokens exceed max_tokens_per_sample ",
                                                   limits.max_tokens_per_sample));
  }
  for (int64_t i = 0; i < n; ++i) {
    const int32_t id = request.token_ids(static_cast<int>(i));
    if (id < 0 || id >= limits.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("token_ids[", i, "] = ", id,
                                                     " is outside the vocabulary [0, ", limits.vocab_size, ")"));
    }
  }
  const std::span<const int32_t> ids(request.token_ids().data(), static_cast<size_t>(n));
  if (const std::string media = FindMediaPlaceholder(ids, limits.media_placeholders, "token_ids"); !media.empty()) {
    // Named by its sample_id too: the fault is in the data, and whoever reads
    // the message must find that sample to drop or fix it.
    return absl::InvalidArgumentError(
        absl::StrCat("sample_id '", TruncateForLog(request.sample_id(), 128), "': ", media));
  }

  ValidatedRequest out;
  if (request.capture_ids_size() == 0) {
    out.capture = limits.default_capture.WithFinalNorm(limits.default_capture.final_norm() || request.final_norm());
  } else {
    absl::StatusOr<CaptureSpec> capture =
        CaptureSpec::Make({request.capture_ids().begin(), request.capture_ids().end()}, request.final_norm(),
                          static_cast<int>(limits.num_layers), "capture_ids");
    if (!capture.ok()) return capture.status();
    out.capture = *std::move(capture);
  }

  absl::StatusOr<OutputDType> dtype = OutputDTypeFromProto(static_cast<int>(request.dtype()));
  if (!dtype.ok()) return dtype.status();
  out.dtype = *dtype;
  absl::StatusOr<ChecksumKind> checksum = ChecksumKindFromProto(static_cast<int>(request.checksum()));
  if (!checksum.ok()) return checksum.status();
  out.checksum = *checksum;
  out.summary = request.summary();
  return out;
}

}  // namespace hsx
