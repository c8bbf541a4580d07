// Tests the safetensors writer and the validating reader, one corruption at a time.
#include "format/safetensors.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include <xxhash.h>

#include "format/safetensors_writer.h"
#include "format/test_files.h"

namespace hsx {
namespace {

using ::hsx::testing::EditSafetensorsHeader;
using ::hsx::testing::ReadFile;
using ::hsx::testing::TempDir;
using ::hsx::testing::WriteFile;
using ::testing::HasSubstr;

// Writes a file with a bf16 [2, 3] tensor "a", an f32 [4] tensor "b" and an i64 [2] "c".
std::string WriteSample(const TempDir& dir) {
  SafetensorsWriter writer;
  const std::vector<uint16_t> a = {1, 2, 3, 4, 5, 6};
  const std::vector<float> b = {0.5f, 1.5f, 2.5f, 3.5f};
  const std::vector<int64_t> c = {7, -8};
  writer.AddBytes("a", DType::kBF16, {2, 3}, {reinterpret_cast<const uint8_t*>(a.data()), 12});
  writer.AddBytes("b", DType::kF32, {4}, {reinterpret_cast<const uint8_t*>(b.data()), 16});
  writer.AddBytes("c", DType::kI64, {2}, {reinterpret_cast<const uint8_t*>(c.data()), 16});
  writer.SetMetadata("format", "pt");
  const std::string path = dir / "sample.safetensors";
  EXPECT_TRUE(writer.Write(path).ok());
  return path;
}

absl::Status OpenStatus(const std::string& path) { return SafetensorsFile::Open(path).status(); }

TEST(Safetensors, RoundTripsWithAlignedOffsets) {
  TempDir dir;
  const std::string path = WriteSample(dir);
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->header().metadata.at("format"), "pt");
  EXPECT_EQ((*file)->header().data_start % 8, 0u);
  const TensorInfo* b = (*file)->Find("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->shape, (std::vector<int64_t>{4}));
  float values[4];
  std::memcpy(values, (*file)->Data(*b).data(), 16);
  EXPECT_EQ(values[3], 3.5f);
  for (const TensorInfo& info : (*file)->header().tensors) {
    EXPECT_EQ(info.begin % DTypeSize(info.dtype), 0u) << info.name;
  }
  const TensorInfo* c = (*file)->Find("c");
  int64_t ints[2];
  std::memcpy(ints, (*file)->Data(*c).data(), 16);
  EXPECT_EQ(ints[1], -8);
  EXPECT_EQ((*file)->Find("missing"), nullptr);
}

// A tensor added as pieces is written as their concatenation, with the
// digest of the file read back: thousands of tiny pieces (more than one
// writev(2) takes, IOV_MAX), pieces larger than the writer's hashing block,
// and empty ones.
TEST(Safetensors, PiecesWriteTheirConcatenation) {
  TempDir dir;
  std::vector<uint8_t> bytes(3 * 1024 * 1024 + 6);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
  std::vector<std::span<const uint8_t>> pieces;
  size_t at = 0;
  for (size_t k = 0; at < bytes.size(); ++k) {  // 5000 pieces of 0-3 bytes, then up to 700 KiB
    const size_t n = std::min(bytes.size() - at, k < 5000 ? k % 4 : (k % 7 + 1) * 100 * 1024 + 3);
    pieces.push_back(std::span<const uint8_t>(bytes).subspan(at, n));
    at += n;
  }
  ASSERT_GT(pieces.size(), 5000u);
  WrittenDigest as_pieces, as_view;
  SafetensorsWriter a, b;
  a.AddPieces("t", DType::kBF16, {static_cast<int64_t>(bytes.size() / 2)}, pieces);
  b.AddView("t", DType::kBF16, {static_cast<int64_t>(bytes.size() / 2)}, bytes);
  ASSERT_TRUE(a.Write(dir / "pieces.safetensors", &as_pieces).ok());
  ASSERT_TRUE(b.Write(dir / "view.safetensors", &as_view).ok());
  const std::string written = ReadFile(dir / "pieces.safetensors");
  EXPECT_TRUE(written == ReadFile(dir / "view.safetensors"));
  EXPECT_EQ(as_pieces.bytes, written.size());
  EXPECT_EQ(as_pieces.xxh64, as_view.xxh64);
  EXPECT_EQ(as_pieces.xxh64, XXH64(written.data(), written.size(), 0));
  EXPECT_EQ(written.substr(written.size() - bytes.size()), std::string(bytes.begin(), bytes.end()));
  // Pieces that do not make up the shape: refused, nothing left behind.
  pieces.pop_back();
  SafetensorsWriter c;
  c.AddPieces("t", DType::kBF16, {static_cast<int64_t>(bytes.size() / 2)}, pieces);
  const absl::Status s = c.Write(dir / "short.safetensors");
  EXPECT_THAT(s.message(), HasSubstr("bytes for a shape of"));
  EXPECT_FALSE(std::filesystem::exists(dir / "short.safetensors"));
}

// A file system that takes part of a write and then refuses the rest (a full
// disk, a quota: here the process's file-size limit, in a child process so
// that the limit stays there): the writer resumes after the short write, then
// reports the error naming the file, and leaves neither the file nor its
// temporary behind. The child's exit code says which expectation failed.
TEST(Safetensors, AWriteCutShortByTheFileSystemLeavesNothing) {
  TempDir dir;
  const std::string path = dir / "full.safetensors";
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    signal(SIGXFSZ, SIG_IGN);  // EFBIG instead of the signal
    const rlimit limit = {(1 << 20) + 7, (1 << 20) + 7};  // inside a 256 KiB block, mid-piece
    if (setrlimit(RLIMIT_FSIZE, &limit) != 0) _exit(10);
    std::vector<uint8_t> bytes(3 << 20, 0x5a);
    std::vector<std::span<const uint8_t>> pieces;
    for (size_t at = 0; at < bytes.size(); at += 100003) {
      pieces.push_back(std::span<const uint8_t>(bytes).subspan(at, std::min<size_t>(100003, bytes.size() - at)));
    }
    SafetensorsWriter writer;
    writer.AddPieces("t", DType::kBF16, {static_cast<int64_t>(bytes.size() / 2)}, pieces);
    const absl::Status status = writer.Write(path);
    if (status.ok()) _exit(1);
    if (status.message().find(path) == std::string::npos ||
        status.message().find("File too large") == std::string::npos) {
      _exit(2);
    }
    if (!std::filesystem::is_empty(dir.path())) _exit(3);  // no file, no temporary
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: the write succeeded; 2: the error does not name the file and "
                                       "the cause; 3: something was left behind; 10: setrlimit failed";
}

TEST(Safetensors, WriteLeavesNoTemporaryFiles) {
  TempDir dir;
  WriteSample(dir);
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    ++count;
    EXPECT_EQ(entry.path().filename(), "sample.safetensors");
  }
  EXPECT_EQ(count, 1);
}

TEST(Safetensors, TruncatedFile) {
  TempDir dir;
  const std::string path = WriteSample(dir);
  const std::string bytes = ReadFile(path);
  WriteFile(path, bytes.substr(0, bytes.size() - 5));
  EXPECT_THAT(OpenStatus(path).message(),
              HasSubstr("run past the end of the data section"));
  EXPECT_THAT(OpenStatus(path).message(), HasSubstr(path));
  WriteFile(path, bytes.substr(0, 5));
  EXPECT_THAT(OpenStatus(path).message(), HasSubstr("too short for a safetensors header"));
}

TEST(Safetensors, OffsetsPastTheEnd) {
  TempDir dir;
  const std::string path = WriteSample(dir);
  EditSafetensorsHeader(path, [](nlohmann::json& h) { h["c"]["data_offsets"] = {1000, 1016}; });
  EXPECT_THAT(OpenStatus(path).message(),
              HasSubstr("tensor 'c': data_offsets [1000, 1016] run past the end"));
}

TEST(Safetensors, OverlappingTensors) {
  TempDir dir;
  const std::string path = WriteSample(dir);
  // "b" (16 bytes) moved to start 8 bytes into "c".
  EditSafetensorsHeader(path, [](nlohmann::json& h) {
    const uint64_t c_begin = h["c"]["data_offsets"][0];
    h["b"]["data_offsets"] = {c_begin + 8, c_begin + 24};
  });
  EXPECT_THAT(OpenStatus(path).message(), HasSubstr("overlap tensor"));
}

TEST(Safetensors, ByteLengthMustMatchShape) {
  TempDir dir;
  const std::string path = WriteSample(dir);
  EditSafetensorsHeader(path, [](nlohmann::json& h) { h["a"]["shape"] = {3, 3}; });
  EXPECT_THAT(OpenStatus(path).message(),
              HasSubstr("tensor 'a': holds 12 bytes but shape [3, 3] of BF16 needs 18"));
}

TEST(Safetensors, UnknownDtype) {
  TempDir dir;
  const std::string path = WriteSample(dir);
  EditSafetensorsHeader(path, [](nlohmann::json& h) { h["a"]["dtype"] = "Q4_K"; });
  EXPECT_THAT(OpenStatus(path).message(), HasSubstr("tensor 'a': unknown dtype 'Q4_K'"));
}

TEST(Safetensors, HugeHeaderLength) {
  TempDir dir;
  const std::string path = dir / "huge.safetensors";
  std::string bytes(8, '\0');
  bytes[7] = 0x10;  // 2^60
  WriteFile(path, bytes + "{}");
  EXPECT_THAT(OpenStatus(path).message(),
              HasSubstr("header length 1152921504606846976 exceeds the limit"));
}

TEST(Safetensors, HeaderLengthPastEndOfFile) {
  TempDir dir;
  const std::string path = dir / "short.safetensors";
  std::string bytes(8, '\0');
  bytes[0] = 100;
  WriteFile(path, bytes + "{}");
  EXPECT_THAT(OpenStatus(path).message(), HasSubstr("header length 100 runs past the end"));
}

TEST(Safetensors, MalformedJsonAndEntries) {
  TempDir dir;
  const std::string path = dir / "bad.safetensors";
  auto write_header = [&](const std::string& text) {
    std::string bytes(8, '\0');
    bytes[0] = static_cast<char>(text.size());
    WriteFile(path, bytes + text);
  };
  write_header("{\"a\": ");
  EXPECT_THAT(OpenStatus(path).message(), HasSubstr("header is not valid JSON"));
  write_header("[1, 2]");
  EXPECT_THAT(OpenStatus(path).message(), HasSubstr("header is not a JSON object"));
  write_header(R"({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}})");
  EXPECT_THAT(OpenStatus(path).message(), HasSubstr("shape entry -1 is not a non-negative"));
  write_header(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}})");
  EXPECT_THAT(OpenStatus(path).message(), HasSubstr("are reversed"));
  write_header(R"({"a": {"dtype": "F32", "shape": [1]}})");
  EXPECT_THAT(OpenStatus(path).message(), HasSubstr("'data_offsets' must be two"));
  write_header(R"({"a": {"dtype": "F32", "shape": [4294967296, 4294967296, 4294967296], "data_offsets": [0, 0]}})");
  EXPECT_THAT(OpenStatus(path).message(), HasSubstr("byte size overflows"));
  write_header(R"({"__metadata__": {"k": 1}})");
  EXPECT_THAT(OpenStatus(path).message(), HasSubstr("'__metadata__' value of 'k' is not a string"));
}

TEST(Safetensors, MissingFile) {
  EXPECT_EQ(OpenStatus("/nonexistent/x.safetensors").code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace hsx
