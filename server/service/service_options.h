// service_options.h: everything hsx-server is configured with, from the
// command line to a validated ServiceOptions.
//
// Two steps, because some defaults depend on the model: OptionsFromFlags()
// reads and checks the flags alone (cheap, before anything is loaded), then
// ResolveModelLimits() fills in what depends on config.json (max tokens per
// sample, max request bytes, the default capture set, the refused media
// placeholders) and checks the limits
// against each other. After both succeed every field is usable as is: sizes
// are positive, the chunk fits the per-stream buffer, a sample fits a batch.
#ifndef HSX_SERVER_SERVICE_SERVICE_OPTIONS_H_
#define HSX_SERVER_SERVICE_SERVICE_OPTIONS_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "format/capture_spec.h"
#include "server/model/config.h"
#include "server/runtime/engine_flags.h"

namespace hsx {

// Bytes a Chunk message carries besides its row data (field tags, capture id,
// first_row, num_rows, the length prefix of data, the oneof wrapper).
inline constexpr int64_t kChunkOverheadBytes = 64;
// The longest sample_id accepted.
inline constexpr int64_t kMaxSampleIdBytes = 1024;
// The smallest --max-request-bytes: below it even a one-token request is refused.
inline constexpr int64_t kMinRequestBytes = 256;

// What gRPC itself accepts: 4 x --max-request-bytes + 64 KiB (at most 2 GiB).
// The service enforces --max-request-bytes on what arrives, so that an
// oversized request is answered, logged and counted (gRPC's own refusal of
// a larger one happens before any handler and is none of these).
inline int64_t TransportRequestLimit(int64_t max_request_bytes) {
  return std::min<int64_t>(4 * max_request_bytes + (64 << 10), INT32_MAX);
}

struct ServiceOptions {
  std::string model_dir;
  std::string listen = "0.0.0.0:50051";
  // The engine, the default capture set and the longest sample, as hsx-dump
  // reads them too (server/runtime/engine_flags.h); max_tokens_per_sample is 0
  // until resolved.
  EngineFlags engine_flags;

  int max_concurrent_requests = 256;
  int64_t max_buffered_bytes_per_stream = 64LL << 20;
  int64_t max_chunk_bytes = 1LL << 20;
  int64_t max_request_bytes = 0;  // 0 until resolved: enough for max_tokens_per_sample ids

  std::string metrics_listen;  // empty: no metrics endpoint
  std::string health_listen;   // empty: health only on the main port
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;  // set: clients must present a certificate signed by it (mTLS)
  std::string auth_token_file;
  absl::Duration drain_timeout = absl::Seconds(30);
  absl::Duration stream_stall_timeout = absl::Minutes(5);  // 0: never cancel a stalled stream
  // GOAWAY after this long, so clients re-resolve and find new replicas (0: never).
  absl::Duration max_connection_age = absl::Minutes(5);
  absl::Duration max_connection_age_grace = absl::Minutes(10);
  int64_t inject_device_loss_after_batches = -1;  // testing: -1 off (server/runtime/fault_injection.h)

  // Filled by ResolveModelLimits: the capture set of a request with no capture_ids.
  CaptureSpec default_capture;
  // Filled by ResolveModelLimits: the token ids a request must not hold (the
  // model's media placeholders; none with --allow-media-placeholder).
  std::vector<MediaPlaceholder> refused_media_placeholders;

  bool tls() const { return !tls_cert.empty(); }
};

// Reads the ABSL flags (defined in service_options.cc, the engine's in
// engine_flags.cc) and checks them.
absl::StatusOr<ServiceOptions> OptionsFromFlags();

// Fills the model-dependent defaults and checks the limits against the model.
absl::Status ResolveModelLimits(const ModelConfig& config, ServiceOptions* options);

// Checks a --listen style address: HOST:PORT with the port in 0..65535 (an
// IPv6 host in brackets), or unix:PATH. The error names the flag.
absl::Status ValidateListenAddress(absl::string_view flag, absl::string_view address);
// True for 127.0.0.0/8, ::1, localhost and unix: addresses.
bool IsLoopbackAddress(absl::string_view address);

// One line for the start-up log: every setting that matters.
std::string DescribeOptions(const ServiceOptions& options, const ModelConfig& config);

}  // namespace hsx

#endif  // HSX_SERVER_SERVICE_SERVICE_OPTIONS_H_
