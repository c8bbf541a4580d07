// dump_job.cc: the journal check, the in-flight window, verification, writes.
#include "client/dump/dump_job.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/dump/dump_dir.h"
#include "client/dump/fault.h"
#include "client/dump/run_lease.h"

namespace hsx {
namespace {

std::string Where(const InputSample& input) {
  return absl::StrCat("sample ", input.index, " (id ", input.id, ")");
}

std::string IdsText(const std::vector<int>& ids) { return nlohmann::json(ids).dump(); }

std::string TokenHashHex(const InputSample& input) {
  return absl::StrFormat("%016x", TokenIdsHash(input.input_ids));
}

std::string LossMaskHashHex(const InputSample& input) {
  return input.loss_mask ? Int64Xxh64Hex(*input.loss_mask) : std::string();
}

// A name part no other writer uses: 64 random bits, drawn per run. Staging
// names must be unique across processes that share a directory, including two
// pods that are both PID 1 on one volume.
std::string RandomToken() {
  std::random_device random;
  return absl::StrFormat("%08x%08x", random(), random());
}

// Removes the temporaries ("hs_{i}.safetensors.partial.*" and the writer's
// "*.tmp.*") of samples the journal already records as done. Those are
// provably nobody's work in progress: a writer still busy with such a sample
// finds it journaled when it commits and discards its own copy, so deleting
// its staging file loses nothing. Temporaries of samples not yet done are
// left alone: another live process, on this host or another, may own them.
void RemoveStaleTemporaries(const std::string& dir, const std::set<int64_t>& done) {
  std::set<std::string> prefixes;
  for (int64_t index : done) prefixes.insert(SampleFileName(index) + ".");
  std::error_code error;
  for (const std::string& file : ListDumpFiles(dir)) {  // OUT's, and the nested layout's subdirectories'
    const std::string name = std::filesystem::path(file).filename().string();
    const size_t dot = name.find(".safetensors.");
    if (dot == std::string::npos || !prefixes.count(name.substr(0, dot + 13))) continue;
    if (name.find(".partial.") == std::string::npos && name.find(".tmp.") == std::string::npos) continue;
    const std::filesystem::path path = std::filesystem::path(dir) / file;
    std::filesystem::remove(path, error);
  }
}

// A journaled sample's file must still be there with the size the journal
// recorded (a stat: cheap). Otherwise the journal would skip the sample
// forever while its data is gone: say what is wrong, so that it is redone.
std::string DamagedFile(const std::string& dir, const JournalScan::Line& line) {
  const std::string path = (std::filesystem::path(dir) / line.entry.file).string();
  std::error_code error;
  const uintmax_t size = std::filesystem::file_size(path, error);
  if (error) return absl::StrCat(path, " is missing (", error.message(), ")");
  if (static_cast<int64_t>(size) != line.entry.bytes) {
    return absl::StrCat(path, " has ", size, " bytes, the journal says ", line.entry.bytes);
  }
  return "";
}

// Creates a subdirectory of the nested layout if it is missing, durably (its
// parent synced when it was created here).
absl::Status MakeSubdirectory(const std::string& path) {
  std::error_code error;
  if (std::filesystem::create_directory(path, error)) {
    return SyncDirectory(std::filesystem::path(path).parent_path().string());
  }
  if (error) return absl::InternalError(absl::StrCat(path, ": cannot create: ", error.message()));
  return absl::OkStatus();
}

// Every captured layer has exactly `bytes` bytes (of states kept or dropped).
bool LayersWhole(const SampleTensors& sample, int64_t bytes) {
  if (sample.tensors.size() < sample.capture_ids.size()) return false;
  for (size_t l = 0; l < sample.capture_ids.size(); ++l) {
    if (sample.tensors[l].bytes != bytes) return false;
  }
  return true;
}

}  // namespace

absl::Status VerifySample(const InputSample& input, const ExtractSpec& spec,
                          const SampleTensors& sample) {
  const std::string where = Where(input);
  const int64_t layers = static_cast<int64_t>(sample.capture_ids.size());
  const int64_t row_bytes = RowBytes(sample.dtype, sample.hidden);
  const int64_t tokens = static_cast<int64_t>(input.input_ids.size());
  if (sample.dropped && spec.keep_states) {
    return absl::InternalError(absl::StrCat(where, ": the states were dropped on arrival, but are to be kept"));
  }
  if (sample.capture_ids != spec.capture.ids()) {
    return absl::DataLossError(absl::StrCat(where, ": received capture ids ", IdsText(sample.capture_ids),
                                            ", requested ", IdsText(spec.capture.ids())));
  }
  if (sample.dtype != spec.dtype) {
    return absl::DataLossError(absl::StrCat(where, ": received ", OutputDTypeName(sample.dtype),
                                            " states, requested ", OutputDTypeName(spec.dtype)));
  }
  if (sample.tokens != tokens) {
    return absl::DataLossError(absl::StrCat(where, ": ", sample.tokens, " rows of states for ", tokens, " tokens"));
  }
  if (sample.hidden < 1 || !LayersWhole(sample, tokens * row_bytes)) {
    return absl::DataLossError(absl::StrCat(where, ": ", sample.layer_bytes(), " bytes of states for [",
                                            tokens, ", ", layers, ", ", sample.hidden, "] ",
                                            OutputDTypeName(sample.dtype)));
  }
  const int64_t final_norm_bytes = sample.bytes() - sample.layer_bytes();
  if (sample.has_final_norm() != spec.capture.final_norm() ||
      (sample.has_final_norm() && final_norm_bytes != tokens * row_bytes)) {
    return absl::DataLossError(absl::StrCat(where, ": final norm state ",
                                            spec.capture.final_norm() ? "missing or misshapen" : "not requested"));
  }
  // From the tensors' findings (the stream assembler's, made on arrival: the
  // only record when the states were dropped; the encoder's in process), or
  // read here.
  if (absl::Status s = CheckSampleValues(sample); !s.ok()) {
    return absl::DataLossError(absl::StrCat(where, ": ", s.message()));
  }
  return absl::OkStatus();
}

JournalEntry MakeJournalEntry(const InputSample& input, const SampleTensors& sample,
                              const DumpOptions& options, const FileDigest& digest) {
  JournalEntry e;
  e.index = input.index;
  e.id = input.id;
  e.file = SampleRelativePath(input.index, options.layout);
  e.tokens = sample.tokens;
  e.bytes = digest.bytes;
  e.xxh64 = digest.xxh64;
  e.capture_ids = sample.capture_ids;
  e.final_norm = sample.has_final_norm();
  e.dtype = OutputDTypeName(sample.dtype);
  e.model = options.info.model_name;
  e.model_revision = options.info.model_revision;
  e.compute_precision = options.info.compute_precision;
  e.token_ids_xxh64 = TokenHashHex(input);
  e.loss_mask_xxh64 = LossMaskHashHex(input);
  e.input_xxh64 = options.input_xxh64;
  return e;
}

absl::Status CheckJournalEntry(const JournalEntry& e, const std::string& path, int64_t line,
                               const std::vector<InputSample>& samples, const DumpOptions& options) {
  const std::string where = absl::StrCat(path, ":", line, " (sample ", e.index, ")");
  const std::string advice = "; resume with the same settings and input, or use a new --out directory";
  auto differs = [&](absl::string_view what, const std::string& journal, const std::string& now) {
    return absl::FailedPreconditionError(absl::StrCat("cannot resume: ", where, ": the journal records ", what,
                                                      " ", journal, ", this run has ", now, advice));
  };
  if (e.capture_ids != options.capture.ids()) {
    return differs("capture ids", IdsText(e.capture_ids), IdsText(options.capture.ids()));
  }
  if (e.final_norm != options.capture.final_norm()) {
    return differs("final_norm", e.final_norm ? "true" : "false", options.capture.final_norm() ? "true" : "false");
  }
  if (e.dtype != OutputDTypeName(options.dtype)) return differs("dtype", e.dtype, OutputDTypeName(options.dtype));
  if (e.model != options.info.model_name) {
    return differs("model", absl::StrCat("'", e.model, "'"), absl::StrCat("'", options.info.model_name, "'"));
  }
  if (!e.model_revision.empty() && !options.info.model_revision.empty() &&
      e.model_revision != options.info.model_revision) {
    return differs("model revision", e.model_revision, options.info.model_revision);
  }
  if (!e.compute_precision.empty() && !options.info.compute_precision.empty() &&
      e.compute_precision != options.info.compute_precision) {
    return differs("compute precision", e.compute_precision, options.info.compute_precision);
  }
  if (e.index >= static_cast<int64_t>(samples.size())) {
    return absl::FailedPreconditionError(absl::StrCat("cannot resume: ", where, ": the input has only ",
                                                      samples.size(), " samples", advice));
  }
  const InputSample& input = samples[static_cast<size_t>(e.index)];
  if (!IsSamplePath(e.file, e.index)) {
    return absl::FailedPreconditionError(absl::StrCat("cannot resume: ", where, ": file '", e.file,
                                                      "' is not ", SampleRelativePath(e.index, options.layout)));
  }
  if (e.token_ids_xxh64 != TokenHashHex(input) || e.tokens != static_cast<int64_t>(input.input_ids.size())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot resume: ", where, ": token ids differ from line ", input.line, " of the input (journal: ",
        e.tokens, " tokens, xxh64 ", e.token_ids_xxh64, "; input: ", input.input_ids.size(),
        " tokens, xxh64 ", TokenHashHex(input), ")", advice));
  }
  if (e.loss_mask_xxh64 != LossMaskHashHex(input)) {
    return absl::FailedPreconditionError(absl::StrCat("cannot resume: ", where, ": loss_mask differs from line ",
                                                      input.line, " of the input", advice));
  }
  if (e.id != input.id) {
    return absl::FailedPreconditionError(absl::StrCat("cannot resume: ", where, ": id '", e.id,
                                                      "' differs from '", input.id, "' on line ", input.line,
                                                      " of the input", advice));
  }
  return absl::OkStatus();
}

