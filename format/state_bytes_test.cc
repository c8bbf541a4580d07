// state_bytes_test.cc: StateBytes holds what is written into it, copies
// deeply, leaves a moved-from block empty, and compares by content;
// StateBytesPool hands a returned block out again, within its bound, and asks
// for huge pages for its large new blocks.
#include "format/state_bytes.h"

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "format/state_bytes_pool.h"

#include "gtest/gtest.h"

namespace hsx {
namespace {

TEST(StateBytesTest, CopiesAreDeepMovesEmptyTheSourceEqualityIsByContent) {
  StateBytes a(5);
  ASSERT_EQ(a.size(), 5u);
  for (size_t i = 0; i < a.size(); ++i) a.data()[i] = static_cast<char>('a' + i);
  EXPECT_EQ(a.view(), "abcde");
  EXPECT_EQ(a.bytes().size(), 5u);
  EXPECT_EQ(a.bytes()[4], 'e');

  StateBytes b = a;  // a copy: its own bytes
  b.data()[0] = 'x';
  EXPECT_EQ(a.view(), "abcde");
  EXPECT_EQ(b.view(), "xbcde");
  EXPECT_FALSE(a == b);
  b = a;
  EXPECT_TRUE(a == b);
  EXPECT_NE(a.data(), b.data());

  const char* held = a.data();
  StateBytes c = std::move(a);  // a move: the block changes hands
  EXPECT_EQ(c.data(), held);
  EXPECT_TRUE(a.empty());  // NOLINT(bugprone-use-after-move): the moved-from state is specified
  EXPECT_EQ(a.size(), 0u);
  a = std::move(c);
  EXPECT_EQ(a.data(), held);
  EXPECT_TRUE(c.empty());  // NOLINT(bugprone-use-after-move)

  EXPECT_EQ(StateBytes(std::string("pq")).view(), "pq");
  EXPECT_TRUE(StateBytes() == StateBytes(std::string()));
  EXPECT_TRUE(StateBytes(0).empty());
}

TEST(StateBytesPoolTest, SizeClassesLeaveAtMostAFifthUnused) {
  EXPECT_EQ(StateBytesPool::SizeClass(0), 0u);
  EXPECT_EQ(StateBytesPool::SizeClass(10), 10u);
  EXPECT_EQ(StateBytesPool::SizeClass(1024), 1024u);
  EXPECT_EQ(StateBytesPool::SizeClass(1025), 1280u);
  EXPECT_EQ(StateBytesPool::SizeClass(1280), 1280u);
  EXPECT_EQ(StateBytesPool::SizeClass(1281), 1536u);
  EXPECT_EQ(StateBytesPool::SizeClass(1793), 2048u);
  for (size_t n = 64; n < (1u << 20); n = n * 3 / 2 + 7) {
    const size_t c = StateBytesPool::SizeClass(n);
    EXPECT_GE(c, n);
    EXPECT_LE(c - n, c / 5) << n;
  }
  // From 2 MiB on, whole huge pages: at most 2 MiB more, and from 8 MiB on
  // (where the classes are multiples of 2 MiB already) still a fifth.
  constexpr size_t kHuge = size_t{2} << 20;
  EXPECT_EQ(StateBytesPool::SizeClass(kHuge + 1), 2 * kHuge);
  EXPECT_EQ(StateBytesPool::SizeClass(14684160), 8 * kHuge);  // 2048 tokens of 7168 e4m3 values
  for (size_t n = kHuge; n < (size_t{1} << 32); n = n * 3 / 2 + 7) {
    const size_t c = StateBytesPool::SizeClass(n);
    EXPECT_GE(c, n);
    EXPECT_EQ(c % kHuge, 0u) << n;
    if (n < 4 * kHuge) {
      EXPECT_LT(c - n, kHuge) << n;
    } else {
      EXPECT_LE(c - n, c / 5) << n;
    }
  }
}

TEST(StateBytesPoolTest, AReturnedBlockServesTheNextRequestOfItsClass) {
  auto pool = StateBytesPool::Create(1 << 20);
  const char* first;
  {
    StateBytes a = pool->Take(5000);
    ASSERT_EQ(a.size(), 5000u);
    a.data()[4999] = 'z';
    first = a.data();
    EXPECT_EQ(pool->idle_blocks(), 0u);
  }
  EXPECT_EQ(pool->idle_blocks(), 1u);
  EXPECT_EQ(pool->idle_bytes(), StateBytesPool::SizeClass(5000));
  StateBytes b = pool->Take(4900);  // the same class (4096 * 1.25 = 5120)
  EXPECT_EQ(b.data(), first);
  EXPECT_EQ(b.size(), 4900u);
  EXPECT_EQ(pool->idle_blocks(), 0u);
  StateBytes c = pool->Take(3000);  // nothing idle: a new block
  EXPECT_NE(c.data(), first);
  const char* third = c.data();
  c = StateBytes();  // back: 3072 bytes idle
  {
    StateBytes small = pool->Take(1000);  // class 1024: 3072 is over twice that, a new block
    EXPECT_NE(small.data(), third);
  }
  EXPECT_EQ(pool->Take(1600).data(), third);  // class 1792: 3072 holds it and is within twice
  pool->Clear();

  // A copy is a plain block; a move carries the pooled one; assigning over a
  // pooled block returns it.
  { StateBytes copy = b; }
  EXPECT_EQ(pool->idle_blocks(), 0u);
  StateBytes moved = std::move(b);
  EXPECT_EQ(moved.data(), first);
  EXPECT_EQ(pool->idle_blocks(), 0u);
  moved = StateBytes(3);
  EXPECT_EQ(pool->idle_blocks(), 1u);
  pool->Clear();
  EXPECT_EQ(pool->idle_bytes(), 0u);
}

TEST(StateBytesPoolTest, IdleBlocksStayWithinTheBoundOldestFreedFirst) {
  auto pool = StateBytesPool::Create(3 * 4096);
  std::vector<StateBytes> held;
  for (int i = 0; i < 5; ++i) held.push_back(pool->Take(4096));
  const char* newest = held.back().data();
  held.clear();  // returned in order: the first three are freed again
  EXPECT_EQ(pool->idle_blocks(), 3u);
  EXPECT_EQ(pool->idle_bytes(), 3u * 4096);
  EXPECT_EQ(pool->Take(4096).data(), newest);  // the most recently returned is handed out first
  { StateBytes huge = pool->Take(1 << 20); }   // over the bound on its own: freed
  EXPECT_EQ(pool->idle_bytes(), 3u * 4096);
}

TEST(StateBytesPoolTest, ABlockOutlivesItsPool) {
  StateBytes kept;
  {
    auto pool = StateBytesPool::Create(1 << 20);
    kept = pool->Take(100);
  }
  kept.data()[99] = 'q';  // the pool lives on in the block (ASan would see a use after free)
  EXPECT_EQ(kept.size(), 100u);
}

// The VmFlags line of the mapping that holds `address` in /proc/self/smaps,
// or "" where there is none (not Linux).
std::string VmFlagsAt(const void* address) {
  std::ifstream smaps("/proc/self/smaps");
  const auto at = reinterpret_cast<uintptr_t>(address);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    uintptr_t begin = 0, end = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> begin >> dash >> end && dash == '-' && line.find(' ') > line.find('-')) {
      inside = begin <= at && at < end;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

TEST(StateBytesPoolTest, ALargeNewBlockAsksForHugePages) {
  const int on_the_stack = 0;
  if (VmFlagsAt(&on_the_stack).empty()) GTEST_SKIP() << "no /proc/self/smaps with VmFlags here";
  if (!std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled")) {
    GTEST_SKIP() << "this kernel has no transparent huge pages";
  }
  auto pool = StateBytesPool::Create(size_t{64} << 20);
  // A sample's size, not a multiple of 2 MiB: the whole block, first and last
  // byte included, is in huge pages, and it starts on a huge page.
  StateBytes block = pool->Take(14684160);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(block.data()) % (uintptr_t{2} << 20), 0u);
  for (const char* at : {block.data(), block.data() + (size_t{7} << 20), block.data() + block.size() - 1}) {
    EXPECT_NE(VmFlagsAt(at).find(" hg"), std::string::npos) << "byte " << at - block.data() << ": " << VmFlagsAt(at);
  }
  StateBytes small = pool->Take(4096);  // under one huge page: left alone
  EXPECT_EQ(VmFlagsAt(small.data()).find(" hg"), std::string::npos);
}

}  // namespace
}  // namespace hsx
