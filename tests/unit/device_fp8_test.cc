// device_fp8_test.cc: the device's fp8 path run on the CPU. A backend whose
// copies do not land on return (CUDA; here a ForwardingBackend over the CPU
// backend) gets no capture sink: Model::Run copies an fp8 sample's wanted
// tensors out encoded (Backend::CopyToHostFp8) and its bf16 samples as they
// are, the batcher delivers the fp8 ones as fp8 rows, and EncodeSample checks
// and hashes them in place. One batch of mixed samples (fp8 with and without
// an encode buffer, as hsx-server and hsx-dump --model ask; bf16; one long
// enough for several of the CPU sink's pieces; one with an infinity) goes
// through the batcher on both paths, bf16 and f32 engines, tp 1 and 2 (only
// rank 0 copies): every sample's bytes, findings and verdict are those of the
// CPU sink path (capture_check.h), only fp8 rows are copied for fp8 samples,
// and the infinity fails its own sample alone, with the message of the CPU
// path naming the capture id, row and column.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "format/capture_spec.h"
#include "format/response_encoder.h"
#include "format/sample_encoding.h"
#include "format/test_files.h"
#include "format/test_values.h"
#include "kernels/bf16.h"
#include "kernels/cpu/in_process_communicator.h"
#include "kernels/forwarding_backend.h"
#include "server/model/checkpoint.h"
#include "server/model/random_model.h"
#include "server/runtime/batcher.h"
#include "server/runtime/engine.h"

namespace hsx {
namespace {

using ::hsx::testing::HeapBuffers;
using ::hsx::testing::TempDir;

constexpr int kLayers = 3;

// What the test's backends share: a gate that holds every Stage until it is
// opened (so the samples submitted meanwhile make one batch), the copies
// rank 0 made, and the token whose embedding row gets an infinity.
struct Shared {
  std::mutex mutex;
  std::condition_variable changed;
  bool open = false;
  int waiting = 0;
  std::atomic<int> copies{0};      // CopyToHost calls
  std::atomic<int> fp8_copies{0};  // CopyToHostFp8 calls
  int32_t poison = -1;

  void Pass() {
    std::unique_lock<std::mutex> lock(mutex);
    ++waiting;
    changed.notify_all();
    changed.wait(lock, [&] { return open; });
  }
  void AwaitWaiter() {
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [&] { return waiting > 0; });
  }
  void Open() {
    std::lock_guard<std::mutex> lock(mutex);
    open = true;
    changed.notify_all();
  }
};

// The CPU backend with copies that land on return (the sink path) or not
// (the device path), gated, counting rank 0's copies; column 3 of the
// embedding of the poisoned token is +inf.
class TestBackend : public ForwardingBackend {
 public:
  TestBackend(ElementType precision, bool land_on_return, bool rank0, Shared* shared)
      : ForwardingBackend(MakeCpuBackend(precision, 1)), land_(land_on_return), rank0_(rank0), shared_(shared) {}

  bool copies_land_on_return() const override { return land_; }
  void CopyToHost(const Matrix& src, void* dst) override {
    if (rank0_) ++shared_->copies;
    ForwardingBackend::CopyToHost(src, dst);
  }
  void CopyToHostFp8(const Matrix& src, void* dst) override {
    if (rank0_) ++shared_->fp8_copies;
    ForwardingBackend::CopyToHostFp8(src, dst);
  }
  absl::StatusOr<std::unique_ptr<StagedBatch>> Stage(std::span<const int32_t> tokens,
                                                     std::span<const int64_t> cu_seqlens) override {
    shared_->Pass();
    tokens_.assign(tokens.begin(), tokens.end());
    return ForwardingBackend::Stage(tokens, cu_seqlens);
  }
  void Embed(const StagedBatch& batch, const uint16_t* table, int64_t vocab_begin, int64_t vocab_rows,
             const Matrix& out) override {
    ForwardingBackend::Embed(batch, table, vocab_begin, vocab_rows, out);
    if (!rank0_) return;  // the all-reduce adds rank 1's zero or finite share
    for (size_t t = 0; t < tokens_.size(); ++t) {
      if (tokens_[t] != shared_->poison) continue;
      const float inf = std::numeric_limits<float>::infinity();
      if (out.type == ElementType::kBf16) {
        const uint16_t b = FloatToBf16(inf);
        std::memcpy(out.at(static_cast<int64_t>(t), 3), &b, 2);
      } else {
        std::memcpy(out.at(static_cast<int64_t>(t), 3), &inf, 4);
      }
    }
  }

