// hsx-verify: re-checks an hsx-dump output directory from scratch.
//
//   every journal (manifest.jsonl, journal/shard-I-of-N.jsonl) parses, and no
//   sample is in two; a torn last line is reported;
//   every journaled file exists, has the journaled size and XXH64;
//   its safetensors header is valid, hidden_states is [T, L, H] in the
//   journaled dtype with the journaled capture ids, token_ids [T] int64,
//   loss_mask [T] int64 (0/1) when journaled, final_norm_hidden_states [T, H]
//   when journaled, for fp8 their float32 scales (hidden_states_scales
//   [T, L, 1], final_norm_hidden_states_scales [T, 1]), nothing else; the
//   metadata agrees with the journal and its per-tensor checksums with the
//   data; values are finite (fp8: every scale finite and positive), no layer
//   all zeros;
//   with --input: token_ids, loss_mask and the id equal the input line's, and
//   every input sample (of --shard) is journaled;
//   files on disk that the journal does not list are incomplete: a warning
//   (an error with --strict);
//   with --for TRAINER: what that trainer assumes of its input (see
//   TrainerProblems and docs/trainers.md).
// Exit status 0 when all is well, 1 with the list of problems otherwise.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/cli.h"
#include "client/dump/dump_dir.h"
#include "client/dump/input.h"
#include "client/dump/journal.h"
#include "client/dump/shard.h"
#include "format/sample_file.h"
#include "format/sample_file_checker.h"

ABSL_FLAG(std::string, input, "", "The JSONL input of the dump: token_ids, loss_mask and ids must "
          "equal its lines, and every sample must be journaled.");
ABSL_FLAG(std::string, shard, "0/1", "With --input: only samples whose index % N == I are expected.");
ABSL_FLAG(bool, strict, false, "Warnings (files not in the journal, a torn journal line, "
          "duplicate journal lines) are failures too.");
ABSL_FLAG(int, threads, 0, "Files checked in parallel (0: the number of cores).");
ABSL_FLAG(std::string, for, "", "Also check what a trainer assumes of this dump: speculators (capture ids end "
          "in N, samples 0..n-1 without gaps, as hs_{i} is matched to row i of its prepared dataset), "
          "specforge (--final-norm, 3 auxiliary layers below N) or modelopt (the final norm or N, "
          "auxiliary layers below N); warns about tensors stored that the trainer does not read (--capture "
          "speculators|specforge|modelopt stores exactly what each reads). See docs/trainers.md.");

