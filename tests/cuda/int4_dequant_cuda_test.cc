// int4_dequant_cuda_test.cc: the CUDA INT4 dequantization kernel against the
// CPU reference (kernels/cpu/int4_dequant.h), bit for bit.
//
// Tests that need a GPU skip, saying why, when cudaGetDeviceCount finds none.
// The argument-validation tests need no GPU and always run.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/cpu/int4_dequant.h"
#include "kernels/cuda/int4_dequant.h"
#include "tests/common/value_comparison.h"

namespace hsx {
namespace {

#define HSX_ASSERT_CUDA(expr)                                                   \
  do {                                                                         \
    const cudaError_t hsx_status_ = (expr);                                    \
    ASSERT_EQ(hsx_status_, cudaSuccess) << #expr << ": " << cudaGetErrorString(hsx_status_); \
  } while (0)

// An empty string when a CUDA device is usable, else why not.
std::string NoDeviceReason() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) return cudaGetErrorString(status);
  if (count == 0) return "cudaGetDeviceCount returned 0 devices";
  return "";
}

class Int4DequantCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string reason = NoDeviceReason();
    if (!reason.empty()) GTEST_SKIP() << "no CUDA device: " << reason;
  }
};

// A device allocation freed on scope exit.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t count) : count_(count) {
    status_ = cudaMalloc(reinterpret_cast<void**>(&ptr_), count * sizeof(T));
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return ptr_; }
  cudaError_t status() const { return status_; }
  cudaError_t Upload(const std::vector<T>& host) const {
    return cudaMemcpy(ptr_, host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice);
  }
  cudaError_t Download(std::vector<T>& host) const {
    host.resize(count_);
    return cudaMemcpy(host.data(), ptr_, count_ * sizeof(T), cudaMemcpyDeviceToHost);
  }

 private:
  T* ptr_ = nullptr;
  size_t count_;
  cudaError_t status_;
};

enum class ScaleKind {
  kRealistic,    // small positive and negative scales, as in checkpoints
  kAnyFinite,    // every finite bf16 bit pattern: denormals, huge, +-0
  kWithSpecial,  // finite plus inf and NaN
};

// A random quantized weight: packed words and bf16 scale bits.
struct Int4Weight {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t group_size = 0;
  std::vector<int32_t> packed;
  std::vector<uint16_t> scale;
};

Int4Weight RandomWeight(int64_t rows, int64_t cols, int64_t group_size, ScaleKind kind,
                        uint32_t seed) {
  std::mt19937 rng(seed);
  Int4Weight weight;
  weight.rows = rows;
  weight.cols = cols;
  weight.group_size = group_size;
  std::vector<int8_t> values(static_cast<size_t>(rows * cols));
  std::uniform_int_distribution<int> q_dist(-8, 7);
  for (int8_t& v : values) v = static_cast<int8_t>(q_dist(rng));
  weight.packed.resize(static_cast<size_t>(rows * cols / 8));
  PackInt4(values.data(), rows, cols, weight.packed.data());

  weight.scale.resize(static_cast<size_t>(rows * (cols / group_size)));
  std::uniform_real_distribution<float> magnitude(1e-4f, 0.1f);
  std::uniform_int_distribution<uint32_t> bits(0, 0xFFFF);
  for (uint16_t& s : weight.scale) {
    switch (kind) {
      case ScaleKind::kRealistic: {
        const float sign = (bits(rng) & 1u) ? -1.0f : 1.0f;
        s = FloatToBf16(sign * magnitude(rng));
        break;
      }
      case ScaleKind::kAnyFinite:
        do {
          s = static_cast<uint16_t>(bits(rng));
        } while ((s & 0x7F80u) == 0x7F80u);
        break;
      case ScaleKind::kWithSpecial:
        s = static_cast<uint16_t>(bits(rng));
        if (bits(rng) % 8 == 0) s = (bits(rng) & 1u) ? 0x7F80u : 0xFF80u;  // +-inf
        break;
    }
  }
  return weight;
}

