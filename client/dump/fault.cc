// fault.cc: the classification of failed samples (fault.h).
#include "client/dump/fault.h"

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace hsx {
namespace {

// The payload that marks a status as the environment's fault; it travels with
// the status (copies, absl::Status(code, message) rebuilds do not keep it, so
// the mark is set last, where the run's failure is decided).
constexpr char kEnvironmentPayload[] = "type.hsx/fault.environment";

}  // namespace

Fault FaultOfCode(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kCancelled:           // a signal, or the run stopping
    case absl::StatusCode::kDeadlineExceeded:    // a slow or stalled server
    case absl::StatusCode::kResourceExhausted:   // a busy server, or a full disk
    case absl::StatusCode::kUnavailable:         // no server, a connection lost
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kFailedPrecondition:  // the system is not in a state to serve
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kUnimplemented:       // a server of another version
      return Fault::kEnvironment;
    default:
      return Fault::kSample;
  }
}

absl::Status EnvironmentFault(absl::Status status) {
  if (!status.ok()) status.SetPayload(kEnvironmentPayload, absl::Cord("1"));
  return status;
}

Fault FaultOf(const absl::Status& status) {
  if (status.GetPayload(kEnvironmentPayload).has_value()) return Fault::kEnvironment;
  return FaultOfCode(status.code());
}

absl::Status EnvironmentStop(const absl::Status& error, const std::string& out_dir) {
  // A marked error is the file system's; the others come from the transport.
  const bool local = IsEnvironmentFault(error);
  return EnvironmentFault(absl::Status(
      error.code(),
      absl::StrCat("stopped by the environment, not by a sample (nothing quarantined for it): ", error.message(),
                   "; the samples written so far are journaled in ", out_dir,
                   "; rerun the same command to resume once ",
                   local ? "the file system has room (or the I/O error is gone)"
                         : "the servers answer and have room")));
}

bool IsEnvironmentFault(const absl::Status& status) {
  return !status.ok() && status.GetPayload(kEnvironmentPayload).has_value();
}

}  // namespace hsx