namespace {

using hsx::JournalEntry;

struct Problem {
  std::string where;
  std::string what;
  bool error = true;
};

// One trainer's rules for one journal entry of a dump of a model with `n`
// layers; `report(what, error)` records a finding (once per dump).
void TrainerRules(const std::string& trainer, int n, const JournalEntry& e,
                  const std::function<void(const std::string&, bool)>& report) {
  // Each trainer's preset (format/capture_spec.h) is exactly what it reads.
  const std::string ids_hint =
      trainer == "speculators"
          ? absl::StrCat("dump with --capture speculators (2, N/2, N-3, N; N = ", n, ")")
          : absl::StrCat("dump with --capture ", trainer, " (2, N/2, N-3 and the final norm; N = ", n, ")");
  const std::string unread = absl::StrCat(" is stored but ", trainer, " does not read it (--capture ", trainer,
                                          " stores exactly what it reads)");
  const int64_t aux = std::count_if(e.capture_ids.begin(), e.capture_ids.end(), [&](int id) { return id < n; });
  const bool has_n = !e.capture_ids.empty() && e.capture_ids.back() == n;
  const std::string ids = nlohmann::json(e.capture_ids).dump();
  if (trainer == "speculators") {
    if (!has_n) {
      report(absl::StrCat("capture ids ", ids, " do not end in N = ", n,
                          ": speculators takes the last captured layer as the verifier's last layer and "
                          "would misread this dump silently; ", ids_hint), true);
    }
    if (aux < 1) report(absl::StrCat("capture ids ", ids, " have no auxiliary layer below N; ", ids_hint), true);
    if (e.final_norm) report(absl::StrCat("final_norm_hidden_states", unread), false);
  } else if (trainer == "specforge") {
    if (!e.final_norm) {
      report("no final_norm_hidden_states: SpecForge trains against the post-norm state (hidden_state); "
             "dump with --final-norm", true);
    }
    if (aux != 3) {
      report(absl::StrCat("capture ids ", ids, " have ", aux, " auxiliary layers below N = ", n,
                          "; SpecForge's EAGLE-3 draft reads exactly 3 (aux_hidden_state [T, 3H]); ", ids_hint), true);
    }
    if (has_n && e.final_norm) report(absl::StrCat("capture id N = ", n, unread), false);
    if (e.loss_mask_xxh64.empty()) {
      report("no loss_mask: SpecForge reads loss_mask from each file and hsx.convert writes all ones "
             "(every token trained); put the prepared dataset's loss_mask in the input", false);
    }
  } else if (trainer == "modelopt") {
    if (!e.final_norm && !has_n) {
      report(absl::StrCat("neither the final norm nor capture id N = ", n,
                          ": ModelOpt needs the base model's last hidden state; ", ids_hint), true);
    }
    if (aux < 1) report(absl::StrCat("capture ids ", ids, " have no auxiliary layer below N; ", ids_hint), true);
    if (has_n && e.final_norm) report(absl::StrCat("capture id N = ", n, unread), false);
    if (!e.loss_mask_xxh64.empty()) {
      report("ModelOpt ignores loss_mask unless answer_only_loss is on (then it uses the file's)", false);
    }
  }
}

// What `trainer` assumes of a dump with these journal entries (by index) that
// the general checks do not cover. `have_input`: --input was given (then gaps
// are already reported as input samples not journaled).
std::vector<Problem> TrainerProblems(const std::string& trainer, const std::string& dir,
                                     const std::map<int64_t, const hsx::JournalScan::Line*>& entries,
                                     bool have_input) {
  std::vector<Problem> problems;
  if (entries.empty()) {
    problems.push_back({dir, absl::StrCat("--for ", trainer, ": no journaled samples")});
    return problems;
  }
  const JournalEntry& first = entries.begin()->second->entry;
  absl::StatusOr<int> n = hsx::SampleFileNumLayers((std::filesystem::path(dir) / first.file).string());
  if (!n.ok()) {
    problems.push_back({(std::filesystem::path(dir) / first.file).string(), std::string(n.status().message())});
    return problems;
  }
  // Settings are the same for every sample (hsx-dump refuses to mix them); a
  // problem is reported once, for the first sample that has it.
  std::set<std::string> reported;
  for (const auto& [index, line] : entries) {
    const JournalEntry& e = line->entry;
    auto report = [&](const std::string& what, bool error) {
      if (reported.insert(what).second) {
        problems.push_back({(std::filesystem::path(dir) / e.file).string(), absl::StrCat("--for ", trainer, ": ", what),
                            error});
      }
    };
    if (trainer == "speculators" && e.file != hsx::SampleFileName(index)) {
      report("sample files are in subdirectories (hsx-dump --layout nested): speculators reads "
             "hs_{i}.safetensors from one directory; dump with --layout flat", true);
    }
    TrainerRules(trainer, *n, e, report);
  }
  // speculators pairs hs_{i} with row i of its prepared dataset.
  if (trainer == "speculators" && !have_input) {
    const int64_t count = static_cast<int64_t>(entries.size());
    const int64_t last = entries.rbegin()->first;
    if (last != count - 1) {
      problems.push_back({dir, absl::StrCat("--for speculators: samples 0..", last, " are not all journaled (",
                                            count, " of ", last + 1,
                                            "); speculators pairs hs_{i} with row i of its prepared dataset")});
    }
  }
  return problems;
}

using JournalIndex = std::map<int64_t, const hsx::JournalScan::Line*>;

// The journal's lines; a missing or unreadable journal is a problem and an
// empty scan, a torn last line a warning.
hsx::JournalScan ScanJournal(const std::string& journal_path, std::vector<Problem>* problems) {
  absl::StatusOr<hsx::JournalScan> scan = hsx::ReadJournal(journal_path);
  if (!scan.ok()) {
    problems->push_back({journal_path, absl::IsNotFound(scan.status())
                                           ? "missing: not an hsx-dump output directory, or nothing was completed"
                                           : std::string(scan.status().message())});
    return hsx::JournalScan();
  }
  if (scan->torn_bytes > 0) {
    problems->push_back({journal_path,
                         absl::StrCat("a torn last line (", scan->torn_bytes,
                                      " bytes, an interrupted append): that sample is not complete; the next "
                                      "hsx-dump run removes the line and redoes it"),
                         false});
  }
  return *std::move(scan);
}

// Adds one journal's entries to `entries` (one per index, over all journals;
// `journal_of` remembers which journal each came from: a pointer, as the
// line's number is in the entry); duplicates are harmless only when identical.
// `input_samples`: the number of --input samples (0: no --input).
void IndexJournal(const hsx::JournalScan& scan, const std::string& journal_path, size_t input_samples,
                  JournalIndex* index, std::map<int64_t, const std::string*>* journal_of,
                  std::vector<Problem>* problems) {
  JournalIndex& entries = *index;
  for (const hsx::JournalScan::Line& line : scan.lines) {
    const JournalEntry& e = line.entry;
    const std::string where = absl::StrCat(journal_path, ":", line.number);
    if (!hsx::IsSamplePath(e.file, e.index)) {
      problems->push_back({where, absl::StrCat("file '", e.file, "' is not ", hsx::SampleFileName(e.index), " or ",
                                               hsx::SampleRelativePath(e.index, hsx::SampleLayout::kNested))});
      continue;
    }
    auto [it, inserted] = entries.emplace(e.index, &line);
    if (inserted) {
      (*journal_of)[e.index] = &journal_path;
    } else {
      const bool same = it->second->entry == e;
      problems->push_back({where,
                           absl::StrCat("sample ", e.index, " is journaled again (first at ", *(*journal_of)[e.index],
                                        ":", it->second->number, same ? ", identical)" : ", with different contents)"),
                           !same});
    }
    if (input_samples > 0 && e.index >= static_cast<int64_t>(input_samples)) {
      problems->push_back({where, absl::StrCat("sample ", e.index, " is beyond the input's ", input_samples,
                                               " samples")});
    }
  }
}

struct Totals {
  int64_t tokens = 0;
  int64_t bytes = 0;
};

// Every journaled file, in parallel on --threads threads.
Totals CheckFiles(const std::filesystem::path& root, const JournalIndex& entries,
                  const std::vector<hsx::InputSample>& samples, std::vector<Problem>* problems) {
  std::vector<const hsx::JournalScan::Line*> todo;
  for (const auto& [index, line] : entries) todo.push_back(line);
  std::vector<std::vector<std::string>> results(todo.size());
  std::atomic<size_t> next{0};
  int threads = absl::GetFlag(FLAGS_threads);
  if (threads < 1) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads = std::min<int>(threads, static_cast<int>(std::max<size_t>(1, todo.size())));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (size_t i; (i = next.fetch_add(1)) < todo.size();) {
        const JournalEntry& e = todo[i]->entry;
        const hsx::InputSample* input =
            e.index < static_cast<int64_t>(samples.size()) ? &samples[static_cast<size_t>(e.index)] : nullptr;
        results[i] = hsx::CheckSampleFile((root / e.file).string(), e, input);
      }
    });
  }
  for (std::thread& t : pool) t.join();
  Totals totals;
  for (size_t i = 0; i < todo.size(); ++i) {
    const JournalEntry& e = todo[i]->entry;
    for (const std::string& what : results[i]) problems->push_back({(root / e.file).string(), what});
    totals.tokens += e.tokens;
    totals.bytes += e.bytes;
  }
  return totals;
}

