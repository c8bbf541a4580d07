// cuda_communicator_test.cc: the CUDA all-reduce transports against the
// collective plan run on the host (AllReduceByPlan, what the CPU's in-process
// communicator does), bitwise, for rank counts and sizes that leave slices
// empty, uneven and granule-misaligned; the precise errors for bad input; and
// Abort() waking a rank that waits for one that will not come. The
// same-device transport needs one GPU, NCCL two; each skips with the reason.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/collective_plan.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_communicator.h"
#include "tests/common/value_comparison.h"
#include "tests/cuda/cuda_test_util.h"

namespace hsx {
namespace {

enum class Transport { kSameDevice, kNccl };

class CudaCommunicatorTest : public ::testing::TestWithParam<Transport> {
 protected:
  void SetUp() override {
    HSX_SKIP_WITHOUT_CUDA();
    gpus_ = *CudaDeviceCount();
    if (GetParam() == Transport::kNccl && gpus_ < 2) {
      GTEST_SKIP() << "NCCL needs 2 or more GPUs (it refuses two ranks on one); this machine has " << gpus_;
    }
  }

  // The most ranks this transport can have here.
  int MaxRanks() const { return GetParam() == Transport::kNccl ? std::min(gpus_, 8) : 8; }

  // `ranks` backends and their group.
  void MakeGroup(int ranks) {
    backends_.clear();
    for (int r = 0; r < ranks; ++r) {
      absl::StatusOr<std::unique_ptr<Backend>> b =
          MakeCudaBackend(GetParam() == Transport::kNccl ? r : 0, ElementType::kF32);
      ASSERT_TRUE(b.ok()) << b.status();
      backends_.push_back(*std::move(b));
    }
    std::vector<Backend*> raw;
    for (auto& b : backends_) raw.push_back(b.get());
    absl::StatusOr<std::unique_ptr<CommunicatorGroup>> group =
        GetParam() == Transport::kNccl ? MakeNcclGroup(raw) : MakeSameDeviceGroup(raw);
    ASSERT_TRUE(group.ok()) << group.status();
    group_ = *std::move(group);
  }

  // Every rank's AllReduceSum at once, each on its own thread. As the engine
  // does, a failed rank aborts the group, so that a rank failing before the
  // barrier (or, on NCCL, before its sends) fails the others instead of
  // leaving them waiting forever; the group is re-armed afterwards.
  std::vector<absl::Status> AllReduce(const std::vector<Matrix>& data) {
    std::vector<absl::Status> results(data.size());
    std::vector<std::thread> threads;
    for (size_t r = 0; r < data.size(); ++r) {
      threads.emplace_back([&, r] {
        results[r] = group_->rank(static_cast<int>(r))->AllReduceSum(data[r]);
        if (!results[r].ok()) group_->Abort(results[r]);
      });
    }
    for (auto& t : threads) t.join();
    for (const absl::Status& s : results) {
      if (!s.ok()) {
        const absl::Status reset = group_->Reset();
        EXPECT_TRUE(reset.ok()) << reset;
        break;
      }
    }
    return results;
  }

