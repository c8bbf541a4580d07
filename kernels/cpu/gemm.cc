// gemm.cc: panel packing and the FMA micro-kernels (AVX-512 8x16 and 8x32, AVX2
// 4x16, and a scalar std::fma kernel with the identical arithmetic).
#include "kernels/cpu/gemm.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels/bf16.h"
#include "kernels/cpu/int4_dequant.h"
#include "kernels/cpu/thread_pool.h"

namespace hsx {
namespace {

constexpr int64_t kPanel = 16;        // B rows per packed panel (two AVX2 / one AVX-512 vector)
constexpr int64_t kMaxRows = 8;       // A rows per micro-kernel call, at most
constexpr int64_t kPanelsPerTask = 4; // panels one task packs and sweeps A with

// Packs B rows [n0, n0 + 16) into panel[k * 16 + j] = B[n0 + j][k]; rows past N are zero.
void PackPanel(const GemmB& b, int64_t n0, float* panel) {
  const int64_t rows = std::min(kPanel, b.n - n0);
  const int64_t k_size = b.k;
  if (rows < kPanel) std::memset(panel, 0, sizeof(float) * kPanel * k_size);
  switch (b.kind) {
    case GemmB::Kind::kBf16: {
      const uint16_t* data = static_cast<const uint16_t*>(b.data);
      for (int64_t j = 0; j < rows; ++j) {
        const uint16_t* row = data + (n0 + j) * b.ld;
        for (int64_t k = 0; k < k_size; ++k) panel[k * kPanel + j] = Bf16ToFloat(row[k]);
      }
      break;
    }
    case GemmB::Kind::kInt4: {
      const int32_t* packed = static_cast<const int32_t*>(b.data);
      std::vector<float> row(k_size);
      for (int64_t j = 0; j < rows; ++j) {
        DequantizeInt4RowsToFloat(packed, b.scale, k_size, b.group_size, n0 + j, n0 + j + 1,
                                  row.data());
        for (int64_t k = 0; k < k_size; ++k) panel[k * kPanel + j] = row[k];
      }
      break;
    }
    case GemmB::Kind::kF32: {
      const float* data = static_cast<const float*>(b.data);
      for (int64_t j = 0; j < rows; ++j) {
        const float* row = data + (n0 + j) * b.ld;
        for (int64_t k = 0; k < k_size; ++k) panel[k * kPanel + j] = row[k];
      }
      break;
    }
    case GemmB::Kind::kF32Transposed: {
      const float* data = static_cast<const float*>(b.data);
      for (int64_t k = 0; k < k_size; ++k) {
        std::memcpy(panel + k * kPanel, data + k * b.ld + n0, sizeof(float) * rows);
      }
      break;
    }
  }
}

// acc[r][j] = sum_k a[r][k] * panel[k][j], k ascending, fused multiply-add,
// for r < 4 (the scalar and AVX2 kernels) or r < 8 (AVX-512). Every kernel
// computes each element with the same operations in the same order, so they
// agree bit for bit and the row count never changes a result.
void MicroKernelScalar(const float* const* a, const float* panel, int64_t k_size,
                       float acc[kMaxRows][kPanel]) {
  constexpr int64_t kRows = 4;
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t j = 0; j < kPanel; ++j) acc[r][j] = 0.0f;
  }
  for (int64_t k = 0; k < k_size; ++k) {
    for (int64_t r = 0; r < kRows; ++r) {
      const float x = a[r][k];
      for (int64_t j = 0; j < kPanel; ++j) acc[r][j] = std::fma(x, panel[k * kPanel + j], acc[r][j]);
    }
  }
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) void MicroKernelAvx2(const float* const* a, const float* panel,
                                                         int64_t k_size,
                                                         float acc[kMaxRows][kPanel]) {
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps();
  __m256 c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
  __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
  __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
  const float* a0 = a[0];
  const float* a1 = a[1];
  const float* a2 = a[2];
  const float* a3 = a[3];
  for (int64_t k = 0; k < k_size; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 b1 = _mm256_loadu_ps(panel + k * kPanel + 8);
    __m256 x = _mm256_broadcast_ss(a0 + k);
    c00 = _mm256_fmadd_ps(x, b0, c00);
    c01 = _mm256_fmadd_ps(x, b1, c01);
    x = _mm256_broadcast_ss(a1 + k);
    c10 = _mm256_fmadd_ps(x, b0, c10);
    c11 = _mm256_fmadd_ps(x, b1, c11);
    x = _mm256_broadcast_ss(a2 + k);
    c20 = _mm256_fmadd_ps(x, b0, c20);
    c21 = _mm256_fmadd_ps(x, b1, c21);
    x = _mm256_broadcast_ss(a3 + k);
    c30 = _mm256_fmadd_ps(x, b0, c30);
    c31 = _mm256_fmadd_ps(x, b1, c31);
  }
  _mm256_storeu_ps(acc[0], c00);
  _mm256_storeu_ps(acc[0] + 8, c01);
  _mm256_storeu_ps(acc[1], c10);
  _mm256_storeu_ps(acc[1] + 8, c11);
  _mm256_storeu_ps(acc[2], c20);
  _mm256_storeu_ps(acc[2] + 8, c21);
  _mm256_storeu_ps(acc[3], c30);
  _mm256_storeu_ps(acc[3] + 8, c31);
}

