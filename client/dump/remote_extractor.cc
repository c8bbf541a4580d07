// remote_extractor.cc: gRPC callback client, reassembly and checks, retries.
#include "client/dump/remote_extractor.h"

#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_names.h"
#include "format/stream_assembler.h"
#include "hsx/v1/hsx.grpc.pb.h"

namespace hsx {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kMaxReceiveMessageBytes = 64 << 20;
constexpr double kModelInfoDeadlineSeconds = 10.0;
// A server that did not answer at start is asked again at most this far apart.
constexpr double kJoinBackoffMaxSeconds = 5.0;

bool Retryable(grpc::StatusCode code) {
  return code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::DEADLINE_EXCEEDED ||
         code == grpc::StatusCode::RESOURCE_EXHAUSTED;
}

// Runs callbacks at given times on one thread (retry backoffs must not sleep
// in gRPC's reaction threads).
class Scheduler {
 public:
  Scheduler() : thread_([this] { Loop(); }) {}
  ~Scheduler() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  void At(Clock::time_point when, std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.emplace(when, std::move(fn));
    }
    wake_.notify_all();
  }
  // Runs everything queued now (after a cancellation).
  void FlushNow() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      flush_ = true;
    }
    wake_.notify_all();
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      if (queue_.empty()) {
        if (stop_) return;
        wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        continue;
      }
      auto first = queue_.begin();
      if (!flush_ && !stop_ && first->first > Clock::now()) {
        wake_.wait_until(lock, first->first);
        continue;
      }
      std::function<void()> fn = std::move(first->second);
      queue_.erase(first);
      lock.unlock();
      fn();
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::multimap<Clock::time_point, std::function<void()>> queue_;
  bool stop_ = false;
  bool flush_ = false;
  std::thread thread_;
};

struct SampleCall {
  const InputSample* input = nullptr;
  ExtractSpec spec;
  Extractor::Done done;
  v1::ExtractRequest request;
  uint64_t token_hash = 0;
  int attempts = 0;
};

}  // namespace

class Attempt;

class RemoteExtractor::Impl {
 public:
  struct Server {
    std::string address;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::HiddenStates::Stub> stub;
    std::unique_ptr<grpc::internal::RpcMethod> extract;  // Extract, read as raw byte buffers
  };

  explicit Impl(const RemoteOptions& options) : options_(options), rng_(std::random_device()()) {
    if (!options_.log) {
      options_.log = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
    }
  }
  ~Impl();

  absl::Status Connect();
  absl::StatusOr<RemoteModelInfo> FetchModelInfo();
  void Extract(const InputSample& sample, const ExtractSpec& spec, Done done);
  void CancelAll();

  // Called by an attempt from OnDone, after Release.
  void AttemptDone(std::shared_ptr<SampleCall> call, absl::StatusOr<SampleTensors> result,
                   grpc::StatusCode code);
  // Forgets a finished attempt (CancelAll no longer reaches it).
  void Release(Attempt* attempt);
  // An Attempt object exists from AttemptBorn to AttemptGone (its last member
  // destroyed); ~Impl waits for none to be left (see AttemptLifetime).
  void AttemptBorn();
  void AttemptGone();

  const RemoteOptions& options() const { return options_; }
  const Server& server(size_t i) const { return servers_[i]; }
  // What responses must agree with (0 / empty: not known).
  int64_t expected_hidden() const { return hidden_; }
  int64_t expected_layers() const { return layers_; }
  const std::string& expected_model() const { return model_; }
  void AddAuth(grpc::ClientContext* context) const {
    if (!options_.auth_token.empty()) context->AddMetadata("authorization", "Bearer " + options_.auth_token);
  }
  std::atomic<int64_t> attempts_{0};
  std::atomic<int64_t> retries_{0};

