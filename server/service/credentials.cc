// credentials.cc: reading the PEM files into gRPC server credentials.
#include "server/service/credentials.h"

#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/file_util.h"

namespace hsx {
namespace {

absl::StatusOr<std::string> ReadPem(const char* flag, const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) return absl::NotFoundError(absl::StrCat("--", flag, " ", path, ": cannot read"));
  if (text->empty()) return absl::InvalidArgumentError(absl::StrCat("--", flag, " ", path, ": empty"));
  return text;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const ServiceOptions& options) {
  if (!options.tls()) return grpc::InsecureServerCredentials();
  absl::StatusOr<std::string> cert = ReadPem("tls-cert", options.tls_cert);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem("tls-key", options.tls_key);
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({*key, *cert});
  if (!options.tls_client_ca.empty()) {
    absl::StatusOr<std::string> ca = ReadPem("tls-client-ca", options.tls_client_ca);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  } else {
    ssl.client_certificate_request = GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE;
  }
  return grpc::SslServerCredentials(ssl);
}

}  // namespace hsx
