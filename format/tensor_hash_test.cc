// TensorHash against libxxhash's one-shot functions, for every XXH3 build
// this CPU runs, fed in uneven pieces.
#include "format/tensor_hash.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace hsx {
namespace {

std::vector<unsigned char> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> out(n);
  for (unsigned char& b : out) b = static_cast<unsigned char>(rng());
  return out;
}

// Feeds `data` in pieces of random sizes (empty ones included) up to `max_piece`.
void FeedInPieces(TensorHash& hash, const std::vector<unsigned char>& data, size_t max_piece, uint32_t seed) {
  std::mt19937 rng(seed);
  size_t at = 0;
  while (at < data.size()) {
    const size_t n = std::min<size_t>(data.size() - at, rng() % (max_piece + 1));
    hash.Update(data.data() + at, n);
    at += n;
  }
}

// Sizes around XXH3's internal boundaries (16, 128, 240 bytes; 64-byte
// stripes, 1024-byte blocks, its 256-byte buffer) and a few large ones.
const std::vector<size_t> kSizes = {0, 1, 3, 16, 17, 128, 129, 240, 241, 255, 256, 257, 1023, 1024, 1025,
                                    4096 + 63, 65536 + 7, (3u << 20) + 5};

TEST(TensorHashTest, EveryXxh3BuildThisCpuRunsMatchesLibxxhash) {
  std::string names;
  for (const Xxh3Build& build : RunnableXxh3Builds()) names += std::string(" ") + build.name;
  std::printf("XXH3 builds this CPU runs:%s\n", names.c_str());
  EXPECT_EQ(std::string(RunnableXxh3Builds().back().name), "libxxhash");
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2")) { EXPECT_NE(names.find("avx2"), std::string::npos) << names; }
#endif
  for (const Xxh3Build& build : RunnableXxh3Builds()) {
    TensorHash hash(build);
    for (size_t k = 0; k < kSizes.size(); ++k) {
      const std::vector<unsigned char> data = RandomBytes(kSizes[k], static_cast<uint32_t>(k));
      const uint64_t want = XXH3_64bits(data.data(), data.size());
      hash.Reset();
      hash.Update(data.data(), data.size());
      EXPECT_EQ(hash.Digest(), want) << build.name << ", " << data.size() << " bytes in one piece";
      for (size_t max_piece : {size_t{7}, size_t{300}, size_t{70000}}) {
        hash.Reset();
        FeedInPieces(hash, data, max_piece, static_cast<uint32_t>(k * 31 + max_piece));
        EXPECT_EQ(hash.Digest(), want) << build.name << ", " << data.size() << " bytes in pieces of at most "
                                       << max_piece;
      }
    }
  }
}

TEST(TensorHashTest, EachKindIsLibxxhashsFunctionOfThatName) {
  const std::vector<unsigned char> data = RandomBytes(100000, 9);
  TensorHash xxh64(ChecksumKind::kXxh64), xxh3(ChecksumKind::kXxh3);
  FeedInPieces(xxh64, data, 5000, 1);
  FeedInPieces(xxh3, data, 5000, 2);
  EXPECT_EQ(xxh64.Digest(), XXH64(data.data(), data.size(), 0));
  EXPECT_EQ(xxh3.Digest(), XXH3_64bits(data.data(), data.size()));
  EXPECT_NE(xxh64.Digest(), xxh3.Digest());
  EXPECT_EQ(xxh64.kind(), ChecksumKind::kXxh64);
  EXPECT_EQ(xxh3.kind(), ChecksumKind::kXxh3);
}

TEST(TensorHashTest, NamesParseBackAndNothingElseDoes) {
  EXPECT_EQ(ParseChecksumKind("xxh64"), ChecksumKind::kXxh64);
  EXPECT_EQ(ParseChecksumKind("xxh3"), ChecksumKind::kXxh3);
  EXPECT_EQ(ParseChecksumKind("XXH3"), std::nullopt);
  EXPECT_EQ(ParseChecksumKind("xxh3_64"), std::nullopt);
  EXPECT_EQ(ParseChecksumKind(""), std::nullopt);
  EXPECT_STREQ(ChecksumKindName(ChecksumKind::kXxh3), "xxh3_64");
  EXPECT_STREQ(ChecksumKindName(ChecksumKind::kXxh64), "xxh64");
}

}  // namespace
}  // namespace hsx