 private:
  grpc::Status AskModelInfo(const Server& server, grpc::ClientContext* context, v1::ModelInfo* info) const;
  // "" when `info` (from server i) serves the model of the run; else why not.
  std::string Disagreement(size_t i, const v1::ModelInfo& info) const;
  // Asks the servers in `pending` again, with backoff, until each answers
  // (then it joins the round-robin) or the run ends. Runs on joiner_.
  void JoinLater(std::vector<size_t> pending);
  void StartAttempt(std::shared_ptr<SampleCall> call);
  void Complete(const std::shared_ptr<SampleCall>& call, absl::StatusOr<SampleTensors> result);
  size_t PickServer();
  double Backoff(int attempt);

  RemoteOptions options_;
  std::vector<Server> servers_;
  // Whether a server takes samples: all do until FetchModelInfo, which keeps
  // those that answered; JoinLater adds the others as they come up.
  std::vector<std::atomic<bool>> joined_;
  size_t reference_ = 0;  // the first server that answered: the model of the run
  v1::ModelInfo reference_info_;
  int64_t max_tokens_ = 0;  // the run's limit (the smallest of those that answered; 0: none)
  std::atomic<uint64_t> next_{0};
  int64_t hidden_ = 0;
  int64_t layers_ = 0;
  std::string model_;

  std::mutex mutex_;
  std::condition_variable idle_;
  // Running attempts. Each owns itself until its OnDone (as the server's
  // ExtractReactor does); CancelAll holds a strong reference while it cancels.
  std::map<Attempt*, std::weak_ptr<Attempt>> active_;
  int64_t outstanding_ = 0;  // samples whose `done` has not been called yet
  // Attempt objects not yet destroyed. Atomic, not under mutex_: attempts
  // are constructed with mutex_ held (StartAttempt); decremented under it.
  std::atomic<int64_t> attempts_alive_{0};
  bool cancelled_ = false;
  std::mt19937_64 rng_;
  std::condition_variable join_wake_;
  grpc::ClientContext* probing_ = nullptr;  // JoinLater's call in progress
  std::thread joiner_;
  Scheduler scheduler_;
};

// One attempt of one sample: an Extract call and the reassembly of its stream.
// The responses are read as raw byte buffers (the generated method's path,
// with ByteBuffer as the response type): the assembler checks a chunk's rows
// in the received slices and keeps references to those slices as the
// sample's states (no copy: the file is written from them), or, when the
// caller does not keep the states (--discard), keeps nothing
// (stream_assembler.h).
// Owned by shared pointers: its own (self_, from Start to the end of OnDone)
// and, briefly, CancelAll's; so gRPC's last reaction and a concurrent cancel
// never see it freed.
class Attempt : public grpc::ClientReadReactor<grpc::ByteBuffer> {
 public:
  Attempt(RemoteExtractor::Impl* impl, std::shared_ptr<SampleCall> call, size_t server)
      : lifetime_(impl), impl_(impl), call_(std::move(call)), server_(server),
        assembler_(Expectation(*impl_, *call_), call_->spec.keep_states ? StreamAssembler::Mode::kKeepReceived
                                                                         : StreamAssembler::Mode::kVerifyOnly) {}

  void Start(std::shared_ptr<Attempt> self) {
    self_ = std::move(self);
    const auto deadline = std::chrono::system_clock::now() +
                          std::chrono::duration_cast<std::chrono::system_clock::duration>(
                              std::chrono::duration<double>(impl_->options().deadline_seconds));
    context_.set_deadline(deadline);
    impl_->AddAuth(&context_);
    const auto& server = impl_->server(server_);
    grpc::internal::ClientCallbackReaderFactory<grpc::ByteBuffer>::Create(server.channel.get(), *server.extract,
                                                                          &context_, &call_->request, this);
    StartRead(&response_);
    StartCall();  // may finish (and release self_) before returning: nothing after it
  }

  void Cancel() { context_.TryCancel(); }

