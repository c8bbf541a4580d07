// journal.cc: manifest.jsonl lines, the torn-tail rule and locked appends.
#include "client/dump/journal.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/file_util.h"
#include "format/xxh64_stream.h"

namespace hsx {
namespace {

using json = nlohmann::json;

// Reads [offset, offset + size) of an open file.
absl::StatusOr<std::string> ReadRange(int fd, uint64_t offset, uint64_t size, const std::string& path) {
  std::string bytes(size, '\0');
  uint64_t done = 0;
  while (done < size) {
    const ssize_t n = ::pread(fd, bytes.data() + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(path, "read failed");
    }
    if (n == 0) break;  // shrank meanwhile
    done += static_cast<uint64_t>(n);
  }
  bytes.resize(done);
  return bytes;
}

// Holds an flock() for its lifetime.
class FileLock {
 public:
  explicit FileLock(int fd) : fd_(fd) {
    while (::flock(fd_, LOCK_EX) != 0 && errno == EINTR) {
    }
  }
  ~FileLock() { ::flock(fd_, LOCK_UN); }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_;
};

// A JSON integer that fits T. (nlohmann's get<T> converts any number: 1.5
// becomes 1, and 1e47 is undefined behaviour. Found by journal_fuzzer.)
template <typename T>
bool IsIntegerOf(const json& value) {
  if (!value.is_number_integer()) return false;
  if (value.is_number_unsigned()) return value.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max());
  const int64_t v = value.get<int64_t>();
  return v >= std::numeric_limits<T>::min() && v <= std::numeric_limits<T>::max();
}

template <typename T>
bool HasType(const json& value) {
  if constexpr (std::is_same_v<T, int64_t>) {
    return IsIntegerOf<int64_t>(value);
  } else if constexpr (std::is_same_v<T, std::vector<int>>) {
    return value.is_array() && std::all_of(value.begin(), value.end(), IsIntegerOf<int>);
  } else {
    return true;  // strings and bools: get<T> throws on any other type
  }
}

template <typename T>
absl::Status Get(const json& object, const char* key, T* out) {
  auto it = object.find(key);
  if (it == object.end()) return absl::InvalidArgumentError(absl::StrCat("missing \"", key, "\""));
  if (!HasType<T>(*it)) {
    return absl::InvalidArgumentError(absl::StrCat("\"", key, "\" has the wrong type: ", it->dump()));
  }
  try {
    *out = it->template get<T>();
  } catch (const json::exception&) {
    return absl::InvalidArgumentError(absl::StrCat("\"", key, "\" has the wrong type: ", it->dump()));
  }
  return absl::OkStatus();
}

// A line that supersedes an earlier one of this scan replaces it: that line
// must be its sample's current entry and comes out of scan->lines.
absl::Status Supersede(const JournalEntry& entry, int64_t number, int64_t first_line,
                       std::map<int64_t, int64_t>* current, JournalScan* scan) {
  const int64_t target = entry.supersedes;
  if (target >= number) return absl::InvalidArgumentError(absl::StrCat("supersedes line ", target, ", not earlier"));
  if (target >= first_line) {
    auto it = current->find(entry.index);
    if (it == current->end() || it->second != target) {
      return absl::InvalidArgumentError(absl::StrCat("supersedes line ", target, ", which is not sample ",
                                                     entry.index, "'s current entry"));
    }
    auto line = std::find_if(scan->lines.begin(), scan->lines.end(),
                             [&](const JournalScan::Line& l) { return l.number == target; });
    scan->lines.erase(line);
    ++scan->superseded;
  }
  (*current)[entry.index] = number;
  return absl::OkStatus();
}

}  // namespace

std::string JournalLine(const JournalEntry& e) {
  nlohmann::ordered_json line = {
      {"index", e.index},
      {"id", e.id},
      {"file", e.file},
      {"tokens", e.tokens},
      {"bytes", e.bytes},
      {"xxh64", e.xxh64},
      {"capture_ids", e.capture_ids},
      {"final_norm", e.final_norm},
      {"dtype", e.dtype},
      {"model", e.model},
      {"model_revision", e.model_revision},
      {"compute_precision", e.compute_precision},
      {"token_ids_xxh64", e.token_ids_xxh64},
      {"loss_mask_xxh64", e.loss_mask_xxh64},
      {"input_xxh64", e.input_xxh64},
  };
  if (e.supersedes > 0) line["supersedes"] = e.supersedes;  // only redos carry it
  return line.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
}

