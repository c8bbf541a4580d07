// health.h: grpc.health.v1 status of the server, kept the same on every gRPC
// server of the process (the main port and the optional --health-listen
// port).
//
// Two names are reported: "" (the whole server, for liveness) and
// "hsx.v1.HiddenStates" (readiness). Both are NOT_SERVING from the moment a
// server is attached until SetServing(true) -- i.e. until the model is loaded
// and the start-up self-check passed -- and NOT_SERVING for good after
// Shutdown() (drain). The health service itself is gRPC's default one
// (grpc::EnableDefaultHealthCheckService), so Check and Watch both work.
#ifndef HSX_SERVER_SERVICE_HEALTH_H_
#define HSX_SERVER_SERVICE_HEALTH_H_

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <grpcpp/server.h>

#include "absl/status/statusor.h"

namespace hsx {

inline constexpr char kServiceName[] = "hsx.v1.HiddenStates";

class Health {
 public:
  // Marks `server` NOT_SERVING now and follows later changes.
  void Attach(grpc::Server* server);
  void SetServing(bool serving);
  // NOT_SERVING on every attached server, frozen.
  void Shutdown();

 private:
  std::mutex mutex_;
  std::vector<grpc::Server*> servers_;
  bool serving_ = false;
  bool shut_down_ = false;
};

// A plaintext server on `address` carrying only grpc.health.v1 (no
// reflection, no hsx service). `bound` receives HOST:PORT.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartHealthOnlyServer(const std::string& address, std::string* bound);

// HOST of HOST:PORT with `port` instead.
std::string WithPort(const std::string& address, int port);

}  // namespace hsx

#endif  // HSX_SERVER_SERVICE_HEALTH_H_
