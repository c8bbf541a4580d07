// fault.h: whose fault a failed sample is, which decides what hsx-dump does
// with it. A sample at fault (the server refused it as invalid, its states
// failed a check) is quarantined, within --max-failures: a rerun would fail it
// the same way. A failure of the environment (a full disk or an I/O error
// while writing, renaming or journaling; servers busy, unreachable or too slow
// after the retries; a refused credential) says nothing about the sample: it
// stops the run with kExitEnvironment and marks no sample, so that a rerun,
// once the cause is gone, takes every sample up again. Quarantining those
// (issue 45) filled quarantine/ with good samples that reruns then skipped.
#ifndef HSX_CLIENT_DUMP_FAULT_H_
#define HSX_CLIENT_DUMP_FAULT_H_

#include <string>

#include "absl/status/status.h"

namespace hsx {

enum class Fault { kSample, kEnvironment };

// hsx-dump's exit status when the environment stopped the run (EX_TEMPFAIL of
// sysexits.h: a temporary failure, retry later); 0, 1 and 3 are taken.
inline constexpr int kExitEnvironment = 75;

// By status code alone, for a failure that comes from the extractor (after its
// retries) or from the checks of the states. Codes that speak of the request
// itself (INVALID_ARGUMENT, OUT_OF_RANGE), of its states (DATA_LOSS) or that do
// not say (INTERNAL, UNKNOWN, ...) are the sample's: at worst a good sample is
// quarantined, within --max-failures. The codes that speak of the servers, the
// network, the clock or the credentials are the environment's.
Fault FaultOfCode(absl::StatusCode code);

// `status` marked as the environment's fault whatever its code: for a failed
// write, fsync, rename or journal append of a sample that had verified (the
// bytes to write were good, the file system refused them).
absl::Status EnvironmentFault(absl::Status status);

// The fault of a failed sample: a marked status is the environment's,
// otherwise FaultOfCode.
Fault FaultOf(const absl::Status& status);

// The run's failure for `error`, the environment's fault of a sample's
// extraction or write: says so, that no sample was marked, what is kept (the
// journaled samples in `out_dir`) and that a rerun of the same command
// resumes; marked as the environment's (IsEnvironmentFault).
absl::Status EnvironmentStop(const absl::Status& error, const std::string& out_dir);

// Whether a run's failure is the environment's (hsx-dump then exits with kExitEnvironment).
bool IsEnvironmentFault(const absl::Status& status);

}  // namespace hsx

#endif  // HSX_CLIENT_DUMP_FAULT_H_
