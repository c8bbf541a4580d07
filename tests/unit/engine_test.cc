// engine_test.cc: the engine's device choice and its failure rule: a rank
// whose backend fails mid-batch fails the batch on every rank with its own
// error, nobody hangs in a collective, and the next batch runs normally.
#include <atomic>
#include <chrono>
#include <future>

#include "gtest/gtest.h"
#include "kernels/cpu/in_process_communicator.h"
#include "server/model/random_model.h"
#include "server/model/sample_states.h"
#include "server/runtime/engine.h"
#include "tests/unit/test_util.h"

namespace hsx {
namespace {

using ::hsx::testing::TempDir;

// Where a FaultyBackend fails: the n-th call (counting from 1) of Linear or of
// Allocate, once armed; 0 never.
struct Fault {
  std::atomic<int> linear_call{0};
  std::atomic<int> allocate_call{0};
};

// A CPU backend that fails on command. Linear's failure is an op error
// (recorded, reported by Synchronize, the forward pass runs on); Allocate's is
// immediate, so the rank leaves the batch early while others may be waiting in
// an all-reduce.
class FaultyBackend : public Backend {
 public:
  FaultyBackend(std::unique_ptr<Backend> inner, Fault* fault) : inner_(std::move(inner)), fault_(fault) {}

  Precision precision() const override { return inner_->precision(); }
  std::string name() const override { return "faulty-" + inner_->name(); }
  absl::StatusOr<std::unique_ptr<Buffer>> Allocate(int64_t rows, int64_t cols, ElementType type) override {
    if (fault_->allocate_call > 0 && ++allocations_ == fault_->allocate_call) {
      return absl::ResourceExhaustedError("injected: out of memory on this rank");
    }
    return inner_->Allocate(rows, cols, type);
  }
  absl::StatusOr<std::unique_ptr<HostBuffer>> AllocateHost(size_t bytes) override {
    return inner_->AllocateHost(bytes);
  }
  void CopyToHost(const Matrix& src, void* dst) override { inner_->CopyToHost(src, dst); }
  void CopyFromHost(const void* src, const Matrix& dst) override { inner_->CopyFromHost(src, dst); }
  absl::Status Synchronize() override {
    absl::Status inner = inner_->Synchronize();
    absl::Status injected = std::move(injected_);
    injected_ = absl::OkStatus();
    return injected.ok() ? inner : injected;
  }
  absl::StatusOr<LinearWeight> PlaceLinear(const LinearWeight& host) override { return inner_->PlaceLinear(host); }
  absl::StatusOr<const void*> PlaceTensor(const void* host, size_t bytes) override {
    return inner_->PlaceTensor(host, bytes);
  }
  absl::StatusOr<std::unique_ptr<ExpertTable>> PlaceExperts(std::span<const ExpertWeights> host,
                                                            std::span<const bool> held) override {
    return inner_->PlaceExperts(host, held);
  }
  int64_t placed_bytes() const override { return inner_->placed_bytes(); }
  absl::StatusOr<std::unique_ptr<StagedBatch>> Stage(std::span<const int32_t> tokens,
                                                     std::span<const int64_t> cu_seqlens) override {
    return inner_->Stage(tokens, cu_seqlens);
  }
  absl::StatusOr<std::unique_ptr<RopeTable>> PlaceRopeTable(std::span<const float> cos, std::span<const float> sin,
                                                           int64_t half_dim) override {
    return inner_->PlaceRopeTable(cos, sin, half_dim);
  }
  absl::StatusOr<std::unique_ptr<Routing>> AllocateRouting(int64_t tokens, int64_t top_k) override {
    return inner_->AllocateRouting(tokens, top_k);
  }
  void Embed(const StagedBatch& batch, const uint16_t* table, int64_t begin, int64_t rows,
             const Matrix& out) override {
    inner_->Embed(batch, table, begin, rows, out);
  }
  void Linear(const Matrix& x, const LinearWeight& w, const Matrix& y, bool partial) override {
    if (fault_->linear_call > 0 && ++linears_ == fault_->linear_call) {
      if (injected_.ok()) injected_ = absl::DataLossError("injected: a device fault in Linear");
      return;  // the op does not run; its output is garbage, as after a real fault
    }
    inner_->Linear(x, w, y, partial);
  }
  void Round(const Matrix& partial, const Matrix& out) override { inner_->Round(partial, out); }
  void RmsNorm(const Matrix& x, const uint16_t* w, float eps, const Matrix& y) override {
    inner_->RmsNorm(x, w, eps, y);
  }
  void Add(const Matrix& a, const Matrix& b, const Matrix& out) override { inner_->Add(a, b, out); }
  void SiluMul(const Matrix& g, const Matrix& u, const Matrix& out) override { inner_->SiluMul(g, u, out); }
  void Rope(const Matrix& x, int64_t heads, int64_t stride, int64_t offset, const StagedBatch& batch,
            const RopeTable& table) override {
    inner_->Rope(x, heads, stride, offset, batch, table);
  }
  void Attention(const Matrix& q, const Matrix& kv, const Matrix& k_rope, int64_t heads, int64_t nope,
                 int64_t rope, int64_t v, const StagedBatch& batch, float scale, const Matrix& out) override {
    inner_->Attention(q, kv, k_rope, heads, nope, rope, v, batch, scale, out);
  }
  void Route(const Matrix& x, const RouterParams& router, Routing& routing) override {
    inner_->Route(x, router, routing);
  }
  void MoeExperts(const Matrix& x, const Routing& routing, const ExpertTable& experts, const Matrix& out,
                  bool partial) override {
    inner_->MoeExperts(x, routing, experts, out, partial);
  }
  void CopyRoutingToHost(const Routing& routing, int32_t* experts, float* weights) override {
    inner_->CopyRoutingToHost(routing, experts, weights);
  }

