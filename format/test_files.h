// test_files.h: temporary directories, whole-file reads and writes and
// safetensors header surgery for the tests (header-only, for tests).
#ifndef HSX_FORMAT_TEST_FILES_H_
#define HSX_FORMAT_TEST_FILES_H_

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/file_util.h"
#include "gtest/gtest.h"

namespace hsx::testing {

// A fresh directory under the test temp dir, removed when the test ends.
class TempDir {
 public:
  TempDir() {
    std::random_device random;
    const char* base = std::getenv("TEST_TMPDIR");
    path_ = std::filesystem::path(base ? base : std::filesystem::temp_directory_path().string()) /
            ("hsx_test_" + std::to_string(random()) + std::to_string(random()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string path() const { return path_.string(); }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// The file's bytes; empty when it cannot be read.
inline std::string ReadFile(const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadFileToString(path);
  return bytes.ok() ? *std::move(bytes) : std::string();
}

inline void WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << contents;
}

// Rewrites the JSON header of a safetensors file through `edit`, keeping the
// data section byte for byte.
inline void EditSafetensorsHeader(const std::string& path,
                                  const std::function<void(nlohmann::json&)>& edit) {
  const std::string bytes = ReadFile(path);
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | static_cast<uint8_t>(bytes[i]);
  nlohmann::json header = nlohmann::json::parse(bytes.substr(8, length));
  edit(header);
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  WriteFile(path, out + text + bytes.substr(8 + length));
}

}  // namespace hsx::testing

#endif  // HSX_FORMAT_TEST_FILES_H_
