// engine_test.cc: the engine's device choice and its failure rule: a rank
// whose backend fails mid-batch fails the batch on every rank with its own
// error, nobody hangs in a collective, and the next batch runs normally;
// unless the rank's device is lost: then that batch, every queued and every
// later sample fail with UNAVAILABLE naming the rank, and the server's health
// turns NOT_SERVING (server/service/device_loss.h).
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <future>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "format/tensor_encoding.h"
#include "kernels/cpu/in_process_communicator.h"
#include "kernels/device_lost.h"
#include "kernels/forwarding_backend.h"
#include "server/model/random_model.h"
#include "server/model/capture_views.h"
#include "server/runtime/capture_check.h"
#include "server/runtime/batcher.h"
#include "server/runtime/engine.h"
#include "server/service/device_loss.h"
#include "server/service/health.h"
#include "server/service/metrics.h"
#include "tests/unit/float_states.h"
#include "tests/unit/test_util.h"

namespace hsx {
namespace {

using ::hsx::testing::FloatStates;
using ::hsx::testing::SplitBySample;
using ::hsx::testing::Widen;

using ::hsx::testing::TempDir;

// Where a FaultyBackend fails: the n-th call (counting from 1) of Linear or of
// Allocate, once armed; 0 never. With `device_lost`, the failure is marked as
// a lost device (kernels/device_lost.h), as a sticky CUDA error is. `stages`
// counts the batches the faulty rank staged.
struct Fault {
  std::atomic<int> linear_call{0};
  std::atomic<int> allocate_call{0};
  std::atomic<bool> device_lost{false};
  std::atomic<int> stages{0};
  // The group's Reset() fails, as NCCL's would if its communicators cannot be made anew.
  std::atomic<bool> reset_fails{false};
};

// The in-process group, whose re-arming fails on command.
class FaultyGroup : public CommunicatorGroup {
 public:
  FaultyGroup(int ranks, Fault* fault) : inner_(ranks), fault_(fault) {}
  int size() const override { return inner_.size(); }
  Communicator* rank(int rank) override { return inner_.rank(rank); }
  void Abort(const absl::Status& why) override { inner_.Abort(why); }
  absl::Status Reset() override {
    if (fault_->reset_fails) return absl::FailedPreconditionError("injected: ncclCommInitAll: unhandled cuda error");
    return inner_.Reset();
  }

 private:
  InProcessGroup inner_;
  Fault* fault_;
};

// A CPU backend that fails on command. Linear's failure is an op error
// (recorded, reported by Synchronize, the forward pass runs on); Allocate's is
// immediate, so the rank leaves the batch early while others may be waiting in
// an all-reduce.
class FaultyBackend : public ForwardingBackend {
 public:
  FaultyBackend(std::unique_ptr<Backend> inner, Fault* fault) : ForwardingBackend(std::move(inner)), fault_(fault) {}

  std::string name() const override { return "faulty-" + ForwardingBackend::name(); }
  absl::StatusOr<std::unique_ptr<Buffer>> Allocate(int64_t rows, int64_t cols, ElementType type) override {
    if (fault_->allocate_call > 0 && ++allocations_ == fault_->allocate_call) {
      return Injected(absl::ResourceExhaustedError("injected: out of memory on this rank"),
                      "injected: cudaErrorIllegalAddress in Allocate");
    }
    return ForwardingBackend::Allocate(rows, cols, type);
  }
  absl::Status Synchronize() override {
    absl::Status inner = ForwardingBackend::Synchronize();
    absl::Status injected = std::move(injected_);
    injected_ = absl::OkStatus();
    return injected.ok() ? inner : injected;
  }
  absl::StatusOr<std::unique_ptr<StagedBatch>> Stage(std::span<const int32_t> tokens,
                                                     std::span<const int64_t> cu_seqlens) override {
    ++fault_->stages;
    return ForwardingBackend::Stage(tokens, cu_seqlens);
  }
  void Linear(const Matrix& x, const LinearWeight& w, const Matrix& y, bool partial) override {
    if (fault_->linear_call > 0 && ++linears_ == fault_->linear_call) {
      if (injected_.ok()) {
        injected_ = Injected(absl::DataLossError("injected: a device fault in Linear"),
                             "injected: cudaErrorLaunchFailure in Linear");
      }
      return;  // the op does not run; its output is garbage, as after a real fault
    }
    ForwardingBackend::Linear(x, w, y, partial);
  }

