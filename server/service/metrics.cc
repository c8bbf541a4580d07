// metrics.cc: metric families, the scrape-time probe and the exposer.
#include "server/service/metrics.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <thread>
#include <vector>

#include <prometheus/metric_family.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace hsx {

// What the exposer scrapes: refreshes the batcher gauges, then collects the
// registry.
class Metrics::ScrapeHook : public prometheus::Collectable {
 public:
  ScrapeHook(std::shared_ptr<prometheus::Registry> registry, prometheus::Gauge* queue_depth,
             prometheus::Gauge* fill)
      : registry_(std::move(registry)), queue_depth_(queue_depth), fill_(fill) {}

  void SetProbe(std::function<BatcherSample()> probe) {
    std::lock_guard<std::mutex> lock(mutex_);
    probe_ = std::move(probe);
  }

  std::vector<prometheus::MetricFamily> Collect() const override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (probe_) {
        const BatcherSample sample = probe_();
        queue_depth_->Set(static_cast<double>(sample.queued_tokens));
        fill_->Set(sample.fill);
      }
    }
    return registry_->Collect();
  }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Gauge* queue_depth_;
  prometheus::Gauge* fill_;
  mutable std::mutex mutex_;
  std::function<BatcherSample()> probe_;
};

namespace {

// civetweb (under prometheus-cpp's Exposer) gives each connection a worker
// thread of its own until the connection sends a whole request or times out.
// With one worker, one silent connection kept every scrape waiting for the
// default 30 s, and an alert such as hsx_device_lost dark. So: enough workers
// that kMetricsWorkers - 1 idle or slow connections at once still leave one
// for the scrape, and a request timeout that drops them soon (it counts from
// the connection's start, so a client trickling bytes is dropped as well).
// No keep-alive: a finished scrape's connection frees its worker at once.
// The limits are stated in docs/api.md ("Metrics") and docs/deploy.md.
constexpr int kMetricsWorkers = 64;
constexpr int kMetricsRequestTimeoutMs = 5000;

std::vector<std::string> ExposerOptions(const std::string& address) {
  return {"listening_ports", address,
          "num_threads", std::to_string(kMetricsWorkers),
          "request_timeout_ms", std::to_string(kMetricsRequestTimeoutMs),
          "enable_keep_alive", "no"};
}

}  // namespace

