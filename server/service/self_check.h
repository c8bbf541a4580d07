// self_check.h: the start-up proof that results do not depend on the batch.
//
// Runs one 17-token sample alone, then the same sample between two others
// (5 and 30 tokens) in one ragged batch, capturing every layer and the final
// norm, and requires its states to agree bit for bit, to be finite and not
// all zero. Uses the Engine directly, before the batcher exists (the engine
// has one caller at a time). The server reports SERVING only after it passes;
// a failure is fatal.
#ifndef HSX_SERVER_SERVICE_SELF_CHECK_H_
#define HSX_SERVER_SERVICE_SELF_CHECK_H_

#include <string>

#include "absl/status/statusor.h"
#include "server/runtime/engine.h"

namespace hsx {

// On success, a one-line description of what was checked.
absl::StatusOr<std::string> RunSelfCheck(Engine& engine);

}  // namespace hsx

#endif  // HSX_SERVER_SERVICE_SELF_CHECK_H_
