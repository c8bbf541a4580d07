// dump_job.h: the part of hsx-dump after the transport, shared by the
// in-process and remote modes: reads every journal of the directory
// (dump_dir.h) to skip what is done, keeps up to `concurrency` samples in
// flight, verifies every sample before writing it atomically, declares it
// done in its shard's journal, reports progress (and writes the shard's
// status file), and quarantines a sample that fails by its own fault (after
// the transport's retries; fault.h): it is recorded in the shard's quarantine
// file and the run goes on, until more than `max_failures` samples failed. A
// failure of the environment (a full disk, servers busy or gone) marks no
// sample and fails the run at once (IsEnvironmentFault). It never leaves a partial
// file or a journaled file that does not verify.
#ifndef HSX_CLIENT_DUMP_DUMP_JOB_H_
#define HSX_CLIENT_DUMP_DUMP_JOB_H_

#include <atomic>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/dump/dump_dir.h"
#include "client/dump/extractor.h"
#include "client/dump/input.h"
#include "client/dump/journal.h"
#include "client/dump/progress.h"
#include "client/dump/shard.h"
#include "format/sample_file.h"

namespace hsx {

struct DumpOptions {
  std::string out_dir;
  CaptureSpec capture;
  OutputDType dtype = OutputDType::kBf16;
  int concurrency = 64;
  // Bytes of states in flight at once (0: no limit beyond `concurrency`); a
  // sample larger than the budget alone still runs, by itself.
  int64_t max_in_flight_bytes = 0;
  int64_t hidden_size = 0;  // to size samples for max_in_flight_bytes
  int writer_threads = 2;  // threads that verify, write and journal
  ShardSpec shard;
  SampleFileInfo info;
  std::string input_xxh64;  // of the whole input file, recorded in the journal
  ProgressMode progress = ProgressMode::kAuto;
  double progress_interval_seconds = 10.0;
  // When it becomes true (a signal), nothing new starts, what is in flight is
  // cancelled, and RunDump returns Cancelled once the journal is consistent.
  const std::atomic<bool>* interrupted = nullptr;
  // Verify every sample, then drop it: no files, no journal (--discard).
  // The extractor is asked not to keep the states (ExtractSpec::keep_states),
  // so a remote sample is verified as it arrives and never assembled.
  bool discard = false;
  // --server: the checksum each stream's Trailer carries (--wire-checksum).
  ChecksumKind wire_checksum = ChecksumKind::kXxh64;
  // Samples that may fail by their own fault (each is quarantined) before the
  // run stops; the run fails when more than this many fail. 0: the first
  // failure stops it. The environment's failures are never counted here.
  int64_t max_failures = 0;
  // Take up the samples quarantined by earlier runs again (by default they
  // are skipped, and the run ends with them still quarantined).
  bool retry_quarantined = false;
  // Input samples known to be unusable (index -> why, e.g. a token id outside
  // the vocabulary): quarantined without being extracted.
  std::map<int64_t, std::string> invalid_inputs;
  // Where sample files go (--layout; dump_dir.h).
  SampleLayout layout = SampleLayout::kFlat;
  // The transport's retries so far (for progress and status; none: 0).
  std::function<int64_t()> retries;
};

struct DumpStats {
  int64_t samples = 0;  // written (and journaled) by this run
  int64_t redone = 0;   // of those, journaled before but found damaged (missing, other size)
  int64_t skipped = 0;  // already journaled (by an earlier run or another shard)
  int64_t failed = 0;       // samples that failed in this run
  int64_t quarantined = 0;  // of those, quarantined (the run went on)
  int64_t quarantined_before = 0;  // skipped: quarantined by an earlier run (no --retry-quarantined)
  int64_t retries = 0;      // of the transport, in this run
  int64_t tokens = 0;   // of the samples written
  int64_t bytes = 0;    // of the files written
  double seconds = 0.0;
};

// Checks what a consumer relies on, on the bytes that will be written: shape
// [len(input_ids), L, H] with the requested capture ids, dtype and final norm,
// finite values, no all-zero layer. A sample delivered without its states
// (spec.keep_states false) is judged from the receiver's record of them: the
// byte counts that arrived and the value checks made on arrival.
absl::Status VerifySample(const InputSample& input, const ExtractSpec& spec,
                          const SampleTensors& sample);

// The journal entry of a verified sample whose file has `digest`.
JournalEntry MakeJournalEntry(const InputSample& input, const SampleTensors& sample,
                              const DumpOptions& options, const FileDigest& digest);

// Whether line `line` of journal `path` agrees with this run (settings, and
// the input's sample at that index); the error says what differs.
absl::Status CheckJournalEntry(const JournalEntry& entry, const std::string& path, int64_t line,
                               const std::vector<InputSample>& samples, const DumpOptions& options);

// Bytes of one sample's states in the output dtype.
int64_t SampleStateBytes(const InputSample& input, const DumpOptions& options);

// Runs the dump; `stats` is filled in whether or not it succeeds.
absl::Status RunDump(const std::vector<InputSample>& samples, Extractor& extractor,
                     const DumpOptions& options, DumpStats* stats);
absl::StatusOr<DumpStats> RunDump(const std::vector<InputSample>& samples, Extractor& extractor,
                                  const DumpOptions& options);

// The one-line summary hsx-dump prints on stdout.
std::string FormatDumpSummary(const DumpStats& stats, const std::string& out_dir, bool discarded = false);

}  // namespace hsx

#endif  // HSX_CLIENT_DUMP_DUMP_JOB_H_