  void ResetCounts() {
    linears_ = 0;
    allocations_ = 0;
  }

 private:
  // The batch error, or (device_lost) the lost-device error a CUDA backend
  // would report: INTERNAL, marked.
  absl::Status Injected(absl::Status batch_error, const char* lost_message) const {
    if (!fault_->device_lost) return batch_error;
    return MarkDeviceLost(absl::InternalError(absl::StrCat(name(), " ", lost_message)), name());
  }

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
    std::unique_ptr<Backend> cpu = MakeCpuBackend(ElementType::kBf16, 1);
    if (rank != faulty_rank_) return cpu;
    auto faulty = std::make_unique<FaultyBackend>(std::move(cpu), fault_);
    faulty_ = faulty.get();
    return faulty;
  }
  absl::StatusOr<std::unique_ptr<CommunicatorGroup>> MakeGroup(std::span<Backend* const> backends) override {
    return std::make_unique<FaultyGroup>(static_cast<int>(backends.size()), fault_);
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
  static CaptureSpec AllLayers() { return CaptureSpec::All(static_cast<int>(checkpoint_->config().num_hidden_layers), true); }

  // Runs a batch on another thread; fails the test instead of hanging.
  static absl::StatusOr<std::vector<FloatStates>> RunBounded(Engine& engine) {
    auto result = std::async(std::launch::async, [&]() -> absl::StatusOr<std::vector<FloatStates>> {
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
      Engine::Create(*checkpoint_, {.tp = 1, .precision = ElementType::kBf16, .threads = 1, .device = Device::kCuda});
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
      Engine::Create(*checkpoint_, {.tp = 2, .precision = ElementType::kBf16, .threads = 2});
  ASSERT_TRUE(clean.ok()) << clean.status();
  const absl::StatusOr<std::vector<FloatStates>> expected = RunBounded(**clean);
  ASSERT_TRUE(expected.ok()) << expected.status();

  for (const int tp : {2, 4}) {
    for (const bool in_allocate : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "TP " << tp << (in_allocate ? ", allocation" : ", Linear op"));
      Fault fault;
      auto factory = std::make_shared<FaultyFactory>(1, &fault);
      absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(
          *checkpoint_, {.tp = tp, .precision = ElementType::kBf16, .threads = tp, .factory = factory});
      ASSERT_TRUE(engine.ok()) << engine.status();
      // Mid-batch: the 5th Linear (layer 0's attention) or the 12th allocation.
      (in_allocate ? fault.allocate_call : fault.linear_call) = in_allocate ? 12 : 5;
      const absl::StatusOr<std::vector<FloatStates>> failed = RunBounded(**engine);
      ASSERT_FALSE(failed.ok());
      EXPECT_EQ(failed.status().code(), in_allocate ? absl::StatusCode::kResourceExhausted
                                                    : absl::StatusCode::kDataLoss)
          << failed.status();
      EXPECT_NE(failed.status().message().find("injected"), std::string::npos) << failed.status();

      fault.linear_call = 0;
      fault.allocate_call = 0;
      const absl::StatusOr<std::vector<FloatStates>> next = RunBounded(**engine);
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

// Rank 1 records an op error (its first Linear) and then leaves the batch at a
// failed allocation, before the Synchronize() that would have reported and
// cleared the op error: the batch fails with the allocation's error, and the
// next batch must not inherit the op's.
TEST_F(EngineTest, AnOpErrorOfARankThatLeftEarlyDoesNotFailTheNextBatch) {
  Fault fault;
  auto factory = std::make_shared<FaultyFactory>(1, &fault);
  absl::StatusOr<std::unique_ptr<Engine>> engine =
      Engine::Create(*checkpoint_, {.tp = 2, .precision = ElementType::kBf16, .threads = 2, .factory = factory});
  ASSERT_TRUE(engine.ok()) << engine.status();
  ASSERT_TRUE(RunBounded(**engine).ok());  // places the rotary table: later batches do not synchronize early
  factory->faulty()->ResetCounts();
  fault.linear_call = 1;
  fault.allocate_call = 12;  // after the first Linear: layer 0 has allocated 6 scratch matrices by then
  const absl::StatusOr<std::vector<FloatStates>> failed = RunBounded(**engine);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted) << failed.status();

  fault.linear_call = 0;
  fault.allocate_call = 0;
  const absl::StatusOr<std::vector<FloatStates>> next = RunBounded(**engine);
  EXPECT_TRUE(next.ok()) << next.status();
}

// A lost device on rank 1 of 2, in an op (reported at Synchronize, the other
// rank finishes the batch) or in an allocation (rank 1 leaves at once, rank 0
// waits in an all-reduce until the abort): the batch fails on every rank with
// UNAVAILABLE naming rank 1, its device and its own error; the engine never
// touches the devices again, and says so once.
TEST_F(EngineTest, ALostDeviceFailsTheBatchEverywhereAndEveryLaterOne) {
  for (const bool in_allocate : {false, true}) {
    SCOPED_TRACE(in_allocate ? "lost in Allocate" : "lost in a Linear op");
    Fault fault;
    fault.device_lost = true;
    int heard = 0;
    absl::Status heard_status;
    EngineOptions options{.tp = 2, .precision = ElementType::kBf16, .threads = 2,
                          .factory = std::make_shared<FaultyFactory>(1, &fault)};
    options.on_device_lost = [&](const absl::Status& status) {
      ++heard;
      heard_status = status;
    };
    absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(*checkpoint_, options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    ASSERT_TRUE(RunBounded(**engine).ok());
    EXPECT_TRUE((*engine)->lost().ok());

    (in_allocate ? fault.allocate_call : fault.linear_call) = in_allocate ? 12 : 5;
    const absl::StatusOr<std::vector<FloatStates>> failed = RunBounded(**engine);
    ASSERT_FALSE(failed.ok());
    const absl::Status& status = failed.status();
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
    EXPECT_TRUE(IsDeviceLost(status)) << status;
    EXPECT_EQ(LostDevice(status), "faulty-cpu");
    const std::string message(status.message());
    EXPECT_NE(message.find("device lost: rank 1 of 2 (faulty-cpu) failed with INTERNAL: faulty-cpu injected: "),
              std::string::npos)
        << message;
    EXPECT_NE(message.find(in_allocate ? "cudaErrorIllegalAddress in Allocate" : "cudaErrorLaunchFailure in Linear"),
              std::string::npos)
        << message;
    EXPECT_EQ((*engine)->lost(), status);
    EXPECT_EQ(heard, 1);
    EXPECT_EQ(heard_status, status);

    // Later batches fail at once with the same status, without running.
    fault.linear_call = 0;
    fault.allocate_call = 0;
    const int stages = fault.stages;
    for (int i = 0; i < 2; ++i) {
      const absl::StatusOr<std::vector<FloatStates>> later = RunBounded(**engine);
      ASSERT_FALSE(later.ok());
      EXPECT_EQ(later.status(), status);
    }
    EXPECT_EQ(fault.stages, stages) << "a batch ran on a lost device";
    EXPECT_EQ(heard, 1);
  }
}

// A group that cannot be re-armed after an ordinary batch error can run no
// collective again: the engine stops as for a lost device, naming the group.
TEST_F(EngineTest, AGroupThatCannotBeReArmedStopsTheEngine) {
  Fault fault;
  int heard = 0;
  EngineOptions options{.tp = 2, .precision = ElementType::kBf16, .threads = 2,
                        .factory = std::make_shared<FaultyFactory>(1, &fault)};
  options.on_device_lost = [&](const absl::Status&) { ++heard; };
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(*checkpoint_, options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  fault.reset_fails = true;
  fault.allocate_call = 12;  // an ordinary error; the abort and the failed re-arming follow
  const absl::StatusOr<std::vector<FloatStates>> failed = RunBounded(**engine);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable) << failed.status();
  EXPECT_TRUE(IsDeviceLost(failed.status()));
  EXPECT_EQ(LostDevice(failed.status()), "the communicator group");
  EXPECT_NE(failed.status().message().find("device lost: the communicator group failed with FAILED_PRECONDITION: "
                                           "injected: out of memory on this rank; re-arming the ranks failed: "
                                           "injected: ncclCommInitAll"),
            std::string::npos)
      << failed.status();
  EXPECT_EQ(heard, 1);
  fault.allocate_call = 0;
  EXPECT_EQ(RunBounded(**engine).status(), failed.status());
}

// The server's side, through the batcher and the handler hsx-server installs:
// a lost device fails the batch, every queued sample and every later
// submission with the engine's UNAVAILABLE status, and turns both health names
// NOT_SERVING; a batch error that is not a lost device leaves it SERVING and
// the next sample runs.
class DeviceLossServingTest : public EngineTest {
 protected:
  // TP 2 (rank 1 faulty) behind a batcher whose budget holds one 7-token
  // sample per batch, and hsx-server's handler; health SERVING.
  void SetUp() override {
    EngineOptions options{.tp = 2, .precision = ElementType::kBf16, .threads = 2,
                          .factory = std::make_shared<FaultyFactory>(1, &fault_)};
    options.on_device_lost = DeviceLossHandler(&health_, &metrics_);
    absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(*checkpoint_, options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
    batcher_ = std::make_unique<Batcher>(*engine_, BatcherOptions{.max_batch_tokens = 7});
    health_.SetServing(true);
  }

  // The statuses of `count` samples of 7 tokens, submitted at once.
  std::vector<absl::Status> SubmitAndWait(int count) {
    std::mutex mutex;
    std::condition_variable done;
    std::vector<absl::Status> statuses;
    for (int i = 0; i < count; ++i) {
      WorkItem item;
      item.tokens = {1, 2, 3, 4, 5, 6, 7};
      item.capture = AllLayers();
      item.deliver = [&](absl::StatusOr<SampleTensors> states) {
        std::lock_guard<std::mutex> lock(mutex);
        statuses.push_back(states.status());
        done.notify_all();
      };
      if (absl::Status s = batcher_->Submit(std::move(item)); !s.ok()) {
        std::lock_guard<std::mutex> lock(mutex);
        statuses.push_back(s);
      }
    }
    std::unique_lock<std::mutex> lock(mutex);
    if (!done.wait_for(lock, std::chrono::seconds(60), [&] { return statuses.size() == static_cast<size_t>(count); })) {
      ADD_FAILURE() << "samples were never answered";
      std::abort();
    }
    return statuses;
  }

  Health health_;
  Metrics metrics_;
  Fault fault_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Batcher> batcher_;  // after the engine: destroyed before it
};

TEST_F(DeviceLossServingTest, ALostDeviceTurnsTheServerNotServingAndFailsQueuedAndLaterSamples) {
  fault_.device_lost = true;
  fault_.linear_call = 5;
  const std::vector<absl::Status> statuses = SubmitAndWait(4);
  for (const absl::Status& status : statuses) {
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
    EXPECT_TRUE(IsDeviceLost(status)) << status;
    EXPECT_NE(status.message().find("rank 1 of 2 (faulty-cpu)"), std::string::npos) << status;
    EXPECT_NE(status.message().find("cudaErrorLaunchFailure in Linear"), std::string::npos) << status;
  }
  EXPECT_EQ(fault_.stages, 1) << "queued samples ran after the device was lost";
  EXPECT_EQ(health_.Get(""), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(health_.Get(kServiceName), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  health_.SetServing(true);  // frozen: nothing turns it back
  EXPECT_EQ(health_.Get(""), grpc::health::v1::HealthCheckResponse::NOT_SERVING);

  // A later submission is refused at once, with the same status.
  WorkItem later;
  later.tokens = {1, 2, 3};
  later.capture = AllLayers();
  later.deliver = [](absl::StatusOr<SampleTensors>) { ADD_FAILURE() << "a refused sample was answered"; };
  EXPECT_EQ(batcher_->Submit(std::move(later)), statuses.front());
  EXPECT_EQ(batcher_->device_lost(), statuses.front());
}

TEST_F(DeviceLossServingTest, ABatchErrorThatIsNotADeviceLossKeepsTheServerServing) {
  fault_.linear_call = 5;  // a DATA_LOSS op error, not marked lost
  const std::vector<absl::Status> failed = SubmitAndWait(1);
  EXPECT_EQ(failed.front().code(), absl::StatusCode::kDataLoss) << failed.front();
  EXPECT_FALSE(IsDeviceLost(failed.front()));
  fault_.linear_call = 0;
  fault_.allocate_call = 12;  // RESOURCE_EXHAUSTED: out of memory for this batch
  const std::vector<absl::Status> oom = SubmitAndWait(1);
  EXPECT_EQ(oom.front().code(), absl::StatusCode::kResourceExhausted) << oom.front();
  fault_.allocate_call = 0;

  EXPECT_EQ(health_.Get(""), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(health_.Get(kServiceName), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_TRUE(batcher_->device_lost().ok());
  const std::vector<absl::Status> next = SubmitAndWait(2);
  for (const absl::Status& status : next) EXPECT_TRUE(status.ok()) << status;
}


// ---- Capture copies that land after Run returns (Backend::FenceCopies) -----

// How a LateCopyBackend's copies land: `delay` after the batch's compute, or
// (lost) never, the fence then reporting a lost device.
struct LateCopies {
  std::chrono::milliseconds delay{40};
  std::atomic<bool> lost{false};
};

// The copies of one batch, written by a thread of their own after a delay.
// Destroying the fence does not wait for them (nor does destroying a CUDA
// event): only Wait() does, so a reader that skips it reads unwritten rows.
class LateFence : public CopyFence {
 public:
  struct Copy {
    char* dst;
    std::vector<char> bytes;
  };
  LateFence(std::vector<Copy> copies, LateCopies* how) : state_(std::make_shared<State>()) {
    std::thread([state = state_, copies = std::move(copies), how] {
      std::this_thread::sleep_for(how->delay);
      absl::Status status;
      if (how->lost) {
        status = MarkDeviceLost(
            absl::InternalError("late-cpu: injected: cudaErrorIllegalAddress in a capture copy"), "late-cpu");
      } else {
        for (const Copy& c : copies) std::memcpy(c.dst, c.bytes.data(), c.bytes.size());
      }
      std::lock_guard<std::mutex> lock(state->mutex);
      state->status = status;
      state->done = true;
      state->landed.notify_all();
    }).detach();
  }

  absl::Status Wait() override {
    std::unique_lock<std::mutex> lock(state_->mutex);
    state_->landed.wait(lock, [&] { return state_->done; });
    return state_->status;
  }

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable landed;
    bool done = false;
    absl::Status status;
  };
  std::shared_ptr<State> state_;
};

// A CPU backend whose capture copies behave as the CUDA backend's do with the
// copy stream: CopyToHost snapshots the rows (the staging ring) and the
// destination is written only later, after FenceCopies has returned.
class LateCopyBackend : public ForwardingBackend {
 public:
  LateCopyBackend(std::unique_ptr<Backend> inner, LateCopies* how) : ForwardingBackend(std::move(inner)), how_(how) {}

  void CopyToHost(const Matrix& src, void* dst) override {
    const size_t row = static_cast<size_t>(src.cols) * ElementSize(src.type);
    std::vector<char> bytes(row * static_cast<size_t>(src.rows));
    for (int64_t r = 0; r < src.rows; ++r) std::memcpy(bytes.data() + r * row, src.at(r, 0), row);
    pending_.push_back({static_cast<char*>(dst), std::move(bytes)});
  }
  absl::StatusOr<std::shared_ptr<CopyFence>> FenceCopies() override {
    std::vector<LateFence::Copy> copies = std::move(pending_);
    pending_.clear();
    if (absl::Status s = Synchronize(); !s.ok()) return s;  // a failed batch's copies are dropped: "ended"
    return std::shared_ptr<CopyFence>(std::make_shared<LateFence>(std::move(copies), how_));
  }

 private:
  LateCopies* how_;
  std::vector<LateFence::Copy> pending_;
};

class LateCopyFactory : public DeviceFactory {
 public:
  explicit LateCopyFactory(LateCopies* how) : how_(how) {}
  absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(int rank) override {
    return std::make_unique<LateCopyBackend>(MakeCpuBackend(ElementType::kBf16, 1), how_);
  }
  absl::StatusOr<std::unique_ptr<CommunicatorGroup>> MakeGroup(std::span<Backend* const> backends) override {
    return std::make_unique<InProcessGroup>(static_cast<int>(backends.size()));
  }

 private:
  LateCopies* how_;
};

// The batcher waits for a batch's copies (on its delivery thread) before any
// sample's rows are read, and no capture buffer goes back to the pool, to be
// handed to the next batch, while a copy still writes it: every sample, run
// through several batches, equals the same sample run alone by a plain engine.
TEST_F(EngineTest, CapturesCopiedAfterRunReturnsAreWaitedForBeforeDelivery) {
  LateCopies how;
  EngineOptions options{.tp = 2, .precision = ElementType::kBf16, .threads = 2,
                        .factory = std::make_shared<LateCopyFactory>(&how)};
  absl::StatusOr<std::unique_ptr<Engine>> late = Engine::Create(*checkpoint_, options);
  ASSERT_TRUE(late.ok()) << late.status();
  absl::StatusOr<std::unique_ptr<Engine>> plain =
      Engine::Create(*checkpoint_, {.tp = 1, .precision = ElementType::kBf16, .threads = 1});
  ASSERT_TRUE(plain.ok()) << plain.status();
  const std::vector<std::vector<int32_t>> samples = {{1, 2, 3, 4, 5}, {9, 8, 7}, {4, 4, 4, 4, 4, 4}, {2},
                                                     {5, 6, 7, 8}, {3, 1, 4, 1, 5, 9}, {7, 7}};
  std::vector<absl::StatusOr<FloatStates>> got(samples.size(), absl::UnknownError("not delivered"));
  {
    Batcher batcher(**late, BatcherOptions{.max_batch_tokens = 8});
    for (size_t i = 0; i < samples.size(); ++i) {
      WorkItem item{samples[i], AllLayers(), [&got, i](absl::StatusOr<SampleTensors> s) { got[i] = Widen(s); },
                    nullptr};
      ASSERT_TRUE(batcher.Submit(std::move(item)).ok());
    }
  }
  for (size_t i = 0; i < samples.size(); ++i) {
    ASSERT_TRUE(got[i].ok()) << got[i].status();
    Batch solo;
    solo.AddSample(samples[i]);
    absl::StatusOr<Captures> want = (*plain)->Run(solo, AllLayers());
    ASSERT_TRUE(want.ok()) << want.status();
    const FloatStates expected = SplitBySample(*want, solo.cu_seqlens)[0];
    EXPECT_EQ(got[i]->hidden_states, expected.hidden_states) << "sample " << i;
    EXPECT_EQ(got[i]->final_norm, expected.final_norm) << "sample " << i;
  }
  // Engine::Run's default waits for the copies itself.
  const Batch batch = TestBatch();
  absl::StatusOr<Captures> waited = (*late)->Run(batch, AllLayers());
  ASSERT_TRUE(waited.ok()) << waited.status();
  absl::StatusOr<Captures> reference = (*plain)->Run(batch, AllLayers());
  ASSERT_TRUE(reference.ok()) << reference.status();
  const std::vector<FloatStates> a = SplitBySample(*waited, batch.cu_seqlens);
  const std::vector<FloatStates> b = SplitBySample(*reference, batch.cu_seqlens);
  for (size_t s = 0; s < a.size(); ++s) EXPECT_EQ(a[s].hidden_states, b[s].hidden_states) << "sample " << s;
}

// Where copies land on return (the CPU backend), the engine tells the
// batcher's capture check (CaptureCheck) of the rows it copies, and the check
// finds in each sample's tensors what their consumer asked for: exactly what
// CheckTensor gives over the rows in the buffer, tensor by tensor, for every
// sample that asked for a check of rows sent as they are, and nothing for the
// others; rank 0 does it with tensor parallelism too. A backend whose copies
// land later (LateCopyBackend) leaves it to the consumer.
TEST_F(EngineTest, TheCaptureCopyChecksTheRowsAsTheirConsumerAsked) {
  const int64_t hidden = checkpoint_->config().hidden_size;
  // Sample 3 is long enough that its copy is checked in several pieces and a partial one.
  const int64_t long_sample = 5 * (int64_t{128} << 10) / (hidden * 2) / 2 + 3;
  std::vector<int32_t> long_tokens(long_sample);
  for (int64_t t = 0; t < long_sample; ++t) long_tokens[t] = static_cast<int32_t>(1 + t % 50);
  for (const ElementType precision : {ElementType::kBf16, ElementType::kF32}) {
    const OutputDType as_is = precision == ElementType::kBf16 ? OutputDType::kBf16 : OutputDType::kFp32;
    const std::vector<std::optional<RowCheck>> checks = {RowCheck{as_is, ChecksumKind::kXxh3}, std::nullopt,
                                                         RowCheck{OutputDType::kFp16, ChecksumKind::kXxh64},
                                                         RowCheck{as_is, ChecksumKind::kXxh64}};
    Batch batch;
    for (const std::vector<int32_t>& tokens : {std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7}, std::vector<int32_t>{9, 8, 7},
                                                std::vector<int32_t>{4, 4, 4}, long_tokens}) {
      batch.AddSample(tokens);
    }
    std::vector<int64_t> values;
    for (int64_t s = 0; s < 4; ++s) values.push_back((batch.cu_seqlens[s + 1] - batch.cu_seqlens[s]) * hidden);
    for (const bool late : {false, true}) {
      for (const int tp : {1, 2}) {
        if (late && tp == 2) continue;
        SCOPED_TRACE(::testing::Message() << (precision == ElementType::kBf16 ? "bf16" : "fp32") << " tp " << tp
                                        << (late ? " late copies" : ""));
        LateCopies how;
        EngineOptions options{.tp = tp, .precision = precision, .threads = tp};
        if (late) options.factory = std::make_shared<LateCopyFactory>(&how);
        absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(*checkpoint_, options);
        ASSERT_TRUE(engine.ok()) << engine.status();
        for (const CaptureSpec& spec : {AllLayers(), *CaptureSpec::Make({0}, false, 3)}) {
          const size_t tensors = spec.ids().size() + (spec.final_norm() ? 1 : 0);
          CaptureCheck check(checks, precision, tensors, values);
          absl::StatusOr<Captures> captures = (*engine)->Run(batch, spec, Engine::Copies::kWait, &check);
          ASSERT_TRUE(captures.ok()) << captures.status();
          std::vector<SampleTensors> samples = ViewBySample(*std::move(captures));
          ASSERT_EQ(samples.size(), 4u);
          for (int64_t s = 0; s < 4; ++s) {
            check.AttachFindings(s, samples[s]);
            const bool want = !late && checks[s].has_value() && checks[s]->dtype == as_is;
            ASSERT_EQ(samples[s].tensors.size(), tensors);
            for (size_t k = 0; k < tensors; ++k) {
              const SampleTensor& tensor = samples[s].tensors[k];
              ASSERT_EQ(tensor.findings.has_value(), want) << "sample " << s << " tensor " << k;
              if (!want) continue;
              const TensorFindings got = *tensor.findings;
              const TensorFindings wanted = CheckTensor(tensor.pieces[0].data(), values[s], as_is, checks[s]->checksum);
              EXPECT_EQ(got.checksum_kind, checks[s]->checksum) << "sample " << s << " tensor " << k;
              EXPECT_EQ(got.checksum, wanted.checksum) << "sample " << s << " tensor " << k;
              EXPECT_EQ(got.bad_index, -1) << "sample " << s << " tensor " << k;
              EXPECT_TRUE(got.nonzero) << "sample " << s << " tensor " << k;
            }
          }
        }
      }
    }
  }
}

// A copy that fails because its device was lost, seen only when the batcher
// waits for it, stops the engine as a failed op would: the batch's samples
// fail with UNAVAILABLE, on_device_lost hears it once, later samples are refused.
TEST_F(EngineTest, ACopyThatLosesItsDeviceStopsTheEngine) {
  LateCopies how;
  how.lost = true;
  int heard = 0;
  EngineOptions options{.tp = 1, .precision = ElementType::kBf16, .threads = 1,
                        .factory = std::make_shared<LateCopyFactory>(&how)};
  options.on_device_lost = [&heard](const absl::Status&) { ++heard; };
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(*checkpoint_, options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::vector<absl::Status> statuses(2, absl::UnknownError("not delivered"));
  {
    Batcher batcher(**engine, BatcherOptions{.max_batch_tokens = 8});
    for (size_t i = 0; i < statuses.size(); ++i) {
      WorkItem item{{1, 2, 3, 4, 5, 6}, AllLayers(),
                    [&statuses, i](absl::StatusOr<SampleTensors> s) { statuses[i] = s.status(); }, nullptr};
      ASSERT_TRUE(batcher.Submit(std::move(item)).ok());
    }
  }
  for (const absl::Status& status : statuses) {
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
    EXPECT_TRUE(IsDeviceLost(status)) << status;
  }
  EXPECT_NE(statuses[0].message().find("injected: cudaErrorIllegalAddress in a capture copy"), std::string::npos)
      << statuses[0];
  EXPECT_EQ(heard, 1);
  EXPECT_EQ((*engine)->lost(), statuses[0]);
}

}  // namespace
}  // namespace hsx
