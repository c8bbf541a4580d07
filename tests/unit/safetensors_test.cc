// Tests the safetensors writer and the validating reader, one corruption at a time.
#include "format/safetensors.h"

#include <cstring>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "format/safetensors_writer.h"
#include "tests/unit/test_util.h"

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
