// service_options.cc: the flags of hsx-server and their validation.
#include "server/service/service_options.h"

#include <algorithm>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "base/cli.h"

ABSL_FLAG(std::string, model, "", "Checkpoint directory (config.json + safetensors). Required.");
ABSL_FLAG(std::string, listen, "0.0.0.0:50051",
          "Address of the gRPC port, HOST:PORT; port 0 picks a free port (the log line "
          "'hsx-server: listening on HOST:PORT' names the one bound).");
ABSL_FLAG(int, max_concurrent_requests, 256,
          "Extract RPCs in progress at once, over all clients; beyond it an Extract fails at once "
          "with RESOURCE_EXHAUSTED.");
ABSL_FLAG(std::string, max_buffered_bytes_per_stream, "64MiB",
          "Bound on encoded-but-unsent response bytes per stream (the chunk being written and "
          "gRPC's serialized copy of it); must be at least 2 x (--max-chunk-bytes + 64).");
ABSL_FLAG(std::string, max_chunk_bytes, "1MiB",
          "Row bytes per Chunk message: whole rows, at least one fp32 row of the model.");
ABSL_FLAG(std::string, max_request_bytes, "",
          "gRPC max receive message size (empty: 8 + 5 x max-tokens-per-sample + 4096, enough "
          "for any valid request); larger requests fail with RESOURCE_EXHAUSTED.");
ABSL_FLAG(std::string, metrics_listen, "",
          "HOST:PORT of the Prometheus /metrics endpoint (empty: off; port 0 picks one).");
ABSL_FLAG(std::string, health_listen, "",
          "Optional extra plaintext HOST:PORT serving only grpc.health.v1 (Kubernetes gRPC probes "
          "cannot speak TLS).");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain of the server: serve TLS.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: require client certificates signed by it (mTLS). Needs --tls-cert.");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding a bearer token: hsx.v1.HiddenStates calls must carry metadata "
          "'authorization: Bearer <token>'. Health and reflection stay open.");
ABSL_FLAG(absl::Duration, stream_stall_timeout, absl::Minutes(5),
          "Cancel an Extract stream whose client has taken no data for this long (it keeps its "
          "connection open but never reads), freeing its slot and memory; 0 never cancels.");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(30),
          "On SIGTERM/SIGINT: how long in-flight samples may take to finish before they are "
          "cancelled.");
ABSL_FLAG(absl::Duration, max_connection_age, absl::Minutes(5),
          "Close each client connection gracefully (HTTP/2 GOAWAY) after this long, so that clients "
          "re-resolve a DNS name and spread over replicas that started since (a headless Service); "
          "0 never closes. gRPC adds +-10% jitter.");
ABSL_FLAG(absl::Duration, max_connection_age_grace, absl::Minutes(10),
          "After --max-connection-age: how long the samples in flight on the old connection may still "
          "take before it is closed hard (at least the longest sample; hsx-dump's --deadline is 600 s).");
ABSL_FLAG(int64_t, inject_device_loss_after_batches, -1,
          "FOR TESTING ONLY: once the server is ready, let this many batches run, then make the last "
          "tensor-parallel rank fail as a lost device does (a sticky CUDA error): the batch and every "
          "later request fail with UNAVAILABLE and health turns NOT_SERVING. -1 (the default): off.");

namespace hsx {
namespace {

absl::StatusOr<int64_t> ByteFlag(const char* name, const std::string& text) {
  absl::StatusOr<int64_t> value = ParseByteSize(text);
  if (!value.ok()) return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", value.status().message()));
  return value;
}

std::string Bytes(int64_t n) {
  if (n % (1LL << 20) == 0) return absl::StrCat(n >> 20, "MiB");
  if (n % (1LL << 10) == 0) return absl::StrCat(n >> 10, "KiB");
  return absl::StrCat(n, "B");
}

// The host of HOST:PORT ("[::1]:50051" -> "::1"), or "" for a unix: address.
absl::string_view HostOf(absl::string_view address) {
  if (absl::StartsWith(address, "unix:")) return "";
  const size_t colon = address.rfind(':');
  absl::string_view host = colon == absl::string_view::npos ? address : address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return host;
}

}  // namespace

absl::Status ValidateListenAddress(absl::string_view flag, absl::string_view address) {
  if (absl::StartsWith(address, "unix:")) {
    if (address.size() == 5) return absl::InvalidArgumentError(absl::StrCat("--", flag, " ", address, ": no path"));
    return absl::OkStatus();
  }
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " '", address, "': expected HOST:PORT"));
  }
  const absl::string_view host = address.substr(0, colon);
  if (host.front() == '[' ? host.back() != ']' : host.find(':') != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, " '", address, "': write an IPv6 host in brackets, e.g. [::1]:50051"));
  }
  const absl::string_view port = address.substr(colon + 1);
  int value = -1;
  if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), absl::ascii_isdigit) ||
      !absl::SimpleAtoi(port, &value) || value > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, " '", address, "': port '", port, "' is not in 0..65535"));
  }
  return absl::OkStatus();
}

