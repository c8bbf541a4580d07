// Property tests: a sample's states do not depend on its batch, on the batch
// budget or order, and (within float32 rounding) on the tensor-parallel degree.
#include <atomic>
#include <chrono>
#include <cmath>
#include <map>
#include <random>
#include <thread>

#include "gtest/gtest.h"
#include "server/model/random_model.h"
#include "server/runtime/batcher.h"
#include "server/runtime/engine.h"
#include "tests/unit/float_states.h"
#include "tests/unit/test_util.h"

namespace hsx {
namespace {

using ::hsx::testing::FloatStates;
using ::hsx::testing::SplitBySample;
using ::hsx::testing::TempDir;
using ::hsx::testing::Widen;

std::vector<FloatStates> RunBatchFree(Engine& engine, const std::vector<std::vector<int32_t>>& samples,
                                       const CaptureSpec& capture) {
  Batch batch;
  for (const auto& s : samples) batch.AddSample(s);
  absl::StatusOr<Captures> captures = engine.Run(batch, capture);
  EXPECT_TRUE(captures.ok()) << captures.status();
  return SplitBySample(*captures, batch.cu_seqlens);
}

// A small model whose head and intermediate counts allow TP up to 8.
class InvarianceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    ModelConfig config = *PresetConfig("tiny");
    config.num_attention_heads = 8;
    config.num_key_value_heads = 8;
    config.num_hidden_layers = 4;
    config.vocab_size = 512;
    GeneratorOptions options;
    options.seed = 9;
    ASSERT_TRUE(WriteRandomCheckpoint(config, (*dir_) / "m", options).ok());
    checkpoint_ = Checkpoint::Open((*dir_) / "m")->release();
  }
  static void TearDownTestSuite() {
    delete checkpoint_;
    delete dir_;
  }

  static Engine& GetEngine(int tp, ElementType precision) {
    static std::map<std::pair<int, ElementType>, std::unique_ptr<Engine>> engines;
    auto& engine = engines[{tp, precision}];
    if (!engine) engine = *Engine::Create(*checkpoint_, {tp, precision, 2});
    return *engine;
  }

  static CaptureSpec AllLayers() { return CaptureSpec::All(static_cast<int>(checkpoint_->config().num_hidden_layers), true); }

  static std::vector<FloatStates> RunBatch(Engine& engine, const std::vector<std::vector<int32_t>>& samples) {
    return RunBatchFree(engine, samples, AllLayers());
  }

  static TempDir* dir_;
  static Checkpoint* checkpoint_;
};

TempDir* InvarianceTest::dir_ = nullptr;
Checkpoint* InvarianceTest::checkpoint_ = nullptr;

std::vector<int32_t> RandomTokens(std::mt19937& random, int64_t length, int64_t vocab) {
  std::vector<int32_t> tokens(length);
  for (int32_t& t : tokens) t = static_cast<int32_t>(random() % vocab);
  return tokens;
}

bool SameStates(const FloatStates& a, const FloatStates& b) {
  return a.tokens == b.tokens && a.capture_ids == b.capture_ids && a.hidden_states == b.hidden_states &&
         a.final_norm == b.final_norm;
}

double RelativeError(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    norm += double(want[i]) * want[i];
  }
  return std::sqrt(diff / norm);
}

// Indices of the samples whose batched states differ from their solo runs.
std::vector<size_t> Mismatches(const std::vector<FloatStates>& batched, const std::vector<FloatStates>& solo) {
  std::vector<size_t> bad;
  for (size_t i = 0; i < solo.size(); ++i) {
    if (i >= batched.size() || !SameStates(batched[i], solo[i])) bad.push_back(i);
  }
  return bad;
}

