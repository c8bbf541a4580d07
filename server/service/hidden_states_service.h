// hidden_states_service.h: hsx.v1.HiddenStates on the gRPC callback API.
//
// GetModelInfo answers from the ModelInfo built at start-up. Extract parses
// the request's bytes first (so that every log line names the sample_id, and
// undecodable bytes are counted in hsx_undecodable_requests_total even from
// a client without the token), then checks, in order: the bearer token (when
// configured: UNAUTHENTICATED whatever the bytes were, so a client without
// the token learns nothing more), that the bytes parsed (INVALID_ARGUMENT
// "could not be parsed", with their size), that the model is ready
// (UNAVAILABLE "loading" before SetBatcher), that the server is not draining
// (UNAVAILABLE "draining"), that no device is lost (UNAVAILABLE "device lost:
// rank R of N (DEVICE) failed with ...", Engine::lost()), the request itself (INVALID_ARGUMENT naming the
// field, see request_validator.h) and the concurrency limit
// (RESOURCE_EXHAUSTED at once, never queued). An accepted sample goes to the
// one Batcher that every RPC of every client shares; its ExtractReactor
// streams the result.
//
// Bookkeeping: inflight() counts accepted Extract RPCs until their OnDone;
// samples_in_batcher() counts samples submitted and not yet delivered (a
// cancelled RPC's sample stays counted until the batcher is done with it).
// WaitIdle() lets the drain wait for both to reach zero.
#ifndef HSX_SERVER_SERVICE_HIDDEN_STATES_SERVICE_H_
#define HSX_SERVER_SERVICE_HIDDEN_STATES_SERVICE_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>

#include "absl/time/time.h"
#include "hsx/v1/hsx.grpc.pb.h"
#include "server/model/host_buffer_pool.h"
#include "server/runtime/batcher.h"
#include "server/service/auth.h"
#include "server/service/metrics.h"
#include "server/service/request_validator.h"
#include "server/service/service_options.h"
#include "server/service/extract_reactor.h"
#include "server/service/stall_watchdog.h"

namespace hsx {

// Extract is registered as a raw method (WithRawCallbackMethod_Extract): the
// request arrives as bytes and is parsed here, so that an undecodable one
// gets a precise INVALID_ARGUMENT (and a log line and a metric) instead of
// gRPC's bare UNIMPLEMENTED; responses go out as hand-framed byte buffers
// whose chunk data aliases the encoded rows (response_framing.h). The wire
// format is the generated one; reflection still lists the method.
class HiddenStatesService final
    : public v1::HiddenStates::WithRawCallbackMethod_Extract<v1::HiddenStates::CallbackService> {
 public:
  // `auth` may be null (no token required); `metrics` and `auth` must outlive
  // the service.
  HiddenStatesService(const ServiceOptions& options, v1::ModelInfo info, Metrics* metrics, TokenAuth* auth);

  // From now on samples go to `batcher` (which must outlive every RPC).
  void SetBatcher(Batcher* batcher);
  // From now on Extract answers UNAVAILABLE "draining".
  void StartDraining();
  // The drain's time is up: streams cancelled from now on are the server's
  // doing, and their log lines say so rather than blaming the client.
  void DrainExpired() { drain_expired_.store(true); }
  // Blocks until no Extract is in progress and no sample is in the batcher
  // (true), or until `deadline` or Interrupt() (false).
  bool WaitIdle(absl::Time deadline);
  void Interrupt();

  int inflight() const { return inflight_.load(); }
  int64_t samples_in_batcher() const { return samples_in_batcher_.load(); }

  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context, const v1::GetModelInfoRequest* request,
                                         v1::ModelInfo* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Extract(grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* request) override;

 private:
  // Finishes the call with `status`, counted, and logged unless `log` is
  // false (an authentication failure left out of the log: auth.h).
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Reject(grpc::CallbackServerContext* context,
                                                     const v1::ExtractRequest& request, grpc::Status status,
                                                     bool log = true);
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Accept(grpc::CallbackServerContext* context,
                                                     const v1::ExtractRequest& request);
  // Takes one of --max-concurrent-requests' slots, or says why not
  // (RESOURCE_EXHAUSTED).
  grpc::Status ReserveSlot();
  // A stream's end: its metrics and log line, and its slot back.
  void StreamDone(const std::string& sample_id, const std::string& peer, const StreamResult& result);
  void Notify();

  const ServiceOptions options_;
  const v1::ModelInfo info_;
  const RequestLimits limits_;
  Metrics* const metrics_;
  TokenAuth* const auth_;

  std::atomic<Batcher*> batcher_{nullptr};
  std::atomic<bool> draining_{false};
  std::atomic<bool> drain_expired_{false};
  std::atomic<int> inflight_{0};
  std::atomic<int64_t> samples_in_batcher_{0};

  std::mutex idle_mutex_;
  std::condition_variable idle_;
  bool interrupted_ = false;
  // Encoded samples, reused from stream to stream (no page faults per sample).
  HostBufferPool encoded_pool_;
  StallWatchdog watchdog_;  // last: its thread stops before the rest goes
};

}  // namespace hsx

#endif  // HSX_SERVER_SERVICE_HIDDEN_STATES_SERVICE_H_