int64_t SampleStateBytes(const InputSample& input, const DumpOptions& options) {
  const int64_t tensors = static_cast<int64_t>(options.capture.ids().size()) + (options.capture.final_norm() ? 1 : 0);
  return static_cast<int64_t>(input.input_ids.size()) * tensors * RowBytes(options.dtype, options.hidden_size);
}

namespace {

// One run of the dump, in named steps: Prepare (the directory, the journal and
// its agreement with this run, what is left to do), Start (progress and the
// writer threads), Submit (every sample, within the in-flight limits), Finish
// (wait for what is in flight, stop the writers). Writer threads Persist each
// sample (verify, stage, rename and journal under the journal's lock) and
// Record the outcome. The first failure or a signal cancels what is in flight.
class DumpRun {
 public:
  DumpRun(const std::vector<InputSample>& samples, Extractor& extractor, const DumpOptions& options,
          DumpStats* stats)
      : samples_(samples), extractor_(extractor), options_(options), stats_(stats),
        spec_{options.capture, options.dtype, /*keep_states=*/!options.discard, options.wire_checksum}, run_token_(RandomToken()) {}

  absl::Status Run() {
    *stats_ = DumpStats();
    if (absl::Status s = Prepare(); !s.ok()) return s;
    Start();
    for (const auto& [sample, why] : invalid_todo_) Fail(*sample, absl::InvalidArgumentError(why));
    Submit();
    Finish();
    stats_->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    stats_->retries = options_.retries ? options_.retries() : 0;
    WriteStatus(failure_.ok() ? "finished" : Interrupted() ? "interrupted" : "failed");
    return failure_;
  }

