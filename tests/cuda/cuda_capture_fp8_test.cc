// cuda_capture_fp8_test.cc: the CUDA backend's fp8 capture copy
// (Backend::CopyToHostFp8, kernels/cuda/fp8_rows.cu) writes the bytes of the
// CPU rule (kernels/fp8_e4m3.h; the CPU backend's CopyToHostFp8, which
// tests/unit/fp8_copy_test.cc checks against format's EncodeFp8Tensor):
//  * the device's division and rounding alone on every finite bf16 value
//    under scales the encoder chooses and others, against the host's
//    FloatToFp8E4m3(value / scale);
//  * the row kernel through both capture paths (overlap off: pool scratch;
//    overlap on: encoded into the staging ring, the default ring and one of a
//    few rows that wraps), bf16 and f32, rows of 45 and of 7168 values
//    (Kimi-K2's hidden), strided sources copied whole and per sample, rows of
//    zeros, of tiny and of huge values, rows with inf or NaN (marked), the
//    source overwritten right after the copy: byte for byte the CPU backend's;
//  * the tiny model through the batcher: a sample asked for in fp8 arrives as
//    fp8 rows of exactly its capture set, which EncodeSample sends in place,
//    the bytes and checksums the host encoder gives over the same sample's
//    bf16 rows (batch invariance: the same rows in any batch).
// Every test here needs a GPU and skips, with CUDA's reason, without one.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "format/fp8.h"
#include "format/sample_encoding.h"
#include "format/test_values.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/ops.h"
#include "kernels/fp8_e4m3.h"
#include "server/runtime/batcher.h"
#include "server/runtime/engine.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/unit/test_util.h"

namespace hsx {
namespace {

// Scales the encoder can choose (amax / 448, FLT_MIN, 1) and a few more.
std::vector<float> Scales() {
  std::vector<float> s = {1.0f, FLT_MIN, 3.0f / 448.0f, 0.0123f / 448.0f, 1e30f / 448.0f, FLT_MAX / 448.0f,
                          0.5f, 0.1f, 1.0f / 3.0f, 7.0f, 2e-30f};
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-40.0f, 40.0f);
  for (int i = 0; i < 12; ++i) s.push_back(std::exp2(exponent(rng)) * 1.2345f);
  return s;
}

TEST(CudaCaptureFp8KernelTest, EveryBf16ValueUnderEachScaleGivesTheHostsCode) {
  HSX_SKIP_WITHOUT_CUDA();
  std::vector<uint16_t> values;
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    if ((b & 0x7f80u) != 0x7f80u) values.push_back(static_cast<uint16_t>(b));
  }
  const int64_t n = static_cast<int64_t>(values.size());
  uint16_t* device_values = nullptr;
  uint8_t* device_codes = nullptr;
  ASSERT_EQ(cudaMalloc(&device_values, n * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&device_codes, n), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(device_values, values.data(), n * sizeof(uint16_t), cudaMemcpyHostToDevice), cudaSuccess);
  std::vector<uint8_t> codes(n);
  for (float scale : Scales()) {
    ASSERT_EQ(cuda::LaunchFp8Quantize(device_values, n, scale, device_codes, nullptr), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(codes.data(), device_codes, n, cudaMemcpyDeviceToHost), cudaSuccess);
    int wrong = 0;
    for (int64_t i = 0; i < n && wrong < 5; ++i) {
      const uint8_t want = FloatToFp8E4m3(Fp8BitsFloat(uint32_t{values[i]} << 16) / scale);
      if (codes[i] != want) {
        ++wrong;
        ADD_FAILURE() << "bf16 0x" << std::hex << values[i] << " scale " << scale << ": host 0x" << int{want}
                      << ", device 0x" << int{codes[i]};
      }
    }
  }
  cudaFree(device_values);
  cudaFree(device_codes);
}

constexpr int64_t kRows = 37;

// kRows rows of `hidden` values: normal values of growing magnitude, row 0
// zeros, row 5 tiny, row 6 near float32's top, rows 9-11 with inf or NaN.
std::vector<float> TestRows(int64_t hidden, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(kRows * hidden);
  for (int64_t t = 0; t < kRows; ++t) {
    const float magnitude = t == 5 ? 1e-42f : t == 6 ? 1e37f : std::ldexp(1.0f, static_cast<int>(t % 12) * 4 - 20);
    for (int64_t i = 0; i < hidden; ++i) v[t * hidden + i] = t == 0 ? 0.0f : normal(rng) * magnitude;
  }
  v[9 * hidden + 100 % hidden] = INFINITY;
  v[10 * hidden + hidden - 1] = NAN;
  v[11 * hidden] = -INFINITY;
  v[11 * hidden + hidden / 2] = NAN;
  return v;
}