  void ResetCounts() {
    linears_ = 0;
    allocations_ = 0;
  }

 private:
  std::unique_ptr<Backend> inner_;
  Fault* fault_;
  absl::Status injected_;
  int linears_ = 0;
  int allocations_ = 0;
};

// CPU ranks; rank `faulty_rank` gets a FaultyBackend driven by `fault`.
class FaultyFactory : public DeviceFactory {
 public:
  FaultyFactory(int faulty_rank, Fault* fault) : faulty_rank_(faulty_rank), fault_(fault) {}
  absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(int rank) override {
    std::unique_ptr<Backend> cpu = MakeCpuBackend(Precision::kBf16, 1);
    if (rank != faulty_rank_) return cpu;
    auto faulty = std::make_unique<FaultyBackend>(std::move(cpu), fault_);
    faulty_ = faulty.get();
    return faulty;
  }
  absl::StatusOr<std::unique_ptr<CommunicatorGroup>> MakeGroup(std::span<Backend* const> backends) override {
    return std::make_unique<InProcessGroup>(static_cast<int>(backends.size()));
  }
  FaultyBackend* faulty() const { return faulty_; }

 private:
  int faulty_rank_;
  Fault* fault_;
  FaultyBackend* faulty_ = nullptr;
};

class EngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    ModelConfig config = *PresetConfig("tiny");
    config.num_hidden_layers = 3;
    ASSERT_TRUE(WriteRandomCheckpoint(config, (*dir_) / "m", GeneratorOptions{}).ok());
    checkpoint_ = Checkpoint::Open((*dir_) / "m")->release();
  }
  static void TearDownTestSuite() {
    delete checkpoint_;
    delete dir_;
  }

  static Batch TestBatch() {
    Batch batch;
    batch.AddSample({1, 2, 3, 4, 5, 6, 7});
    batch.AddSample({9, 8, 7});
    return batch;
  }
  static CaptureSpec AllLayers() { return *ParseCaptureSpec("all", checkpoint_->config(), true); }