  // What this attempt's stream must match.
  static StreamExpectation Expectation(const RemoteExtractor::Impl& impl, const SampleCall& call) {
    StreamExpectation e;
    e.sample_id = call.request.sample_id();
    e.num_tokens = call.request.token_ids_size();
    e.token_ids_xxh64 = call.token_hash;
    e.capture_ids = call.spec.capture.ids();
    e.final_norm = call.spec.capture.final_norm();
    e.dtype = call.spec.dtype;
    e.checksum = call.spec.checksum;
    e.hidden_size = impl.expected_hidden();
    e.num_layers = impl.expected_layers();
    e.model_name = impl.expected_model();
    return e;
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream ended: OnDone follows
    if (error_.ok()) {
      error_ = assembler_.Consume(response_);
      response_.Clear();  // the received slices go back to gRPC
      if (!error_.ok()) context_.TryCancel();
    }
    StartRead(&response_);  // after a cancel this completes with ok = false
  }

  void OnDone(const grpc::Status& status) override {
    const std::string where = absl::StrCat("server ", impl_->server(server_).address);
    absl::StatusOr<SampleTensors> result;
    grpc::StatusCode code = status.error_code();
    if (!error_.ok()) {
      result = absl::Status(error_.code(), absl::StrCat(where, ": ", error_.message()));
      code = grpc::StatusCode::DATA_LOSS;
    } else if (!status.ok()) {
      result = absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                            absl::StrCat(where, ": ", StatusCodeName(status.error_code()), ": ",
                                         status.error_message()));
    } else if (absl::Status end = assembler_.EndOfStream(); !end.ok()) {
      result = absl::DataLossError(absl::StrCat(where, ": ", end.message()));
      code = grpc::StatusCode::DATA_LOSS;
    } else {
      result = assembler_.Take();
    }
    RemoteExtractor::Impl* impl = impl_;
    std::shared_ptr<SampleCall> call = std::move(call_);
    const std::shared_ptr<Attempt> self = std::move(self_);  // may be the last: nothing after this scope
    impl->Release(this);
    impl->AttemptDone(std::move(call), std::move(result), code);
  }

 private:
  // Counts the attempt as alive until all its other members are gone (it is
  // declared first, so it is destroyed last): context_ among them, which holds
  // a reference to the channel. The attempt usually dies on one of gRPC's
  // callback threads, at the end of OnDone, after `done` has let the caller
  // destroy the extractor; were the channel's last reference dropped there,
  // ~grpc::Channel would shut down gRPC's callback queue and join its threads
  // from one of those very threads (gRPC 1.51): a double free in libgrpc at
  // exit, seen under ASan (docs/testing.md). ~Impl waits for every attempt,
  // so the channels' last references go on the thread that destroys it.
  class AttemptLifetime {
   public:
    explicit AttemptLifetime(RemoteExtractor::Impl* impl) : impl_(impl) { impl_->AttemptBorn(); }
    ~AttemptLifetime() { impl_->AttemptGone(); }
    AttemptLifetime(const AttemptLifetime&) = delete;
    AttemptLifetime& operator=(const AttemptLifetime&) = delete;

   private:
    RemoteExtractor::Impl* impl_;
  };
  AttemptLifetime lifetime_;
  RemoteExtractor::Impl* impl_;
  std::shared_ptr<Attempt> self_;  // released in OnDone
  std::shared_ptr<SampleCall> call_;
  size_t server_;
  grpc::ClientContext context_;
  grpc::ByteBuffer response_;
  absl::Status error_;
  StreamAssembler assembler_;
};

absl::Status CheckStreamWindow(int64_t bytes) {
  if (bytes == 0 || (bytes >= kMinStreamWindowBytes && bytes <= kMaxStreamWindowBytes)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("a stream window of ", bytes,
                                                 " bytes: 0 (gRPC's automatic window) or 64KiB to 1GiB"));
}

