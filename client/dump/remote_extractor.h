// remote_extractor.h: the Extractor that asks hsx-server(s) over gRPC.
//
// One channel (one connection) per server address; each attempt of a sample
// goes to the next server in round-robin order, skipping servers whose
// channel is failing while another one is not. The run starts with the
// servers that answer GetModelInfo; one that does not (down, not yet up) is
// logged and asked again in the background with backoff, and joins the
// round-robin once it answers with the same model. Only when no server
// answers (after `retries` rounds) does FetchModelInfo fail. One Extract RPC per sample
// (gRPC callback API, ClientReadReactor), with a per-attempt deadline. An
// attempt that ends in UNAVAILABLE, DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED
// is retried from scratch after an exponential backoff with jitter, at most
// `retries` times; any other status fails the sample with the server's
// message.
//
// The response stream is kept as the received slices (each tensor's bytes as
// pieces, no copy; the file writer walks them in [T, L, H] file order) and
// checked before it is handed on: the header
// echoes the request (sample id, token count, token-id hash, capture ids,
// dtype, final norm, hidden size); chunks hold whole rows, layer after layer
// in the header's order, each layer's rows in order without gaps or overlaps;
// every tensor's XXH64 equals the trailer's; the trailer's token hash equals
// the request's. Values (finite, no all-zero layer) are checked as each
// piece arrives and reported after the transport by the shared VerifySample.
// When the spec does not keep the states (--discard) nothing is assembled:
// the same checks run on the received slices and the sample is delivered
// without its states.
#ifndef HSX_CLIENT_DUMP_REMOTE_EXTRACTOR_H_
#define HSX_CLIENT_DUMP_REMOTE_EXTRACTOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/dump/extractor.h"

namespace hsx {

// A fixed window rather than gRPC's automatic one: hsx-dump --discard cost
// 0.93-0.95x the CPU per byte with it (docs/BENCHMARKS.md), and 4 MiB per
// stream allows 4 GB/s per stream at a 1 ms round trip.
inline constexpr int64_t kDefaultStreamWindowBytes = int64_t{4} << 20;
inline constexpr int64_t kMinStreamWindowBytes = int64_t{64} << 10;
inline constexpr int64_t kMaxStreamWindowBytes = int64_t{1} << 30;  // gRPC takes an int

// OK for 0 (gRPC's automatic window) and kMinStreamWindowBytes..kMaxStreamWindowBytes.
absl::Status CheckStreamWindow(int64_t bytes);

struct RemoteOptions {
  std::vector<std::string> servers;  // gRPC target addresses (host:port, dns:///..., unix:...)
  double deadline_seconds = 600.0;   // per attempt of one sample
  int retries = 8;                   // further attempts after the first
  double backoff_initial_seconds = 0.1;
  double backoff_max_seconds = 10.0;
  std::string auth_token;            // sent as "authorization: Bearer <token>" when set
  bool tls = false;
  std::string tls_ca_pem;            // trusted roots (empty: the system's)
  std::string tls_cert_pem;          // client certificate chain (mTLS)
  std::string tls_key_pem;
  std::string tls_server_name;       // name to check the server certificate against (optional)
  // HTTP/2 flow-control window of each Extract stream: how far the server may
  // send ahead of what has been read (a stream's throughput is at most the
  // window per round trip). 0: gRPC's automatic window (BDP probing).
  int64_t stream_window_bytes = kDefaultStreamWindowBytes;
  std::function<void(const std::string&)> log;  // notes about retries (default: stderr)
};

// What the servers run (all of them must agree).
struct RemoteModelInfo {
  std::string model_name;
  std::string model_revision;
  std::string compute_precision;
  std::string device;
  std::string server_version;
  int64_t num_layers = 0;
  int64_t hidden_size = 0;
  int64_t vocab_size = 0;
  int64_t max_tokens_per_sample = 0;  // the smallest over the servers (0: no limit)
  std::vector<int> default_capture_ids;
};

class RemoteExtractor : public Extractor {
 public:
  static absl::StatusOr<std::unique_ptr<RemoteExtractor>> Create(const RemoteOptions& options);
  // Cancels what is in flight and waits for every call to end.
  ~RemoteExtractor() override;

  // Asks every server and checks that those that answer serve the same
  // model (later responses are checked against it); starts without, and
  // keeps asking, those that do not answer; fails when none does after
  // `retries` rounds, or at once on a refusal (e.g. UNAUTHENTICATED).
  absl::StatusOr<RemoteModelInfo> FetchModelInfo();

  void Extract(const InputSample& sample, const ExtractSpec& spec, Done done) override;
  void CancelAll() override;

  // Attempts started and retries scheduled so far.
  int64_t attempts() const;
  int64_t retries() const;

  class Impl;

 private:
  explicit RemoteExtractor(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace hsx

#endif  // HSX_CLIENT_DUMP_REMOTE_EXTRACTOR_H_
