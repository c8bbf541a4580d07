// safetensors_writer.h: writes .safetensors files atomically.
//
// Tensors are laid out by descending element size, so every tensor's offset
// is a multiple of its element size (readers can use the data in place), and
// the header is padded with spaces to a multiple of 8 bytes, as the reference
// implementation does. Data is produced tensor by tensor through a callback,
// so writing a file needs memory for one tensor, not the whole file. The file
// appears under its final name only once complete and fsynced.
#ifndef HSX_FORMAT_SAFETENSORS_WRITER_H_
#define HSX_FORMAT_SAFETENSORS_WRITER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "format/safetensors.h"

namespace hsx {

// The size and XXH64 (seed 0) of every byte of a written file, computed as
// the bytes are written (no read-back).
struct WrittenDigest {
  uint64_t bytes = 0;
  uint64_t xxh64 = 0;
};

class SafetensorsWriter {
 public:
  // Fills the tensor's bytes (little-endian, row-major).
  using Fill = std::function<void(std::span<uint8_t>)>;

  void Add(std::string name, DType dtype, std::vector<int64_t> shape, Fill fill);
  // Copies `bytes`, which must hold product(shape) * DTypeSize(dtype) bytes.
  void AddBytes(std::string name, DType dtype, std::vector<int64_t> shape,
                std::span<const uint8_t> bytes);
  // Writes `bytes` (product(shape) * DTypeSize(dtype) of them) straight from
  // the caller's memory: no copy in user space. They must stay alive and
  // unchanged until Write() returns.
  void AddView(std::string name, DType dtype, std::vector<int64_t> shape,
               std::span<const uint8_t> bytes);
  // The same for bytes that lie in several pieces of memory: the tensor is
  // `pieces` one after the other, written with writev(2) straight from them.
  void AddPieces(std::string name, DType dtype, std::vector<int64_t> shape,
                 std::vector<std::span<const uint8_t>> pieces);
  void SetMetadata(std::string key, std::string value) { metadata_[std::move(key)] = std::move(value); }
  // Tensors of at least `bytes` bytes are not filled: Write() leaves them as
  // holes in the file, which read back as zeros (and take no disk space).
  void ZeroTensorsFrom(uint64_t bytes) { zero_from_ = bytes; }

  // Bytes of tensor data added so far.
  uint64_t data_bytes() const;
  size_t num_tensors() const { return entries_.size(); }

  // Writes everything added to `path` (temporary file, fsync, rename). When
  // `digest` is set, fills it with the file's size and XXH64, hashed block
  // by block (piece by piece) just before each block is written, so it
  // equals a digest of the file read back.
  absl::Status Write(const std::string& path, WrittenDigest* digest = nullptr) const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    Fill fill;                                  // empty for a view
    std::vector<std::span<const uint8_t>> view;  // AddView's bytes, AddPieces' pieces
    uint64_t bytes;
  };
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
  uint64_t zero_from_ = UINT64_MAX;
};

// Writes `contents` to `path` atomically (temporary file in the same
// directory, fsync, rename, fsync of the directory).
absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents);

}  // namespace hsx

#endif  // HSX_FORMAT_SAFETENSORS_WRITER_H_
