// dump_dir.h: the bookkeeping files of an hsx-dump output directory, and the
// one view of a dump that all its journals give (docs/formats.md, "Output
// directory").
//
//   manifest.jsonl                 the journal of an unsharded run (--shard 0/1),
//                                  and the shared journal of dumps made before
//                                  per-shard journals
//   journal/shard-I-of-N.jsonl     the journal of shard I of N (N > 1): one writer
//                                  per file, so shards on different hosts need no
//                                  shared lock
//   quarantine/shard-I-of-N.jsonl  samples of that shard that failed (after
//                                  retries): {"index", "id", "tokens", "code", "reason"}
//   status/shard-I-of-N.json       that shard's latest run: totals, counters and
//                                  rate, rewritten atomically every progress interval
//
// A sample is complete if and only if exactly one journal has a current entry
// for it; the same sample in two journals (two runs with different N at once,
// or files merged by hand) is an error that names both lines.
#ifndef HSX_CLIENT_DUMP_DUMP_DIR_H_
#define HSX_CLIENT_DUMP_DUMP_DIR_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/dump/journal.h"
#include "client/dump/shard.h"

namespace hsx {

// Where sample files go (--layout). kFlat: OUT/hs_{i}.safetensors, the
// layout speculators reads (one directory). kNested: OUT/{i / 1000, 5
// digits}/hs_{i}.safetensors, at most 1000 files per directory, for readers
// that go through the journals (hsx.journal, the converters, hsx-verify).
enum class SampleLayout { kFlat, kNested };
inline constexpr int64_t kSamplesPerSubdirectory = 1000;
absl::StatusOr<SampleLayout> ParseSampleLayout(const std::string& name);
// The sample's file, relative to OUT ("hs_12345.safetensors" or
// "00012/hs_12345.safetensors").
std::string SampleRelativePath(int64_t index, SampleLayout layout);
// Whether `file` (a journal's "file") is sample `index`'s, in either layout.
bool IsSamplePath(const std::string& file, int64_t index);
// Whether `name` is a directory of the nested layout (digits only).
bool IsSampleSubdirectory(const std::string& name);
// The regular files of `dir` and of its nested layout's subdirectories,
// relative to `dir` ("hs_1.safetensors", "00000/hs_1.safetensors"), sorted;
// what cannot be read is left out.
std::vector<std::string> ListDumpFiles(const std::string& dir);
// This machine's name as status and lease files record it ("" where it has none).
std::string HostName();

inline constexpr char kJournalDirName[] = "journal";
inline constexpr char kQuarantineDirName[] = "quarantine";
inline constexpr char kStatusDirName[] = "status";

// "shard-I-of-N".
std::string ShardStem(const ShardSpec& shard);
// Where shard `shard` journals: DIR/manifest.jsonl for 0/1, else
// DIR/journal/shard-I-of-N.jsonl.
std::string ShardJournalPath(const std::string& dir, const ShardSpec& shard);
std::string ShardQuarantinePath(const std::string& dir, const ShardSpec& shard);
std::string ShardStatusPath(const std::string& dir, const ShardSpec& shard);

// The journals present: DIR/manifest.jsonl first (if any), then
// DIR/journal/*.jsonl in name order.
std::vector<std::string> ListJournals(const std::string& dir);

// Every journal of a directory, merged.
struct DumpJournals {
  struct Ref {
    std::string path;  // the journal
    int64_t line = 0;
    JournalEntry entry;
  };
  std::map<int64_t, Ref> current;  // index -> its current entry
  std::vector<std::string> paths;  // the journals read
  uint64_t torn_bytes = 0;         // unterminated last lines, over all journals
};
// Reads and merges every journal (none: an empty result). A corrupt line, or a
// sample current in two journals, is DataLoss naming the lines.
absl::StatusOr<DumpJournals> ReadDumpJournals(const std::string& dir);

// One quarantined sample (a line of a quarantine file).
struct QuarantineEntry {
  int64_t index = -1;
  std::string id;
  int64_t tokens = 0;
  std::string code;    // the status code's name (e.g. INVALID_ARGUMENT)
  std::string reason;  // the error message
};
std::string QuarantineLine(const QuarantineEntry& entry);
// Every quarantine file of DIR; for a sample quarantined more than once the
// latest line (in file order) wins. A torn last line is ignored; any other bad
// line is DataLoss naming it.
absl::StatusOr<std::map<int64_t, QuarantineEntry>> ReadQuarantine(const std::string& dir);
// Appends one line to `path` and fsyncs (creating the file and its directory).
absl::Status AppendQuarantine(const std::string& path, const QuarantineEntry& entry);

// What status/shard-I-of-N.json holds.
struct ShardStatus {
  std::string shard;  // "I/N"
  std::string state;  // running, finished, failed, interrupted
  std::string host;
  int64_t pid = 0;
  double started_unix = 0;
  double updated_unix = 0;
  int64_t input_samples = 0;  // the whole input
  int64_t input_tokens = 0;
  int64_t shard_samples = 0;  // of this shard
  int64_t shard_tokens = 0;
  int64_t written = 0;      // samples this run wrote
  int64_t failed = 0;       // samples this run quarantined
  int64_t retries = 0;      // attempts this run retried
  double tokens_per_s = 0;  // smoothed (progress.h)
  double samples_per_s = 0;
};
std::string ShardStatusJson(const ShardStatus& status);
// Writes `path` atomically (beside, then rename).
absl::Status WriteShardStatus(const std::string& path, const ShardStatus& status);
// Every DIR/status/*.json; an unreadable one is an error naming it.
absl::StatusOr<std::vector<ShardStatus>> ReadShardStatuses(const std::string& dir);

}  // namespace hsx

#endif  // HSX_CLIENT_DUMP_DUMP_DIR_H_