absl::Status RemoteExtractor::Impl::Connect() {
  if (options_.servers.empty()) return absl::InvalidArgumentError("no server address");
  if (absl::Status window = CheckStreamWindow(options_.stream_window_bytes); !window.ok()) return window;
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (options_.tls) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options_.tls_ca_pem;
    ssl.pem_cert_chain = options_.tls_cert_pem;
    ssl.pem_private_key = options_.tls_key_pem;
    credentials = grpc::SslCredentials(ssl);
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  for (size_t i = 0; i < options_.servers.size(); ++i) {
    const std::string& address = options_.servers[i];
    if (address.empty()) return absl::InvalidArgumentError("an empty server address");
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxReceiveMessageBytes);
    // A name resolving to several replicas (a headless Service) spreads too.
    args.SetLoadBalancingPolicyName("round_robin");
    // A connection of its own, even when two addresses are the same.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("hsx.channel_index", static_cast<int>(i));
    // Find a restarted server within a couple of seconds.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
    // Detect dead connections; every 5 min is what servers accept by default.
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 300000);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20000);
    if (options_.stream_window_bytes > 0) {
      args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
      args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, static_cast<int>(options_.stream_window_bytes));
    }
    if (!options_.tls_server_name.empty()) args.SetSslTargetNameOverride(options_.tls_server_name);
    Server server;
    server.address = address;
    server.channel = grpc::CreateCustomChannel(address, credentials, args);
    server.stub = v1::HiddenStates::NewStub(server.channel);
    server.extract = std::make_unique<grpc::internal::RpcMethod>(
        "/hsx.v1.HiddenStates/Extract", grpc::internal::RpcMethod::SERVER_STREAMING, server.channel);
    servers_.push_back(std::move(server));
  }
  joined_ = std::vector<std::atomic<bool>>(servers_.size());
  for (std::atomic<bool>& joined : joined_) joined = true;
  return absl::OkStatus();
}

double RemoteExtractor::Impl::Backoff(int attempt) {
  const double base = std::min(options_.backoff_max_seconds,
                               options_.backoff_initial_seconds * std::pow(2.0, std::max(0, attempt - 1)));
  std::lock_guard<std::mutex> lock(mutex_);
  return base * std::uniform_real_distribution<double>(0.5, 1.0)(rng_);
}

grpc::Status RemoteExtractor::Impl::AskModelInfo(const Server& server, grpc::ClientContext* context,
                                                 v1::ModelInfo* info) const {
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(kModelInfoDeadlineSeconds * 1000)));
  AddAuth(context);
  return server.stub->GetModelInfo(context, v1::GetModelInfoRequest(), info);
}

namespace {
std::string Describe(const std::string& address, const v1::ModelInfo& m) {
  return absl::StrCat(address, " serves '", m.model_name(), "' (revision ", m.model_revision(), ", ", m.num_layers(),
                      " layers, hidden ", m.hidden_size(), ", vocabulary ", m.vocab_size(), ", ",
                      m.compute_precision(), ")");
}
}  // namespace

std::string RemoteExtractor::Impl::Disagreement(size_t i, const v1::ModelInfo& b) const {
  const v1::ModelInfo& a = reference_info_;
  if (a.model_name() != b.model_name() || a.model_revision() != b.model_revision() ||
      a.num_layers() != b.num_layers() || a.hidden_size() != b.hidden_size() || a.vocab_size() != b.vocab_size() ||
      a.compute_precision() != b.compute_precision()) {
    return absl::StrCat("the servers run different models: ", Describe(servers_[reference_].address, a), "; ",
                        Describe(servers_[i].address, b));
  }
  return "";
}