Metrics::Metrics() : registry_(std::make_shared<prometheus::Registry>()) {
  using prometheus::BuildCounter;
  using prometheus::BuildGauge;
  using prometheus::BuildHistogram;
  prometheus::Registry& r = *registry_;
  requests_ = &BuildCounter().Name("hsx_requests_total").Help("Extract RPCs received, whatever their outcome (this replica's share of the work).").Register(r).Add({});
  samples_ = &BuildCounter().Name("hsx_samples_total").Help("Samples streamed completely (trailer sent).").Register(r).Add({});
  tokens_ = &BuildCounter().Name("hsx_tokens_total").Help("Tokens of the samples streamed completely.").Register(r).Add({});
  bytes_sent_ = &BuildCounter().Name("hsx_bytes_sent_total").Help("Serialized Extract response bytes written.").Register(r).Add({});
  errors_ = &BuildCounter().Name("hsx_errors_total").Help("RPCs finished with a non-OK status, by status code.").Register(r);
  queue_depth_ = &BuildGauge().Name("hsx_queue_depth").Help("Tokens queued in the batcher and not yet running.").Register(r).Add({});
  inflight_ = &BuildGauge().Name("hsx_inflight_requests").Help("Extract RPCs in progress.").Register(r).Add({});
  fill_ = &BuildGauge().Name("hsx_batch_fill").Help("Real tokens over the token budget, summed over all batches run.").Register(r).Add({});
  buffered_ = &BuildGauge().Name("hsx_buffered_bytes").Help("Encoded-but-unsent response bytes, all streams.").Register(r).Add({});
  held_states_ = &BuildGauge().Name("hsx_held_state_bytes").Help("Hidden states held by streams until they finish, encoded in the output dtype.").Register(r).Add({});
  undecodable_ = &BuildCounter().Name("hsx_undecodable_requests_total").Help("Extract requests whose bytes could not be parsed as an ExtractRequest (answered INVALID_ARGUMENT).").Register(r).Add({});
  oversized_ = &BuildCounter().Name("hsx_oversized_requests_total").Help("Extract requests over --max-request-bytes (answered RESOURCE_EXHAUSTED).").Register(r).Add({});
  latency_ = &BuildHistogram()
                  .Name("hsx_extract_latency_seconds")
                  .Help("Extract latency, from accepting the request to sending the trailer.")
                  .Register(r)
                  .Add({}, prometheus::Histogram::BucketBoundaries{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                                                   2.5, 5, 10, 30, 60, 120, 300});
  device_lost_ = &BuildGauge().Name("hsx_device_lost").Help("1 once a device was lost: the server runs no more batches and health is NOT_SERVING until it is restarted; 0 otherwise.").Register(r).Add({});
  auth_failures_ = &BuildCounter().Name("hsx_auth_failures_total").Help("Calls refused for their bearer token: missing, wrong, or refused unchecked because their client address failed too often.").Register(r).Add({});
  auth_rate_limited_ = &BuildCounter().Name("hsx_auth_rate_limited_total").Help("Calls refused RESOURCE_EXHAUSTED without checking their token: their client address failed authentication too often.").Register(r).Add({});
  hook_ = std::make_shared<ScrapeHook>(registry_, queue_depth_, fill_);
}

Metrics::~Metrics() { StopServing(); }

absl::StatusOr<std::string> Metrics::Serve(const std::string& address) {
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(ExposerOptions(address));
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("--metrics-listen ", address, ": cannot listen: ", e.what()));
  }
  exposer_->RegisterCollectable(hook_);
  const std::vector<int> ports = exposer_->GetListeningPorts();
  if (ports.empty()) return absl::UnavailableError(absl::StrCat("--metrics-listen ", address, ": no port bound"));
  const size_t colon = address.rfind(':');
  const std::string host = colon == std::string::npos ? address : address.substr(0, colon);
  port_ = ports[0];
  poke_host_ = host == "0.0.0.0" || host.empty() ? "127.0.0.1" : host == "[::]" ? "::1" : host;
  if (poke_host_.size() > 2 && poke_host_.front() == '[') poke_host_ = poke_host_.substr(1, poke_host_.size() - 2);
  return absl::StrCat(host, ":", port_);
}

namespace {

// Opens and closes one TCP connection to host:port, ignoring failures.
void Poke(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    const bool connected = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
    close(fd);
    if (connected) break;
  }
  freeaddrinfo(found);
}

}  // namespace

void Metrics::StopServing() {
  if (!exposer_) return;
  // civetweb's listener polls with a 2 s quantum before it notices the stop
  // request; a connection wakes it, so stopping takes milliseconds.
  std::atomic<bool> stopped{false};
  std::thread waker([&] {
    while (!stopped.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      if (!stopped.load()) Poke(poke_host_, port_);
    }
  });
  exposer_.reset();
  stopped.store(true);
  waker.join();
}

void Metrics::SetBatcherProbe(std::function<BatcherSample()> probe) { hook_->SetProbe(std::move(probe)); }

void Metrics::SampleDone(int64_t tokens, double seconds) {
  samples_->Increment();
  tokens_->Increment(static_cast<double>(tokens));
  latency_->Observe(seconds);
}

void Metrics::BytesSent(int64_t bytes) { bytes_sent_->Increment(static_cast<double>(bytes)); }

void Metrics::Error(grpc::StatusCode code) { errors_->Add({{"code", StatusCodeName(code)}}).Increment(); }

}  // namespace hsx
