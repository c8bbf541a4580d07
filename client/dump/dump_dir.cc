// dump_dir.cc: journal, quarantine and status files of an output directory.
#include "client/dump/dump_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/file_util.h"
#include "format/sample_file.h"

namespace hsx {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// The files DIR/SUB/*SUFFIX in name order.
std::vector<std::string> FilesIn(const std::string& dir, const char* sub, const char* suffix) {
  std::vector<std::string> paths;
  std::error_code error;
  for (const auto& item : fs::directory_iterator(fs::path(dir) / sub, error)) {
    const std::string name = item.path().filename().string();
    if (item.is_regular_file() && absl::EndsWith(name, suffix) && !absl::StartsWith(name, ".")) {
      paths.push_back(item.path().string());
    }
  }
  std::sort(paths.begin(), paths.end());
  return paths;
}

template <typename T>
T Field(const json& object, const char* key, T fallback) {
  auto it = object.find(key);
  if (it == object.end()) return fallback;
  try {
    return it->template get<T>();
  } catch (const json::exception&) {
    return fallback;
  }
}

// Writes `text` to a new file `path` and fsyncs it.
absl::Status WriteNewFile(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(path, "cannot create");
  absl::Status status = WriteAll(fd, text, path, "write failed");
  if (status.ok() && ::fdatasync(fd) != 0) status = ErrnoStatus(path, "fsync failed");
  ::close(fd);
  return status;
}

}  // namespace

absl::StatusOr<SampleLayout> ParseSampleLayout(const std::string& name) {
  if (name == "flat") return SampleLayout::kFlat;
  if (name == "nested") return SampleLayout::kNested;
  return absl::InvalidArgumentError(absl::StrCat("'", name, "': expected flat or nested"));
}

std::string SampleRelativePath(int64_t index, SampleLayout layout) {
  if (layout == SampleLayout::kFlat) return SampleFileName(index);
  return absl::StrFormat("%05d/%s", index / kSamplesPerSubdirectory, SampleFileName(index));
}

bool IsSamplePath(const std::string& file, int64_t index) {
  return file == SampleRelativePath(index, SampleLayout::kFlat) ||
         file == SampleRelativePath(index, SampleLayout::kNested);
}

