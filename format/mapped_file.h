// mapped_file.h: a whole file mapped read-only into memory, the one mmap
// wrapper of the tree (the safetensors reader and the sample-file checker use
// it). Guarantees: bytes() stays valid and unchanged in this process while the
// object lives; an empty file maps to an empty span; errors name the path.
#ifndef HSX_FORMAT_MAPPED_FILE_H_
#define HSX_FORMAT_MAPPED_FILE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/statusor.h"

namespace hsx {

class MappedFile {
 public:
  // NOT_FOUND when the file cannot be opened, FAILED_PRECONDITION when it is
  // not a regular file, INTERNAL when it cannot be mapped.
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  std::span<const uint8_t> bytes() const { return {data_, size_}; }

 private:
  MappedFile() = default;

  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace hsx

#endif  // HSX_FORMAT_MAPPED_FILE_H_