// Every server is asked; the run starts with those that answer. When none
// does, all are asked again (with backoff, up to `retries` times) before
// giving up; those still silent once one answered are asked again in the
// background by JoinLater. A refusal (any status but UNAVAILABLE,
// DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED) or another model is an error.
absl::StatusOr<RemoteModelInfo> RemoteExtractor::Impl::FetchModelInfo() {
  const size_t n = servers_.size();
  std::vector<std::optional<v1::ModelInfo>> infos(n);
  std::vector<std::string> failures(n);
  for (int attempt = 1;; ++attempt) {
    grpc::StatusCode code = grpc::StatusCode::OK;
    for (size_t i = 0; i < n; ++i) {
      if (infos[i]) continue;
      grpc::ClientContext context;
      v1::ModelInfo info;
      const grpc::Status status = AskModelInfo(servers_[i], &context, &info);
      if (status.ok()) {
        infos[i] = std::move(info);
        continue;
      }
      code = status.error_code();
      failures[i] = absl::StrCat("server ", servers_[i].address, ": GetModelInfo: ", StatusCodeName(code), ": ",
                                 status.error_message());
      if (!Retryable(code)) return absl::Status(static_cast<absl::StatusCode>(code), failures[i]);
    }
    if (std::any_of(infos.begin(), infos.end(), [](const auto& info) { return info.has_value(); })) break;
    if (attempt > options_.retries) {
      std::string all;
      for (const std::string& failure : failures) absl::StrAppend(&all, all.empty() ? "" : "; ", failure);
      return absl::Status(static_cast<absl::StatusCode>(code),
                          absl::StrCat(all, " (gave up after ", attempt, " attempts: no server is usable)"));
    }
    const double delay = Backoff(attempt);
    for (const std::string& failure : failures) {
      options_.log(absl::StrFormat("hsx-dump: %s; retry %d/%d in %.1f s", failure, attempt, options_.retries, delay));
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(delay));
  }
  reference_ = static_cast<size_t>(std::find_if(infos.begin(), infos.end(),
                                                [](const auto& info) { return info.has_value(); }) -
                                   infos.begin());
  reference_info_ = *infos[reference_];
  std::vector<size_t> pending;
  for (size_t i = 0; i < n; ++i) {
    if (!infos[i]) {
      pending.push_back(i);
      continue;
    }
    if (const std::string why = Disagreement(i, *infos[i]); !why.empty()) return absl::FailedPreconditionError(why);
    const int64_t limit = infos[i]->max_tokens_per_sample();
    if (limit > 0 && (max_tokens_ == 0 || limit < max_tokens_)) max_tokens_ = limit;
  }
  const v1::ModelInfo& m = reference_info_;
  if (m.num_layers() < 1 || m.hidden_size() < 1 || m.vocab_size() < 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("implausible model info: ", Describe(servers_[reference_].address, m)));
  }
  RemoteModelInfo info;
  info.model_name = m.model_name();
  info.model_revision = m.model_revision();
  info.compute_precision = m.compute_precision();
  info.device = m.device();
  info.server_version = m.server_version();
  info.num_layers = m.num_layers();
  info.hidden_size = m.hidden_size();
  info.vocab_size = m.vocab_size();
  info.default_capture_ids.assign(m.default_capture_ids().begin(), m.default_capture_ids().end());
  info.max_tokens_per_sample = max_tokens_;
  hidden_ = info.hidden_size;
  layers_ = info.num_layers;
  model_ = info.model_name;
  if (!pending.empty()) {
    for (size_t i : pending) {
      joined_[i] = false;
      options_.log(absl::StrFormat("hsx-dump: %s; starting without it: it is asked again (backoff up to %.0f s) "
                                   "and joins when it answers", failures[i], kJoinBackoffMaxSeconds));
    }
    joiner_ = std::thread([this, pending] { JoinLater(pending); });
  }
  return info;
}