// Input samples (of the shard) that are not journaled.
void CheckAllJournaled(const std::string& dir, const std::vector<hsx::InputSample>& samples,
                       const hsx::ShardSpec& shard, const JournalIndex& entries, std::vector<Problem>* problems) {
  std::vector<int64_t> missing;
  int64_t expected = 0;
  for (const hsx::InputSample& s : samples) {
    if (!shard.Contains(s.index)) continue;
    ++expected;
    if (!entries.count(s.index)) missing.push_back(s.index);
  }
  if (missing.empty()) return;
  const size_t shown = std::min<size_t>(missing.size(), 20);
  absl::StatusOr<std::map<int64_t, hsx::QuarantineEntry>> quarantine = hsx::ReadQuarantine(dir);
  const int64_t quarantined = !quarantine.ok() ? 0 : std::count_if(missing.begin(), missing.end(), [&](int64_t i) {
    return quarantine->count(i) > 0;
  });
  problems->push_back({dir, absl::StrCat(missing.size(), " of ", expected, " input samples are not journaled: ",
                                         absl::StrJoin(missing.begin(), missing.begin() + shown, ", "),
                                         missing.size() > shown ? ", ..." : "",
                                         quarantined > 0 ? absl::StrCat(" (", quarantined, " of them quarantined: "
                                                                        "see quarantine/)")
                                                         : "")});
}

