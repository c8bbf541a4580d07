// dump_status.cc: merging journals, quarantine and status files into one report.
#include "client/dump/dump_status.h"

#include <algorithm>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/dump/progress.h"

namespace hsx {

absl::StatusOr<DumpStatusReport> ReadDumpStatus(const std::string& dir, double now_unix) {
  std::error_code error;
  if (!std::filesystem::is_directory(dir, error)) return absl::NotFoundError(absl::StrCat(dir, ": not a directory"));
  DumpStatusReport r;
  r.dir = dir;
  absl::StatusOr<DumpJournals> journals = ReadDumpJournals(dir);
  if (!journals.ok()) return journals.status();
  for (const auto& [index, ref] : journals->current) {
    ++r.done_samples;
    r.done_tokens += ref.entry.tokens;
  }
  absl::StatusOr<std::map<int64_t, QuarantineEntry>> quarantine = ReadQuarantine(dir);
  if (!quarantine.ok()) return quarantine.status();
  for (const auto& [index, entry] : *quarantine) {
    if (journals->current.count(index)) continue;  // done by a later run
    ++r.quarantined;
    r.quarantined_tokens += entry.tokens;
  }
  absl::StatusOr<std::vector<ShardStatus>> shards = ReadShardStatuses(dir);
  if (!shards.ok()) return shards.status();
  r.shards = *std::move(shards);
  for (const ShardStatus& s : r.shards) {
    r.total_samples = std::max(r.total_samples, s.input_samples);
    r.total_tokens = std::max(r.total_tokens, s.input_tokens);
    r.retries += s.retries;
    if (s.state != "running") continue;
    if (now_unix - s.updated_unix > kStaleStatusSeconds) {
      r.stale.push_back(s.shard);
      continue;
    }
    ++r.running;
    r.tokens_per_s += s.tokens_per_s;
    r.samples_per_s += s.samples_per_s;
  }
  const int64_t remaining = r.total_tokens - r.done_tokens - r.quarantined_tokens;
  if (r.total_samples > 0 && remaining <= 0) {
    r.eta_s = 0;
  } else if (r.total_samples > 0 && r.tokens_per_s > 0) {
    r.eta_s = static_cast<double>(remaining) / r.tokens_per_s;
  }
  return r;
}

std::string DumpStatusText(const DumpStatusReport& r) {
  std::string text;
  const std::string total = r.total_samples > 0 ? absl::StrCat(r.total_samples) : std::string("?");
  const double percent = r.total_samples > 0 ? 100.0 * r.done_samples / r.total_samples : 0.0;
  absl::StrAppendFormat(&text, "%s: %d/%s samples done (%.1f%%), %d tokens; %d quarantined; %d retries\n", r.dir,
                        r.done_samples, total, percent, r.done_tokens, r.quarantined, r.retries);
  absl::StrAppendFormat(&text, "  %d shards running, %.1f tokens/s, %.2f samples/s (moving averages over a minute), ETA %s\n",
                        r.running, r.tokens_per_s, r.samples_per_s, r.eta_s < 0 ? "?" : Progress::Duration(r.eta_s));
  for (const ShardStatus& s : r.shards) {
    absl::StrAppendFormat(&text, "  shard %s: %s on %s (pid %d), wrote %d, failed %d, retries %d, %.1f tokens/s\n",
                          s.shard, s.state, s.host, s.pid, s.written, s.failed, s.retries, s.tokens_per_s);
  }
  for (const std::string& shard : r.stale) {
    absl::StrAppendFormat(&text, "  shard %s: says running but has not updated its status for over %.0f s: "
                                 "its process is gone (rerun it to resume)\n", shard, kStaleStatusSeconds);
  }
  if (r.total_samples == 0) text += "  total unknown: no status/ files (a dump from before hsx-dump status)\n";
  return text;
}

std::string DumpStatusJson(const DumpStatusReport& r) {
  nlohmann::ordered_json shards = nlohmann::ordered_json::array();
  for (const ShardStatus& s : r.shards) shards.push_back(nlohmann::ordered_json::parse(ShardStatusJson(s)));
  nlohmann::ordered_json j = {
      {"dir", r.dir},
      {"total_samples", r.total_samples > 0 ? nlohmann::ordered_json(r.total_samples) : nlohmann::ordered_json()},
      {"total_tokens", r.total_samples > 0 ? nlohmann::ordered_json(r.total_tokens) : nlohmann::ordered_json()},
      {"done_samples", r.done_samples},
      {"done_tokens", r.done_tokens},
      {"quarantined", r.quarantined},
      {"retries", r.retries},
      {"running_shards", r.running},
      {"tokens_per_s", r.tokens_per_s},
      {"samples_per_s", r.samples_per_s},
      {"eta_s", r.eta_s < 0 ? nlohmann::ordered_json() : nlohmann::ordered_json(r.eta_s)},
      {"stale_shards", r.stale},
      {"shards", shards},
  };
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

}  // namespace hsx
