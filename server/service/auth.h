// auth.h: bearer-token authentication of hsx.v1.HiddenStates calls.
//
// With --auth-token-file every GetModelInfo and Extract call must carry the
// metadata "authorization: Bearer <token>". Missing (or not a Bearer
// credential) is UNAUTHENTICATED, a different token PERMISSION_DENIED; both
// with a message saying what was expected. The check runs in our handlers, so
// it works on plaintext and TLS ports alike; grpc.health.v1 and reflection are
// not ours and stay reachable without a token (probes and grpcurl list work).
// Tokens are compared in constant time and never logged.
#ifndef HSX_SERVER_SERVICE_AUTH_H_
#define HSX_SERVER_SERVICE_AUTH_H_

#include <memory>
#include <string>

#include <grpcpp/server_context.h>

#include "absl/status/statusor.h"

namespace hsx {

class TokenAuth {
 public:
  // Reads the token from `path` (surrounding whitespace ignored); an empty
  // file is an error.
  static absl::StatusOr<std::unique_ptr<TokenAuth>> FromFile(const std::string& path);
  explicit TokenAuth(std::string token) : token_(std::move(token)) {}

  // OK, or the status to finish the call with.
  grpc::Status Check(const grpc::CallbackServerContext& context) const;

 private:
  std::string token_;
};

}  // namespace hsx

#endif  // HSX_SERVER_SERVICE_AUTH_H_
