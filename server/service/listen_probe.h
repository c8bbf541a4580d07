// listen_probe.h: why an address cannot be listened on, in words.
//
// gRPC's BuildAndStart only says that it failed. Before it runs, the server
// resolves the address and binds a throwaway socket to it, so that the error
// names the real cause: a host that does not resolve, an address that is not
// this machine's, a port in use or reserved.
#ifndef HSX_SERVER_SERVICE_LISTEN_PROBE_H_
#define HSX_SERVER_SERVICE_LISTEN_PROBE_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace hsx {

// OK when `address` (HOST:PORT, validated by ValidateListenAddress; unix:
// addresses are not probed) could be bound now; else the cause, naming `flag`.
absl::Status ProbeListenAddress(absl::string_view flag, absl::string_view address);

}  // namespace hsx

#endif  // HSX_SERVER_SERVICE_LISTEN_PROBE_H_