std::vector<uint16_t> CpuDequant(const Int4Weight& w) {
  std::vector<uint16_t> out(static_cast<size_t>(w.rows * w.cols));
  DequantizeInt4Rows(w.packed.data(), w.scale.data(), w.cols, w.group_size, 0, w.rows,
                     out.data());
  return out;
}

bool IsBf16Nan(uint16_t bits) { return (bits & 0x7F80u) == 0x7F80u && (bits & 0x7Fu) != 0; }

// Bit-exact comparison; with nan_equal, any two NaNs count as equal. A
// failure names the elements at fault (tests/common/value_comparison.h) and
// the first one's INT4 code and group scale.
::testing::AssertionResult SameBits(const Int4Weight& w, const std::vector<uint16_t>& want,
                                    const std::vector<uint16_t>& got, bool nan_equal = false) {
  ::testing::AssertionResult result =
      ::hsx::testing::Bf16BitsMatch({"DequantizeInt4", {w.rows, w.cols}, "bf16"}, got, want, nan_equal);
  if (result || want.size() != got.size()) return result;
  int64_t first = 0;
  while (want[first] == got[first] || (nan_equal && IsBf16Nan(want[first]) && IsBf16Nan(got[first]))) ++first;
  const int64_t row = first / w.cols;
  const int64_t col = first % w.cols;
  const int32_t* packed_row = w.packed.data() + row * (w.cols / 8);
  const uint16_t scale_bits = w.scale[static_cast<size_t>(row * (w.cols / w.group_size) + col / w.group_size)];
  char detail[160];
  std::snprintf(detail, sizeof(detail), "; the first, [%lld][%lld]: q=%d scale=0x%04x want=0x%04x got=0x%04x",
                static_cast<long long>(row), static_cast<long long>(col), Int4At(packed_row, col), scale_bits,
                want[static_cast<size_t>(first)], got[static_cast<size_t>(first)]);
  return result << detail;
}

// Runs the kernel on `w` (on `stream`) and returns its output in `got`.
void GpuDequant(const Int4Weight& w, cudaStream_t stream, std::vector<uint16_t>& got) {
  DeviceBuffer<int32_t> packed(w.packed.size());
  DeviceBuffer<uint16_t> scale(w.scale.size());
  DeviceBuffer<uint16_t> out(static_cast<size_t>(w.rows * w.cols));
  HSX_ASSERT_CUDA(packed.status());
  HSX_ASSERT_CUDA(scale.status());
  HSX_ASSERT_CUDA(out.status());
  HSX_ASSERT_CUDA(packed.Upload(w.packed));
  HSX_ASSERT_CUDA(scale.Upload(w.scale));
  HSX_ASSERT_CUDA(cudaMemset(out.get(), 0xFF, static_cast<size_t>(w.rows * w.cols) * 2));
  // The uploads and the memset are on the legacy default stream (the memset,
  // and a pageable upload's DMA, may still be running when they return),
  // which a non-blocking `stream` does not wait for: without this the memset
  // could land after the kernel's output.
  HSX_ASSERT_CUDA(cudaDeviceSynchronize());
  HSX_ASSERT_CUDA(static_cast<cudaError_t>(LaunchDequantizeInt4(
      packed.get(), scale.get(), w.rows, w.cols, w.group_size, out.get(), stream)));
  HSX_ASSERT_CUDA(cudaStreamSynchronize(stream));
  HSX_ASSERT_CUDA(out.Download(got));
}

struct Shape {
  int64_t rows;
  int64_t cols;
  int64_t group_size;
};

// Odd row counts, group sizes 32 and 128 (the checkpoint's and a common one),
// smaller groups, groups that are not a multiple of 8 (per-element scales),
// and the K2 expert shapes.
const Shape kShapes[] = {
    {1, 8, 8},      {1, 32, 32},     {3, 64, 32},   {7, 256, 128},  {33, 1024, 32},
    {129, 384, 128}, {255, 128, 128}, {5, 96, 16},   {9, 48, 24},    {11, 40, 4},
    {3, 24, 12},    {17, 7168, 32},  {31, 2048, 128}, {2048, 7168, 32}, {7168, 2048, 32},
};

