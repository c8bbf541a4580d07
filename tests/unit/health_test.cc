// grpc.health.v1 as hsx-server serves it: the shared status (Health) and the
// callback service (HealthService) over a real in-process gRPC server, Watch
// streams included (run under ASan/UBSan by scripts/test.sh).
#include "server/service/health.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/service/health_service.h"

namespace hsx {
namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

class HealthServer {
 public:
  explicit HealthServer(Health* health) : service_(health) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
    stub_ = grpc::health::v1::Health::NewStub(channel_);
  }
  ~HealthServer() { server_->Shutdown(std::chrono::system_clock::now()); }

  // The status, or -1 - the gRPC status code on error.
  int Check(const std::string& name) {
    grpc::ClientContext context;
    HealthCheckRequest request;
    request.set_service(name);
    HealthCheckResponse response;
    const grpc::Status status = stub_->Check(&context, request, &response);
    return status.ok() ? response.status() : -1 - status.error_code();
  }
  grpc::health::v1::Health::Stub& stub() { return *stub_; }
  grpc::Server& server() { return *server_; }

 private:
  HealthService service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<grpc::health::v1::Health::Stub> stub_;
};

TEST(Health, NotServingUntilSetThenFrozenByShutdown) {
  Health health;
  EXPECT_EQ(health.Get(""), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(health.Get(kServiceName), HealthCheckResponse::NOT_SERVING);
  EXPECT_FALSE(health.Get("other").has_value());
  health.SetServing(true);
  EXPECT_EQ(health.Get(""), HealthCheckResponse::SERVING);
  health.Shutdown();
  EXPECT_EQ(health.Get(kServiceName), HealthCheckResponse::NOT_SERVING);
  health.SetServing(true);  // ignored after Shutdown
  EXPECT_EQ(health.Get(""), HealthCheckResponse::NOT_SERVING);
}

TEST(HealthService, CheckAnswersFromTheStateAndUnknownIsNotFound) {
  Health health;
  HealthServer server(&health);
  EXPECT_EQ(server.Check(""), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(server.Check(kServiceName), HealthCheckResponse::NOT_SERVING);
  health.SetServing(true);
  EXPECT_EQ(server.Check(""), HealthCheckResponse::SERVING);
  EXPECT_EQ(server.Check(kServiceName), HealthCheckResponse::SERVING);
  EXPECT_EQ(server.Check("nope"), -1 - grpc::StatusCode::NOT_FOUND);
}

TEST(HealthService, WatchSendsNowThenEveryChange) {
  Health health;
  HealthServer server(&health);
  grpc::ClientContext context;
  HealthCheckRequest request;
  request.set_service(kServiceName);
  std::unique_ptr<grpc::ClientReader<HealthCheckResponse>> reader = server.stub().Watch(&context, request);
  HealthCheckResponse response;
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);
  health.SetServing(true);
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);
  health.Shutdown();
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);
  context.TryCancel();
  while (reader->Read(&response)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

TEST(HealthService, WatchOfAnUnknownNameSaysServiceUnknown) {
  Health health;
  HealthServer server(&health);
  grpc::ClientContext context;
  HealthCheckRequest request;
  request.set_service("nope");
  auto reader = server.stub().Watch(&context, request);
  HealthCheckResponse response;
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVICE_UNKNOWN);
  context.TryCancel();
  while (reader->Read(&response)) {
  }
  reader->Finish();
}

// EndWatches (the server is about to close its connections) ends every Watch,
// of a known name or not, open or opened later, with UNAVAILABLE after its last
// status; then a graceful shutdown has no call to wait for and returns at once.
TEST(HealthService, EndWatchesEndsEveryWatchSoTheShutdownNeedNotWait) {
  Health health;
  health.SetServing(true);
  HealthServer server(&health);
  std::atomic<int> opened{0};  // Watches that have their first status
  // Reads a Watch of `name` to its end: the statuses seen and the final status.
  auto watch_to_end = [&](const std::string& name, std::vector<int>* seen, grpc::ClientContext* context) {
    HealthCheckRequest request;
    request.set_service(name);
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));  // fail, not hang
    auto reader = server.stub().Watch(context, request);
    HealthCheckResponse response;
    if (reader->Read(&response)) seen->push_back(response.status());
    opened.fetch_add(1);
    while (reader->Read(&response)) seen->push_back(response.status());
    return reader->Finish();
  };
  std::vector<int> known_seen, unknown_seen;
  grpc::ClientContext known_context, unknown_context;
  grpc::Status known_end, unknown_end;
  std::thread known([&] { known_end = watch_to_end(kServiceName, &known_seen, &known_context); });
  std::thread unknown([&] { unknown_end = watch_to_end("nope", &unknown_seen, &unknown_context); });
  while (opened.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));  // both registered
  health.EndWatches();
  known.join();
  unknown.join();
  EXPECT_EQ(known_seen, (std::vector<int>{HealthCheckResponse::SERVING, HealthCheckResponse::NOT_SERVING}));
  EXPECT_EQ(unknown_seen, std::vector<int>{HealthCheckResponse::SERVICE_UNKNOWN});
  for (const grpc::Status& end : {known_end, unknown_end}) {
    EXPECT_EQ(end.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_EQ(end.error_message(), "health watch: the server is stopping");
  }
  std::vector<int> late_seen;
  grpc::ClientContext late_context;
  EXPECT_EQ(watch_to_end("", &late_seen, &late_context).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(late_seen, std::vector<int>{HealthCheckResponse::NOT_SERVING});
  const auto start = std::chrono::steady_clock::now();
  server.server().Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(30));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

// Many watchers while the status flips: each sees alternating statuses (never
// the same twice in a row) ending in the final one; a server shutdown with
// watches open ends them.
TEST(HealthService, ConcurrentWatchersSeeAlternatingStatusesEndingInTheLast) {
  Health health;
  HealthServer server(&health);
  constexpr int kWatchers = 6;
  constexpr int kFlips = 200;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReader<HealthCheckResponse>>> readers;
  for (int i = 0; i < kWatchers; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    HealthCheckRequest request;
    readers.push_back(server.stub().Watch(contexts.back().get(), request));
    HealthCheckResponse first;
    ASSERT_TRUE(readers.back()->Read(&first));  // registered before the flips start
    EXPECT_EQ(first.status(), HealthCheckResponse::NOT_SERVING);
  }
  std::vector<std::vector<int>> seen(kWatchers);
  std::vector<std::thread> threads;
  for (int i = 0; i < kWatchers; ++i) {
    threads.emplace_back([&, i] {
      HealthCheckResponse response;
      seen[i].push_back(HealthCheckResponse::NOT_SERVING);
      while (readers[i]->Read(&response)) {
        seen[i].push_back(response.status());
      }
    });
  }
  for (int k = 0; k < kFlips; ++k) health.SetServing(k % 2 == 0);  // the last flip sets NOT_SERVING
  health.SetServing(true);
  // Give the last write time to arrive, then end the streams by shutting the server down.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  server.server().Shutdown(std::chrono::system_clock::now());
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kWatchers; ++i) {
    readers[i]->Finish();
    ASSERT_GE(seen[i].size(), 2u) << "watcher " << i;
    EXPECT_EQ(seen[i].back(), HealthCheckResponse::SERVING) << "watcher " << i;
    for (size_t j = 1; j < seen[i].size(); ++j) EXPECT_NE(seen[i][j], seen[i][j - 1]) << "watcher " << i;
  }
}

}  // namespace
}  // namespace hsx