bool IsLoopbackAddress(absl::string_view address) {
  const absl::string_view host = HostOf(address);
  return host.empty() || host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

namespace {

// The per-stream and per-request sizes, checked against each other.
absl::Status ReadSizeFlags(ServiceOptions* o) {
  o->max_concurrent_requests = absl::GetFlag(FLAGS_max_concurrent_requests);
  if (o->max_concurrent_requests < 1) {
    return absl::InvalidArgumentError("--max-concurrent-requests must be at least 1");
  }
  absl::StatusOr<int64_t> size =
      ByteFlag("max-buffered-bytes-per-stream", absl::GetFlag(FLAGS_max_buffered_bytes_per_stream));
  if (!size.ok()) return size.status();
  o->max_buffered_bytes_per_stream = *size;
  size = ByteFlag("max-chunk-bytes", absl::GetFlag(FLAGS_max_chunk_bytes));
  if (!size.ok()) return size.status();
  o->max_chunk_bytes = *size;
  if (o->max_chunk_bytes > (1LL << 30)) return absl::InvalidArgumentError("--max-chunk-bytes: at most 1GiB");
  if (const std::string text = absl::GetFlag(FLAGS_max_request_bytes); !text.empty()) {
    size = ByteFlag("max-request-bytes", text);
    if (!size.ok()) return size.status();
    if (*size > INT32_MAX) return absl::InvalidArgumentError("--max-request-bytes: at most 2147483647");
    if (*size < kMinRequestBytes) {
      return absl::InvalidArgumentError(absl::StrCat("--max-request-bytes ", *size, ": at least ", kMinRequestBytes,
                                                     " (smaller refuses even a one-token request)"));
    }
    o->max_request_bytes = *size;
  }
  if (2 * (o->max_chunk_bytes + kChunkOverheadBytes) > o->max_buffered_bytes_per_stream) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-buffered-bytes-per-stream ", o->max_buffered_bytes_per_stream, " is below 2 x (--max-chunk-bytes ",
        o->max_chunk_bytes, " + ", kChunkOverheadBytes, "): a stream holds one chunk and gRPC's serialized "
        "copy of it; lower --max-chunk-bytes or raise the buffer"));
  }
  return absl::OkStatus();
}

// The extra ports, TLS and the token.
absl::Status ReadEndpointFlags(ServiceOptions* o) {
  o->metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  o->health_listen = absl::GetFlag(FLAGS_health_listen);
  for (const auto& [flag, address] : {std::pair{"metrics-listen", &o->metrics_listen},
                                      std::pair{"health-listen", &o->health_listen}}) {
    if (address->empty()) continue;
    if (absl::Status s = ValidateListenAddress(flag, *address); !s.ok()) return s;
  }
  o->tls_cert = absl::GetFlag(FLAGS_tls_cert);
  o->tls_key = absl::GetFlag(FLAGS_tls_key);
  o->tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  if (o->tls_cert.empty() != o->tls_key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (!o->tls_client_ca.empty() && o->tls_cert.empty()) {
    return absl::InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key (mTLS is TLS)");
  }
  o->auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  return absl::OkStatus();
}

// The drain and stall timeouts, and the fault injection of the tests.
absl::Status ReadLifecycleFlags(ServiceOptions* o) {
  o->drain_timeout = absl::GetFlag(FLAGS_drain_timeout);
  o->stream_stall_timeout = absl::GetFlag(FLAGS_stream_stall_timeout);
  if (o->stream_stall_timeout < absl::ZeroDuration() ||
      (o->stream_stall_timeout > absl::ZeroDuration() && o->stream_stall_timeout < absl::Seconds(1))) {
    return absl::InvalidArgumentError("--stream-stall-timeout must be 0 (never) or at least 1s");
  }
  if (o->drain_timeout < absl::ZeroDuration()) return absl::InvalidArgumentError("--drain-timeout must not be negative");
  o->max_connection_age = absl::GetFlag(FLAGS_max_connection_age);
  o->max_connection_age_grace = absl::GetFlag(FLAGS_max_connection_age_grace);
  for (auto [name, value] : {std::pair{"max-connection-age", o->max_connection_age},
                             std::pair{"max-connection-age-grace", o->max_connection_age_grace}}) {
    if (value < absl::ZeroDuration() || value > absl::Milliseconds(INT32_MAX)) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " ", absl::FormatDuration(value),
                                                     ": must be 0 to 596h (gRPC takes milliseconds as an int)"));
    }
  }
  if (o->max_connection_age > absl::ZeroDuration() && o->max_connection_age < absl::Seconds(1)) {
    return absl::InvalidArgumentError("--max-connection-age must be 0 (never) or at least 1s");
  }
  o->inject_device_loss_after_batches = absl::GetFlag(FLAGS_inject_device_loss_after_batches);
  if (o->inject_device_loss_after_batches < -1) {
    return absl::InvalidArgumentError("--inject-device-loss-after-batches must be -1 (off) or at least 0");
  }
  return absl::OkStatus();
}