void RemoteExtractor::Impl::JoinLater(std::vector<size_t> pending) {
  std::vector<int> tries(servers_.size(), 0);
  std::vector<Clock::time_point> next(servers_.size(), Clock::now());
  std::unique_lock<std::mutex> lock(mutex_);
  const auto backoff = [&](size_t i) {  // with mutex_ held (rng_)
    const double base =
        std::min(kJoinBackoffMaxSeconds, options_.backoff_initial_seconds * std::pow(2.0, std::min(tries[i]++, 30)));
    const double delay = base * std::uniform_real_distribution<double>(0.5, 1.0)(rng_);
    next[i] = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(delay));
  };
  for (size_t i : pending) backoff(i);
  while (!pending.empty() && !cancelled_) {
    const auto due = std::min_element(pending.begin(), pending.end(), [&](size_t a, size_t b) { return next[a] < next[b]; });
    if (join_wake_.wait_until(lock, next[*due], [&] { return cancelled_; })) break;
    const size_t i = *due;
    grpc::ClientContext context;
    v1::ModelInfo info;
    probing_ = &context;
    lock.unlock();
    const grpc::Status status = AskModelInfo(servers_[i], &context, &info);
    lock.lock();
    probing_ = nullptr;
    if (cancelled_) break;
    const std::string address = servers_[i].address;
    if (!status.ok() && Retryable(status.error_code())) {
      backoff(i);
      continue;
    }
    pending.erase(due);
    std::string why;
    if (!status.ok()) {
      why = absl::StrCat("GetModelInfo: ", StatusCodeName(status.error_code()), ": ", status.error_message());
    } else if (why = Disagreement(i, info); why.empty() && info.max_tokens_per_sample() > 0 &&
                                            (max_tokens_ == 0 || info.max_tokens_per_sample() < max_tokens_)) {
      why = absl::StrCat("it takes at most ", info.max_tokens_per_sample(), " tokens per sample, this run admits ",
                         max_tokens_ == 0 ? std::string("any number") : absl::StrCat(max_tokens_));
    }
    if (why.empty()) {
      joined_[i] = true;
      options_.log(absl::StrCat("hsx-dump: server ", address, " answers now: it joins the round-robin"));
    } else {
      options_.log(absl::StrCat("hsx-dump: server ", address, ": ", why, "; it is not used"));
    }
  }
}

size_t RemoteExtractor::Impl::PickServer() {
  const size_t n = servers_.size();
  const size_t first = static_cast<size_t>(next_.fetch_add(1) % n);
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (first + k) % n;
    if (joined_[i] && servers_[i].channel->GetState(false) != GRPC_CHANNEL_TRANSIENT_FAILURE) return i;
  }
  for (size_t k = 0; k < n; ++k) {  // all failing: let the attempt fail and back off
    if (joined_[(first + k) % n]) return (first + k) % n;
  }
  return first;
}

void RemoteExtractor::Impl::Extract(const InputSample& sample, const ExtractSpec& spec, Done done) {
  auto call = std::make_shared<SampleCall>();
  call->input = &sample;
  call->spec = spec;
  call->done = std::move(done);
  call->request.set_sample_id(std::to_string(sample.index));
  call->request.mutable_token_ids()->Add(sample.input_ids.begin(), sample.input_ids.end());
  call->request.mutable_capture_ids()->Add(spec.capture.ids().begin(), spec.capture.ids().end());
  call->request.set_dtype(OutputDTypeToProto(spec.dtype));
  call->request.set_checksum(ChecksumKindToProto(spec.checksum));
  call->request.set_final_norm(spec.capture.final_norm());
  call->token_hash = TokenIdsHash(sample.input_ids);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++outstanding_;
  }
  StartAttempt(std::move(call));
}

void RemoteExtractor::Impl::StartAttempt(std::shared_ptr<SampleCall> call) {
  const size_t server = PickServer();  // not under mutex_: gRPC may run reactions inline
  std::shared_ptr<Attempt> attempt;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!cancelled_) {
      ++call->attempts;
      attempt = std::make_shared<Attempt>(this, call, server);
      active_.emplace(attempt.get(), attempt);
    }
  }
  if (attempt == nullptr) {
    Complete(call, absl::CancelledError("cancelled"));
    return;
  }
  ++attempts_;
  Attempt* started = attempt.get();
  started->Start(std::move(attempt));
}

void RemoteExtractor::Impl::Release(Attempt* attempt) {
  std::lock_guard<std::mutex> lock(mutex_);
  active_.erase(attempt);
}

