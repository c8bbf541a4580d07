// includes_client.cc: a file that includes a client header, compiled once as
// a server target (must not compile) and once as a client target (must).
#include "client/dump/input.h"
#include "server/service/service_options.h"

int HsxLayeringProbe() { return static_cast<int>(sizeof(hsx::InputSample)); }