 private:
  struct Result {
    const InputSample* sample;
    absl::StatusOr<SampleTensors> states;
  };

  absl::Status Prepare() {
    std::error_code error;
    std::filesystem::create_directories(options_.out_dir, error);
    if (error) return absl::InternalError(absl::StrCat(options_.out_dir, ": cannot create: ", error.message()));
    absl::StatusOr<std::unique_ptr<Journal>> opened = Journal::Open(ShardJournalPath(options_.out_dir, options_.shard));
    if (!opened.ok()) return opened.status();
    journal_ = *std::move(opened);
    if (journal_->repaired_torn_bytes() > 0) {
      std::fprintf(stderr, "hsx-dump: %s: removed a torn last line (%llu bytes) left by an interrupted run\n",
                   journal_->path().c_str(), static_cast<unsigned long long>(journal_->repaired_torn_bytes()));
    }
    for (const JournalScan::Line& line : journal_->initial().lines) {
      if (absl::Status s = CheckJournalEntry(line.entry, journal_->path(), line.number, samples_, options_); !s.ok()) {
        return s;
      }
      if (!options_.discard && options_.shard.Contains(line.entry.index)) {
        if (const std::string damage = DamagedFile(options_.out_dir, line); !damage.empty()) {
          std::fprintf(stderr, "hsx-dump: %s, though %s:%lld records sample %lld as done: redoing it\n",
                       damage.c_str(), journal_->path().c_str(), static_cast<long long>(line.number),
                       static_cast<long long>(line.entry.index));
          redo_[line.entry.index] = line.number;
        }
      }
    }
    if (absl::Status s = ReadOtherJournals(); !s.ok()) return s;
    absl::StatusOr<std::map<int64_t, QuarantineEntry>> quarantined = ReadQuarantine(options_.out_dir);
    if (!quarantined.ok()) return quarantined.status();
    std::set<int64_t> done;
    for (const InputSample& sample : samples_) {
      input_tokens_ += static_cast<int64_t>(sample.input_ids.size());
      if (!options_.shard.Contains(sample.index)) continue;
      ++shard_samples_;
      shard_tokens_ += static_cast<int64_t>(sample.input_ids.size());
      if ((journal_->IsJournaled(sample.index) && !redo_.count(sample.index)) || other_done_.count(sample.index)) {
        ++stats_->skipped;
        done.insert(sample.index);
      } else if (quarantined->count(sample.index) && !options_.retry_quarantined) {
        ++stats_->quarantined_before;
      } else if (auto bad = options_.invalid_inputs.find(sample.index); bad != options_.invalid_inputs.end()) {
        invalid_todo_.emplace_back(&sample, bad->second);
      } else {
        todo_.push_back(&sample);
        todo_tokens_ += static_cast<int64_t>(sample.input_ids.size());
      }
    }
    if (!options_.discard) {
      RemoveStaleTemporaries(options_.out_dir, done);
      if (const int removed = RunLease::RemoveAbandoned(options_.out_dir); removed > 0) {
        std::fprintf(stderr, "hsx-dump: %s: removed %d files of an interrupted run on this host (temporaries and its lease)\n",
                     options_.out_dir.c_str(), removed);
      }
      absl::StatusOr<std::unique_ptr<RunLease>> lease = RunLease::Acquire(options_.out_dir, run_token_);
      if (!lease.ok()) return lease.status();
      lease_ = *std::move(lease);
    }
    return absl::OkStatus();
  }