TEST_F(Int4DequantCudaTest, MatchesCpuReference) {
  uint32_t seed = 1234;
  for (const Shape& shape : kShapes) {
    for (ScaleKind kind : {ScaleKind::kRealistic, ScaleKind::kAnyFinite}) {
      SCOPED_TRACE(::testing::Message() << "rows=" << shape.rows << " cols=" << shape.cols
                                        << " group=" << shape.group_size
                                        << " kind=" << static_cast<int>(kind));
      const Int4Weight w = RandomWeight(shape.rows, shape.cols, shape.group_size, kind, seed++);
      std::vector<uint16_t> got;
      ASSERT_NO_FATAL_FAILURE(GpuDequant(w, nullptr, got));
      EXPECT_TRUE(SameBits(w, CpuDequant(w), got));
    }
  }
}

TEST_F(Int4DequantCudaTest, SpecialScalesGiveSameValuesAndNans) {
  const Int4Weight w = RandomWeight(37, 512, 32, ScaleKind::kWithSpecial, 99);
  std::vector<uint16_t> got;
  ASSERT_NO_FATAL_FAILURE(GpuDequant(w, nullptr, got));
  EXPECT_TRUE(SameBits(w, CpuDequant(w), got, /*nan_equal=*/true));
}

TEST_F(Int4DequantCudaTest, RunsOnAStream) {
  const Int4Weight w = RandomWeight(65, 768, 128, ScaleKind::kRealistic, 7);
  cudaStream_t stream = nullptr;
  HSX_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<uint16_t> got;
  GpuDequant(w, stream, got);
  HSX_ASSERT_CUDA(cudaStreamDestroy(stream));
  EXPECT_TRUE(SameBits(w, CpuDequant(w), got));
}

// More words than one grid covers (65536 blocks x 256 threads = 2^24 words),
// so the grid-stride loop runs a second round.
TEST_F(Int4DequantCudaTest, CoversMoreWordsThanOneGrid) {
  const Int4Weight w = RandomWeight(16385, 8192, 128, ScaleKind::kRealistic, 11);
  ASSERT_GT(w.packed.size(), size_t{1} << 24);
  std::vector<uint16_t> got;
  ASSERT_NO_FATAL_FAILURE(GpuDequant(w, nullptr, got));
  EXPECT_TRUE(SameBits(w, CpuDequant(w), got));
}

TEST_F(Int4DequantCudaTest, BatchedMatchesCpuReference) {
  constexpr int kExperts = 6;
  constexpr int64_t kRows = 45;
  constexpr int64_t kCols = 1024;
  for (int64_t group_size : {int64_t{32}, int64_t{128}, int64_t{4}}) {
    SCOPED_TRACE(::testing::Message() << "group=" << group_size);
    std::vector<Int4Weight> weights;
    std::vector<std::unique_ptr<DeviceBuffer<int32_t>>> packed;
    std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> scale;
    std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> out;
    std::vector<const int32_t*> packed_ptrs;
    std::vector<const uint16_t*> scale_ptrs;
    std::vector<uint16_t*> out_ptrs;
    for (int e = 0; e < kExperts; ++e) {
      weights.push_back(RandomWeight(kRows, kCols, group_size, ScaleKind::kAnyFinite,
                                     static_cast<uint32_t>(500 + e)));
      packed.push_back(std::make_unique<DeviceBuffer<int32_t>>(weights.back().packed.size()));
      scale.push_back(std::make_unique<DeviceBuffer<uint16_t>>(weights.back().scale.size()));
      out.push_back(std::make_unique<DeviceBuffer<uint16_t>>(static_cast<size_t>(kRows * kCols)));
      HSX_ASSERT_CUDA(packed.back()->status());
      HSX_ASSERT_CUDA(scale.back()->status());
      HSX_ASSERT_CUDA(out.back()->status());
      HSX_ASSERT_CUDA(packed.back()->Upload(weights.back().packed));
      HSX_ASSERT_CUDA(scale.back()->Upload(weights.back().scale));
      packed_ptrs.push_back(packed.back()->get());
      scale_ptrs.push_back(scale.back()->get());
      out_ptrs.push_back(out.back()->get());
    }
    DeviceBuffer<const int32_t*> d_packed(kExperts);
    DeviceBuffer<const uint16_t*> d_scale(kExperts);
    DeviceBuffer<uint16_t*> d_out(kExperts);
    HSX_ASSERT_CUDA(d_packed.Upload(packed_ptrs));
    HSX_ASSERT_CUDA(d_scale.Upload(scale_ptrs));
    HSX_ASSERT_CUDA(d_out.Upload(out_ptrs));
    HSX_ASSERT_CUDA(static_cast<cudaError_t>(
        LaunchDequantizeInt4Batched(d_packed.get(), d_scale.get(), d_out.get(), kExperts, kRows,
                                    kCols, group_size, nullptr)));
    HSX_ASSERT_CUDA(cudaDeviceSynchronize());
    for (int e = 0; e < kExperts; ++e) {
      SCOPED_TRACE(::testing::Message() << "expert " << e);
      std::vector<uint16_t> got;
      HSX_ASSERT_CUDA(out[static_cast<size_t>(e)]->Download(got));
      EXPECT_TRUE(SameBits(weights[static_cast<size_t>(e)],
                           CpuDequant(weights[static_cast<size_t>(e)]), got));
    }
  }
}

