// dump_status.h: hsx-dump status, one view of a dump's progress over all its
// shards (dump_dir.h): what is done comes from the journals (the truth), what
// failed from the quarantine files, the input's size, the retries and the
// rates from the shards' status files.
#ifndef HSX_CLIENT_DUMP_DUMP_STATUS_H_
#define HSX_CLIENT_DUMP_DUMP_STATUS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/dump/dump_dir.h"

namespace hsx {

// A status file not rewritten for this long belongs to a run that is gone
// (killed) even if it says "running"; its rate no longer counts.
inline constexpr double kStaleStatusSeconds = 120.0;

struct DumpStatusReport {
  std::string dir;
  int64_t total_samples = 0;  // of the input (0: unknown, no status file)
  int64_t total_tokens = 0;
  int64_t done_samples = 0;   // journaled, over all journals
  int64_t done_tokens = 0;
  int64_t quarantined = 0;    // quarantined and not journaled since
  int64_t quarantined_tokens = 0;
  int64_t retries = 0;        // over the shards' latest runs
  int64_t running = 0;        // shards whose run is alive (updated recently)
  double tokens_per_s = 0;    // summed over running shards (smoothed)
  double samples_per_s = 0;
  double eta_s = -1;          // -1: unknown
  std::vector<ShardStatus> shards;
  std::vector<std::string> stale;  // "I/N" of runs that say running but stopped updating
};

// Reads DIR's journals, quarantine and status files; `now_unix` judges staleness.
absl::StatusOr<DumpStatusReport> ReadDumpStatus(const std::string& dir, double now_unix);
std::string DumpStatusText(const DumpStatusReport& report);
std::string DumpStatusJson(const DumpStatusReport& report);

}  // namespace hsx

#endif  // HSX_CLIENT_DUMP_DUMP_STATUS_H_
