// metrics.h: the Prometheus metrics of hsx-server (all prefixed hsx_), and
// the optional HTTP endpoint that exposes them at /metrics.
//
//   hsx_requests_total                counter  Extract RPCs received (whatever their outcome)
//   hsx_samples_total                 counter  samples streamed completely (trailer sent)
//   hsx_tokens_total                  counter  tokens of those samples
//   hsx_bytes_sent_total              counter  serialized response bytes accepted by gRPC
//   hsx_errors_total{code}            counter  RPCs finished with a non-OK status, by code
//   hsx_queue_depth                   gauge    tokens queued in the batcher, not yet running
//   hsx_inflight_requests             gauge    Extract RPCs in progress
//   hsx_batch_fill                    gauge    real tokens / token budget over all batches run
//   hsx_buffered_bytes                gauge    encoded-but-unsent response bytes, all streams
//   hsx_held_state_bytes              gauge    encoded states held by streams, all streams
//   hsx_undecodable_requests_total    counter  Extract requests whose bytes are not an ExtractRequest
//   hsx_oversized_requests_total      counter  Extract requests over --max-request-bytes
//   hsx_extract_latency_seconds       histogram  accept to trailer, per successful Extract
//   hsx_device_lost                   gauge    1 once a device is lost (health NOT_SERVING for good), else 0
//   hsx_auth_failures_total           counter  calls refused for their token (missing, wrong, or unchecked: rate-limited)
//   hsx_auth_rate_limited_total       counter  of those, refused without checking the token (auth_limiter.h)
//
// The recording methods are thread-safe and cheap (atomics, plus a short
// lock for the error family), fit for gRPC reactions and the batcher thread. Gauges read from the batcher are sampled at scrape time
// through the probe given to SetBatcherProbe().
#ifndef HSX_SERVER_SERVICE_METRICS_H_
#define HSX_SERVER_SERVICE_METRICS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include <grpcpp/support/status.h>
#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "absl/status/statusor.h"
#include "base/status_names.h"

namespace hsx {

struct BatcherSample {
  int64_t queued_tokens = 0;
  double fill = 0.0;
};

class Metrics {
 public:
  Metrics();
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // Starts the /metrics endpoint on HOST:PORT (port 0: any free port) and
  // returns the address actually bound.
  absl::StatusOr<std::string> Serve(const std::string& address);
  // Stops the endpoint (idempotent); later scrapes fail to connect.
  void StopServing();

  // Called at every scrape, from the HTTP server's thread.
  void SetBatcherProbe(std::function<BatcherSample()> probe);

  void SampleDone(int64_t tokens, double seconds);
  void BytesSent(int64_t bytes);
  void Error(grpc::StatusCode code);
  void RequestReceived() { requests_->Increment(); }
  void UndecodableRequest() { undecodable_->Increment(); }
  void OversizedRequest() { oversized_->Increment(); }
  void AddInflight(double delta) { inflight_->Increment(delta); }
  void AddBuffered(double delta) { buffered_->Increment(delta); }
  void AddHeldStates(double delta) { held_states_->Increment(delta); }
  void DeviceLost() { device_lost_->Set(1); }
  void AuthFailure(bool rate_limited) {
    auth_failures_->Increment();
    if (rate_limited) auth_rate_limited_->Increment();
  }

 private:
  class ScrapeHook;

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<ScrapeHook> hook_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string poke_host_;  // where StopServing connects to wake the listener
  int port_ = 0;
  prometheus::Counter* requests_;
  prometheus::Counter* samples_;
  prometheus::Counter* tokens_;
  prometheus::Counter* bytes_sent_;
  prometheus::Family<prometheus::Counter>* errors_;
  prometheus::Gauge* queue_depth_;
  prometheus::Gauge* inflight_;
  prometheus::Gauge* fill_;
  prometheus::Gauge* buffered_;
  prometheus::Gauge* held_states_;
  prometheus::Counter* undecodable_;
  prometheus::Counter* oversized_;
  prometheus::Histogram* latency_;
  prometheus::Gauge* device_lost_;
  prometheus::Counter* auth_failures_;
  prometheus::Counter* auth_rate_limited_;
};

}  // namespace hsx

#endif  // HSX_SERVER_SERVICE_METRICS_H_