// What a file the journal does not list is, by its name.
const char* StrayFileKind(const std::string& name) {
  const bool temporary = absl::StrContains(name, ".tmp.") || absl::StrContains(name, ".partial.");
  int64_t index = -1;
  const bool sample_file = absl::StartsWith(name, "hs_") && absl::EndsWith(name, ".safetensors") &&
                           absl::SimpleAtoi(name.substr(3, name.size() - 3 - 12), &index);
  const bool lease = absl::StartsWith(name, ".hsx-run.");
  return lease ? "the lease of a running hsx-dump, or of one killed on this host: the next hsx-dump run "
                 "removes it and that run's temporaries"
         : temporary ? "a temporary of an interrupted (or still running) write, not in the journal; hsx-dump "
                     "removes it once the journal records that sample as done"
         : sample_file ? "not in the journal: a sample file written but never declared done (a crash between "
                         "rename and journal line); hsx-dump writes it again on the next run"
                       : "not written by hsx-dump (not in the journal); --strict refuses any file the journal "
                         "does not list";
}

// Files the journal does not list: warnings.
void CheckStrayFiles(const std::filesystem::path& root, const JournalIndex& entries, std::vector<Problem>* problems) {
  std::set<std::string> journaled;
  for (const auto& [index, line] : entries) journaled.insert(line->entry.file);
  std::vector<std::string> strays;
  // Relative to root, the nested layout's subdirectories' files included.
  const std::vector<std::string> names = hsx::ListDumpFiles(root.string());
  for (const std::string& name : names) {
    if (name == hsx::kJournalFileName || journaled.count(name)) continue;
    strays.push_back(name);
  }
  std::sort(strays.begin(), strays.end());
  for (const std::string& name : strays) problems->push_back({(root / name).string(), StrayFileKind(std::filesystem::path(name).filename().string()), false});
}