struct Case {
  const char* name;
  CudaCaptureOptions options;
};

class CudaCaptureFp8Test : public ::testing::TestWithParam<ElementType> {
 protected:
  void SetUp() override { HSX_SKIP_WITHOUT_CUDA(); }
};

// The rows put into a strided [kRows, hidden] view of a buffer of `backend`;
// copied out encoded whole, then per sample, then the source overwritten at
// once; returns both copies' bytes (empty, with a failure, on error).
std::vector<std::string> CopyOut(Backend& backend, const std::vector<char>& bytes, int64_t hidden) {
  const std::vector<int64_t> cu = {0, 1, 17, 30, kRows};
  const ElementType type = backend.precision();
  absl::StatusOr<std::unique_ptr<Buffer>> buffer = backend.Allocate(kRows, hidden + 5, type);
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  if (!buffer.ok()) return {};
  const Matrix rows = (*buffer)->matrix().Cols(2, hidden);
  backend.CopyFromHost(bytes.data(), rows);
  const size_t encoded = static_cast<size_t>(kRows * (hidden + kFp8ScaleBytes));
  absl::StatusOr<std::unique_ptr<HostBuffer>> host = backend.AllocateHost(2 * encoded);
  EXPECT_TRUE(host.ok()) << host.status();
  if (!host.ok()) return {};
  char* out = static_cast<char*>((*host)->data());
  std::memset(out, 0x5a, 2 * encoded);
  backend.CopyToHostFp8(rows, out);
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    backend.CopyToHostFp8(rows.Rows(cu[s], cu[s + 1] - cu[s]), out + encoded + cu[s] * (hidden + kFp8ScaleBytes));
  }
  const std::vector<char> zeros(bytes.size(), 0);
  backend.CopyFromHost(zeros.data(), rows);  // the copies must hold the rows as they were
  absl::StatusOr<std::shared_ptr<CopyFence>> fence = backend.FenceCopies();
  EXPECT_TRUE(fence.ok()) << fence.status();
  if (!fence.ok()) return {};
  const absl::Status landed = (*fence)->Wait();
  EXPECT_TRUE(landed.ok()) << landed;
  EXPECT_TRUE(backend.Synchronize().ok());  // before `zeros` goes
  return {std::string(out, encoded), std::string(out + encoded, encoded)};
}

// The first row and byte where `got` and `want` differ, for the message.
std::string FirstDifference(const std::string& got, const std::string& want, int64_t hidden) {
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] == want[i]) continue;
    const int64_t row = static_cast<int64_t>(i) / (hidden + kFp8ScaleBytes);
    const int64_t at = static_cast<int64_t>(i) % (hidden + kFp8ScaleBytes);
    return absl::StrCat("row ", row, at < kFp8ScaleBytes ? " scale byte " : " value ",
                        at < kFp8ScaleBytes ? at : at - kFp8ScaleBytes, ": device 0x",
                        absl::Hex(static_cast<uint8_t>(got[i])), ", cpu 0x", absl::Hex(static_cast<uint8_t>(want[i])));
  }
  return "none";
}

