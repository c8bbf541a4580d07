// collective_plan_test.cc: the all-reduce plan's index arithmetic, and that its
// sums are rank-ordered whatever the size (which a ring all-reduce is not).
#include "kernels/collective_plan.h"

#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace hsx {
namespace {

std::vector<std::vector<float>> RandomPartials(int ranks, int64_t elements, uint32_t seed) {
  std::mt19937 random(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> partials(ranks, std::vector<float>(elements));
  for (auto& p : partials) {
    for (float& v : p) v = normal(random) * std::ldexp(1.0f, static_cast<int>(random() % 20) - 10);
  }
  return partials;
}

std::vector<float> RankOrderSum(const std::vector<std::vector<float>>& partials) {
  std::vector<float> sum = partials[0];
  for (size_t r = 1; r < partials.size(); ++r) {
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += partials[r][i];
  }
  return sum;
}

std::vector<float> ByPlan(std::vector<std::vector<float>> partials, std::vector<float>* rank_copy, int which) {
  std::vector<float*> pointers;
  for (auto& p : partials) pointers.push_back(p.data());
  AllReduceByPlan(pointers, static_cast<int64_t>(partials[0].size()));
  if (rank_copy != nullptr) *rank_copy = partials[which];
  return partials[0];
}

// A ring all-reduce's reduce-scatter: chunk c's sum starts at rank c + 1 and
// goes around, so the order depends on which chunk an element falls in, i.e.
// on the buffer's length. What the contract forbids.
std::vector<float> RingSum(const std::vector<std::vector<float>>& partials) {
  const int n = static_cast<int>(partials.size());
  const int64_t elements = static_cast<int64_t>(partials[0].size());
  std::vector<float> out(elements);
  for (int c = 0; c < n; ++c) {
    const int64_t begin = elements * c / n, end = elements * (c + 1) / n;
    for (int64_t i = begin; i < end; ++i) {
      float acc = partials[(c + 1) % n][i];
      for (int k = 2; k <= n; ++k) acc += partials[(c + k) % n][i];
      out[i] = acc;
    }
  }
  return out;
}

TEST(CollectivePlan, SlicesPartitionAlignAndBalance) {
  for (const int ranks : {1, 2, 3, 4, 7, 8}) {
    for (const int64_t elements : {int64_t{0}, int64_t{1}, int64_t{63}, int64_t{64}, int64_t{65}, int64_t{1000},
                                   int64_t{7168}, int64_t{7168 * 37 + 5}}) {
      int64_t next = 0;
      int64_t largest = 0, smallest = elements;
      for (int r = 0; r < ranks; ++r) {
        const SliceRange s = ReduceSlice(elements, ranks, r);
        EXPECT_EQ(s.begin, next) << elements << " over " << ranks;
        EXPECT_LE(s.begin, s.end);
        EXPECT_EQ(s.begin % kCollectiveGranule == 0 || s.begin == elements, true);
        next = s.end;
        largest = std::max(largest, s.size());
        smallest = std::min(smallest, s.size());
      }
      EXPECT_EQ(next, elements);
      EXPECT_LE(largest - smallest, 2 * kCollectiveGranule) << elements << " over " << ranks;
    }
  }
}

TEST(CollectivePlan, SumsInRankOrderOnEveryRankForEverySize) {
  for (const int ranks : {2, 3, 4, 8}) {
    for (const int64_t elements : {int64_t{1}, int64_t{100}, int64_t{4097}, int64_t{7168 * 3}}) {
      const auto partials = RandomPartials(ranks, elements, static_cast<uint32_t>(ranks * 1000 + elements));
      const std::vector<float> want = RankOrderSum(partials);
      for (int which = 0; which < ranks; ++which) {
        std::vector<float> got;
        ByPlan(partials, &got, which);
        EXPECT_EQ(std::memcmp(got.data(), want.data(), sizeof(float) * elements), 0)
            << "rank " << which << ", " << elements << " elements over " << ranks << " ranks";
      }
    }
  }
}

// The rule is not vacuous: a ring all-reduce gives an element a different sum
// when the same values sit in a buffer of another length.
TEST(CollectivePlan, ARingAllReduceWouldDependOnTheBufferSize) {
  const auto big = RandomPartials(4, 4096, 7);
  std::vector<std::vector<float>> small(4);
  for (int r = 0; r < 4; ++r) small[r].assign(big[r].begin(), big[r].begin() + 1000);
  const std::vector<float> ring_big = RingSum(big), ring_small = RingSum(small);
  const std::vector<float> plan_big = ByPlan(big, nullptr, 0), plan_small = ByPlan(small, nullptr, 0);
  int ring_differs = 0;
  for (int i = 0; i < 1000; ++i) {
    ring_differs += std::memcmp(&ring_big[i], &ring_small[i], sizeof(float)) != 0;
    EXPECT_EQ(std::memcmp(&plan_big[i], &plan_small[i], sizeof(float)), 0) << "element " << i;
  }
  EXPECT_GT(ring_differs, 0) << "the ring's order should depend on the length for some element";
}

}  // namespace
}  // namespace hsx
