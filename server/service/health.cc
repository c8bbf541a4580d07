// health.cc: the shared health state; the health-only port.
#include "server/service/health.h"

#include <algorithm>

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/service/health_service.h"

namespace hsx {
namespace {

using Response = grpc::health::v1::HealthCheckResponse;

}  // namespace

Health::Status Health::Current() const { return serving_ ? Response::SERVING : Response::NOT_SERVING; }

std::optional<Health::Status> Health::Get(const std::string& service) const {
  if (!service.empty() && service != kServiceName) return std::nullopt;
  std::lock_guard<std::mutex> lock(mutex_);
  return Current();
}

void Health::SetServing(bool serving) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (shut_down_ || serving_ == serving) return;
  serving_ = serving;
  for (Watcher* watcher : watchers_) watcher->OnStatus(Current());
}

void Health::Shutdown() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (shut_down_) return;
  shut_down_ = true;
  const bool changed = serving_;
  serving_ = false;
  if (changed) {
    for (Watcher* watcher : watchers_) watcher->OnStatus(Current());
  }
}

void Health::EndWatches() {
  Shutdown();
  std::lock_guard<std::mutex> lock(mutex_);
  watches_ended_ = true;
  for (Watcher* watcher : watchers_) watcher->OnEnd();
}

void Health::AddWatcher(Watcher* watcher) {
  std::lock_guard<std::mutex> lock(mutex_);
  watchers_.push_back(watcher);
  watcher->OnStatus(Current());
  if (watches_ended_) watcher->OnEnd();
}

void Health::RemoveWatcher(Watcher* watcher) {
  std::lock_guard<std::mutex> lock(mutex_);
  watchers_.erase(std::remove(watchers_.begin(), watchers_.end(), watcher), watchers_.end());
}

std::string WithPort(const std::string& address, int port) {
  const size_t colon = address.rfind(':');
  return absl::StrCat(colon == std::string::npos ? address : address.substr(0, colon), ":", port);
}

absl::StatusOr<HealthOnlyServer> StartHealthOnlyServer(const std::string& address, Health* health,
                                                       std::string* bound) {
  HealthOnlyServer result;
  result.service = std::make_unique<HealthService>(health);
  grpc::ServerBuilder builder;
  builder.RegisterService(result.service.get());
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  int port = 0;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
  result.server = builder.BuildAndStart();
  if (result.server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("--health-listen ", address, ": cannot listen"));
  }
  *bound = WithPort(address, port);
  return result;
}

}  // namespace hsx