// Prints the problems and the summary line; an error unless all were warnings
// (and not --strict).
absl::Status Report(const std::string& dir, const std::vector<Problem>& problems, size_t samples, Totals totals,
                    const std::string& trainer) {
  int64_t errors = 0;
  int64_t warnings = 0;
  const bool strict = absl::GetFlag(FLAGS_strict);
  for (const Problem& p : problems) {
    const bool fails = p.error || strict;
    (fails ? errors : warnings)++;
    std::printf("%s: %s: %s\n", p.where.c_str(), fails ? "error" : "warning", p.what.c_str());
  }
  std::printf("hsx-verify: %s: %zu journaled samples (%lld tokens, %lld bytes) checked%s; %lld errors, %lld warnings\n",
              dir.c_str(), samples, static_cast<long long>(totals.tokens), static_cast<long long>(totals.bytes),
              trainer.empty() ? "" : absl::StrCat(" for ", trainer).c_str(), static_cast<long long>(errors),
              static_cast<long long>(warnings));
  std::fflush(stdout);
  if (errors > 0) {
    return absl::DataLossError(absl::StrCat(dir, ": ", errors, errors == 1 ? " problem" : " problems",
                                            " (listed on stdout)"));
  }
  return absl::OkStatus();
}

absl::Status Run(const std::vector<char*>& args) {
  if (args.size() != 2) return absl::InvalidArgumentError("expected one directory (see --help)");
  const std::string dir = args[1];
  const std::filesystem::path root(dir);
  if (!std::filesystem::is_directory(root)) return absl::NotFoundError(absl::StrCat(dir, ": not a directory"));
  absl::StatusOr<hsx::ShardSpec> shard = hsx::ParseShard(absl::GetFlag(FLAGS_shard));
  if (!shard.ok()) return absl::InvalidArgumentError(absl::StrCat("--shard: ", shard.status().message()));
  std::vector<hsx::InputSample> samples;
  const std::string input_path = absl::GetFlag(FLAGS_input);
  if (!input_path.empty()) {
    hsx::InputLimits limits;
    limits.vocab_size = int64_t{1} << 31;
    absl::StatusOr<std::vector<hsx::InputSample>> read = hsx::ReadInputFile(input_path, limits);
    if (!read.ok()) return read.status();
    samples = *std::move(read);
  }
  const std::string trainer = absl::GetFlag(FLAGS_for);
  if (!trainer.empty() && trainer != "speculators" && trainer != "specforge" && trainer != "modelopt") {
    return absl::InvalidArgumentError(
        absl::StrCat("--for '", trainer, "': expected speculators, specforge or modelopt"));
  }

  std::vector<Problem> problems;
  // Every journal: manifest.jsonl (unsharded, or an older dump) and journal/*.jsonl (shards).
  std::vector<std::string> journal_paths = hsx::ListJournals(dir);
  if (journal_paths.empty()) journal_paths.push_back((root / hsx::kJournalFileName).string());  // reported missing
  std::vector<hsx::JournalScan> scans;
  scans.reserve(journal_paths.size());  // entries point into them
  JournalIndex entries;
  std::map<int64_t, const std::string*> journal_of;  // into journal_paths, which stays as it is
  for (const std::string& journal_path : journal_paths) {
    scans.push_back(ScanJournal(journal_path, &problems));
    IndexJournal(scans.back(), journal_path, samples.size(), &entries, &journal_of, &problems);
  }
  const Totals totals = CheckFiles(root, entries, samples, &problems);
  if (!samples.empty()) CheckAllJournaled(dir, samples, *shard, entries, &problems);
  if (!trainer.empty()) {
    for (Problem& p : TrainerProblems(trainer, dir, entries, !samples.empty())) problems.push_back(std::move(p));
  }
  CheckStrayFiles(root, entries, &problems);
  return Report(dir, problems, entries.size(), totals, trainer);
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Re-checks an hsx-dump output directory: the journal, every journaled file's bytes, header,\n"
      "shapes, checksums and values; with --input, that it matches the input. Flags accept - or _.\n\n"
      "  hsx-verify DIR [--input samples.jsonl] [--shard I/N] [--strict] [--for speculators|specforge|modelopt]\n\n"
      "With --for, also what that trainer assumes (docs/trainers.md); with --input, the input must be\n"
      "the trainer's prepared dataset exported in row order.");
  hsx::AcceptDashedFlags(argc, argv);
  const std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  return hsx::ExitWithStatus("hsx-verify", Run(args));
}