// "; media placeholder 163605 refused" (or "allowed"), "" for a text-only model.
std::string DescribeMediaPlaceholders(const ServiceOptions& o, const ModelConfig& config) {
  if (config.media_placeholders.empty()) return "";
  std::vector<int32_t> ids;
  for (const MediaPlaceholder& p : config.media_placeholders) ids.push_back(p.id);
  return absl::StrCat("; media placeholder ", absl::StrJoin(ids, ","),
                      o.refused_media_placeholders.empty() ? " allowed (--allow-media-placeholder)" : " refused");
}

}  // namespace

absl::StatusOr<ServiceOptions> OptionsFromFlags() {
  ServiceOptions o;
  o.model_dir = absl::GetFlag(FLAGS_model);
  if (o.model_dir.empty()) return absl::InvalidArgumentError("--model DIR is required (see --help)");
  o.listen = absl::GetFlag(FLAGS_listen);
  if (absl::Status s = ValidateListenAddress("listen", o.listen); !s.ok()) return s;
  absl::StatusOr<EngineFlags> engine = EngineFlagsFromCommandLine();
  if (!engine.ok()) return engine.status();
  o.engine_flags = *std::move(engine);
  if (absl::Status s = ReadSizeFlags(&o); !s.ok()) return s;
  if (absl::Status s = ReadEndpointFlags(&o); !s.ok()) return s;
  if (absl::Status s = ReadLifecycleFlags(&o); !s.ok()) return s;
  return o;
}

absl::Status ResolveModelLimits(const ModelConfig& config, ServiceOptions* o) {
  const EngineFlags& engine = o->engine_flags;
  absl::StatusOr<CaptureSpec> capture =
      CaptureSpec::Parse(engine.capture, static_cast<int>(config.num_hidden_layers), engine.final_norm);
  if (!capture.ok()) return absl::InvalidArgumentError(absl::StrCat("--capture: ", capture.status().message()));
  o->default_capture = *std::move(capture);
  o->refused_media_placeholders = RefusedMediaPlaceholders(config, engine);

  if (absl::Status s = ResolveMaxTokensPerSample(config, &o->engine_flags); !s.ok()) return s;
  if (o->max_request_bytes == 0) {
    o->max_request_bytes = std::min<int64_t>(INT32_MAX, 8 + 5 * engine.max_tokens_per_sample + 4096);
  }
  const int64_t fp32_row = 4 * config.hidden_size;
  if (o->max_chunk_bytes < fp32_row) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-chunk-bytes ", o->max_chunk_bytes, " is below one fp32 row of this model (", fp32_row,
        " bytes); a chunk holds whole rows"));
  }
  return absl::OkStatus();
}

std::string DescribeOptions(const ServiceOptions& o, const ModelConfig& config) {
  const EngineOptions& engine = o.engine_flags.engine;
  return absl::StrCat(
      "model ", o.model_dir, " (", config.architectures.empty() ? "?" : config.architectures[0], ", ",
      config.num_hidden_layers, " layers, hidden ", config.hidden_size, ", vocab ", config.vocab_size,
      "); device ", DeviceName(engine.device), ", tp ", engine.tp, ", precision ", PrecisionName(engine.precision),
      ", threads ", engine.threads == 0 ? std::string("all") : absl::StrCat(engine.threads), "; default capture {",
      absl::StrJoin(o.default_capture.ids(), ","), "}", o.default_capture.final_norm() ? " + final norm" : "",
      "; max tokens/sample ", o.engine_flags.max_tokens_per_sample, ", max batch tokens ", engine.max_batch_tokens,
      ", max concurrent requests ", o.max_concurrent_requests, ", chunk ", Bytes(o.max_chunk_bytes),
      ", buffered/stream ", Bytes(o.max_buffered_bytes_per_stream), ", max request ", o.max_request_bytes,
      " B; tls ", o.tls() ? (o.tls_client_ca.empty() ? "on" : "on (mTLS)") : "off", ", auth token ",
      o.auth_token_file.empty() ? "off" : "on", ", drain timeout ", absl::FormatDuration(o.drain_timeout),
      ", stream stall timeout ", absl::FormatDuration(o.stream_stall_timeout), ", max connection age ",
      o.max_connection_age == absl::ZeroDuration() ? std::string("off") : absl::FormatDuration(o.max_connection_age),
      " (grace ", absl::FormatDuration(o.max_connection_age_grace), ")", DescribeMediaPlaceholders(o, config));
}

}  // namespace hsx