  // The journals of other shards (or of runs with another N, or the shared
  // journal of an older dump), merged as hsx-verify merges them (a sample
  // current in two journals is an error naming both lines): their samples are
  // done, and must agree with this run. A damaged file recorded there is not
  // this run's to redo.
  absl::Status ReadOtherJournals() {
    absl::StatusOr<DumpJournals> journals = ReadDumpJournals(options_.out_dir);
    if (!journals.ok()) return journals.status();
    for (const auto& [index, ref] : journals->current) {
      if (ref.path == journal_->path()) continue;
      JournalScan::Line line{ref.line, ref.entry};
      if (absl::Status s = CheckJournalEntry(line.entry, ref.path, line.number, samples_, options_); !s.ok()) return s;
      if (!options_.shard.Contains(index)) continue;
      other_done_.insert(index);
      if (options_.discard) continue;
      if (const std::string damage = DamagedFile(options_.out_dir, line); !damage.empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            damage, ", though ", ref.path, ":", line.number, " records sample ", index,
            " as done; that journal belongs to another shard layout: rerun with the --shard that wrote it, "
            "or delete its line and the file"));
      }
    }
    return absl::OkStatus();
  }

  void Start() {
    Progress::Options progress_options;
    progress_options.total_samples = static_cast<int64_t>(todo_.size());
    progress_options.total_tokens = todo_tokens_;
    progress_options.mode = options_.progress;
    progress_options.interval_seconds = options_.progress_interval_seconds;
    progress_options.retries = options_.retries;
    if (!options_.discard) {
      progress_options.observer = [this](const ProgressSnapshot& snapshot) {
        {
          std::lock_guard<std::mutex> lock(status_mutex_);
          last_snapshot_ = snapshot;
        }
        WriteStatus("running");
      };
    }
    progress_ = std::make_unique<Progress>(progress_options);
    WriteStatus("running");  // the totals are known from the start
    progress_->Start();
    for (int i = 0; i < std::max(1, options_.writer_threads); ++i) writers_.emplace_back([this] { WriterLoop(); });
  }

  void Submit() {
    for (const InputSample* sample : todo_) {
      const int64_t bytes = SampleStateBytes(*sample, options_);
      {
        std::unique_lock<std::mutex> lock(mutex_);
        const auto full = [&] {
          return in_flight_ >= options_.concurrency ||
                 (options_.max_in_flight_bytes > 0 && in_flight_ > 0 &&
                  in_flight_bytes_ + bytes > options_.max_in_flight_bytes);
        };
        while (full() && failure_.ok() && !Interrupted()) changed_.wait_for(lock, std::chrono::milliseconds(100));
        NoteInterrupt(lock);
        if (!failure_.ok()) break;
        ++in_flight_;
        in_flight_bytes_ += bytes;
      }
      extractor_.Extract(*sample, spec_, [this, sample](absl::StatusOr<SampleTensors> states) {
        std::lock_guard<std::mutex> lock(mutex_);
        ready_.push_back({sample, std::move(states)});
        changed_.notify_all();  // under the lock: Run may return as soon as this is written
      });
    }
  }

  void Finish() {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      while (in_flight_ > 0) {
        changed_.wait_for(lock, std::chrono::milliseconds(100));
        NoteInterrupt(lock);
      }
      closing_ = true;
    }
    changed_.notify_all();
    for (std::thread& thread : writers_) thread.join();
    progress_->Stop();
  }

  void WriterLoop() {
    while (true) {
      Result result{nullptr, absl::CancelledError()};
      {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [&] { return !ready_.empty() || closing_; });
        if (ready_.empty()) return;
        result = std::move(ready_.front());
        ready_.pop_front();
      }
      const InputSample& input = *result.sample;
      absl::Status status = result.states.status();
      int64_t bytes = 0;
      bool written = false;
      if (status.ok()) status = Persist(input, *result.states, &bytes, &written);
      result.states = absl::CancelledError();  // frees the states before waiting for the lock
      Record(input, status, bytes, written);
    }
  }

  // Verifies, writes under a staging name, then renames and journals under
  // the journal's lock. Sets *written = false when another process journaled
  // the sample meanwhile.
  absl::Status Persist(const InputSample& input, const SampleTensors& sample, int64_t* bytes, bool* written) {
    if (absl::Status s = VerifySample(input, spec_, sample); !s.ok()) return s;
    if (options_.discard) {  // a throughput or smoke run: verified, then dropped
      *bytes = sample.bytes();
      *written = true;
      return absl::OkStatus();
    }
    const std::filesystem::path final_fs = std::filesystem::path(options_.out_dir) /
                                           SampleRelativePath(input.index, options_.layout);
    const std::string final_path = final_fs.string();
    const std::string final_dir = final_fs.parent_path().string();
    // From here on the sample is good: what fails is the file system's (fault.h).
    if (final_dir != std::filesystem::path(options_.out_dir).string()) {  // the nested layout
      if (absl::Status s = MakeSubdirectory(final_dir); !s.ok()) return EnvironmentFault(s);
    }
    const std::string staging = absl::StrCat(final_path, ".partial.", run_token_);
    // The file's digest is hashed as it is written: no read-back.
    WrittenDigest written_digest;
    if (absl::Status s = WriteSampleFile(staging, input, sample, options_.info, &written_digest); !s.ok()) {
      return EnvironmentFault(s);
    }
    const FileDigest digest = ToFileDigest(written_digest);
    JournalEntry entry = MakeJournalEntry(input, sample, options_, digest);
    if (auto it = redo_.find(input.index); it != redo_.end()) entry.supersedes = it->second;
    absl::StatusOr<bool> committed = journal_->Commit(
        entry,
        [&]() -> absl::Status {
          if (::rename(staging.c_str(), final_path.c_str()) != 0) {
            return absl::InternalError(absl::StrCat(final_path, ": rename failed: ", std::strerror(errno)));
          }
          return SyncDirectory(final_dir);
        },
        [this](const JournalEntry& e, int64_t line) {
          return CheckJournalEntry(e, journal_->path(), line, samples_, options_);
        });
    if (!committed.ok() || !*committed) ::unlink(staging.c_str());
    if (!committed.ok()) return EnvironmentFault(committed.status());
    *written = *committed;
    *bytes = digest.bytes;
    return absl::OkStatus();
  }

  // Counts one finished sample; a failure is quarantined (Fail).
  void Record(const InputSample& input, const absl::Status& status, int64_t bytes, bool written) {
    bool failed = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (status.ok()) {
        if (written) {
          ++stats_->samples;
          if (redo_.count(input.index)) ++stats_->redone;
          stats_->tokens += static_cast<int64_t>(input.input_ids.size());
          stats_->bytes += bytes;
        } else {
          ++stats_->skipped;
        }
      } else if (!(cancelled_ && absl::IsCancelled(status))) {
        failed = true;
      }
    }
    if (failed) Fail(input, status);  // before the sample leaves the window: Finish waits for it
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --in_flight_;
      in_flight_bytes_ -= SampleStateBytes(input, options_);
    }
    changed_.notify_all();
    if (status.ok() && written) progress_->Add(1, static_cast<int64_t>(input.input_ids.size()), bytes);
  }

  // A sample failed. When it is the sample's fault (fault.h), within
  // --max-failures, it goes to the shard's quarantine file and the run goes
  // on; the failure beyond the limit, a failure of the environment (a full
  // disk, busy or unreachable servers, after the retries: nothing wrong with
  // the sample) or a quarantine that cannot be written fail the run instead
  // and cancel what is in flight; such a sample is not quarantined, so a
  // rerun takes it up. Must be called without mutex_ held.
  void Fail(const InputSample& input, const absl::Status& status) {
    absl::Status error = status.message().find(absl::StrCat("sample ", input.index, " ")) == 0
                             ? status
                             : absl::Status(status.code(), absl::StrCat(Where(input), ": ", status.message()));
    if (IsEnvironmentFault(status)) error = EnvironmentFault(error);  // the new status lost the mark
    // Not counted as a failed sample: the sample may well be good.
    if (FaultOf(status) == Fault::kEnvironment) return Stop(EnvironmentStop(error, options_.out_dir));
    const std::string quarantine = ShardQuarantinePath(options_.out_dir, options_.shard);
    int64_t failed = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      failed = ++stats_->failed;
    }
    progress_->AddFailure();
    if (failed > options_.max_failures) {
      return Stop(options_.max_failures == 0
                      ? error
                      : absl::Status(error.code(), absl::StrCat("more than ", options_.max_failures,
                                                                " samples failed (--max-failures ",
                                                                options_.max_failures, "; the others are in ",
                                                                quarantine, "); the last: ", error.message())));
    }
    if (!options_.discard) {  // --discard keeps no files: the failure is only counted
      const absl::Status kept = AppendQuarantine(
          quarantine, {input.index, input.id, static_cast<int64_t>(input.input_ids.size()),
                       std::string(absl::StatusCodeToString(status.code())), std::string(status.message())});
      if (!kept.ok()) return Stop(EnvironmentStop(EnvironmentFault(kept), options_.out_dir));
      std::lock_guard<std::mutex> lock(mutex_);
      ++stats_->quarantined;
    }
    std::fprintf(stderr, "hsx-dump: %s; %s (%lld of at most %lld)\n", std::string(error.message()).c_str(),
                 options_.discard ? "going on" : absl::StrCat("quarantined in ", quarantine).c_str(),
                 static_cast<long long>(failed), static_cast<long long>(options_.max_failures));
  }

  // Fails the run with `stop` (the first such failure is the run's) and
  // cancels what is in flight. Must be called without mutex_ held.
  void Stop(const absl::Status& stop) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (failure_.ok()) failure_ = stop;
    }
    CancelAll();
  }

  // Writes the shard's status file (dump_dir.h); a failure to write it is
  // reported, not fatal: it is informational.
  void WriteStatus(const std::string& state) {
    if (options_.discard) return;
    std::lock_guard<std::mutex> lock(status_mutex_);
    ShardStatus s;
    s.shard = absl::StrCat(options_.shard.index, "/", options_.shard.count);
    s.state = state;
    s.host = host_;
    s.pid = pid_;
    s.started_unix = started_unix_;
    s.updated_unix = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    s.input_samples = static_cast<int64_t>(samples_.size());
    s.input_tokens = input_tokens_;
    s.shard_samples = shard_samples_;
    s.shard_tokens = shard_tokens_;
    s.written = last_snapshot_.samples;
    s.failed = last_snapshot_.failures;
    s.retries = last_snapshot_.retries;
    if (state == "running") {
      s.tokens_per_s = last_snapshot_.tokens_per_s;
      s.samples_per_s = last_snapshot_.samples_per_s;
    }
    if (absl::Status w = WriteShardStatus(ShardStatusPath(options_.out_dir, options_.shard), s); !w.ok()) {
      std::fprintf(stderr, "hsx-dump: cannot write the status file: %s\n", std::string(w.message()).c_str());
    }
  }

  // Must be called without mutex_ held.
  void CancelAll() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (cancelled_) return;
      cancelled_ = true;
    }
    extractor_.CancelAll();
  }

  bool Interrupted() const { return options_.interrupted != nullptr && options_.interrupted->load(); }

  // With mutex_ held (through `lock`): turns a signal into the run's failure and cancels.
  void NoteInterrupt(std::unique_lock<std::mutex>& lock) {
    if (!Interrupted() || cancelled_) return;
    if (failure_.ok()) {
      failure_ = absl::CancelledError("interrupted by a signal; the samples written are journaled, "
                                      "rerun the same command to resume");
    }
    lock.unlock();
    CancelAll();
    lock.lock();
  }

  const std::vector<InputSample>& samples_;
  Extractor& extractor_;
  const DumpOptions& options_;
  DumpStats* const stats_;
  const ExtractSpec spec_;
  const std::string run_token_;  // this run's staging names
  std::unique_ptr<RunLease> lease_;  // held while this run may leave temporaries
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::unique_ptr<Journal> journal_;
  std::vector<const InputSample*> todo_;
  int64_t todo_tokens_ = 0;
  std::vector<std::pair<const InputSample*, std::string>> invalid_todo_;  // to quarantine at once
  std::set<int64_t> other_done_;  // samples of this shard journaled in other journals
  int64_t input_tokens_ = 0, shard_samples_ = 0, shard_tokens_ = 0;
  const double started_unix_ =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::mutex status_mutex_;  // WriteStatus, last_snapshot_
  const std::string host_ = HostName();  // the status file's
  const int64_t pid_ = ::getpid();
  ProgressSnapshot last_snapshot_;
  std::map<int64_t, int64_t> redo_;  // journaled samples whose file is damaged -> their journal line
  std::unique_ptr<Progress> progress_;
  std::vector<std::thread> writers_;

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Result> ready_;  // extracted, waiting for a writer
  int in_flight_ = 0;
  int64_t in_flight_bytes_ = 0;
  bool closing_ = false;    // no more results will come: writers return when ready_ is empty
  bool cancelled_ = false;  // CancelAll was called
  absl::Status failure_;
};

}  // namespace

