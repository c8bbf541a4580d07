// hsx-server: serves the hidden states of one model over gRPC.
//
// Start-up: flags -> options; config.json (for limits and ModelInfo); the
// metrics endpoint; the gRPC port(s), health NOT_SERVING; then the checkpoint,
// the engine and the self-check; then the one shared batcher, health SERVING
// and "ready". Shutdown (SIGTERM/SIGINT/SIGHUP, seen by a sigwait thread, never in a
// signal handler): health NOT_SERVING, new Extract calls refused with
// UNAVAILABLE "draining", in-flight samples finish within --drain-timeout (a
// second signal cuts the wait short), then the rest are cancelled, the servers
// shut down and the process exits 0.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/model/checkpoint.h"
#include "server/model/config.h"
#include "server/runtime/batcher.h"
#include "server/runtime/engine.h"
#include "server/runtime/engine_flags.h"
#include "server/runtime/fault_injection.h"
#include "server/service/auth.h"
#include "server/service/credentials.h"
#include "server/service/device_loss.h"
#include "server/service/health.h"
#include "server/service/health_service.h"
#include "server/service/hidden_states_service.h"
#include "server/service/listen_probe.h"
#include "server/service/log.h"
#include "server/service/metrics.h"
#include "server/service/model_info.h"
#include "server/service/self_check.h"
#include "server/service/service_options.h"
#include "server/service/signal_watcher.h"
#include "base/cli.h"

namespace hsx {
namespace {

// After the drain, the least time the connections get to close gracefully (the
// rest of --drain-timeout, if longer): enough for any live client to read its
// last bytes and answer the GOAWAY's PING.
constexpr absl::Duration kCloseGrace = absl::Seconds(2);

// Stop requests from the signal watcher, seen by main().
class StopRequests {
 public:
  // Before the server is ready nothing is in flight: exit at once.
  void OnSignal(int signal, int count, HiddenStatesService* service) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!ready_) {
      LogInfo("received %s during start-up; exiting", strsignal(signal));
      std::_Exit(0);
    }
    signal_ = signal;
    count_ = count;
    if (count > 1) {
      LogWarning("received %s again: cutting the drain short", strsignal(signal));
      service->Interrupt();
    }
    wake_.notify_all();
  }
  void SetReady() {
    std::lock_guard<std::mutex> lock(mutex_);
    ready_ = true;
  }
  // Blocks until the first stop signal; returns it.
  int Wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    wake_.wait(lock, [&] { return count_ > 0; });
    return signal_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable wake_;
  bool ready_ = false;
  int signal_ = 0;
  int count_ = 0;
};

double SecondsSince(absl::Time start) { return absl::ToDoubleSeconds(absl::Now() - start); }

// What start-up reads before anything listens: the options, config.json and
// what follows from them.
struct Startup {
  ServiceOptions options;
  ModelConfig config;
  v1::ModelInfo info;
  std::unique_ptr<TokenAuth> auth;  // null without --auth-token-file
  std::shared_ptr<grpc::ServerCredentials> credentials;
};

absl::StatusOr<Startup> Prepare() {
  Startup s;
  absl::StatusOr<ServiceOptions> options = OptionsFromFlags();
  if (!options.ok()) return options.status();
  s.options = *std::move(options);
  absl::StatusOr<ModelConfig> config =
      ReadModelConfig((std::filesystem::path(s.options.model_dir) / "config.json").string());
  if (!config.ok()) return config.status();
  s.config = *std::move(config);
  if (absl::Status limits = ResolveModelLimits(s.config, &s.options); !limits.ok()) return limits;
  absl::StatusOr<v1::ModelInfo> info = BuildModelInfo(s.options, s.config);
  if (!info.ok()) return info.status();
  s.info = *std::move(info);
  if (!s.options.auth_token_file.empty()) {
    absl::StatusOr<std::unique_ptr<TokenAuth>> loaded = TokenAuth::FromFile(s.options.auth_token_file);
    if (!loaded.ok()) return loaded.status();
    s.auth = *std::move(loaded);
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = MakeServerCredentials(s.options);
  if (!credentials.ok()) return credentials.status();
  s.credentials = *std::move(credentials);
  return s;
}

// The main gRPC port, serving `services`; says why when it cannot.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartServer(const ServiceOptions& options,
                                                          const std::shared_ptr<grpc::ServerCredentials>& credentials,
                                                          std::initializer_list<grpc::Service*> services) {
  // gRPC only says that listening failed; find out why first.
  if (absl::Status s = ProbeListenAddress("listen", options.listen); !s.ok()) return s;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options.listen, credentials, &port);
  for (grpc::Service* service : services) builder.RegisterService(service);
  builder.SetMaxReceiveMessageSize(static_cast<int>(TransportRequestLimit(options.max_request_bytes)));
  builder.SetMaxSendMessageSize(static_cast<int>(std::max<int64_t>(4 << 20, options.max_chunk_bytes + (64 << 10))));
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // a second server on the port is an error
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Ping idle connections every minute and drop those that do not answer in 20 s: a client
  // that vanished (no FIN: a powered-off node, a partition) frees its streams.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 60000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
  if (options.max_connection_age > absl::ZeroDuration()) {
    // A client re-resolves its target when a connection closes: with a DNS
    // name over several replicas, new ones get work at the next GOAWAY.
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS,
                               static_cast<int>(absl::ToInt64Milliseconds(options.max_connection_age)));
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
                               static_cast<int>(absl::ToInt64Milliseconds(options.max_connection_age_grace)));
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat(
        "--listen ", options.listen, ": gRPC could not start serving on it", options.tls()
            ? " (the address binds: check that --tls-cert and --tls-key belong together and parse; gRPC's own "
              "log lines above say more)"
            : " (the address binds; gRPC's own log lines above say more)"));
  }
  LogInfo("listening on %s (%s; health NOT_SERVING until the model is loaded)", WithPort(options.listen, port),
          options.tls() ? (options.tls_client_ca.empty() ? "TLS" : "mTLS") : "plaintext");
  if (!options.tls() && options.auth_token_file.empty() && !IsLoopbackAddress(options.listen)) {
    LogWarning("serving plaintext without a token on %s, a non-loopback address: anyone who can reach it can "
               "extract hidden states; use --tls-cert/--tls-key and --auth-token-file, or listen on loopback",
               options.listen);
  }
  return server;
}

