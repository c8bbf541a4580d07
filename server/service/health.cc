// health.cc: mirroring health status across servers; the health-only port.
#include "server/service/health.h"

#include <algorithm>

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/impl/server_builder_plugin.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace hsx {
namespace {

void Set(grpc::Server* server, bool serving) {
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus("", serving);
  health->SetServingStatus(kServiceName, serving);
}

// Removes the reflection plugin (which linking grpc++_reflection adds to every
// ServerBuilder) from one builder.
class WithoutReflection : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments* /*args*/) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->erase(std::remove_if(plugins->begin(), plugins->end(),
                                  [](const std::unique_ptr<grpc::ServerBuilderPlugin>& plugin) {
                                    return plugin->name() == "proto_server_reflection";
                                  }),
                   plugins->end());
  }
};

}  // namespace

void Health::Attach(grpc::Server* server) {
  std::lock_guard<std::mutex> lock(mutex_);
  servers_.push_back(server);
  if (shut_down_) {
    if (auto* health = server->GetHealthCheckService()) health->Shutdown();
  } else {
    Set(server, serving_);
  }
}

void Health::SetServing(bool serving) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (shut_down_) return;
  serving_ = serving;
  for (grpc::Server* server : servers_) Set(server, serving);
}

void Health::Shutdown() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (shut_down_) return;
  shut_down_ = true;
  serving_ = false;
  for (grpc::Server* server : servers_) {
    Set(server, false);
    if (auto* health = server->GetHealthCheckService()) health->Shutdown();
  }
}

std::string WithPort(const std::string& address, int port) {
  const size_t colon = address.rfind(':');
  return absl::StrCat(colon == std::string::npos ? address : address.substr(0, colon), ":", port);
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartHealthOnlyServer(const std::string& address, std::string* bound) {
  // With no service of its own the builder sets up no callback queue for the
  // default health service; an empty generic service (everything else:
  // UNIMPLEMENTED) makes it. It must outlive the server: it lives forever.
  static auto* const unimplemented = new grpc::CallbackGenericService();
  grpc::ServerBuilder builder;
  builder.SetOption(std::make_unique<WithoutReflection>());
  builder.RegisterCallbackGenericService(unimplemented);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  int port = 0;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("--health-listen ", address, ": cannot listen"));
  }
  *bound = WithPort(address, port);
  return server;
}

}  // namespace hsx
