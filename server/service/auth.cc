// auth.cc: reading the token file and checking the authorization metadata.
#include "server/service/auth.h"

#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/file_util.h"

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

}  // namespace

absl::StatusOr<std::unique_ptr<TokenAuth>> TokenAuth::FromFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) return absl::NotFoundError(absl::StrCat("--auth-token-file ", path, ": cannot read"));
  std::string token(absl::StripAsciiWhitespace(*text));
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat("--auth-token-file ", path, ": empty"));
  return std::make_unique<TokenAuth>(std::move(token));
}

grpc::Status TokenAuth::Check(const grpc::CallbackServerContext& context) const {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return {grpc::StatusCode::UNAUTHENTICATED,
            "missing 'authorization: Bearer <token>' metadata (this server requires a token)"};
  }
  const std::string value(it->second.data(), it->second.size());
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