// The checkpoint and the engine over it, self-checked. Members are destroyed
// in reverse order: the engine before the checkpoint it reads.
struct LoadedModel {
  std::unique_ptr<Checkpoint> checkpoint;
  std::shared_ptr<DeviceLossFactory> injector;  // --inject-device-loss-after-batches only
  std::unique_ptr<Engine> engine;
};

absl::StatusOr<LoadedModel> LoadModel(const ServiceOptions& options, Health* health, Metrics* metrics) {
  LoadedModel m;
  absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(options.model_dir);
  if (!checkpoint.ok()) return checkpoint.status();
  m.checkpoint = *std::move(checkpoint);
  EngineOptions engine_options = options.engine_flags.engine;
  engine_options.on_device_lost = DeviceLossHandler(health, metrics);
  const int last_rank = engine_options.tp - 1;
  if (options.inject_device_loss_after_batches >= 0) {
    absl::StatusOr<std::unique_ptr<DeviceFactory>> factory =
        MakeDeviceFactory(engine_options.device, engine_options.precision, engine_options.tp, engine_options.threads,
                          engine_options.ranks_per_device, engine_options.attention);
    if (!factory.ok()) return factory.status();
    m.injector = std::make_shared<DeviceLossFactory>(*std::move(factory), last_rank);
    engine_options.factory = m.injector;
  }
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(*m.checkpoint, engine_options);
  if (!engine.ok()) return engine.status();
  m.engine = *std::move(engine);
  LogInfo("loaded %s in %.2f s", options.model_dir, SecondsSince(start));
  start = absl::Now();
  absl::StatusOr<std::string> check = RunSelfCheck(*m.engine);
  if (!check.ok()) {
    LogError("%s", check.status().message());
    return check.status();
  }
  LogInfo("%s (%.2f s)", *check, SecondsSince(start));
  if (m.injector != nullptr) {
    m.injector->Arm(options.inject_device_loss_after_batches);
    LogWarning("--inject-device-loss-after-batches=%d (testing): rank %d loses its device after %d more batches",
               options.inject_device_loss_after_batches, last_rank, options.inject_device_loss_after_batches);
  }
  return m;
}

// After the first stop signal: in-flight samples get --drain-timeout, then the
// connections close (shutdown_by) once their clients have read their last
// bytes, at most until the later of that deadline and kCloseGrace from now.
void Drain(int signal, const ServiceOptions& options, HiddenStatesService& service, Health& health,
           const std::function<void(absl::Time)>& shutdown_by) {
  LogInfo("received %s: draining (health NOT_SERVING, new Extract calls refused); %d in flight, %d samples in the "
          "batcher; waiting up to %s",
          strsignal(signal), service.inflight(), service.samples_in_batcher(),
          absl::FormatDuration(options.drain_timeout));
  health.Shutdown();
  service.StartDraining();
  absl::Time start = absl::Now();
  const absl::Time drain_deadline = start + options.drain_timeout;
  if (service.WaitIdle(drain_deadline)) {
    LogInfo("drained in %.2f s", SecondsSince(start));
  } else {
    LogWarning("drain incomplete after %.2f s (--drain-timeout): cancelling %d in-flight Extract calls",
               SecondsSince(start), service.inflight());
    service.DrainExpired();
  }
  // A finished call's last bytes may still sit in the socket buffers. A
  // graceful gRPC shutdown (GOAWAY, then a PING the client answers only after
  // reading everything before it) closes each connection once its client has
  // them; closing at once could reset the connection and lose them. Watch
  // streams end first: the shutdown waits for every open call.
  health.EndWatches();
  const absl::Time close_deadline = std::max(drain_deadline, absl::Now() + kCloseGrace);
  LogInfo("closing connections: each client has until its last bytes are read, at most %s",
          absl::FormatDuration(absl::Ceil(close_deadline - absl::Now(), absl::Milliseconds(100))));
  start = absl::Now();
  shutdown_by(close_deadline);
  LogInfo("connections closed in %.2f s", SecondsSince(start));
}