// 8 rows x 16 columns: one zmm accumulator per row.
__attribute__((target("avx512f"))) void MicroKernelAvx512(const float* const* a, const float* panel,
                                                         int64_t k_size,
                                                         float acc[kMaxRows][kPanel]) {
  __m512 c[8];
  for (int r = 0; r < 8; ++r) c[r] = _mm512_setzero_ps();
  const float* rows[8];
  for (int r = 0; r < 8; ++r) rows[r] = a[r];
  for (int64_t k = 0; k < k_size; ++k) {
    const __m512 b = _mm512_loadu_ps(panel + k * kPanel);
    for (int r = 0; r < 8; ++r) c[r] = _mm512_fmadd_ps(_mm512_set1_ps(rows[r][k]), b, c[r]);
  }
  for (int r = 0; r < 8; ++r) _mm512_storeu_ps(acc[r], c[r]);
}

// Two panels at once (8 rows x 32 columns, 16 accumulators): one broadcast
// feeds two FMAs, so loads no longer bound the loop. Same per-element order.
__attribute__((target("avx512f"))) void MicroKernelAvx512Pair(const float* const* a, const float* panel0,
                                                             const float* panel1, int64_t k_size,
                                                             float acc0[kMaxRows][kPanel],
                                                             float acc1[kMaxRows][kPanel]) {
  __m512 c0[8], c1[8];
  for (int r = 0; r < 8; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
  const float* rows[8];
  for (int r = 0; r < 8; ++r) rows[r] = a[r];
  for (int64_t k = 0; k < k_size; ++k) {
    const __m512 b0 = _mm512_loadu_ps(panel0 + k * kPanel);
    const __m512 b1 = _mm512_loadu_ps(panel1 + k * kPanel);
    for (int r = 0; r < 8; ++r) {
      const __m512 x = _mm512_set1_ps(rows[r][k]);
      c0[r] = _mm512_fmadd_ps(x, b0, c0[r]);
      c1[r] = _mm512_fmadd_ps(x, b1, c1[r]);
    }
  }
  for (int r = 0; r < 8; ++r) {
    _mm512_storeu_ps(acc0[r], c0[r]);
    _mm512_storeu_ps(acc1[r], c1[r]);
  }
}
#endif

using MicroKernel = void (*)(const float* const*, const float*, int64_t, float[kMaxRows][kPanel]);

using PairKernel = void (*)(const float* const*, const float*, const float*, int64_t,
                           float[kMaxRows][kPanel], float[kMaxRows][kPanel]);

struct KernelChoice {
  MicroKernel kernel;
  PairKernel pair;  // null where there is no two-panel kernel
  int64_t rows;
};

bool CpuSupports(GemmKernel kernel) {
#if defined(__x86_64__)
  switch (kernel) {
    case GemmKernel::kAvx512: return __builtin_cpu_supports("avx512f");
    case GemmKernel::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case GemmKernel::kScalar: return true;
  }
  return false;
#else
  return kernel == GemmKernel::kScalar;
#endif
}

KernelChoice ChoiceFor(GemmKernel kernel) {
#if defined(__x86_64__)
  if (kernel == GemmKernel::kAvx512) return {MicroKernelAvx512, MicroKernelAvx512Pair, 8};
  if (kernel == GemmKernel::kAvx2) return {MicroKernelAvx2, nullptr, 4};
#endif
  return {MicroKernelScalar, nullptr, 4};
}

// Read once, on first use (not at static initialization, so that a bad value
// is reported by a process that runs a GEMM, not by every process linking it).
const KernelChoice& Kernel() {
  static const KernelChoice choice = ChoiceFor(ActiveGemmKernel());
  return choice;
}

// Sweeps all rows of A against `panels` packed panels starting at column n0.
void SweepRows(const float* a, int64_t lda, int64_t m, const float* panels, int64_t panel_count,
               int64_t n0, int64_t n, int64_t k_size, float* c, int64_t ldc, bool round_bf16) {
  std::vector<float> zero_row(k_size, 0.0f);
  float acc[kMaxRows][kPanel];
  const KernelChoice& kernel = Kernel();
  const int64_t block = kernel.rows;
  for (int64_t m0 = 0; m0 < m; m0 += block) {
    const float* rows[kMaxRows];
    for (int64_t r = 0; r < block; ++r) {
      rows[r] = m0 + r < m ? a + (m0 + r) * lda : zero_row.data();  // pad, same kernel
    }
    auto store = [&](int64_t p, float (*result)[kPanel]) {
      const int64_t col0 = n0 + p * kPanel;
      const int64_t cols = std::min(kPanel, n - col0);
      for (int64_t r = 0; r < block && m0 + r < m; ++r) {
        float* out = c + (m0 + r) * ldc + col0;
        for (int64_t j = 0; j < cols; ++j) out[j] = round_bf16 ? RoundToBf16(result[r][j]) : result[r][j];
      }
    };
    int64_t p = 0;
    if (kernel.pair != nullptr) {
      float acc1[kMaxRows][kPanel];
      for (; p + 2 <= panel_count; p += 2) {
        kernel.pair(rows, panels + p * kPanel * k_size, panels + (p + 1) * kPanel * k_size, k_size, acc, acc1);
        store(p, acc);
        store(p + 1, acc1);
      }
    }
    for (; p < panel_count; ++p) {
      kernel.kernel(rows, panels + p * kPanel * k_size, k_size, acc);
      store(p, acc);
    }
  }
}

}  // namespace

