// health_service.h: grpc.health.v1.Health (Check and Watch) on the callback
// API, answering from a Health state (health.h).
//
// hsx registers this instead of gRPC's default health service because the
// default one carries no protobuf descriptor: server reflection lists it but
// cannot describe it, so grpcurl refuses to call it. This one is compiled from
// grpc-proto's health.proto, so reflection serves its descriptor.
//
// Check: the status of "" or "hsx.v1.HiddenStates"; NOT_FOUND for any other
// name (as the health protocol says). Watch: the current status at once, then
// every change, until the client cancels or the server shuts down; an unknown
// name gets SERVICE_UNKNOWN and the stream stays open.
#ifndef HSX_SERVER_SERVICE_HEALTH_SERVICE_H_
#define HSX_SERVER_SERVICE_HEALTH_SERVICE_H_

#include "grpc/health/v1/health.grpc.pb.h"
#include "server/service/health.h"

namespace hsx {

class HealthService final : public grpc::health::v1::Health::CallbackService {
 public:
  // `health` must outlive the service.
  explicit HealthService(Health* health) : health_(health) {}

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* context,
                                  const grpc::health::v1::HealthCheckRequest* request,
                                  grpc::health::v1::HealthCheckResponse* response) override;
  grpc::ServerWriteReactor<grpc::health::v1::HealthCheckResponse>* Watch(
      grpc::CallbackServerContext* context, const grpc::health::v1::HealthCheckRequest* request) override;

 private:
  Health* const health_;
};

}  // namespace hsx

#endif  // HSX_SERVER_SERVICE_HEALTH_SERVICE_H_