// Packs `samples` with random budgets through the batcher's packing rule and
// returns each sample's states, in input order.
std::vector<FloatStates> RunPacked(Engine& engine, const std::vector<std::vector<int32_t>>& samples,
                                    int64_t budget, const CaptureSpec& capture) {
  std::vector<size_t> pending(samples.size());
  for (size_t i = 0; i < samples.size(); ++i) pending[i] = i;
  std::vector<FloatStates> out(samples.size());
  while (!pending.empty()) {
    std::vector<int64_t> lengths;
    for (size_t i : pending) lengths.push_back(static_cast<int64_t>(samples[i].size()));
    std::vector<size_t> chosen = PackNext(lengths, budget, 64);
    std::vector<std::vector<int32_t>> batch;
    for (size_t c : chosen) batch.push_back(samples[pending[c]]);
    std::vector<FloatStates> states = RunBatchFree(engine, batch, capture);
    for (size_t k = 0; k < chosen.size(); ++k) out[pending[chosen[k]]] = std::move(states[k]);
    for (auto it = chosen.rbegin(); it != chosen.rend(); ++it) pending.erase(pending.begin() + *it);
  }
  return out;
}

TEST_F(InvarianceTest, BatchedEqualsSoloBitForBitOverManySeeds) {
  const int64_t vocab = checkpoint_->config().vocab_size;
  for (ElementType precision : {ElementType::kF32, ElementType::kBf16}) {
    for (int tp : {1, 2, 4}) {
      Engine& engine = GetEngine(tp, precision);
      for (int seed = 0; seed < 20; ++seed) {
        std::mt19937 random(seed * 31 + tp);
        const int count = 2 + random() % 6;
        std::vector<std::vector<int32_t>> samples;
        for (int i = 0; i < count; ++i) samples.push_back(RandomTokens(random, 1 + random() % 48, vocab));
        std::vector<FloatStates> solo;
        for (const auto& s : samples) solo.push_back(RunBatch(engine, {s})[0]);
        const int64_t budget = 48 + random() % 160;
        std::vector<FloatStates> packed = RunPacked(engine, samples, budget, AllLayers());
        EXPECT_TRUE(Mismatches(packed, solo).empty())
            << "seed " << seed << " tp " << tp << " budget " << budget;
        // Reversed order, all in one batch.
        std::vector<std::vector<int32_t>> reversed(samples.rbegin(), samples.rend());
        std::vector<FloatStates> together = RunBatch(engine, reversed);
        std::reverse(together.begin(), together.end());
        EXPECT_TRUE(Mismatches(together, solo).empty()) << "seed " << seed << " tp " << tp;
      }
    }
  }
}

// Samples longer than the CPU attention's 64-row query blocks, up to 300
// tokens, packed with short ones: still bitwise equal to their solo runs.
TEST_F(InvarianceTest, LongSamplesBatchedEqualSoloBitForBit) {
  const int64_t vocab = checkpoint_->config().vocab_size;
  for (ElementType precision : {ElementType::kF32, ElementType::kBf16}) {
    for (int tp : {1, 4}) {
      Engine& engine = GetEngine(tp, precision);
      for (int seed = 0; seed < 3; ++seed) {
        std::mt19937 random(seed * 131 + tp);
        std::vector<std::vector<int32_t>> samples;
        for (int64_t length : {int64_t{300}, 1 + static_cast<int64_t>(random() % 20), 65 + static_cast<int64_t>(random() % 100)}) {
          samples.push_back(RandomTokens(random, length, vocab));
        }
        std::vector<FloatStates> solo;
        for (const auto& s : samples) solo.push_back(RunBatch(engine, {s})[0]);
        EXPECT_TRUE(Mismatches(RunBatch(engine, samples), solo).empty()) << "seed " << seed << " tp " << tp;
      }
    }
  }
}

TEST_F(InvarianceTest, TensorParallelDegreesAgreeWithinFloat32Rounding) {
  std::mt19937 random(77);
  std::vector<std::vector<int32_t>> samples;
  for (int64_t length : {1, 7, 33, 64}) samples.push_back(RandomTokens(random, length, checkpoint_->config().vocab_size));
  std::vector<FloatStates> reference = RunBatch(GetEngine(1, ElementType::kF32), samples);
  for (int tp : {2, 4, 8}) {
    std::vector<FloatStates> split = RunBatch(GetEngine(tp, ElementType::kF32), samples);
    for (size_t i = 0; i < samples.size(); ++i) {
      EXPECT_LE(RelativeError(split[i].hidden_states, reference[i].hidden_states), 1e-5) << "tp " << tp;
      EXPECT_LE(RelativeError(split[i].final_norm, reference[i].final_norm), 1e-5) << "tp " << tp;
    }
  }
}