const char* GemmKernelName(GemmKernel kernel) {
  switch (kernel) {
    case GemmKernel::kScalar: return "scalar";
    case GemmKernel::kAvx2: return "avx2";
    case GemmKernel::kAvx512: return "avx512";
  }
  return "?";
}

bool ResolveGemmKernel(const char* requested, GemmKernel* kernel, std::string* error) {
  constexpr GemmKernel kWidestFirst[] = {GemmKernel::kAvx512, GemmKernel::kAvx2, GemmKernel::kScalar};
  if (requested == nullptr || *requested == '\0') {
    for (GemmKernel k : kWidestFirst) {
      if (CpuSupports(k)) {
        *kernel = k;
        return true;
      }
    }
  }
  for (GemmKernel k : kWidestFirst) {
    if (std::strcmp(requested, GemmKernelName(k)) != 0) continue;
    if (!CpuSupports(k)) {
      *error = std::string("HSX_CPU_GEMM=") + requested + ": this CPU does not support the " + requested +
               " kernel";
      return false;
    }
    *kernel = k;
    return true;
  }
  *error = std::string("HSX_CPU_GEMM=") + requested + ": unknown kernel (expected avx512, avx2 or scalar)";
  return false;
}

GemmKernel ActiveGemmKernel() {
  static const GemmKernel active = [] {
    GemmKernel kernel = GemmKernel::kScalar;
    std::string error;
    if (!ResolveGemmKernel(std::getenv("HSX_CPU_GEMM"), &kernel, &error)) {
      std::fprintf(stderr, "hsx: %s\n", error.c_str());
      std::fflush(stderr);
      std::_Exit(2);  // may be on a pool thread: no static destructors
    }
    return kernel;
  }();
  return active;
}

float GemmBAt(const GemmB& b, int64_t n, int64_t k) {
  switch (b.kind) {
    case GemmB::Kind::kBf16: return Bf16ToFloat(static_cast<const uint16_t*>(b.data)[n * b.ld + k]);
    case GemmB::Kind::kInt4: {
      const int32_t* row = static_cast<const int32_t*>(b.data) + n * (b.k / 8);
      return Bf16ToFloat(DequantInt4Element(row, b.scale + n * (b.k / b.group_size), k, b.group_size));
    }
    case GemmB::Kind::kF32: return static_cast<const float*>(b.data)[n * b.ld + k];
    case GemmB::Kind::kF32Transposed: return static_cast<const float*>(b.data)[k * b.ld + n];
  }
  return 0.0f;
}

void GemmReference(const float* a, int64_t lda, int64_t m, const GemmB& b, float* c, int64_t ldc,
                   bool round_bf16) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < b.n; ++j) {
      float acc = 0.0f;
      for (int64_t k = 0; k < b.k; ++k) acc = std::fma(a[i * lda + k], GemmBAt(b, j, k), acc);
      c[i * ldc + j] = round_bf16 ? RoundToBf16(acc) : acc;
    }
  }
}

void Gemm(const float* a, int64_t lda, int64_t m, const GemmB& b, float* c, int64_t ldc,
          bool round_bf16, ThreadPool* pool) {
  if (m <= 0 || b.n <= 0) return;
  const int64_t panels = (b.n + kPanel - 1) / kPanel;
  const int64_t tasks = (panels + kPanelsPerTask - 1) / kPanelsPerTask;
  auto task = [&](int64_t t) {
    const int64_t first = t * kPanelsPerTask;
    const int64_t count = std::min(kPanelsPerTask, panels - first);
    std::vector<float> packed(static_cast<size_t>(count * kPanel * b.k));
    for (int64_t p = 0; p < count; ++p) PackPanel(b, (first + p) * kPanel, packed.data() + p * kPanel * b.k);
    SweepRows(a, lda, m, packed.data(), count, first * kPanel, b.n, b.k, c, ldc, round_bf16);
  };
  if (pool == nullptr) {
    for (int64_t t = 0; t < tasks; ++t) task(t);
  } else {
    pool->ParallelFor(tasks, task);
  }
}

}  // namespace hsx
