// gemm.h: the CPU matrix multiply, C[M, N] = A[M, K] · Bᵀ.
//
// A is float32 (activations). B [N, K] is read in place in whatever form it is
// stored: bfloat16 rows (a checkpoint weight, possibly a column slice), INT4
// pack-quantized rows (dequantized per panel, never expanded in full), or a
// float32 matrix (attention scores and values). B is packed 16 rows at a time
// into float32 panels and multiplied by a register-blocked kernel (4x16 with
// AVX2, 8x16 with AVX-512, chosen at run time).
//
// Guarantee (what makes results independent of the batch): every C[m][n] is
// the sum over k = 0, 1, ..., K-1 of A[m][k] * B[n][k], accumulated with
// fused multiply-adds in that order, starting from 0. The order does not
// depend on M, on which other rows are in A, on the tiling or on the thread
// count. Tail rows and columns are padded, never sent to a different code path.
#ifndef HSX_KERNELS_CPU_GEMM_H_
#define HSX_KERNELS_CPU_GEMM_H_

#include <cstdint>
#include <string>

namespace hsx {

class ThreadPool;

struct GemmB {
  enum class Kind {
    kBf16,            // data: uint16_t [N, ld]; B[n][k] = data[n * ld + k]
    kInt4,            // data: int32 packed [N, K/8], scale: bf16 [N, K/group_size]
    kF32,             // data: float [N, ld]; B[n][k] = data[n * ld + k]
    kF32Transposed,   // data: float [K, ld]; B[n][k] = data[k * ld + n]
  };
  Kind kind = Kind::kBf16;
  const void* data = nullptr;
  int64_t ld = 0;
  const uint16_t* scale = nullptr;
  int64_t group_size = 0;
  int64_t n = 0;
  int64_t k = 0;
};

// C (row stride ldc) = A (row stride lda, m rows) · Bᵀ. With round_bf16, each
// result is rounded to bfloat16 (as a BF16 GEMM with float32 accumulation
// writes it). `pool` may be null (single-threaded).
void Gemm(const float* a, int64_t lda, int64_t m, const GemmB& b, float* c, int64_t ldc,
          bool round_bf16, ThreadPool* pool);

// The plain triple loop with the same summation order (std::fma, k ascending):
// the reference the fast path is tested against bit for bit.
void GemmReference(const float* a, int64_t lda, int64_t m, const GemmB& b, float* c, int64_t ldc,
                   bool round_bf16);

// The micro-kernels. All three compute every element with the same operations
// in the same order, so they agree bit for bit (tests run once per kernel).
enum class GemmKernel { kScalar, kAvx2, kAvx512 };

// "scalar", "avx2" or "avx512".
const char* GemmKernelName(GemmKernel kernel);

// Resolves a request for a kernel: null or "" picks the widest kernel this CPU
// supports; otherwise the named kernel, which must be known and supported
// (else false with a message in *error). Pure apart from reading the CPU flags.
bool ResolveGemmKernel(const char* requested, GemmKernel* kernel, std::string* error);

// The kernel Gemm uses, chosen once per process: the environment variable
// HSX_CPU_GEMM (avx512, avx2 or scalar) if set, else the widest one the CPU
// supports. An unknown or unsupported value ends the process with a message
// on stderr the first time any GEMM runs or this is called.
GemmKernel ActiveGemmKernel();

// B[n][k] as float (for references and tests).
float GemmBAt(const GemmB& b, int64_t n, int64_t k);

}  // namespace hsx

#endif  // HSX_KERNELS_CPU_GEMM_H_