// A split that puts one row of each sample into its neighbour: what a wrong
// cu_seqlens would do. The invariance check must notice.
std::vector<FloatStates> SplitOffByOne(const Captures& captures, std::vector<int64_t> cu_seqlens) {
  for (size_t s = 1; s + 1 < cu_seqlens.size(); ++s) cu_seqlens[s] -= 1;
  return SplitBySample(captures, cu_seqlens);
}

TEST_F(InvarianceTest, AnOffByOneSplitIsCaught) {
  Engine& engine = GetEngine(1, ElementType::kF32);
  std::mt19937 random(5);
  std::vector<std::vector<int32_t>> samples;
  for (int64_t length : {9, 4, 12}) samples.push_back(RandomTokens(random, length, checkpoint_->config().vocab_size));
  std::vector<FloatStates> solo;
  for (const auto& s : samples) solo.push_back(RunBatch(engine, {s})[0]);
  Batch batch;
  for (const auto& s : samples) batch.AddSample(s);
  absl::StatusOr<Captures> captures = engine.Run(batch, AllLayers());
  ASSERT_TRUE(captures.ok());
  EXPECT_TRUE(Mismatches(SplitBySample(*captures, batch.cu_seqlens), solo).empty());
  EXPECT_EQ(Mismatches(SplitOffByOne(*captures, batch.cu_seqlens), solo), (std::vector<size_t>{0, 1, 2}));
}

TEST_F(InvarianceTest, SamplesOf512And259TokensComeBackWhole) {
  Engine& engine = GetEngine(1, ElementType::kBf16);
  std::mt19937 random(1);
  const std::vector<std::vector<int32_t>> samples = {RandomTokens(random, 512, 512), RandomTokens(random, 259, 512)};
  std::vector<FloatStates> states = RunBatch(engine, samples);
  ASSERT_EQ(states.size(), 2u);
  const int64_t layers = checkpoint_->config().num_hidden_layers + 1;
  const int64_t hidden = checkpoint_->config().hidden_size;
  EXPECT_EQ(states[0].tokens, 512);
  EXPECT_EQ(states[1].tokens, 259);
  EXPECT_EQ(states[0].hidden_states.size(), static_cast<size_t>(512 * layers * hidden));
  EXPECT_EQ(states[1].hidden_states.size(), static_cast<size_t>(259 * layers * hidden));
  // And the contents are each sample's own: equal to solo runs, bit for bit.
  EXPECT_TRUE(SameStates(states[0], RunBatch(engine, {samples[0]})[0]));
  EXPECT_TRUE(SameStates(states[1], RunBatch(engine, {samples[1]})[0]));
}

TEST_F(InvarianceTest, BatcherDeliversEachSampleItsOwnCapture) {
  Engine& engine = GetEngine(2, ElementType::kBf16);
  const ModelConfig& c = checkpoint_->config();
  std::mt19937 random(12);
  const std::vector<std::string> specs = {"0,2", "4", "eagle3", "all"};
  std::vector<std::vector<int32_t>> samples;
  std::vector<CaptureSpec> wanted;
  for (int i = 0; i < 12; ++i) {
    samples.push_back(RandomTokens(random, 1 + random() % 40, c.vocab_size));
    wanted.push_back(*CaptureSpec::Parse(specs[i % specs.size()], static_cast<int>(c.num_hidden_layers), i % 3 == 0));
  }
  std::vector<absl::StatusOr<FloatStates>> got(samples.size(), absl::UnknownError("not delivered"));
  {
    BatcherOptions options;
    options.max_batch_tokens = 64;
    Batcher batcher(engine, options);
    for (size_t i = 0; i < samples.size(); ++i) {
      ASSERT_TRUE(batcher.Submit({samples[i], wanted[i],
                                  [&got, i](absl::StatusOr<SampleTensors> s) { got[i] = Widen(s); },
                                  /*abandoned=*/nullptr})
                      .ok());
    }
  }  // the destructor finishes every queued sample
  for (size_t i = 0; i < samples.size(); ++i) {
    ASSERT_TRUE(got[i].ok()) << got[i].status();
    const FloatStates solo = RunBatchFree(engine, {samples[i]}, wanted[i])[0];
    EXPECT_TRUE(SameStates(*got[i], solo)) << "sample " << i;
    EXPECT_EQ(got[i]->capture_ids, wanted[i].ids());
    EXPECT_EQ(got[i]->final_norm.empty(), !wanted[i].final_norm());
  }
  BatcherOptions small;
  small.max_batch_tokens = 8;
  Batcher batcher(engine, small);
  EXPECT_FALSE(batcher.Submit({std::vector<int32_t>(9, 1), wanted[0], [](auto) {}, nullptr}).ok());
}