TEST_P(CudaCaptureFp8Test, BothCopyPathsWriteTheCpuRulesBytes) {
  const ElementType type = GetParam();
  std::unique_ptr<Backend> cpu = MakeCpuBackend(type, 1);
  for (int64_t hidden : {int64_t{45}, int64_t{7168}}) {
    const std::vector<char> bytes = ::hsx::testing::Encode(TestRows(hidden, static_cast<uint32_t>(hidden)), type);
    const std::vector<std::string> want = CopyOut(*cpu, bytes, hidden);
    ASSERT_EQ(want.size(), 2u);
    ASSERT_EQ(want[0], want[1]);
    const int64_t row = hidden + kFp8ScaleBytes;
    const std::vector<Case> cases = {
        {"overlap off", {false, kCaptureStagingBytes}},
        {"overlap on, default ring", {true, kCaptureStagingBytes}},
        {"overlap on, ring of 2.5 rows", {true, row * 5 / 2}},
    };
    for (const Case& c : cases) {
      SCOPED_TRACE(::testing::Message() << c.name << ", hidden " << hidden);
      absl::StatusOr<std::unique_ptr<Backend>> cuda = MakeCudaBackend(0, type);
      ASSERT_TRUE(cuda.ok()) << cuda.status();
      ASSERT_TRUE(SetCudaCaptureOptions(**cuda, c.options).ok());
      const std::vector<std::string> got = CopyOut(**cuda, bytes, hidden);
      ASSERT_EQ(got.size(), 2u);
      EXPECT_TRUE(got[0] == want[0]) << "whole: " << FirstDifference(got[0], want[0], hidden);
      EXPECT_TRUE(got[1] == want[0]) << "per sample: " << FirstDifference(got[1], want[0], hidden);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Precisions, CudaCaptureFp8Test, ::testing::Values(ElementType::kF32, ElementType::kBf16),
                         [](const ::testing::TestParamInfo<ElementType>& param_info) {
                           return param_info.param == ElementType::kBf16 ? "bf16" : "fp32";
                         });

// Through the batcher on --device cuda: each sample twice, asked for in bf16
// and in fp8 (with an encode buffer, as hsx-server asks), overlap on and off.
TEST(CudaCaptureFp8ModelTest, TheBatcherDeliversDeviceEncodedRows) {
  HSX_SKIP_WITHOUT_CUDA();
  ::hsx::testing::TempDir dir;
  std::unique_ptr<Checkpoint> checkpoint(
      ::hsx::testing::WriteTestCheckpoint(::hsx::testing::TinyTestConfig(), dir / "m", 31));
  ASSERT_NE(checkpoint, nullptr);
  const CaptureSpec wanted = *CaptureSpec::Make({0, 2, 4}, true, 4);
  std::mt19937 random(9);
  std::vector<std::vector<int32_t>> samples;
  for (int64_t length : {5, 130, 300, 1}) {
    std::vector<int32_t> tokens(length);
    for (int32_t& t : tokens) t = static_cast<int32_t>(random() % checkpoint->config().vocab_size);
    samples.push_back(tokens);
  }
  for (const char* overlap : {"1", "0"}) {
    SCOPED_TRACE(::testing::Message() << "HSX_CUDA_CAPTURE_OVERLAP=" << overlap);
    setenv("HSX_CUDA_CAPTURE_OVERLAP", overlap, 1);
    EngineOptions options;
    options.precision = ElementType::kBf16;
    options.device = Device::kCuda;
    absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(*checkpoint, options);
    unsetenv("HSX_CUDA_CAPTURE_OVERLAP");
    ASSERT_TRUE(engine.ok()) << engine.status();
    std::mutex mutex;
    std::vector<std::vector<absl::StatusOr<SampleTensors>>> got(
        samples.size(), std::vector<absl::StatusOr<SampleTensors>>(2, absl::UnknownError("not delivered")));
    {
      Batcher batcher(**engine, BatcherOptions{.max_batch_tokens = 512});
      for (size_t i = 0; i < samples.size(); ++i) {
        for (int fp8 = 0; fp8 < 2; ++fp8) {
          WorkItem item;
          item.tokens = samples[i];
          item.capture = wanted;
          item.row_check = RowCheck{fp8 ? OutputDType::kFp8 : OutputDType::kBf16, ChecksumKind::kXxh64};
          if (fp8) item.encode_buffer = ::hsx::testing::HeapBuffers();
          item.deliver = [&, i, fp8](absl::StatusOr<SampleTensors> rows) {
            std::lock_guard<std::mutex> lock(mutex);
            got[i][fp8] = std::move(rows);
          };
          ASSERT_TRUE(batcher.Submit(std::move(item)).ok());
        }
      }
    }  // every sample delivered
    for (size_t i = 0; i < samples.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "sample " << i);
      ASSERT_TRUE(got[i][0].ok() && got[i][1].ok()) << got[i][0].status() << " " << got[i][1].status();
      ASSERT_EQ(got[i][1]->dtype, OutputDType::kFp8) << "not encoded on the device";
      EXPECT_EQ(got[i][1]->capture_ids, wanted.ids());
      int allocations = 0;
      absl::StatusOr<SampleTensors> sent =
          EncodeSample(*got[i][1], OutputDType::kFp8, ChecksumKind::kXxh64, ::hsx::testing::HeapBuffers(&allocations));
      absl::StatusOr<SampleTensors> host =
          EncodeSample(*got[i][0], OutputDType::kFp8, ChecksumKind::kXxh64, ::hsx::testing::HeapBuffers());
      ASSERT_TRUE(sent.ok() && host.ok());
      EXPECT_EQ(allocations, 0) << "encoded again on the host";
      ASSERT_EQ(sent->tensors.size(), host->tensors.size());
      for (size_t k = 0; k < host->tensors.size(); ++k) {
        EXPECT_EQ(sent->tensors[k].findings->bad_index, -1);
        EXPECT_EQ(sent->tensors[k].findings->checksum, host->tensors[k].findings->checksum) << "tensor " << k;
        EXPECT_TRUE(TensorString(sent->tensors[k]) == TensorString(host->tensors[k])) << "tensor " << k;
      }
    }
  }
}

}  // namespace
}  // namespace hsx
