// extract_reactor.cc: the stream's state machine. Every event takes the lock,
// updates the state and decides one action; the action (StartWrite or
// Finish) runs after the lock is released.
#include "server/service/extract_reactor.h"

#include <grpcpp/server_context.h>
#include <grpcpp/support/config.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace hsx {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return {static_cast<grpc::StatusCode>(status.code()), std::string(status.message())};
}

std::shared_ptr<ExtractReactor> ExtractReactor::Create(EncoderOptions encoder_options, CaptureSpec capture,
                                                       int64_t tokens, HostBufferPool* pool, Metrics* metrics,
                                                       std::function<void(const StreamResult&)> on_done) {
  std::shared_ptr<ExtractReactor> reactor(new ExtractReactor(std::move(encoder_options), std::move(capture), tokens,
                                                             pool, metrics, std::move(on_done)));
  reactor->self_ = reactor;
  return reactor;
}

ExtractReactor::ExtractReactor(EncoderOptions encoder_options, CaptureSpec capture, int64_t tokens,
                               HostBufferPool* pool, Metrics* metrics,
                               std::function<void(const StreamResult&)> on_done)
    : encoder_options_(std::move(encoder_options)),
      capture_(std::move(capture)),
      tokens_(tokens),
      pool_(pool),
      metrics_(metrics),
      on_done_(std::move(on_done)),
      start_(absl::Now()) {}

absl::Status ExtractReactor::CheckRows(const SampleTensors& s) const {
  const size_t layers = s.capture_ids.size();
  const bool shapes_ok = s.tokens == tokens_ && s.capture_ids == capture_.ids() &&
                         s.tensors.size() == layers + (capture_.final_norm() ? 1 : 0) &&
                         (s.dtype == OutputDType::kFp32 || s.dtype == OutputDType::kBf16 ||
                          (s.dtype == OutputDType::kFp8 && encoder_options_.dtype == OutputDType::kFp8));
  if (shapes_ok) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("the batcher returned ", OutputDTypeName(s.dtype), " states of ", s.tokens,
                                          " tokens and ", layers, " layers for a request of ", tokens_,
                                          " tokens and ", capture_.ids().size(), " layers in ",
                                          OutputDTypeName(encoder_options_.dtype)));
}

void ExtractReactor::Deliver(absl::StatusOr<SampleTensors> rows) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finish_called_ || cancelled_) return;  // the client went away; the rows are dropped
  }
  absl::Status status = rows.status();
  if (status.ok()) status = CheckRows(*rows);
  // Encoding (the sample's one pass over its rows) runs outside the lock: a
  // cancellation meanwhile is seen below.
  absl::StatusOr<std::unique_ptr<ResponseEncoder>> encoder =
      status.ok() ? ResponseEncoder::Create(*std::move(rows), encoder_options_,
                                                      [this](size_t bytes) { return pool_->Get(bytes); })
                  : absl::StatusOr<std::unique_ptr<ResponseEncoder>>(status);
  rows = absl::CancelledError("released");  // the batch's buffers may go back to their pool
  Action action;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finish_called_) return;
    if (!encoder.ok()) {
      action = FinishLocked(ToGrpcStatus(encoder.status()));
    } else if (cancelled_) {
      action = FinishLocked({grpc::StatusCode::CANCELLED, "cancelled by the client (or its deadline passed)"});
    } else {
      encoder_ = *std::move(encoder);
      held_state_bytes_ = encoder_->held_bytes();
      metrics_->AddHeldStates(static_cast<double>(held_state_bytes_));
      action = NextWriteLocked();
    }
  }
  Perform(action);
}

void ExtractReactor::Fail(grpc::Status status) {
  Action action;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!finish_called_) action = FinishLocked(std::move(status));
  }
  Perform(action);
}

