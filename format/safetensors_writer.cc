// safetensors_writer.cc: header layout and atomic file output.
#include "format/safetensors_writer.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "format/xxh64_stream.h"

namespace hsx {
namespace {

std::string RandomSuffix() {
  std::random_device random;
  return absl::StrFormat("%08x%08x", random(), random());
}

// An open temporary file that is removed unless Commit() renamed it.
class TempFile {
 public:
  // The temporary's name carries 64 random bits and is created exclusively:
  // writers in other processes (other hosts on a shared volume, where PIDs
  // repeat) never share or truncate each other's temporary.
  explicit TempFile(std::string final_path)
      : final_path_(std::move(final_path)),
        temp_path_(absl::StrCat(final_path_, ".tmp.", RandomSuffix())) {}
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(temp_path_.c_str());
  }

  absl::Status Open() {
    fd_ = ::open(temp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0) return Error("cannot create");
    return absl::OkStatus();
  }

  // Writes the pieces `io` (at most IOV_MAX) in order; `io` is used up.
  absl::Status AppendV(std::span<iovec> io) {
    while (!io.empty()) {
      const ssize_t written = ::writev(fd_, io.data(), static_cast<int>(io.size()));
      if (written < 0) {
        if (errno == EINTR) continue;
        return Error("write failed");
      }
      // A short write: skip what went out, resume inside the piece it ended in.
      for (size_t left = static_cast<size_t>(written); left > 0 || (!io.empty() && io[0].iov_len == 0);) {
        const size_t n = std::min(left, io[0].iov_len);
        io[0].iov_base = static_cast<char*>(io[0].iov_base) + n;
        io[0].iov_len -= n;
        left -= n;
        if (io[0].iov_len == 0) io = io.subspan(1);
      }
    }
    return absl::OkStatus();
  }

  // Leaves `bytes` zero bytes as a hole (the file's size is set by Commit).
  absl::Status Skip(uint64_t bytes) {
    if (::lseek(fd_, static_cast<off_t>(bytes), SEEK_CUR) < 0) return Error("seek failed");
    return absl::OkStatus();
  }

  absl::Status Commit() {
    const off_t end = ::lseek(fd_, 0, SEEK_CUR);
    if (end < 0 || ::ftruncate(fd_, end) != 0) return Error("cannot set the size");
    if (::fsync(fd_) != 0) return Error("fsync failed");
    if (::close(fd_) != 0) {
      fd_ = -1;
      return Error("close failed");
    }
    fd_ = -1;
    if (::rename(temp_path_.c_str(), final_path_.c_str()) != 0) return Error("rename failed");
    committed_ = true;
    const std::string dir = std::filesystem::path(final_path_).parent_path().string();
    const int dir_fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir_fd >= 0) {
      ::fsync(dir_fd);
      ::close(dir_fd);
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InternalError(absl::StrCat(final_path_, ": ", what, ": ", std::strerror(errno)));
  }

  std::string final_path_;
  std::string temp_path_;
  int fd_ = -1;
  bool committed_ = false;
};

// Hashes what goes to a TempFile, in blocks small enough to still be in the
// cache when the kernel copies them (one pass over memory for both): each
// block is up to kBlock bytes of one or more pieces, hashed piece by piece,
// then written with one writev(2).
class HashingAppender {
 public:
  HashingAppender(TempFile& file, bool hash) : file_(file) {
    if (hash) hash_.emplace();
  }

  absl::Status Append(std::span<const uint8_t> bytes) { return AppendPieces({&bytes, 1}); }

  absl::Status AppendPieces(std::span<const std::span<const uint8_t>> pieces) {
    constexpr size_t kBlock = 256 << 10;
    constexpr size_t kMaxPieces = IOV_MAX < 1024 ? IOV_MAX : 1024;
    std::vector<iovec> block;
    size_t block_bytes = 0;
    auto flush = [&]() -> absl::Status {
      if (block.empty()) return absl::OkStatus();
      if (hash_) {
        for (const iovec& io : block) hash_->Update(io.iov_base, io.iov_len);
      }
      bytes_ += block_bytes;
      absl::Status s = file_.AppendV(block);
      block.clear();
      block_bytes = 0;
      return s;
    };
    for (std::span<const uint8_t> piece : pieces) {
      while (!piece.empty()) {  // a piece larger than a block is cut into blocks
        const size_t n = std::min(piece.size(), kBlock - block_bytes);
        block.push_back({const_cast<uint8_t*>(piece.data()), n});
        block_bytes += n;
        piece = piece.subspan(n);
        if (block_bytes == kBlock || block.size() == kMaxPieces) {
          if (absl::Status s = flush(); !s.ok()) return s;
        }
      }
    }
    return flush();
  }