 private:
  const bool land_;
  const bool rank0_;
  Shared* shared_;
  std::vector<int32_t> tokens_;
};

class TestFactory : public DeviceFactory {
 public:
  TestFactory(ElementType precision, bool land_on_return, Shared* shared)
      : precision_(precision), land_(land_on_return), shared_(shared) {}
  absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(int rank) override {
    return std::make_unique<TestBackend>(precision_, land_, rank == 0, shared_);
  }
  absl::StatusOr<std::unique_ptr<CommunicatorGroup>> MakeGroup(std::span<Backend* const> backends) override {
    return std::make_unique<InProcessGroup>(static_cast<int>(backends.size()));
  }

 private:
  ElementType precision_;
  bool land_;
  Shared* shared_;
};

struct Sample {
  std::vector<int32_t> tokens;
  CaptureSpec wanted;
  OutputDType dtype;
  ChecksumKind checksum;
  bool encode_buffer;  // hsx-server's fp8 requests give one; hsx-dump --model's do not
};

// The mixed batch (sample 0 first runs alone: it holds the gate).
std::vector<Sample> Samples(int32_t poison, int64_t long_sample) {
  auto tokens = [](int64_t n, int seed) {
    std::vector<int32_t> t;
    for (int64_t i = 0; i < n; ++i) t.push_back(static_cast<int32_t>(1 + (7 * seed + i) % 50));
    return t;
  };
  std::vector<int32_t> poisoned = tokens(6, 4);
  poisoned[2] = poison;
  return {
      {tokens(2, 0), *CaptureSpec::Make({0}, false, kLayers), OutputDType::kFp8, ChecksumKind::kXxh3, true},
      {tokens(7, 1), CaptureSpec::All(kLayers, true), OutputDType::kFp8, ChecksumKind::kXxh3, true},
      {tokens(3, 2), *CaptureSpec::Make({1}, false, kLayers), OutputDType::kBf16, ChecksumKind::kXxh64, false},
      {tokens(long_sample, 3), *CaptureSpec::Make({0, 3}, true, kLayers), OutputDType::kFp8,
       ChecksumKind::kXxh64, false},
      {poisoned, *CaptureSpec::Make({0, 2}, false, kLayers), OutputDType::kFp8, ChecksumKind::kXxh64, true},
      {tokens(5, 5), *CaptureSpec::Make({2}, true, kLayers), OutputDType::kFp8, ChecksumKind::kXxh3, true},
  };
}

// Each sample as its consumer receives it from the batcher, samples 1.. in one batch.
std::vector<absl::StatusOr<SampleTensors>> Delivered(Engine& engine, Shared& shared,
                                                     const std::vector<Sample>& samples) {
  std::mutex mutex;
  std::condition_variable done;
  std::vector<absl::StatusOr<SampleTensors>> got(samples.size(), absl::UnknownError("not delivered"));
  size_t delivered = 0;
  Batcher batcher(engine, BatcherOptions{.max_batch_tokens = 4096});
  for (size_t i = 0; i < samples.size(); ++i) {
    WorkItem item;
    item.tokens = samples[i].tokens;
    item.capture = samples[i].wanted;
    item.row_check = RowCheck{samples[i].dtype, samples[i].checksum};
    if (samples[i].encode_buffer) item.encode_buffer = HeapBuffers();
    item.deliver = [&, i](absl::StatusOr<SampleTensors> rows) {
      std::lock_guard<std::mutex> lock(mutex);
      got[i] = std::move(rows);
      ++delivered;
      done.notify_all();
    };
    EXPECT_TRUE(batcher.Submit(std::move(item)).ok());
    if (i == 0) shared.AwaitWaiter();  // the first batch is running, held at the gate
  }
  shared.Open();
  std::unique_lock<std::mutex> lock(mutex);
  if (!done.wait_for(lock, std::chrono::seconds(60), [&] { return delivered == samples.size(); })) {
    ADD_FAILURE() << "samples were never delivered";
    std::abort();
  }
  EXPECT_EQ(batcher.batches_run(), 2);
  return got;
}

// The sample made the bytes to send (EncodeSample), then the verdict
// (ResponseEncoder::Create: OK, or the sample's error).
struct Sent {
  SampleTensors bytes;
  absl::Status verdict;
  int allocations = 0;
};

Sent Send(const SampleTensors& rows, const Sample& sample) {
  Sent sent;
  absl::StatusOr<SampleTensors> encoded =
      EncodeSample(rows, sample.dtype, sample.checksum, HeapBuffers(&sent.allocations));
  EXPECT_TRUE(encoded.ok()) << encoded.status();
  if (encoded.ok()) sent.bytes = *encoded;
  EncoderOptions options;
  options.dtype = sample.dtype;
  options.checksum = sample.checksum;
  absl::StatusOr<std::unique_ptr<ResponseEncoder>> encoder = ResponseEncoder::Create(rows, options, HeapBuffers());
  sent.verdict = encoder.status();
  return sent;
}

void ExpectSameBytes(const SampleTensors& got, const SampleTensors& want) {
  ASSERT_EQ(got.dtype, want.dtype);
  ASSERT_EQ(got.capture_ids, want.capture_ids);
  ASSERT_EQ(got.tensors.size(), want.tensors.size());
  for (size_t k = 0; k < got.tensors.size(); ++k) {
    SCOPED_TRACE(::testing::Message() << "tensor " << k);
    ASSERT_TRUE(got.tensors[k].findings.has_value() && want.tensors[k].findings.has_value());
    const TensorFindings& g = *got.tensors[k].findings;
    const TensorFindings& w = *want.tensors[k].findings;
    EXPECT_EQ(g.bad_index, w.bad_index);
    EXPECT_EQ(std::memcmp(&g.bad_value, &w.bad_value, sizeof(float)), 0);
    EXPECT_EQ(g.bad_scale, w.bad_scale);
    if (w.bad_index >= 0) continue;  // the sample fails; the bytes after the value are not sent
    EXPECT_EQ(g.checksum_kind, w.checksum_kind);
    EXPECT_EQ(g.checksum, w.checksum);
    EXPECT_EQ(g.nonzero, w.nonzero);
    EXPECT_TRUE(TensorString(got.tensors[k]) == TensorString(want.tensors[k]));
  }
}

class DeviceFp8Test : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    ModelConfig config = *PresetConfig("tiny");
    config.num_hidden_layers = kLayers;
    ASSERT_TRUE(WriteRandomCheckpoint(config, *dir_ / "m", GeneratorOptions{}).ok());
    absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(*dir_ / "m");
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
    checkpoint_ = checkpoint->release();
  }
  static void TearDownTestSuite() {
    delete checkpoint_;
    delete dir_;
  }

  // The samples through an engine of `tp` ranks whose copies land on return or not.
  static std::vector<absl::StatusOr<SampleTensors>> Run(ElementType precision, int tp, bool land_on_return,
                                                        const std::vector<Sample>& samples, Shared& shared) {
    shared.poison = static_cast<int32_t>(checkpoint_->config().vocab_size - 1);
    EngineOptions options{.tp = tp, .precision = precision, .threads = tp,
                          .factory = std::make_shared<TestFactory>(precision, land_on_return, &shared)};
    absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(*checkpoint_, options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return Delivered(**engine, shared, samples);
  }

  static TempDir* dir_;
  static Checkpoint* checkpoint_;
};