// Invalid arguments are rejected before any CUDA call, so these need no GPU.
TEST(Int4DequantCudaArgsTest, RejectsInvalidArguments) {
  // Never dereferenced: every call below returns before launching.
  auto* packed = reinterpret_cast<const int32_t*>(uintptr_t{0x1000});
  auto* scale = reinterpret_cast<const uint16_t*>(uintptr_t{0x2000});
  auto* out = reinterpret_cast<uint16_t*>(uintptr_t{0x3000});
  EXPECT_EQ(LaunchDequantizeInt4(packed, scale, 4, 12, 4, out, nullptr), cudaErrorInvalidValue)
      << "cols % 8 != 0";
  EXPECT_EQ(LaunchDequantizeInt4(packed, scale, 4, 64, 0, out, nullptr), cudaErrorInvalidValue)
      << "group_size 0";
  EXPECT_EQ(LaunchDequantizeInt4(packed, scale, 4, 64, 48, out, nullptr), cudaErrorInvalidValue)
      << "cols % group_size != 0";
  EXPECT_EQ(LaunchDequantizeInt4(packed, scale, -1, 64, 32, out, nullptr), cudaErrorInvalidValue)
      << "negative rows";
  EXPECT_EQ(LaunchDequantizeInt4(nullptr, scale, 4, 64, 32, out, nullptr), cudaErrorInvalidValue)
      << "null packed";
  EXPECT_EQ(LaunchDequantizeInt4(packed, scale, 4, 64, 32, out + 1, nullptr), cudaErrorInvalidValue)
      << "out not 16-byte aligned (an argument error, not the sticky cudaErrorMisalignedAddress)";
  EXPECT_EQ(LaunchDequantizeInt4(packed, scale, 0, 64, 32, out, nullptr), cudaSuccess)
      << "rows == 0 is a no-op";

  auto* const* packed_ptrs = reinterpret_cast<const int32_t* const*>(uintptr_t{0x4000});
  auto* const* scale_ptrs = reinterpret_cast<const uint16_t* const*>(uintptr_t{0x5000});
  auto* const* out_ptrs = reinterpret_cast<uint16_t* const*>(uintptr_t{0x6000});
  EXPECT_EQ(LaunchDequantizeInt4Batched(packed_ptrs, scale_ptrs, out_ptrs, 65536, 4, 64, 32,
                                        nullptr),
            cudaErrorInvalidValue)
      << "count above the grid's y limit";
  EXPECT_EQ(LaunchDequantizeInt4Batched(packed_ptrs, scale_ptrs, out_ptrs, 3, 4, 60, 32,
                                        nullptr),
            cudaErrorInvalidValue)
      << "cols % 8 != 0";
  EXPECT_EQ(LaunchDequantizeInt4Batched(packed_ptrs, scale_ptrs, out_ptrs, 0, 4, 64, 32,
                                        nullptr),
            cudaSuccess)
      << "count == 0 is a no-op";
}

}  // namespace
}  // namespace hsx