absl::StatusOr<JournalEntry> ParseJournalLine(absl::string_view text) {
  const json line = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (line.is_discarded()) return absl::InvalidArgumentError("not valid JSON");
  if (!line.is_object()) return absl::InvalidArgumentError("not a JSON object");
  JournalEntry e;
  for (absl::Status s : {Get(line, "index", &e.index), Get(line, "id", &e.id),
                         Get(line, "file", &e.file), Get(line, "tokens", &e.tokens),
                         Get(line, "bytes", &e.bytes), Get(line, "xxh64", &e.xxh64),
                         Get(line, "capture_ids", &e.capture_ids),
                         Get(line, "final_norm", &e.final_norm), Get(line, "dtype", &e.dtype),
                         Get(line, "model", &e.model),
                         Get(line, "model_revision", &e.model_revision),
                         Get(line, "compute_precision", &e.compute_precision),
                         Get(line, "token_ids_xxh64", &e.token_ids_xxh64),
                         Get(line, "loss_mask_xxh64", &e.loss_mask_xxh64),
                         Get(line, "input_xxh64", &e.input_xxh64)}) {
    if (!s.ok()) return s;
  }
  if (e.index < 0) return absl::InvalidArgumentError(absl::StrCat("\"index\" ", e.index, " is negative"));
  // A plain file name, or DIGITS/name (the nested layout, dump_dir.h).
  const size_t slash = e.file.find('/');
  const std::string name = slash == std::string::npos ? e.file : e.file.substr(slash + 1);
  const std::string subdir = slash == std::string::npos ? "0" : e.file.substr(0, slash);
  if (name.empty() || name.find('/') != std::string::npos || name == "." || name == ".." ||
      e.file.find('\0') != std::string::npos || subdir.empty() ||
      subdir.find_first_not_of("0123456789") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "\"file\" '", e.file, "' is not a plain file name (or DIGITS/name, the nested layout)"));
  }
  if (e.tokens < 1 || e.bytes < 1) {
    return absl::InvalidArgumentError("\"tokens\" and \"bytes\" must be positive");
  }
  if (line.contains("supersedes")) {
    if (absl::Status s = Get(line, "supersedes", &e.supersedes); !s.ok()) return s;
    if (e.supersedes < 1) return absl::InvalidArgumentError("\"supersedes\" must be a line number (1 or more)");
  }
  return e;
}

absl::StatusOr<JournalScan> ParseJournal(absl::string_view bytes, int64_t first_line,
                                         const std::string& path) {
  JournalScan scan;
  scan.next_line = first_line;
  std::map<int64_t, int64_t> current;  // index -> line of its current entry, in this scan
  size_t start = 0;
  while (start < bytes.size()) {
    const size_t end = bytes.find('\n', start);
    if (end == absl::string_view::npos) {
      scan.torn_bytes = bytes.size() - start;  // an interrupted append
      break;
    }
    const absl::string_view text = bytes.substr(start, end - start);
    const int64_t number = scan.next_line++;
    if (!absl::StripAsciiWhitespace(text).empty()) {
      absl::StatusOr<JournalEntry> entry = ParseJournalLine(text);
      if (!entry.ok()) {
        return absl::DataLossError(absl::StrCat(path, ":", number, ": corrupt journal line (",
                                                entry.status().message(), ")"));
      }
      if (absl::Status s = Supersede(*entry, number, first_line, &current, &scan); !s.ok()) {
        return absl::DataLossError(absl::StrCat(path, ":", number, ": ", s.message()));
      }
      scan.lines.push_back({number, *std::move(entry)});
    }
    start = end + 1;
    scan.valid_bytes = start;
  }
  return scan;
}

absl::StatusOr<JournalScan> ReadJournal(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return ErrnoStatus(path, "cannot open");
  }
  struct stat st;
  absl::StatusOr<std::string> bytes =
      ::fstat(fd, &st) == 0 ? ReadRange(fd, 0, static_cast<uint64_t>(st.st_size), path)
                            : absl::StatusOr<std::string>(ErrnoStatus(path, "cannot stat"));
  ::close(fd);
  if (!bytes.ok()) return bytes.status();
  return ParseJournal(*bytes, 1, path);
}

absl::StatusOr<FileDigest> DigestFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(path, "cannot open");
  Xxh64Stream hash;
  std::vector<char> buffer(1 << 20);
  FileDigest digest;
  absl::Status status;
  while (true) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      status = ErrnoStatus(path, "read failed");
      break;
    }
    if (n == 0) break;
    hash.Update(buffer.data(), static_cast<size_t>(n));
    digest.bytes += n;
  }
  ::close(fd);
  digest.xxh64 = hash.HexDigest();
  if (!status.ok()) return status;
  return digest;
}

FileDigest ToFileDigest(const WrittenDigest& written) {
  return {static_cast<int64_t>(written.bytes), absl::StrFormat("%016x", written.xxh64)};
}