bool IsSampleSubdirectory(const std::string& name) {
  return !name.empty() && std::all_of(name.begin(), name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::vector<std::string> ListDumpFiles(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code error;
  for (const auto& item : fs::directory_iterator(dir, error)) {
    const std::string name = item.path().filename().string();
    if (item.is_directory(error) && IsSampleSubdirectory(name)) {
      for (const auto& inner : fs::directory_iterator(item.path(), error)) {
        if (inner.is_regular_file(error)) names.push_back(name + "/" + inner.path().filename().string());
      }
    } else if (item.is_regular_file(error)) {
      names.push_back(name);
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string HostName() {
  char name[256] = {};
  return ::gethostname(name, sizeof(name) - 1) == 0 ? name : "";
}

std::string ShardStem(const ShardSpec& shard) { return absl::StrCat("shard-", shard.index, "-of-", shard.count); }

std::string ShardJournalPath(const std::string& dir, const ShardSpec& shard) {
  if (shard.count == 1) return (fs::path(dir) / kJournalFileName).string();
  return (fs::path(dir) / kJournalDirName / (ShardStem(shard) + ".jsonl")).string();
}

std::string ShardQuarantinePath(const std::string& dir, const ShardSpec& shard) {
  return (fs::path(dir) / kQuarantineDirName / (ShardStem(shard) + ".jsonl")).string();
}

std::string ShardStatusPath(const std::string& dir, const ShardSpec& shard) {
  return (fs::path(dir) / kStatusDirName / (ShardStem(shard) + ".json")).string();
}

std::vector<std::string> ListJournals(const std::string& dir) {
  std::vector<std::string> paths;
  const fs::path manifest = fs::path(dir) / kJournalFileName;
  std::error_code error;
  if (fs::is_regular_file(manifest, error)) paths.push_back(manifest.string());
  for (std::string& path : FilesIn(dir, kJournalDirName, ".jsonl")) paths.push_back(std::move(path));
  return paths;
}

absl::StatusOr<DumpJournals> ReadDumpJournals(const std::string& dir) {
  DumpJournals merged;
  merged.paths = ListJournals(dir);
  for (const std::string& path : merged.paths) {
    absl::StatusOr<JournalScan> scan = ReadJournal(path);
    if (!scan.ok()) {
      if (absl::IsNotFound(scan.status())) continue;  // removed meanwhile
      return scan.status();
    }
    merged.torn_bytes += scan->torn_bytes;
    for (JournalScan::Line& line : scan->lines) {
      auto [it, fresh] = merged.current.try_emplace(line.entry.index);
      if (!fresh) {
        return absl::DataLossError(absl::StrCat(
            path, ":", line.number, ": sample ", line.entry.index, " is journaled twice (also at ", it->second.path,
            ":", it->second.line, "); two runs with different --shard N wrote this directory at once, or journals "
            "were merged by hand: keep the line whose xxh64 matches the file (hsx-verify tells)"));
      }
      it->second = {path, line.number, std::move(line.entry)};
    }
  }
  return merged;
}

std::string QuarantineLine(const QuarantineEntry& e) {
  nlohmann::ordered_json line = {{"index", e.index}, {"id", e.id},         {"tokens", e.tokens},
                                 {"code", e.code},   {"reason", e.reason}};
  return line.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
}

absl::StatusOr<std::map<int64_t, QuarantineEntry>> ReadQuarantine(const std::string& dir) {
  std::map<int64_t, QuarantineEntry> entries;
  for (const std::string& path : FilesIn(dir, kQuarantineDirName, ".jsonl")) {
    absl::StatusOr<std::string> text = ReadFileToString(path);
    if (!text.ok()) return text.status();
    int64_t number = 0;
    size_t start = 0;
    for (size_t end; (end = text->find('\n', start)) != std::string::npos; start = end + 1) {
      ++number;
      const json line = json::parse(text->begin() + static_cast<std::ptrdiff_t>(start),
                                    text->begin() + static_cast<std::ptrdiff_t>(end), nullptr, false);
      if (line.is_discarded() || !line.is_object() || !line.contains("index") || !line["index"].is_number_integer() ||
          line["index"].get<int64_t>() < 0) {
        return absl::DataLossError(absl::StrCat(path, ":", number, ": corrupt quarantine line (a JSON object with "
                                                "a non-negative integer \"index\" expected)"));
      }
      QuarantineEntry e;
      e.index = line["index"].get<int64_t>();
      e.id = Field<std::string>(line, "id", "");
      e.tokens = Field<int64_t>(line, "tokens", 0);
      e.code = Field<std::string>(line, "code", "");
      e.reason = Field<std::string>(line, "reason", "");
      entries[e.index] = std::move(e);
    }
  }
  return entries;
}

absl::Status AppendQuarantine(const std::string& path, const QuarantineEntry& entry) {
  std::error_code error;
  fs::create_directories(fs::path(path).parent_path(), error);
  if (error) return absl::InternalError(absl::StrCat(path, ": cannot create its directory: ", error.message()));
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(path, "cannot open");
  while (::flock(fd, LOCK_EX) != 0 && errno == EINTR) {
  }
  const std::string line = QuarantineLine(entry);
  absl::Status status = WriteAll(fd, line, path, "append failed");
  if (status.ok() && ::fdatasync(fd) != 0) status = ErrnoStatus(path, "fsync failed");
  ::close(fd);  // drops the lock
  return status;
}

std::string ShardStatusJson(const ShardStatus& s) {
  nlohmann::ordered_json j = {
      {"shard", s.shard},
      {"state", s.state},
      {"host", s.host},
      {"pid", s.pid},
      {"started_unix", s.started_unix},
      {"updated_unix", s.updated_unix},
      {"input_samples", s.input_samples},
      {"input_tokens", s.input_tokens},
      {"shard_samples", s.shard_samples},
      {"shard_tokens", s.shard_tokens},
      {"written", s.written},
      {"failed", s.failed},
      {"retries", s.retries},
      {"tokens_per_s", s.tokens_per_s},
      {"samples_per_s", s.samples_per_s},
  };
  return j.dump(1, ' ', false, json::error_handler_t::replace) + "\n";
}

absl::Status WriteShardStatus(const std::string& path, const ShardStatus& status) {
  std::error_code error;
  fs::create_directories(fs::path(path).parent_path(), error);
  if (error) return absl::InternalError(absl::StrCat(path, ": cannot create its directory: ", error.message()));
  std::random_device random;
  const std::string staging = absl::StrFormat("%s.tmp.%08x", path, random());
  if (absl::Status s = WriteNewFile(staging, ShardStatusJson(status)); !s.ok()) return s;
  if (::rename(staging.c_str(), path.c_str()) != 0) {
    absl::Status s = ErrnoStatus(path, "rename failed");
    ::unlink(staging.c_str());
    return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ShardStatus>> ReadShardStatuses(const std::string& dir) {
  std::vector<ShardStatus> statuses;
  for (const std::string& path : FilesIn(dir, kStatusDirName, ".json")) {
    absl::StatusOr<std::string> text = ReadFileToString(path);
    if (!text.ok()) return text.status();
    const json j = json::parse(*text, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("shard")) {
      return absl::DataLossError(absl::StrCat(path, ": not a shard status (a JSON object with \"shard\")"));
    }
    ShardStatus s;
    s.shard = Field<std::string>(j, "shard", "");
    s.state = Field<std::string>(j, "state", "");
    s.host = Field<std::string>(j, "host", "");
    s.pid = Field<int64_t>(j, "pid", 0);
    s.started_unix = Field<double>(j, "started_unix", 0);
    s.updated_unix = Field<double>(j, "updated_unix", 0);
    s.input_samples = Field<int64_t>(j, "input_samples", 0);
    s.input_tokens = Field<int64_t>(j, "input_tokens", 0);
    s.shard_samples = Field<int64_t>(j, "shard_samples", 0);
    s.shard_tokens = Field<int64_t>(j, "shard_tokens", 0);
    s.written = Field<int64_t>(j, "written", 0);
    s.failed = Field<int64_t>(j, "failed", 0);
    s.retries = Field<int64_t>(j, "retries", 0);
    s.tokens_per_s = Field<double>(j, "tokens_per_s", 0);
    s.samples_per_s = Field<double>(j, "samples_per_s", 0);
    statuses.push_back(std::move(s));
  }
  return statuses;
}

}  // namespace hsx