  // Runs a batch on another thread; fails the test instead of hanging.
  static absl::StatusOr<std::vector<SampleStates>> RunBounded(Engine& engine) {
    auto result = std::async(std::launch::async, [&]() -> absl::StatusOr<std::vector<SampleStates>> {
      const Batch batch = TestBatch();
      absl::StatusOr<Captures> captures = engine.Run(batch, AllLayers());
      if (!captures.ok()) return captures.status();
      return SplitBySample(*captures, batch.cu_seqlens);
    });
    if (result.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
      ADD_FAILURE() << "the engine hung";
      std::abort();  // a hung rank thread cannot be joined
    }
    return result.get();
  }

  static TempDir* dir_;
  static Checkpoint* checkpoint_;
};

TempDir* EngineTest::dir_ = nullptr;
Checkpoint* EngineTest::checkpoint_ = nullptr;

// Where --device cuda cannot run (a build without CUDA, or no device), the
// engine says which, and nothing is loaded.
TEST_F(EngineTest, CudaIsRefusedClearlyWhereItCannotRun) {
  absl::StatusOr<std::unique_ptr<Engine>> engine =
      Engine::Create(*checkpoint_, {.tp = 1, .precision = Precision::kBf16, .threads = 1, .device = Device::kCuda});
  if (engine.ok()) GTEST_SKIP() << "a CUDA device is present: the CUDA tests cover it";
  const std::string message(engine.status().message());
  const bool no_build = engine.status().code() == absl::StatusCode::kUnimplemented &&
                        message.find("not available in this build") != std::string::npos;
  const bool no_device = engine.status().code() == absl::StatusCode::kFailedPrecondition &&
                         message.find("--device cuda: no CUDA device") != std::string::npos;
  EXPECT_TRUE(no_build || no_device) << engine.status();
  EXPECT_FALSE(ParseDevice("tpu").ok());
}

TEST_F(EngineTest, AFailingRankFailsTheBatchEverywhereAndTheNextBatchRuns) {
  absl::StatusOr<std::unique_ptr<Engine>> clean =
      Engine::Create(*checkpoint_, {.tp = 2, .precision = Precision::kBf16, .threads = 2});
  ASSERT_TRUE(clean.ok()) << clean.status();
  const absl::StatusOr<std::vector<SampleStates>> expected = RunBounded(**clean);
  ASSERT_TRUE(expected.ok()) << expected.status();

  for (const int tp : {2, 4}) {
    for (const bool in_allocate : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "TP " << tp << (in_allocate ? ", allocation" : ", Linear op"));
      Fault fault;
      auto factory = std::make_shared<FaultyFactory>(1, &fault);
      absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(
          *checkpoint_, {.tp = tp, .precision = Precision::kBf16, .threads = tp, .factory = factory});
      ASSERT_TRUE(engine.ok()) << engine.status();
      // Mid-batch: the 5th Linear (layer 0's attention) or the 12th allocation.
      (in_allocate ? fault.allocate_call : fault.linear_call) = in_allocate ? 12 : 5;
      const absl::StatusOr<std::vector<SampleStates>> failed = RunBounded(**engine);
      ASSERT_FALSE(failed.ok());
      EXPECT_EQ(failed.status().code(), in_allocate ? absl::StatusCode::kResourceExhausted
                                                    : absl::StatusCode::kDataLoss)
          << failed.status();
      EXPECT_NE(failed.status().message().find("injected"), std::string::npos) << failed.status();

      fault.linear_call = 0;
      fault.allocate_call = 0;
      const absl::StatusOr<std::vector<SampleStates>> next = RunBounded(**engine);
      ASSERT_TRUE(next.ok()) << next.status();
      if (tp == 2) {
        ASSERT_EQ(next->size(), expected->size());
        for (size_t s = 0; s < next->size(); ++s) {
          EXPECT_EQ((*next)[s].hidden_states, (*expected)[s].hidden_states) << "sample " << s;
        }
      }
    }
  }
}

}  // namespace
}  // namespace hsx