TempDir* DeviceFp8Test::dir_ = nullptr;
Checkpoint* DeviceFp8Test::checkpoint_ = nullptr;

TEST_F(DeviceFp8Test, DeliversTheCpuSinkPathsBytesAndVerdicts) {
  const int64_t hidden = checkpoint_->config().hidden_size;
  const int64_t long_sample = 5 * (int64_t{128} << 10) / (hidden * 2) / 2 + 3;  // several sink pieces
  const std::vector<Sample> samples = Samples(static_cast<int32_t>(checkpoint_->config().vocab_size - 1), long_sample);
  for (const auto& [precision, tp] : {std::pair{ElementType::kBf16, 1}, std::pair{ElementType::kF32, 1},
                                      std::pair{ElementType::kBf16, 2}}) {
    SCOPED_TRACE(::testing::Message() << ElementTypeName(precision) << " tp " << tp);
    Shared sink_shared, device_shared;
    const std::vector<absl::StatusOr<SampleTensors>> sink = Run(precision, tp, true, samples, sink_shared);
    const std::vector<absl::StatusOr<SampleTensors>> device = Run(precision, tp, false, samples, device_shared);
    EXPECT_EQ(sink_shared.fp8_copies, 0) << "the sink path encodes on the host";
    // The device path copies the bf16 sample's 5 tensors as they are, and
    // only the wanted tensors of the fp8 samples, encoded: 1 + 5 + 3 + 2 + 2.
    EXPECT_EQ(device_shared.copies, 5);
    EXPECT_EQ(device_shared.fp8_copies, 13);
    for (size_t i = 0; i < samples.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "sample " << i);
      ASSERT_TRUE(sink[i].ok()) << sink[i].status();
      ASSERT_TRUE(device[i].ok()) << device[i].status();
      if (samples[i].dtype == OutputDType::kFp8) {
        // Encoded on the device: fp8 rows of exactly the wanted tensors, not yet checked.
        EXPECT_EQ(device[i]->dtype, OutputDType::kFp8);
        EXPECT_EQ(device[i]->capture_ids, samples[i].wanted.ids());
        EXPECT_EQ(device[i]->held_bytes, device[i]->bytes());
        for (const SampleTensor& tensor : device[i]->tensors) EXPECT_FALSE(tensor.findings.has_value());
      }
      const Sent want = Send(*sink[i], samples[i]);
      const Sent got = Send(*device[i], samples[i]);
      if (samples[i].dtype == OutputDType::kFp8) {
        EXPECT_EQ(got.allocations, 0) << "encoded again on the host";
      }
      ExpectSameBytes(got.bytes, want.bytes);
      EXPECT_EQ(got.verdict, want.verdict);
      if (i == 4) {
        EXPECT_EQ(got.verdict.message(), "capture id 0: value inf at row 2, column 3 is not finite");
      } else {
        EXPECT_TRUE(got.verdict.ok()) << got.verdict;
      }
    }
  }
}

