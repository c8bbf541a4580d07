// hidden_states_service.cc: admission, validation and hand-off to the batcher.
#include "server/service/hidden_states_service.h"

#include <span>
#include <vector>

#include <grpcpp/support/proto_buffer_reader.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "format/encoding.h"
#include "format/layer_convention.h"
#include "server/service/extract_reactor.h"
#include "server/service/log.h"

namespace hsx {
namespace {

// An Extract that fails before anything is queued.
class RejectedExtract : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  explicit RejectedExtract(grpc::Status status) { Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

// Idle encoded-sample buffers kept for reuse (beyond the one always kept):
// part of the server's memory bound (docs/api.md).
constexpr size_t kIdleEncodedBytes = size_t{256} << 20;

// The raw request as an ExtractRequest; false when its bytes are not one.
bool ParseRequest(const grpc::ByteBuffer& raw, v1::ExtractRequest* request) {
  grpc::ByteBuffer copy(raw);  // ProtoBufferReader wants a mutable buffer; this shares the slices
  grpc::ProtoBufferReader reader(&copy);
  return request->ParseFromZeroCopyStream(&reader);
}

RequestLimits LimitsOf(const ServiceOptions& options, const v1::ModelInfo& info) {
  RequestLimits limits;
  limits.vocab_size = info.vocab_size();
  limits.num_layers = info.num_layers();
  limits.max_tokens_per_sample = options.engine_flags.max_tokens_per_sample;
  limits.default_capture = options.default_capture;
  limits.media_placeholders = options.refused_media_placeholders;
  return limits;
}

void LogFailure(const char* method, const std::string& sample_id, const std::string& peer, int64_t tokens,
                const grpc::Status& status, int64_t messages_sent = 0) {
  const grpc::StatusCode code = status.error_code();
  const bool server_fault = code == grpc::StatusCode::INTERNAL || code == grpc::StatusCode::UNKNOWN ||
                            code == grpc::StatusCode::DATA_LOSS;
  std::string line = absl::StrFormat("%s sample_id='%s' (%d tokens) from %s: %s: %s", method,
                                     TruncateForLog(sample_id, 128), tokens, peer, StatusCodeName(code),
                                     status.error_message());
  if (messages_sent > 0) absl::StrAppend(&line, " (after ", messages_sent, " messages)");
  LogLine(server_fault ? LogLevel::kError : LogLevel::kInfo, line);
}

}  // namespace

HiddenStatesService::HiddenStatesService(const ServiceOptions& options, v1::ModelInfo info, Metrics* metrics,
                                         TokenAuth* auth)
    : options_(options), info_(std::move(info)), limits_(LimitsOf(options_, info_)), metrics_(metrics), auth_(auth),
      encoded_pool_(HostBufferPool::HeapAllocator(), kIdleEncodedBytes),
      watchdog_(options_.stream_stall_timeout) {}

void HiddenStatesService::SetBatcher(Batcher* batcher) { batcher_.store(batcher); }

void HiddenStatesService::StartDraining() { draining_.store(true); }

void HiddenStatesService::Notify() {
  std::lock_guard<std::mutex> lock(idle_mutex_);
  idle_.notify_all();
}

void HiddenStatesService::Interrupt() {
  std::lock_guard<std::mutex> lock(idle_mutex_);
  interrupted_ = true;
  idle_.notify_all();
}

bool HiddenStatesService::WaitIdle(absl::Time deadline) {
  std::unique_lock<std::mutex> lock(idle_mutex_);
  for (;;) {
    if (inflight_.load() == 0 && samples_in_batcher_.load() == 0) return true;
    if (interrupted_ || absl::Now() >= deadline) return false;
    idle_.wait_for(lock, absl::ToChronoMilliseconds(std::min(deadline - absl::Now(), absl::Milliseconds(200))));
  }
}

grpc::ServerUnaryReactor* HiddenStatesService::GetModelInfo(grpc::CallbackServerContext* context,
                                                            const v1::GetModelInfoRequest* /*request*/,
                                                            v1::ModelInfo* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (auth_ != nullptr) {
    if (AuthVerdict verdict = auth_->Check(*context); !verdict.status.ok()) {
      metrics_->Error(verdict.status.error_code());
      metrics_->AuthFailure(verdict.rate_limited);
      if (verdict.log) LogFailure("GetModelInfo", "", context->peer(), 0, verdict.status);
      reactor->Finish(verdict.status);
      return reactor;
    }
  }
  *response = info_;
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* HiddenStatesService::Reject(grpc::CallbackServerContext* context,
                                                                        const v1::ExtractRequest& request,
                                                                        grpc::Status status, bool log) {
  metrics_->Error(status.error_code());
  if (log) LogFailure("Extract", request.sample_id(), context->peer(), request.token_ids_size(), status);
  return new RejectedExtract(std::move(status));
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* HiddenStatesService::Extract(grpc::CallbackServerContext* context,
                                                                         const grpc::ByteBuffer* raw) {
  // The bytes are parsed before the token is checked, so that every log
  // line (an authentication failure's too) names the sample_id, and an
  // undecodable request is counted whoever sent it; but a client without the
  // token gets UNAUTHENTICATED whatever it sent, and learns nothing more.
  metrics_->RequestReceived();
  v1::ExtractRequest request;
  const size_t size = raw->Length();
  const bool oversized = static_cast<int64_t>(size) > options_.max_request_bytes;
  if (oversized) metrics_->OversizedRequest();
  const bool parsed = !oversized && ParseRequest(*raw, &request);
  if (!oversized && !parsed) {
    metrics_->UndecodableRequest();
    request.Clear();  // what a failed parse left is not the client's sample_id
  }
  auto undecodable = [raw] {
    return absl::StrCat("the request (", raw->Length(), " bytes) could not be parsed as an hsx.v1.ExtractRequest: "
                        "is the client built from hsx/v1/hsx.proto?");
  };
  if (auth_ != nullptr) {
    if (AuthVerdict verdict = auth_->Check(*context); !verdict.status.ok()) {
      metrics_->AuthFailure(verdict.rate_limited);
      if (!parsed && verdict.log) {
        LogLine(LogLevel::kInfo, absl::StrCat("Extract from ", context->peer(), ": ",
                                              oversized ? absl::StrCat("a request of ", size, " bytes, over the limit")
                                                        : undecodable()));
      }
      return Reject(context, request, verdict.status, verdict.log);
    }
  }
  if (oversized) {
    return Reject(context, request,
                  {grpc::StatusCode::RESOURCE_EXHAUSTED,
                   absl::StrCat("request larger than max (", size, " vs. ", options_.max_request_bytes,
                                " bytes, --max-request-bytes; a valid request of max-tokens-per-sample ids fits)")});
  }
  if (!parsed) return Reject(context, request, {grpc::StatusCode::INVALID_ARGUMENT, undecodable()});
  return Accept(context, request);
}

grpc::Status HiddenStatesService::ReserveSlot() {
  int current = inflight_.load();
  do {
    if (current >= options_.max_concurrent_requests) {
      return {grpc::StatusCode::RESOURCE_EXHAUSTED,
              absl::StrCat("too many concurrent requests: ", current, " Extract calls in progress, the limit is ",
                           options_.max_concurrent_requests,
                           " (--max-concurrent-requests); retry later or on another replica")};
    }
  } while (!inflight_.compare_exchange_weak(current, current + 1));
  metrics_->AddInflight(1);
  return grpc::Status::OK;
}

void HiddenStatesService::StreamDone(const std::string& sample_id, const std::string& peer,
                                     const StreamResult& result) {
  if (result.status.ok()) {
    metrics_->SampleDone(result.tokens, absl::ToDoubleSeconds(result.elapsed));
  } else {
    metrics_->Error(result.status.error_code());
    grpc::Status status = result.status;
    if (status.error_code() == grpc::StatusCode::CANCELLED && drain_expired_.load()) {
      status = {grpc::StatusCode::CANCELLED, "cancelled by the server: the drain timed out (--drain-timeout)"};
    }
    LogFailure("Extract", sample_id, peer, result.tokens, status, result.messages_sent);
  }
  inflight_.fetch_sub(1);
  metrics_->AddInflight(-1);
  Notify();
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* HiddenStatesService::Accept(grpc::CallbackServerContext* context,
                                                                        const v1::ExtractRequest& parsed) {
  const v1::ExtractRequest* request = &parsed;
  Batcher* batcher = batcher_.load();
  if (batcher == nullptr) {
    return Reject(context, *request,
                  {grpc::StatusCode::UNAVAILABLE, "the model is loading; wait for grpc.health.v1 SERVING"});
  }
  if (draining_.load()) {
    return Reject(context, *request,
                  {grpc::StatusCode::UNAVAILABLE, "draining: the server is shutting down; retry on another replica"});
  }
  if (absl::Status lost = batcher->device_lost(); !lost.ok()) return Reject(context, *request, ToGrpcStatus(lost));
  absl::StatusOr<ValidatedRequest> valid = ValidateExtractRequest(*request, limits_);
  if (!valid.ok()) return Reject(context, *request, ToGrpcStatus(valid.status()));

  // Admission: reserve a slot or refuse at once.
  if (grpc::Status slot = ReserveSlot(); !slot.ok()) return Reject(context, *request, std::move(slot));

  std::vector<int32_t> tokens(request->token_ids().begin(), request->token_ids().end());
  EncoderOptions encoder;
  encoder.sample_id = request->sample_id();
  encoder.dtype = valid->dtype;
  encoder.checksum = valid->checksum;
  encoder.summary = valid->summary;
  encoder.max_chunk_bytes = options_.max_chunk_bytes;
  encoder.token_ids_hash = TokenIdsHash(std::span<const int32_t>(tokens));
  encoder.model_name = info_.model_name();
  encoder.num_layers = info_.num_layers();
  encoder.layer_convention = kLayerConvention;

  const std::string peer = context->peer();
  const std::string sample_id = request->sample_id();
  std::shared_ptr<ExtractReactor> reactor = ExtractReactor::Create(
      std::move(encoder), valid->capture, static_cast<int64_t>(tokens.size()), &encoded_pool_, metrics_,
      [this, peer, sample_id](const StreamResult& result) { StreamDone(sample_id, peer, result); });

  reactor->SetContext(context);
  watchdog_.Watch(reactor);

  WorkItem item;
  item.tokens = std::move(tokens);
  item.capture = valid->capture;
  item.row_check = RowCheck{valid->dtype, valid->checksum};  // what EncodeSample checks in place
  if (valid->dtype == OutputDType::kFp8) {
    item.encode_buffer = [this](size_t bytes) { return encoded_pool_.Get(bytes); };  // encoded where made
  }
  item.abandoned = [reactor] { return reactor->Abandoned(); };
  item.deliver = [this, reactor](absl::StatusOr<SampleTensors> rows) {
    reactor->Deliver(std::move(rows));
    samples_in_batcher_.fetch_sub(1);
    Notify();
  };
  samples_in_batcher_.fetch_add(1);
  if (absl::Status status = batcher->Submit(std::move(item)); !status.ok()) {
    samples_in_batcher_.fetch_sub(1);
    reactor->Fail(ToGrpcStatus(status));
  }
  return reactor.get();
}

}  // namespace hsx
