// health.h: the grpc.health.v1 status of hsx-server, one state shared by every
// gRPC server of the process (the main port and the optional --health-listen
// port), each of which carries a HealthService (health_service.h) reading it.
//
// Two names are served: "" (the whole server, for liveness) and
// "hsx.v1.HiddenStates" (readiness); any other name is unknown. Both are
// NOT_SERVING from construction -- before any server exists, so there is no
// instant at which a probe can see SERVING early -- until SetServing(true),
// i.e. until the model is loaded and the start-up self-check passed; and
// NOT_SERVING for good after Shutdown() (drain, or a lost device). Watchers (the Watch RPCs)
// hear every change, and are ended by EndWatches() (the server is about to close its
// connections, and gRPC's shutdown waits for every open call).
#ifndef HSX_SERVER_SERVICE_HEALTH_H_
#define HSX_SERVER_SERVICE_HEALTH_H_

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/server.h>

#include "absl/status/statusor.h"
#include "grpc/health/v1/health.pb.h"

namespace hsx {

inline constexpr char kServiceName[] = "hsx.v1.HiddenStates";

class Health {
 public:
  using Status = grpc::health::v1::HealthCheckResponse::ServingStatus;

  // Told of every status change; called with Health's lock held, so it must
  // not call back into Health.
  class Watcher {
   public:
    virtual ~Watcher() = default;
    virtual void OnStatus(Status status) = 0;
    // The Watch must end now (EndWatches); same locking as OnStatus.
    virtual void OnEnd() = 0;
  };

  // The status of `service`; nullopt for a name that is not served.
  std::optional<Status> Get(const std::string& service) const;
  void SetServing(bool serving);
  // NOT_SERVING, frozen: the drain, and a lost device (device_loss.h).
  void Shutdown();
  // Shutdown(), then ends every Watch, present and future: the last step before
  // the servers close their connections.
  void EndWatches();

  // `watcher` hears the current status at once (under the lock, so that no
  // change can slip in between) and every later one until RemoveWatcher; after
  // EndWatches it hears OnEnd at once too.
  void AddWatcher(Watcher* watcher);
  void RemoveWatcher(Watcher* watcher);

 private:
  Status Current() const;

  mutable std::mutex mutex_;
  bool serving_ = false;
  bool shut_down_ = false;
  bool watches_ended_ = false;
  std::vector<Watcher*> watchers_;
};

// A plaintext server on `address` carrying only grpc.health.v1 from `health`
// and reflection (which then describes grpc.health.v1 alone, so that grpcurl
// can call it there too); no hsx service. `bound` receives HOST:PORT. The returned
// service must outlive the server.
struct HealthOnlyServer {
  std::unique_ptr<grpc::Service> service;
  std::unique_ptr<grpc::Server> server;
};
absl::StatusOr<HealthOnlyServer> StartHealthOnlyServer(const std::string& address, Health* health, std::string* bound);

// HOST of HOST:PORT with `port` instead.
std::string WithPort(const std::string& address, int port);

}  // namespace hsx

#endif  // HSX_SERVER_SERVICE_HEALTH_H_
