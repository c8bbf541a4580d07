// collective_plan_test.cc: the all-reduce plan's index arithmetic, and that its
// sums are rank-ordered whatever the size (which a ring all-reduce is not).
#include "kernels/collective_plan.h"

#include <algorithm>
#include <cmath>
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

namespace hsx {
namespace {

// The send/receive transport (NCCL) simulated on host memory, message by
// message from the exchange lists: every rank ends with the rank-order sum,
// bitwise what AllReduceByPlan (the in-process communicator) gives.
TEST(CollectivePlan, ExchangesReproduceThePlanBitwise) {
  for (const int ranks : {2, 3, 4, 8}) {
    for (const int64_t elements : {int64_t{1}, int64_t{64}, int64_t{100}, int64_t{4097}, int64_t{7168 * 3}}) {
      SCOPED_TRACE(::testing::Message() << ranks << " ranks, " << elements << " elements");
      const std::vector<std::vector<float>> partials = RandomPartials(ranks, elements, 11);
      std::vector<std::vector<float>> data = partials;
      // Reduce-scatter: each rank's staging gets the peers' partials of its slice.
      std::vector<std::vector<float>> staging(ranks);
      for (int r = 0; r < ranks; ++r) {
        const SliceRange own = ReduceSlice(elements, ranks, r);
        staging[r].assign(static_cast<size_t>((ranks - 1) * own.size()), NAN);
        for (const PeerExchange& e : ReduceScatterExchanges(elements, ranks, r)) {
          // What peer e.peer sends to r: its exchange whose peer is r.
          const std::vector<PeerExchange> theirs = ReduceScatterExchanges(elements, ranks, e.peer);
          const PeerExchange& sent = *std::find_if(theirs.begin(), theirs.end(), [&](const PeerExchange& x) {
            return x.peer == r;
          });
          ASSERT_EQ(sent.send.size(), e.receive.size());
          ASSERT_EQ(sent.send.begin, own.begin);
          ASSERT_TRUE(e.staging >= 0 && e.staging < ranks - 1) << "staging block " << e.staging;
          std::copy_n(partials[e.peer].begin() + sent.send.begin, sent.send.size(),
                      staging[r].begin() + e.staging * own.size());  // (memcpy of an empty slice passes null)
        }
      }
      // Each owner sums its slice in rank order from the summands' sources.
      for (int r = 0; r < ranks; ++r) {
        const SliceRange own = ReduceSlice(elements, ranks, r);
        const std::vector<Summand> sources = ReduceSources(ranks, r, true);
        ASSERT_EQ(static_cast<int>(sources.size()), ranks);
        for (int64_t i = 0; i < own.size(); ++i) {
          float sum = 0;
          for (size_t k = 0; k < sources.size(); ++k) {
            EXPECT_EQ(sources[k].rank, static_cast<int>(k));
            const float v = sources[k].staging < 0 ? data[r][own.begin + i]
                                                   : staging[r][sources[k].staging * own.size() + i];
            sum = k == 0 ? v : sum + v;
          }
          data[r][own.begin + i] = sum;
        }
      }
      // All-gather: every rank receives each peer's reduced slice in place.
      std::vector<std::vector<float>> gathered = data;
      for (int r = 0; r < ranks; ++r) {
        for (const PeerExchange& e : AllGatherExchanges(elements, ranks, r)) {
          ASSERT_EQ(e.send.begin, ReduceSlice(elements, ranks, r).begin);
          std::copy_n(data[e.peer].begin() + e.receive.begin, e.receive.size(), gathered[r].begin() + e.receive.begin);
        }
      }
      const std::vector<float> want = RankOrderSum(partials);
      for (int r = 0; r < ranks; ++r) {
        EXPECT_EQ(0, std::memcmp(gathered[r].data(), want.data(), sizeof(float) * elements)) << "rank " << r;
      }
    }
  }
}

TEST(CollectivePlan, SourcesAreRankOrderedWithDistinctStagingBlocks) {
  for (const int ranks : {1, 2, 5, 8}) {
    for (int owner = 0; owner < ranks; ++owner) {
      const std::vector<Summand> direct = ReduceSources(ranks, owner, false);
      const std::vector<Summand> received = ReduceSources(ranks, owner, true);
      std::vector<bool> used(ranks > 1 ? ranks - 1 : 0, false);
      for (int k = 0; k < ranks; ++k) {
        EXPECT_EQ(direct[k].rank, k);
        EXPECT_EQ(direct[k].staging, -1);
        EXPECT_EQ(received[k].rank, k);
        if (k == owner) {
          EXPECT_EQ(received[k].staging, -1) << "the owner's own partial is read in place";
        } else {
          ASSERT_GE(received[k].staging, 0);
          ASSERT_LT(received[k].staging, ranks - 1);
          EXPECT_FALSE(used[received[k].staging]) << "two peers in one staging block";
          used[received[k].staging] = true;
        }
      }
    }
  }
}

}  // namespace
}  // namespace hsx