void ExtractReactor::OnWriteDone(bool ok) {
  Action action;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    write_in_flight_ = false;
    metrics_->AddBuffered(-static_cast<double>(message_bytes_));
    if (ok) {
      metrics_->BytesSent(message_bytes_);
      ++messages_sent_;
    }
    message_.Clear();
    message_bytes_ = 0;
    if (finish_called_) {
      // Nothing to do: Finish is never called with a write outstanding.
    } else if (stalled_for_ > absl::ZeroDuration()) {
      action = FinishLocked(StalledStatus());
    } else if (!ok || cancelled_) {
      action = FinishLocked({grpc::StatusCode::CANCELLED, "the stream was cancelled or broke during a write"});
    } else {
      action = NextWriteLocked();
    }
  }
  Perform(action);
}

void ExtractReactor::SetContext(grpc::CallbackServerContext* context) {
  std::lock_guard<std::recursive_mutex> lock(context_mutex_);
  context_ = context;
}

bool ExtractReactor::CancelIfStalled(absl::Time now, absl::Duration limit) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!write_in_flight_ || finish_called_ || stalled_for_ > absl::ZeroDuration() || now - write_started_ <= limit) {
      return false;
    }
    stalled_for_ = now - write_started_;
  }
  std::lock_guard<std::recursive_mutex> lock(context_mutex_);
  if (context_ == nullptr) return false;  // already done
  context_->TryCancel();  // the pending write then fails, and OnWriteDone finishes with StalledStatus()
  return true;
}

grpc::Status ExtractReactor::StalledStatus() const {
  return {grpc::StatusCode::CANCELLED,
          absl::StrCat("cancelled by the server: the client took no data for ", absl::FormatDuration(stalled_for_),
                       " (--stream-stall-timeout)")};
}

bool ExtractReactor::Abandoned() {
  std::lock_guard<std::mutex> lock(mutex_);
  return cancelled_ || finish_called_;
}

void ExtractReactor::OnCancel() {
  Action action;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    cancelled_ = true;
    // With a write outstanding, its OnWriteDone finishes the stream.
    if (!finish_called_ && !write_in_flight_) {
      action = FinishLocked(stalled_for_ > absl::ZeroDuration()
                                ? StalledStatus()
                                : grpc::Status(grpc::StatusCode::CANCELLED,
                                               "cancelled by the client (or its deadline passed)"));
    }
  }
  Perform(action);
}

void ExtractReactor::OnDone() {
  SetContext(nullptr);
  StreamResult result;
  std::shared_ptr<ExtractReactor> self;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    result.status = final_status_;
    result.tokens = tokens_;
    result.messages_sent = messages_sent_;
    result.elapsed = absl::Now() - start_;
    self = std::move(self_);
  }
  if (on_done_) on_done_(result);
  // `self` may hold the last reference: the reactor is freed when it goes out
  // of scope, unless the batcher has not delivered yet.
}

ExtractReactor::Action ExtractReactor::NextWriteLocked() {
  if (!encoder_->Next(&message_)) return FinishLocked(grpc::Status::OK);
  write_in_flight_ = true;
  write_started_ = absl::Now();
  message_bytes_ = static_cast<int64_t>(message_.Length());
  metrics_->AddBuffered(static_cast<double>(message_bytes_));
  return {Action::kWrite, grpc::Status::OK};
}

ExtractReactor::Action ExtractReactor::FinishLocked(grpc::Status status) {
  finish_called_ = true;
  final_status_ = status;
  if (encoder_) {
    metrics_->AddHeldStates(-static_cast<double>(held_state_bytes_));
    encoder_.reset();  // the states are not needed any more
    held_state_bytes_ = 0;
  }
  return {Action::kFinish, std::move(status)};
}

void ExtractReactor::Perform(const Action& action) {
  switch (action.kind) {
    case Action::kNone:
      return;
    case Action::kWrite:
      // message_ is not touched again until OnWriteDone.
      StartWrite(&message_, grpc::WriteOptions().set_no_compression());
      return;
    case Action::kFinish:
      Finish(action.status);
      return;
  }
}

}  // namespace hsx
