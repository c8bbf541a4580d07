// auth.h: bearer-token authentication of hsx.v1.HiddenStates calls.
//
// With --auth-token-file every GetModelInfo and Extract call must carry the
// metadata "authorization: Bearer <token>". Missing (or not a Bearer
// credential) is UNAUTHENTICATED, a different token PERMISSION_DENIED; both
// with a message saying what was expected. The check runs in our handlers, so
// it works on plaintext and TLS ports alike; grpc.health.v1 and reflection are
// not ours and stay reachable without a token (probes and grpcurl list work).
// Tokens are compared in constant time and never logged.
//
// Failures are limited per client address (auth_limiter.h, kAuthLimits): past
// them a call is refused RESOURCE_EXHAUSTED ("retry in ...") without its token
// being checked (RESOURCE_EXHAUSTED, not UNAUTHENTICATED: clients retry it
// with backoff, so a right token sharing the address gets through later).
// Only a sample of the failures is marked for the log; a background thread
// logs the summary of the rest once each interval ends.
#ifndef HSX_SERVER_SERVICE_AUTH_H_
#define HSX_SERVER_SERVICE_AUTH_H_

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <grpcpp/server_context.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/service/auth_limiter.h"

namespace hsx {

// What hsx-server allows (docs/api.md, "Authentication").
inline constexpr AuthLimits kAuthLimits{};

struct AuthVerdict {
  grpc::Status status;        // OK, or the status to finish the call with
  bool rate_limited = false;  // refused without checking the token
  bool log = false;           // a failure to log in full (the others are summed up later)
};

class TokenAuth {
 public:
  // Reads the token from `path` (surrounding whitespace ignored); an empty
  // file is an error.
  static absl::StatusOr<std::unique_ptr<TokenAuth>> FromFile(const std::string& path);
  explicit TokenAuth(std::string token, const AuthLimits& limits = kAuthLimits);
  ~TokenAuth();
  TokenAuth(const TokenAuth&) = delete;
  TokenAuth& operator=(const TokenAuth&) = delete;

  AuthVerdict Check(const grpc::CallbackServerContext& context);
  // The same for a call from `peer` (a gRPC peer string) with `authorization`
  // metadata (null: none) at `now`.
  AuthVerdict Check(const std::string& peer, const std::string* authorization, absl::Time now);

 private:
  grpc::Status CheckToken(const std::string* authorization) const;
  // Logs the summaries of the sampling intervals ended by `now`.
  void LogSummaries(absl::Time now);
  void SummaryLoop();

  const std::string token_;
  const AuthLimits limits_;
  std::mutex mutex_;
  AuthLimiter limiter_;     // guarded by mutex_
  AuthLogSampler sampler_;  // guarded by mutex_
  bool stopping_ = false;   // guarded by mutex_
  std::condition_variable wake_;
  std::thread summaries_;
};

}  // namespace hsx

#endif  // HSX_SERVER_SERVICE_AUTH_H_
