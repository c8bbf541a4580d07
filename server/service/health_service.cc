// health_service.cc: Check, and Watch's reactor.
#include "server/service/health_service.h"

#include <mutex>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"

namespace hsx {
namespace {

using grpc::health::v1::HealthCheckResponse;

// One Watch stream: writes the latest status whenever it differs from the last
// one written, one write at a time (a status that changes twice during a
// write is sent once, as its newest value). Ends with UNAVAILABLE when the
// server stops (OnEnd), after the write in flight. Deletes itself in OnDone.
class WatchReactor final : public grpc::ServerWriteReactor<HealthCheckResponse>, public Health::Watcher {
 public:
  // An unknown name is answered SERVICE_UNKNOWN once; it still watches, to hear OnEnd.
  WatchReactor(Health* health, bool known) : health_(health), known_(known) {
    if (!known_) {
      std::lock_guard<std::mutex> lock(mutex_);
      latest_ = HealthCheckResponse::SERVICE_UNKNOWN;
      WriteLocked();
    }
    health_->AddWatcher(this);  // writes the current status (a known name)
  }

  void OnStatus(Health::Status status) override {
    if (!known_) return;
    std::lock_guard<std::mutex> lock(mutex_);
    latest_ = status;
    WriteLocked();
  }

  void OnEnd() override {
    std::lock_guard<std::mutex> lock(mutex_);
    ending_ = true;
    if (!writing_) FinishLocked(StoppingStatus());
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mutex_);
    writing_ = false;
    if (!ok) {
      FinishLocked(grpc::Status(grpc::StatusCode::UNAVAILABLE, "health watch: write failed"));
      return;
    }
    WriteLocked();
    if (ending_ && !writing_) FinishLocked(StoppingStatus());
  }

  void OnCancel() override {
    std::lock_guard<std::mutex> lock(mutex_);
    FinishLocked(grpc::Status::CANCELLED);
  }

  void OnDone() override {
    health_->RemoveWatcher(this);
    { std::lock_guard<std::mutex> lock(mutex_); }  // whoever called Finish has let go
    delete this;
  }

 private:
  void WriteLocked() {
    if (finished_ || writing_ || !latest_.has_value() || latest_ == sent_) return;
    sent_ = latest_;
    response_.set_status(*latest_);
    writing_ = true;
    StartWrite(&response_);
  }

  static grpc::Status StoppingStatus() {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "health watch: the server is stopping");
  }

  void FinishLocked(const grpc::Status& status) {
    if (finished_) return;
    finished_ = true;
    Finish(status);
  }

  Health* const health_;
  const bool known_;
  std::mutex mutex_;
  std::optional<Health::Status> latest_;
  std::optional<Health::Status> sent_;
  HealthCheckResponse response_;
  bool writing_ = false;
  bool ending_ = false;  // OnEnd: finish once no write is in flight
  bool finished_ = false;
};

}  // namespace

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* context,
                                               const grpc::health::v1::HealthCheckRequest* request,
                                               HealthCheckResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  std::optional<Health::Status> status = health_->Get(request->service());
  if (!status.has_value()) {
    reactor->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND,
                                 absl::StrCat("service: unknown service '", request->service(),
                                              "'; this server reports '' and 'hsx.v1.HiddenStates'")));
    return reactor;
  }
  response->set_status(*status);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerWriteReactor<HealthCheckResponse>* HealthService::Watch(
    grpc::CallbackServerContext* /*context*/, const grpc::health::v1::HealthCheckRequest* request) {
  return new WatchReactor(health_, health_->Get(request->service()).has_value());
}

}  // namespace hsx