void RemoteExtractor::Impl::AttemptDone(std::shared_ptr<SampleCall> call, absl::StatusOr<SampleTensors> result,
                                        grpc::StatusCode code) {
  if (result.ok()) {
    Complete(call, std::move(result));
    return;
  }
  bool cancelled;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    cancelled = cancelled_;
  }
  if (cancelled) {
    Complete(call, absl::CancelledError(absl::StrCat("cancelled (", result.status().message(), ")")));
    return;
  }
  if (Retryable(code) && call->attempts <= options_.retries) {
    const double delay = Backoff(call->attempts);
    ++retries_;
    options_.log(absl::StrFormat("hsx-dump: sample %d (id %s): %s; retry %d/%d in %.1f s", call->input->index,
                                 call->input->id, result.status().message(), call->attempts, options_.retries,
                                 delay));
    scheduler_.At(Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(delay)),
                  [this, call] { StartAttempt(call); });
    return;
  }
  if (Retryable(code)) {
    Complete(call, absl::Status(result.status().code(),
                                absl::StrCat("gave up after ", call->attempts, call->attempts == 1 ? " attempt" : " attempts", "; the last: ",
                                             result.status().message())));
    return;
  }
  Complete(call, result.status());
}

void RemoteExtractor::Impl::Complete(const std::shared_ptr<SampleCall>& call, absl::StatusOr<SampleTensors> result) {
  Extractor::Done done = std::move(call->done);
  done(std::move(result));
  std::lock_guard<std::mutex> lock(mutex_);
  --outstanding_;
  idle_.notify_all();  // under the lock: the destructor may free idle_ as soon as it sees 0
}

void RemoteExtractor::Impl::CancelAll() {
  std::vector<std::shared_ptr<Attempt>> running;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    cancelled_ = true;
    if (probing_ != nullptr) probing_->TryCancel();
    for (const auto& [raw, attempt] : active_) {
      if (std::shared_ptr<Attempt> held = attempt.lock()) running.push_back(std::move(held));
    }
  }
  join_wake_.notify_all();
  scheduler_.FlushNow();
  // Outside the lock: a cancel may run the attempt's OnDone on this thread;
  // `running` keeps every attempt alive until the loop is over.
  for (const std::shared_ptr<Attempt>& attempt : running) attempt->Cancel();
}

void RemoteExtractor::Impl::AttemptBorn() { attempts_alive_.fetch_add(1); }

void RemoteExtractor::Impl::AttemptGone() {
  std::lock_guard<std::mutex> lock(mutex_);
  attempts_alive_.fetch_sub(1);
  idle_.notify_all();  // under the lock: the destructor may free idle_ as soon as it sees 0
}

RemoteExtractor::Impl::~Impl() {
  CancelAll();
  if (joiner_.joinable()) joiner_.join();
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.wait(lock, [&] { return outstanding_ == 0 && attempts_alive_.load() == 0; });
}

RemoteExtractor::RemoteExtractor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RemoteExtractor::~RemoteExtractor() = default;

absl::StatusOr<std::unique_ptr<RemoteExtractor>> RemoteExtractor::Create(const RemoteOptions& options) {
  // Without an RPC in progress, nothing polls a connection attempt but gRPC's
  // backup poller, every 5 s by default: a restarted server would be noticed
  // only that late, while our retries fail fast. Poll every 100 ms instead
  // (read once, when gRPC initializes; a value set by the user wins).
  ::setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "100", /*overwrite=*/0);
  auto impl = std::make_unique<Impl>(options);
  if (absl::Status s = impl->Connect(); !s.ok()) return s;
  return std::unique_ptr<RemoteExtractor>(new RemoteExtractor(std::move(impl)));
}

absl::StatusOr<RemoteModelInfo> RemoteExtractor::FetchModelInfo() { return impl_->FetchModelInfo(); }
void RemoteExtractor::Extract(const InputSample& sample, const ExtractSpec& spec, Done done) {
  impl_->Extract(sample, spec, std::move(done));
}
void RemoteExtractor::CancelAll() { impl_->CancelAll(); }
int64_t RemoteExtractor::attempts() const { return impl_->attempts_.load(); }
int64_t RemoteExtractor::retries() const { return impl_->retries_.load(); }

}  // namespace hsx