absl::Status RunDump(const std::vector<InputSample>& samples, Extractor& extractor,
                     const DumpOptions& options, DumpStats* stats) {
  return DumpRun(samples, extractor, options, stats).Run();
}

absl::StatusOr<DumpStats> RunDump(const std::vector<InputSample>& samples, Extractor& extractor,
                                  const DumpOptions& options) {
  DumpStats stats;
  if (absl::Status s = RunDump(samples, extractor, options, &stats); !s.ok()) return s;
  return stats;
}

std::string FormatDumpSummary(const DumpStats& stats, const std::string& out_dir, bool discarded) {
  const double seconds = std::max(stats.seconds, 1e-9);
  return absl::StrFormat(
      "hsx-dump: %s %d samples%s, skipped %d already done, failed %d%s, %d retries; %d tokens, %d bytes "
      "(%.1f MB) in %.2f s, %.1f tokens/s, %.1f MB/s -> %s",
      discarded ? "verified and discarded" : "wrote", stats.samples,
      stats.redone > 0 ? absl::StrFormat(" (%d redone: journaled, but the file was damaged)", stats.redone) : "",
      stats.skipped, stats.failed,
      stats.quarantined_before > 0
          ? absl::StrFormat(", %d quarantined earlier and skipped (--retry-quarantined takes them up)",
                            stats.quarantined_before)
          : "",
      stats.retries, stats.tokens, stats.bytes, stats.bytes / 1e6,
      stats.seconds, stats.tokens / seconds, stats.bytes / 1e6 / seconds, out_dir);
}

}  // namespace hsx
