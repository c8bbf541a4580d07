// auth.cc: reading the token file, checking the authorization metadata, and
// the per-address limit and log sampling of failures around that check.
#include "server/service/auth.h"

#include <fstream>
#include <sstream>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/file_util.h"
#include "server/service/log.h"

namespace hsx {
namespace {

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  unsigned diff = a.size() == b.size() ? 0u : 1u;
  const size_t n = a.size() > b.size() ? a.size() : b.size();
  for (size_t i = 0; i < n; ++i) {
    diff |= static_cast<unsigned char>(i < a.size() ? a[i] : 0) ^ static_cast<unsigned char>(i < b.size() ? b[i] : 0);
  }
  return diff == 0;
}

// How often the summary thread looks for an ended sampling interval.
constexpr absl::Duration kSummaryPoll = absl::Seconds(1);

}  // namespace

absl::StatusOr<std::unique_ptr<TokenAuth>> TokenAuth::FromFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) return absl::NotFoundError(absl::StrCat("--auth-token-file ", path, ": cannot read"));
  std::string token(absl::StripAsciiWhitespace(*text));
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat("--auth-token-file ", path, ": empty"));
  return std::make_unique<TokenAuth>(std::move(token));
}

TokenAuth::TokenAuth(std::string token, const AuthLimits& limits)
    : token_(std::move(token)), limits_(limits), limiter_(limits), sampler_(limits),
      summaries_([this] { SummaryLoop(); }) {}

TokenAuth::~TokenAuth() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  summaries_.join();
}

void TokenAuth::SummaryLoop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    wake_.wait_for(lock, absl::ToChronoMilliseconds(kSummaryPoll));
    lock.unlock();
    LogSummaries(absl::Now());
    lock.lock();
  }
}

void TokenAuth::LogSummaries(absl::Time now) {
  std::vector<std::string> lines;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    lines = sampler_.TakeSummaries(now);
  }
  for (const std::string& line : lines) LogLine(LogLevel::kWarning, line);
}

AuthVerdict TokenAuth::Check(const grpc::CallbackServerContext& context) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  std::string value;
  if (it != metadata.end()) value.assign(it->second.data(), it->second.size());
  return Check(context.peer(), it == metadata.end() ? nullptr : &value, absl::Now());
}

AuthVerdict TokenAuth::Check(const std::string& peer, const std::string* authorization, absl::Time now) {
  const std::string address = PeerAddress(peer);
  AuthVerdict verdict;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (const absl::Duration wait = limiter_.Wait(address, now); wait > absl::ZeroDuration()) {
      verdict.rate_limited = true;
      verdict.log = sampler_.Sample(address, /*rate_limited=*/true, now);
      verdict.status = {grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrFormat("too many failed authentication attempts from %s (%d at once, then one per "
                                        "%s): refused without checking the token; retry in %s",
                                        address, limits_.burst, absl::FormatDuration(limits_.refill),
                                        absl::FormatDuration(absl::Ceil(wait, absl::Milliseconds(10))))};
    }
  }
  if (!verdict.rate_limited) {
    verdict.status = CheckToken(authorization);
    if (verdict.status.ok()) return verdict;
    std::lock_guard<std::mutex> lock(mutex_);
    limiter_.Failed(address, now);
    verdict.log = sampler_.Sample(address, /*rate_limited=*/false, now);
  }
  LogSummaries(now);  // an interval that just ended, before this call's own line
  return verdict;
}

grpc::Status TokenAuth::CheckToken(const std::string* authorization) const {
  if (authorization == nullptr) {
    return {grpc::StatusCode::UNAUTHENTICATED,
            "missing 'authorization: Bearer <token>' metadata (this server requires a token)"};
  }
  const std::string& value = *authorization;
  constexpr char kPrefix[] = "Bearer ";
  if (value.size() < sizeof(kPrefix) - 1 || !absl::EqualsIgnoreCase(value.substr(0, sizeof(kPrefix) - 1), kPrefix)) {
    return {grpc::StatusCode::UNAUTHENTICATED, "authorization metadata is not 'Bearer <token>'"};
  }
  if (!ConstantTimeEquals(std::string(absl::StripAsciiWhitespace(value.substr(sizeof(kPrefix) - 1))), token_)) {
    return {grpc::StatusCode::PERMISSION_DENIED, "bearer token rejected"};
  }
  return grpc::Status::OK;
}

}  // namespace hsx