absl::Status SyncDirectory(const std::string& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(dir, "cannot open directory");
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0 && errno != EINVAL) return ErrnoStatus(dir, "directory fsync failed");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Journal>> Journal::Open(const std::string& path) {
  std::unique_ptr<Journal> journal(new Journal());
  journal->path_ = path;
  const std::string dir = std::filesystem::path(path).parent_path().string();
  std::error_code error;
  std::filesystem::create_directories(dir.empty() ? "." : dir, error);
  if (error) return absl::InternalError(absl::StrCat(dir, ": cannot create: ", error.message()));
  journal->fd_ = ::open(path.c_str(), O_RDWR | O_APPEND | O_CLOEXEC);
  if (journal->fd_ < 0 && errno == ENOENT) {
    journal->fd_ = ::open(path.c_str(), O_RDWR | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (journal->fd_ >= 0) {
      if (absl::Status s = SyncDirectory(dir); !s.ok()) return s;
    }
  }
  if (journal->fd_ < 0) return ErrnoStatus(path, "cannot open");
  FileLock lock(journal->fd_);
  struct stat st;
  if (::fstat(journal->fd_, &st) != 0) return ErrnoStatus(path, "cannot stat");
  absl::StatusOr<std::string> bytes = ReadRange(journal->fd_, 0, static_cast<uint64_t>(st.st_size), path);
  if (!bytes.ok()) return bytes.status();
  absl::StatusOr<JournalScan> scan = ParseJournal(*bytes, 1, path);
  if (!scan.ok()) return scan.status();
  if (scan->torn_bytes > 0) {
    if (::ftruncate(journal->fd_, static_cast<off_t>(scan->valid_bytes)) != 0 ||
        ::fdatasync(journal->fd_) != 0) {
      return ErrnoStatus(path, "cannot truncate the torn last line");
    }
    journal->repaired_ = scan->torn_bytes;
    scan->torn_bytes = 0;
  }
  journal->scanned_ = scan->valid_bytes;
  journal->next_line_ = scan->next_line;
  std::map<int64_t, int64_t> first_line;  // index -> the line that journaled it
  for (const JournalScan::Line& line : scan->lines) {
    auto [it, fresh] = first_line.emplace(line.entry.index, line.number);
    if (!fresh) {
      return absl::DataLossError(absl::StrCat(
          journal->path_, ":", line.number, ": sample ", line.entry.index, " is journaled twice (also at line ",
          it->second, "); hsx-dump never writes that, so the journal was edited or merged by hand: keep the "
          "line whose xxh64 matches the file (hsx-verify tells) and delete the other"));
    }
    journal->journaled_[line.entry.index] = line.number;
  }
  journal->initial_ = *std::move(scan);
  return journal;
}

Journal::~Journal() {
  if (fd_ >= 0) ::close(fd_);
}

bool Journal::IsJournaled(int64_t index) const { return JournaledLine(index) > 0; }

int64_t Journal::JournaledLine(int64_t index) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = journaled_.find(index);
  return it == journaled_.end() ? 0 : it->second;
}

absl::Status Journal::CatchUp(const CheckEntry& check, uint64_t* repaired) {
  struct stat st;
  if (::fstat(fd_, &st) != 0) return ErrnoStatus(path_, "cannot stat");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < scanned_) {
    return absl::DataLossError(absl::StrCat(path_, ": shrank from ", scanned_, " to ", size,
                                            " bytes while in use (edited or truncated by someone else)"));
  }
  if (size == scanned_) return absl::OkStatus();
  absl::StatusOr<std::string> bytes = ReadRange(fd_, scanned_, size - scanned_, path_);
  if (!bytes.ok()) return bytes.status();
  absl::StatusOr<JournalScan> scan = ParseJournal(*bytes, next_line_, path_);
  if (!scan.ok()) return scan.status();
  for (const JournalScan::Line& line : scan->lines) {
    if (check) {
      if (absl::Status s = check(line.entry, line.number); !s.ok()) return s;
    }
    const int64_t target = line.entry.supersedes;
    if (target > 0 && target < next_line_ && JournaledLineLocked(line.entry.index) != target) {
      return absl::DataLossError(absl::StrCat(path_, ":", line.number, ": supersedes line ", target,
                                              ", which is not sample ", line.entry.index, "'s current entry"));
    }
    journaled_[line.entry.index] = line.number;
  }
  scanned_ += scan->valid_bytes;
  next_line_ = scan->next_line;
  if (scan->torn_bytes > 0) {
    // Appends happen under the lock, which we hold: this tail was left by a
    // process that died in the middle of one.
    if (::ftruncate(fd_, static_cast<off_t>(scanned_)) != 0) {
      return ErrnoStatus(path_, "cannot truncate a torn last line");
    }
    *repaired += scan->torn_bytes;
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> Journal::Commit(const JournalEntry& entry,
                                     const std::function<absl::Status()>& publish,
                                     const CheckEntry& check) {
  std::lock_guard<std::mutex> guard(mutex_);
  FileLock lock(fd_);
  uint64_t repaired = 0;
  if (absl::Status s = CatchUp(check, &repaired); !s.ok()) return s;
  // Someone else journaled the sample (or, for a redo, redid it) meanwhile.
  if (JournaledLineLocked(entry.index) != entry.supersedes) return false;
  if (absl::Status s = publish(); !s.ok()) return s;
  const std::string line = JournalLine(entry);
  if (absl::Status error = WriteAll(fd_, line, path_, "append failed"); !error.ok()) {
    // Leave no partial line behind (the sample stays undeclared).
    if (::ftruncate(fd_, static_cast<off_t>(scanned_)) != 0) {
      error = absl::InternalError(absl::StrCat(error.message(), "; and cannot remove the partial line"));
    }
    return error;
  }
  if (::fdatasync(fd_) != 0) return ErrnoStatus(path_, "fsync failed");
  scanned_ += line.size();
  journaled_[entry.index] = next_line_++;
  return true;
}

}  // namespace hsx
