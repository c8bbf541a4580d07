// state_bytes_test.cc: StateBytes holds what is written into it, copies
// deeply, leaves a moved-from block empty, and compares by content.
#include "format/state_bytes.h"

#include <string>
#include <utility>

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

}  // namespace
}  // namespace hsx
