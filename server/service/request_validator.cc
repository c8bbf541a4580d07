// request_validator.cc: the checks, each with a message naming the field.
#include "server/service/request_validator.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
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

  ValidatedRequest out;
  if (request.capture_ids_size() == 0) {
    out.capture = limits.default_capture;
    out.capture.final_norm = limits.default_capture.final_norm || request.final_norm();
  } else {
    for (int i = 0; i < request.capture_ids_size(); ++i) {
      const int32_t id = request.capture_ids(i);
      if (id < 0 || id > limits.num_layers) {
        return absl::InvalidArgumentError(absl::StrCat("capture_ids[", i, "] = ", id, " is outside 0..",
                                                       limits.num_layers, " (the model has ", limits.num_layers,
                                                       " layers; id N is the last layer's output)"));
      }
      out.capture.ids.push_back(id);
    }
    std::sort(out.capture.ids.begin(), out.capture.ids.end());
    out.capture.ids.erase(std::unique(out.capture.ids.begin(), out.capture.ids.end()), out.capture.ids.end());
    out.capture.final_norm = request.final_norm();
  }

  const int dtype = static_cast<int>(request.dtype());
  switch (dtype) {
    case v1::DTYPE_UNSPECIFIED:
    case v1::DTYPE_BF16:
      out.dtype = OutputDType::kBf16;
      out.proto_dtype = v1::DTYPE_BF16;
      break;
    case v1::DTYPE_FP16:
      out.dtype = OutputDType::kFp16;
      out.proto_dtype = v1::DTYPE_FP16;
      break;
    case v1::DTYPE_FP32:
      out.dtype = OutputDType::kFp32;
      out.proto_dtype = v1::DTYPE_FP32;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "dtype: unknown enum value ", dtype, " (expected DTYPE_BF16 = 1, DTYPE_FP16 = 2 or DTYPE_FP32 = 3; "
          "0 means bf16)"));
  }
  out.summary = request.summary();
  return out;
}

}  // namespace hsx