  int gpus_ = 0;
  std::vector<std::unique_ptr<Backend>> backends_;  // destroyed after group_ (declared first)
  std::unique_ptr<CommunicatorGroup> group_;
};

TEST_P(CudaCommunicatorTest, SumsExactlyAsThePlanOnTheHost) {
  for (int ranks = 2; ranks <= MaxRanks(); ranks *= 2) {
    for (const int64_t rows : {int64_t{1}, int64_t{3}, int64_t{65}}) {
      const int64_t cols = rows == 1 ? 5 : 7168 / 16 + 3;  // not a multiple of the granule
      SCOPED_TRACE(::testing::Message() << ranks << " ranks, " << rows << " x " << cols);
      MakeGroup(ranks);
      ASSERT_FALSE(HasFatalFailure());
      std::mt19937 random(static_cast<uint32_t>(ranks * 100 + rows));
      std::normal_distribution<float> normal(0.0f, 1.0f);
      std::vector<std::vector<float>> host(ranks, std::vector<float>(static_cast<size_t>(rows * cols)));
      std::vector<std::unique_ptr<Buffer>> buffers;
      std::vector<Matrix> data;
      for (int r = 0; r < ranks; ++r) {
        for (float& v : host[r]) v = normal(random) * std::ldexp(1.0f, static_cast<int>(random() % 16) - 8);
        absl::StatusOr<std::unique_ptr<Buffer>> b = backends_[r]->Allocate(rows, cols, ElementType::kF32);
        ASSERT_TRUE(b.ok()) << b.status();
        ASSERT_EQ((*b)->matrix().ld, cols);
        backends_[r]->CopyFromHost(host[r].data(), (*b)->matrix());
        ASSERT_TRUE(backends_[r]->Synchronize().ok());
        data.push_back((*b)->matrix());
        buffers.push_back(*std::move(b));
      }
      for (const absl::Status& s : AllReduce(data)) ASSERT_TRUE(s.ok()) << s;
      std::vector<float*> pointers;
      for (auto& h : host) pointers.push_back(h.data());
      AllReduceByPlan(pointers, rows * cols);
      for (int r = 0; r < ranks; ++r) {
        std::vector<float> got(static_cast<size_t>(rows * cols));
        backends_[r]->CopyToHost(data[r], got.data());
        ASSERT_TRUE(backends_[r]->Synchronize().ok());
        EXPECT_TRUE(::hsx::testing::ValuesMatch(
            {absl::StrCat("AllReduce (", ranks, " ranks) on rank ", r, " vs the host plan"), {rows, cols}, "fp32"},
            got, host[r], 0));
      }
      buffers.clear();
      group_.reset();
    }
  }
}

TEST_P(CudaCommunicatorTest, BadInputIsNamedOnEveryRank) {
  MakeGroup(2);
  ASSERT_FALSE(HasFatalFailure());
  std::vector<std::unique_ptr<Buffer>> buffers;
  std::vector<Matrix> bf16, sizes;
  for (int r = 0; r < 2; ++r) {
    buffers.push_back(*backends_[r]->Allocate(4, 8, ElementType::kBf16));
    bf16.push_back(buffers.back()->matrix());
    buffers.push_back(*backends_[r]->Allocate(r == 0 ? 4 : 5, 8, ElementType::kF32));
    sizes.push_back(buffers.back()->matrix());
  }
  for (const absl::Status& s : AllReduce(bf16)) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("partials must be f32, got bf16"), std::string::npos) << s;
  }
  for (const absl::Status& s : AllReduce(sizes)) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find(" elements, this rank "), std::string::npos) << s;
  }
}

TEST_P(CudaCommunicatorTest, AbortWakesARankWaitingForAnother) {
  MakeGroup(2);
  ASSERT_FALSE(HasFatalFailure());
  std::unique_ptr<Buffer> buffer = *backends_[0]->Allocate(2, 64, ElementType::kF32);
  absl::Status waited;
  std::thread rank0([&] { waited = group_->rank(0)->AllReduceSum(buffer->matrix()); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // rank 1 never comes
  group_->Abort(absl::InternalError("rank 1 failed on purpose"));
  rank0.join();
  EXPECT_EQ(waited, absl::InternalError("rank 1 failed on purpose"));
  // Re-armed, the group works again.
  ASSERT_TRUE(group_->Reset().ok());
  std::unique_ptr<Buffer> other = *backends_[1]->Allocate(2, 64, ElementType::kF32);
  for (const absl::Status& s : AllReduce({buffer->matrix(), other->matrix()})) EXPECT_TRUE(s.ok()) << s;
}

INSTANTIATE_TEST_SUITE_P(Transports, CudaCommunicatorTest,
                         ::testing::Values(Transport::kSameDevice, Transport::kNccl),
                         [](const auto& param_info) { return param_info.param == Transport::kNccl ? "nccl" : "same_device"; });

}  // namespace
}  // namespace hsx
