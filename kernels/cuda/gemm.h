// gemm.h: the CUDA backend's matrix multiply, y[M, N] = x[M, K] · Wᵀ, through
// cuBLASLt with float32 accumulation.
//
// Row independence (backend.h, batch invariance (a)). cuBLASLt's heuristic
// picks kernels by problem size, M included, and a kernel's summation order
// over K depends on its tile shape and on any split of K. So a plan (one
// algorithm) is chosen once per (N, K, input type, output type), at the first
// multiply of that shape, for a large M (kPlanRows), with
//   * the heuristic restricted to CUBLASLT_REDUCTION_SCHEME_NONE, and the
//     chosen algorithm's CUBLASLT_ALGO_CONFIG_SPLITK_NUM forced to 1 (and
//     checked with cublasLtMatmulAlgoCheck): K is summed in one sequence;
//   * the same algorithm, unmodified, used for every later M of that shape.
// cuBLASLt sees the product column-major, as yᵀ[N, M] = W[N, K] · xᵀ[K, M],
// so tokens are the "n" dimension: a row of y is one column of the output
// tile grid, and with a fixed tile and no K split its value is computed by
// the same instruction sequence whatever M is. That reasoning does not rule
// out a library kernel whose internal order still depends on the grid (a
// stream-K decomposition hidden inside one algorithm id), so each candidate
// is also checked once, on the device, before it is pinned: a row computed
// alone must equal, bitwise, the same row inside a kPlanRows-row product on
// generated data; the first candidate (in the heuristic's order) that passes
// is used, and a shape with none fails with the list of what was tried. The
// device tests (tests/cuda: rows alone, in 3 and in 8192 rows at the Kimi-K2
// shapes) check the same property through the backend.
//
// Alignment: plans are made for 16-byte aligned operands (pointers and row
// strides); the caller (CudaBackend) copies an unaligned operand into aligned
// scratch first, so the plan, and the arithmetic, never depend on alignment.
//
// Float32 inputs use CUBLAS_COMPUTE_32F_PEDANTIC (falling back to
// CUBLAS_COMPUTE_32F, which is also fp32 unless TF32 or emulation is
// requested): true fp32 multiply-adds, never TF32 or the bf16x9 emulation.
#ifndef HSX_KERNELS_CUDA_GEMM_H_
#define HSX_KERNELS_CUDA_GEMM_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

struct CUstream_st;
struct cublasLtContext;

namespace hsx::cuda {

// One GEMM operand or result in device memory (row-major).
struct GemmMatrix {
  const void* data = nullptr;
  bool bf16 = false;  // else f32
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ld = 0;
};

class LtGemm {
 public:
  // The M a plan is chosen for.
  static constexpr int64_t kPlanRows = 16384;
  // Operands must be aligned to this many bytes (pointers and row strides).
  static constexpr int64_t kAlignment = 16;

  // `workspace` (device memory of `workspace_bytes`) is used by every multiply,
  // in stream order on `stream`.
  static absl::StatusOr<std::unique_ptr<LtGemm>> Create(CUstream_st* stream, void* workspace,
                                                        size_t workspace_bytes);
  ~LtGemm();

  // y = x · wᵀ with w [N, K] (w.rows = N, w.cols = K, same type as x). Enqueues
  // on the stream; `op` names the caller in errors.
  absl::Status Multiply(const GemmMatrix& x, const GemmMatrix& w, const GemmMatrix& y, const char* op);

  // True when the matrix meets kAlignment.
  static bool Aligned(const GemmMatrix& m);

  // The plans made so far, one line each (for logs and tests).
  std::string DescribePlans() const;

 private:
  struct Plan;
  struct Layouts;  // the cuBLASLt layouts of one multiply
  using Key = std::tuple<int64_t, int64_t, bool, bool>;  // N, K, bf16 input, bf16 output

  LtGemm(cublasLtContext* handle, CUstream_st* stream, void* workspace, size_t workspace_bytes);
  absl::StatusOr<Plan*> PlanFor(const Key& key);
  // One heuristic query for a compute type (a cublasComputeType_t), with or
  // without the no-split-K mask: the algorithms that run K in one sequence,
  // in the heuristic's order (empty, with `why` set, when none does).
  std::vector<std::unique_ptr<Plan>> Candidates(int compute, bool mask_splits, const Layouts& layouts,
                                                std::string* why);
  // Whether `plan` computes a row alone exactly as inside a kPlanRows-row
  // product of the same shape (run on device-generated data; synchronizes).
  // False with `rejected` set when cuBLASLt refuses to run the plan at one of
  // those sizes; an error only for a failed CUDA call.
  absl::StatusOr<bool> RowsIndependent(const Plan& plan, const Key& key, std::string* rejected);
  absl::Status Run(const Plan& plan, const GemmMatrix& x, const GemmMatrix& w, const GemmMatrix& y);

  cublasLtContext* handle_;
  CUstream_st* stream_;
  void* workspace_;
  size_t workspace_bytes_;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace hsx::cuda

#endif  // HSX_KERNELS_CUDA_GEMM_H_
