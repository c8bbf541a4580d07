// credentials.h: the transport security of the gRPC port.
//
// No --tls-cert: plaintext (InsecureServerCredentials). --tls-cert/--tls-key:
// TLS. --tls-client-ca in addition: mutual TLS; a client must present a
// certificate that chains to that CA or the handshake fails (the client sees
// UNAVAILABLE, no RPC reaches a handler). Files are read once at start-up;
// a missing or empty file is an error naming the flag.
#ifndef HSX_SERVER_SERVICE_CREDENTIALS_H_
#define HSX_SERVER_SERVICE_CREDENTIALS_H_

#include <memory>

#include <grpcpp/security/server_credentials.h>

#include "absl/status/statusor.h"
#include "server/service/service_options.h"

namespace hsx {

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const ServiceOptions& options);

}  // namespace hsx

#endif  // HSX_SERVER_SERVICE_CREDENTIALS_H_
