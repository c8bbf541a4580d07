// uncached_copy_test.cc: CopyUncached against memcpy, its reference: every
// alignment of both ends, lengths around the 16-byte head and the 64-byte
// loop, and nothing written outside the destination.
#include "format/uncached_copy.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"

namespace hsx {
namespace {

TEST(UncachedCopyTest, CopiesWhatMemcpyCopiesAtAnyAlignmentAndLength) {
  std::vector<unsigned char> source(4096 + 64);
  for (size_t i = 0; i < source.size(); ++i) source[i] = static_cast<unsigned char>(i * 131 + 7);
  std::vector<size_t> lengths;
  for (size_t n = 0; n <= 200; ++n) lengths.push_back(n);
  for (size_t n : {255, 256, 257, 1023, 1024, 1025, 4095, 4096}) lengths.push_back(n);
  std::vector<unsigned char> got(4096 + 128), want(got.size());
  for (size_t from = 0; from < 8; ++from) {
    for (size_t to = 0; to < 64; to += (to < 17 ? 1 : 15)) {
      for (size_t n : lengths) {
        std::memset(got.data(), 0xa5, got.size());
        std::memset(want.data(), 0xa5, want.size());
        CopyUncached(got.data() + to, source.data() + from, n);
        std::memcpy(want.data() + to, source.data() + from, n);
        FenceUncachedCopies();
        ASSERT_EQ(got, want) << "from offset " << from << ", to offset " << to << ", " << n << " bytes";
      }
    }
  }
}

}  // namespace
}  // namespace hsx