absl::Status Serve() {
  absl::StatusOr<Startup> startup = Prepare();
  if (!startup.ok()) return startup.status();
  const ServiceOptions& options = startup->options;
  LogInfo("starting %s: %s", kServerVersion, DescribeOptions(options, startup->config));

  Metrics metrics;
  if (!options.metrics_listen.empty()) {
    absl::StatusOr<std::string> bound = metrics.Serve(options.metrics_listen);
    if (!bound.ok()) return bound.status();
    LogInfo("metrics on %s", *bound);
  }

  HiddenStatesService service(options, startup->info, &metrics, startup->auth.get());
  StopRequests stop;
  SignalWatcher watcher([&](int signal, int count) { stop.OnSignal(signal, count, &service); });

  // NOT_SERVING from here, before any port is open. gRPC's default health
  // service stays off: it has no descriptor for reflection (see health_service.h).
  Health health;
  HealthService health_service(&health);
  HealthOnlyServer health_only;
  if (!options.health_listen.empty()) {
    std::string bound;
    absl::StatusOr<HealthOnlyServer> started = StartHealthOnlyServer(options.health_listen, &health, &bound);
    if (!started.ok()) return started.status();
    health_only = *std::move(started);
    LogInfo("health (grpc.health.v1 only, plaintext) on %s", bound);
  }
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  absl::StatusOr<std::unique_ptr<grpc::Server>> server =
      StartServer(options, startup->credentials, {&service, &health_service});
  if (!server.ok()) return server.status();

  // Both servers; calls still open at `deadline` are cancelled.
  auto shutdown_by = [&](absl::Time deadline) {
    (*server)->Shutdown(absl::ToChronoTime(deadline));
    if (health_only.server) health_only.server->Shutdown(absl::ToChronoTime(deadline));
  };
  absl::StatusOr<LoadedModel> model = LoadModel(options, &health, &metrics);
  if (!model.ok()) {
    shutdown_by(absl::Now());
    return model.status();
  }

  auto batcher =
      std::make_unique<Batcher>(*model->engine, BatcherOptions{.max_batch_tokens = options.engine_flags.engine.max_batch_tokens});
  metrics.SetBatcherProbe([b = batcher.get()] { return BatcherSample{b->queued_tokens(), b->fill()}; });
  service.SetBatcher(batcher.get());
  stop.SetReady();
  // Logged first, so that whoever sees SERVING can already read this line.
  LogInfo("ready: serving hsx.v1.HiddenStates (health SERVING)");
  health.SetServing(true);

  Drain(stop.Wait(), options, service, health, shutdown_by);
  (*server)->Wait();
  metrics.SetBatcherProbe(nullptr);
  metrics.StopServing();
  if (const int64_t left = service.samples_in_batcher(); left > 0) {
    // Their streams are cancelled; running them would only delay the exit.
    LogWarning("abandoning %d samples still in the batcher; exiting", left);
    std::_Exit(0);
  }
  batcher.reset();
  LogInfo("stopped");
  return absl::OkStatus();
}

}  // namespace
}  // namespace hsx

int main(int argc, char** argv) {
  hsx::BlockStopSignals();  // first: every thread inherits the mask
  absl::SetProgramUsageMessage(
      "Serves the hidden states of one DeepSeek-V3 / Kimi-K2 model over gRPC (hsx.v1.HiddenStates, plus\n"
      "grpc.health.v1 and server reflection). Flags accept - or _. See docs/api.md.\n\n"
      "  hsx-server --model DIR [--listen 0.0.0.0:50051] [--final-norm]\n"
      "             [--capture eagle3|all|speculators|specforge|modelopt|2,30,58,61]\n"
      "             [--precision bf16|fp32] [--tp N] [--metrics-listen 0.0.0.0:9090]\n"
      "             [--tls-cert CRT --tls-key KEY [--tls-client-ca CA]] [--auth-token-file FILE]\n\n"
      "Logs go to stderr; 'hsx-server: listening on HOST:PORT' names the port bound (also with port 0).\n"
      "SIGTERM/SIGINT/SIGHUP drain: health NOT_SERVING, in-flight samples finish (--drain-timeout), exit 0.\n"
      "A lost device (a sticky GPU error): health NOT_SERVING for good, Extract UNAVAILABLE naming the rank and\n"
      "its error, hsx_device_lost 1; the process stays up for probes and metrics until it is restarted.");
  hsx::ListFlagsInHelp("server/service/");  // service_options.cc's flags and the engine's
  hsx::AcceptDashedFlags(argc, argv);
  absl::ParseCommandLine(argc, argv);
  hsx::SkipMutexDeadlockDetection();
  return hsx::ExitWithStatus("hsx-server", hsx::Serve());
}