// Delivery runs one batch behind the engine (batcher.h): while the first
// batch's consumer holds its sample, the second batch runs, and the third
// waits until the first is delivered (two batches' buffers at most).
TEST_F(InvarianceTest, TheNextBatchRunsWhileThePreviousIsDelivered) {
  Engine& engine = GetEngine(1, ElementType::kF32);
  const CaptureSpec capture = AllLayers();
  BatcherOptions options;
  options.max_batch_tokens = 8;  // one 8-token sample per batch
  std::atomic<Batcher*> running{nullptr};
  bool second_ran_meanwhile = false;
  int64_t ran_while_held = -1;
  std::vector<int> order;
  {
    Batcher batcher(engine, options);
    running = &batcher;
    auto record = [&order](int i) {
      return [&order, i](absl::StatusOr<SampleTensors> s) { order.push_back(s.ok() ? i : -i); };
    };
    WorkItem first{std::vector<int32_t>(8, 1), capture, nullptr, nullptr};
    first.deliver = [&](absl::StatusOr<SampleTensors> s) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (running.load()->batches_run() < 2 && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      second_ran_meanwhile = running.load()->batches_run() >= 2;
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // time for a third batch, were it allowed
      ran_while_held = running.load()->batches_run();
      order.push_back(s.ok() ? 1 : -1);
    };
    ASSERT_TRUE(batcher.Submit(std::move(first)).ok());
    ASSERT_TRUE(batcher.Submit({std::vector<int32_t>(8, 2), capture, record(2), nullptr}).ok());
    ASSERT_TRUE(batcher.Submit({std::vector<int32_t>(8, 3), capture, record(3), nullptr}).ok());
  }  // the destructor delivers every sample
  EXPECT_TRUE(second_ran_meanwhile) << "the second batch did not run while the first was being delivered";
  EXPECT_EQ(ran_while_held, 2) << "a third batch ran while two were undelivered";
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
}

TEST_F(InvarianceTest, AbandonedSamplesAreDroppedNotComputed) {
  Engine& engine = GetEngine(1, ElementType::kF32);
  const CaptureSpec capture = AllLayers();
  std::atomic<bool> gone{true};
  absl::Status dropped = absl::OkStatus();
  bool kept_ran = false;
  {
    Batcher batcher(engine, BatcherOptions{});
    ASSERT_TRUE(batcher.Submit({std::vector<int32_t>(5, 3), capture,
                                [&](absl::StatusOr<SampleTensors> s) { dropped = s.status(); },
                                [&] { return gone.load(); }})
                    .ok());
    ASSERT_TRUE(batcher.Submit({std::vector<int32_t>(4, 2), capture,
                                [&](absl::StatusOr<SampleTensors> s) { kept_ran = s.ok(); }, nullptr})
                    .ok());
  }
  EXPECT_EQ(dropped.code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(kept_ran);
}

TEST(Packing, OldestAlwaysRunsAndBudgetHolds) {
  EXPECT_EQ(PackNext({5000, 10, 20}, 4096, 8), (std::vector<size_t>{0}));  // oversized head runs alone
  EXPECT_EQ(PackNext({100, 4000, 50, 46}, 200, 8), (std::vector<size_t>{0, 2, 3}));
  EXPECT_EQ(PackNext({100, 4000, 50, 46}, 200, 2), (std::vector<size_t>{0}));  // lookahead bounds the scan
}

}  // namespace
}  // namespace hsx