// Model::Run refuses fp8 samples that do not match the batch.
TEST_F(DeviceFp8Test, RunRefusesFp8SamplesTheBatchDoesNotCapture) {
  Shared shared;
  shared.open = true;
  EngineOptions options{.tp = 1, .precision = ElementType::kBf16, .threads = 1,
                        .factory = std::make_shared<TestFactory>(ElementType::kBf16, false, &shared)};
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(*checkpoint_, options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Batch batch;
  batch.AddSample({1, 2, 3});
  batch.AddSample({4, 5});
  const CaptureSpec capture = *CaptureSpec::Make({0, 2}, false, kLayers);
  const struct {
    Fp8Samples fp8;
    std::string error;
  } cases[] = {
      {{std::nullopt}, "fp8 samples: 1 entries for 2 samples"},
      {{std::nullopt, *CaptureSpec::Make({1}, false, kLayers)}, "fp8 sample 1: capture id 1 is not among"},
      {{*CaptureSpec::Make({0}, true, kLayers), std::nullopt}, "fp8 sample 0: the final norm is not captured"},
  };
  for (const auto& c : cases) {
    absl::StatusOr<Captures> result = (*engine)->Run(batch, capture, Engine::Copies::kWait, nullptr, c.fp8);
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(result.status().message().find(c.error), std::string::npos) << result.status();
  }
  absl::StatusOr<Captures> fine =
      (*engine)->Run(batch, capture, Engine::Copies::kWait, nullptr, {std::nullopt, *CaptureSpec::Make({2}, false, kLayers)});
  ASSERT_TRUE(fine.ok()) << fine.status();
  EXPECT_FALSE(fine->IsFp8(0));
  EXPECT_TRUE(fine->IsFp8(1));
  EXPECT_EQ(fine->Tensor(1, 0), nullptr);  // sample 1 holds capture id 2 only
  EXPECT_EQ(fine->SampleBytes(1), static_cast<size_t>(2 * (checkpoint_->config().hidden_size + 4)));
}

}  // namespace
}  // namespace hsx