  // A hole: hashed as the zeros it reads back as.
  absl::Status Skip(uint64_t bytes) {
    if (hash_) {
      static const std::vector<uint8_t> zeros(1 << 16, 0);
      for (uint64_t left = bytes; left > 0;) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(left, zeros.size()));
        hash_->Update(zeros.data(), n);
        left -= n;
      }
    }
    bytes_ += bytes;
    return file_.Skip(bytes);
  }

  WrittenDigest digest() const { return {bytes_, hash_ ? hash_->Digest() : 0}; }

 private:
  TempFile& file_;
  std::optional<Xxh64Stream> hash_;  // when the caller wants the file's digest
  uint64_t bytes_ = 0;
};

}  // namespace

void SafetensorsWriter::Add(std::string name, DType dtype, std::vector<int64_t> shape, Fill fill) {
  uint64_t bytes = static_cast<uint64_t>(DTypeSize(dtype));
  for (int64_t dim : shape) bytes *= static_cast<uint64_t>(dim);
  entries_.push_back({std::move(name), dtype, std::move(shape), std::move(fill), {}, bytes});
}

void SafetensorsWriter::AddView(std::string name, DType dtype, std::vector<int64_t> shape,
                                std::span<const uint8_t> bytes) {
  uint64_t size = static_cast<uint64_t>(DTypeSize(dtype));
  for (int64_t dim : shape) size *= static_cast<uint64_t>(dim);
  entries_.push_back({std::move(name), dtype, std::move(shape), nullptr, {bytes}, size});
}

void SafetensorsWriter::AddPieces(std::string name, DType dtype, std::vector<int64_t> shape,
                                  std::vector<std::span<const uint8_t>> pieces) {
  uint64_t size = static_cast<uint64_t>(DTypeSize(dtype));
  for (int64_t dim : shape) size *= static_cast<uint64_t>(dim);
  entries_.push_back({std::move(name), dtype, std::move(shape), nullptr, std::move(pieces), size});
}

void SafetensorsWriter::AddBytes(std::string name, DType dtype, std::vector<int64_t> shape,
                                 std::span<const uint8_t> bytes) {
  std::vector<uint8_t> copy(bytes.begin(), bytes.end());
  Add(std::move(name), dtype, std::move(shape),
      [copy = std::move(copy)](std::span<uint8_t> out) {
        std::memcpy(out.data(), copy.data(), std::min(out.size(), copy.size()));
      });
}

uint64_t SafetensorsWriter::data_bytes() const {
  uint64_t total = 0;
  for (const Entry& entry : entries_) total += entry.bytes;
  return total;
}

absl::Status SafetensorsWriter::Write(const std::string& path, WrittenDigest* digest) const {
  std::vector<const Entry*> order;
  for (const Entry& entry : entries_) order.push_back(&entry);
  std::stable_sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    return DTypeSize(a->dtype) > DTypeSize(b->dtype);
  });
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  uint64_t offset = 0;
  for (const Entry* entry : order) {
    header[entry->name] = {{"dtype", DTypeName(entry->dtype)},
                           {"shape", entry->shape},
                           {"data_offsets", {offset, offset + entry->bytes}}};
    offset += entry->bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(text.size() >> (8 * i));

  TempFile file(path);
  if (absl::Status s = file.Open(); !s.ok()) return s;
  HashingAppender out(file, digest != nullptr);
  if (absl::Status s = out.Append(length); !s.ok()) return s;
  if (absl::Status s = out.Append({reinterpret_cast<const uint8_t*>(text.data()), text.size()});
      !s.ok()) {
    return s;
  }
  std::vector<uint8_t> buffer;
  for (const Entry* entry : order) {
    if (entry->bytes >= zero_from_) {
      if (absl::Status s = out.Skip(entry->bytes); !s.ok()) return s;
      continue;
    }
    if (!entry->fill) {  // a view: written from the caller's memory
      uint64_t size = 0;
      for (const std::span<const uint8_t>& piece : entry->view) size += piece.size();
      if (size != entry->bytes) {
        return absl::InternalError(absl::StrCat(path, ": tensor ", entry->name, " has ", size,
                                                " bytes for a shape of ", entry->bytes));
      }
      if (absl::Status s = out.AppendPieces(entry->view); !s.ok()) return s;
      continue;
    }
    buffer.assign(entry->bytes, 0);
    entry->fill(buffer);
    if (absl::Status s = out.Append(buffer); !s.ok()) return s;
  }
  if (absl::Status s = file.Commit(); !s.ok()) return s;
  if (digest != nullptr) *digest = out.digest();
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents) {
  TempFile file(path);
  if (absl::Status s = file.Open(); !s.ok()) return s;
  HashingAppender out(file, /*hash=*/false);
  if (absl::Status s = out.Append({reinterpret_cast<const uint8_t*>(contents.data()), contents.size()});
      !s.ok()) {
    return s;
  }
  return file.Commit();
}

}  // namespace hsx
