// gemm.cc: cuBLASLt plans pinned per (N, K, types); see gemm.h.
#include "kernels/cuda/gemm.h"

#include <cuda_runtime.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/lt_api.h"
#include "kernels/cuda/ops.h"

namespace hsx::cuda {
namespace {

// The loaded cuBLASLt API. LtGemm::Create loads it first, so every other use
// finds it loaded.
const LtApi& Lt() { return **LoadLtApi(); }

// cublasGetStatusName lives in libcublas, which this code does not link.
std::string LtError(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return absl::StrCat("cuBLAS status ", static_cast<int>(status));
  }
}

cudaDataType_t DataType(bool bf16) { return bf16 ? CUDA_R_16BF : CUDA_R_32F; }

// Column-major layout of a row-major [rows, cols] matrix: cols x rows, ld.
absl::StatusOr<cublasLtMatrixLayout_t> Layout(bool bf16, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t layout = nullptr;
  const cublasStatus_t status = Lt().cublasLtMatrixLayoutCreate(&layout, DataType(bf16), static_cast<uint64_t>(cols),
                                                           static_cast<uint64_t>(rows), ld);
  if (status != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrCat("cublasLtMatrixLayoutCreate: ", LtError(status)));
  }
  return layout;
}

int64_t RoundUp(int64_t value, int64_t to) { return (value + to - 1) / to * to; }

}  // namespace

// The three layouts of one multiply, destroyed together.
struct LtGemm::Layouts {
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  ~Layouts() {
    if (a) Lt().cublasLtMatrixLayoutDestroy(a);
    if (b) Lt().cublasLtMatrixLayoutDestroy(b);
    if (d) Lt().cublasLtMatrixLayoutDestroy(d);
  }
  absl::Status Make(bool in_bf16, bool out_bf16, int64_t m, int64_t n, int64_t k, int64_t ldw, int64_t ldx,
                    int64_t ldy) {
    // yᵀ[N, M] = op(A) · B with A = W stored column-major as [K, N] (transposed by op),
    // B = xᵀ stored column-major as [K, M], D = yᵀ column-major [N, M].
    absl::StatusOr<cublasLtMatrixLayout_t> la = Layout(in_bf16, n, k, ldw);
    if (!la.ok()) return la.status();
    a = *la;
    absl::StatusOr<cublasLtMatrixLayout_t> lb = Layout(in_bf16, m, k, ldx);
    if (!lb.ok()) return lb.status();
    b = *lb;
    absl::StatusOr<cublasLtMatrixLayout_t> ld = Layout(out_bf16, m, n, ldy);
    if (!ld.ok()) return ld.status();
    d = *ld;
    return absl::OkStatus();
  }
};

struct LtGemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatmulAlgo_t algo;
  size_t workspace = 0;
  std::string description;
  ~Plan() {
    if (desc) Lt().cublasLtMatmulDescDestroy(desc);
  }
};

absl::StatusOr<std::unique_ptr<LtGemm>> LtGemm::Create(CUstream_st* stream, void* workspace,
                                                       size_t workspace_bytes) {
  if (absl::StatusOr<const LtApi*> api = LoadLtApi(); !api.ok()) return api.status();
  cublasLtHandle_t handle = nullptr;
  const cublasStatus_t status = Lt().cublasLtCreate(&handle);
  if (status != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrCat("cublasLtCreate: ", LtError(status)));
  }
  return std::unique_ptr<LtGemm>(new LtGemm(handle, stream, workspace, workspace_bytes));
}

LtGemm::LtGemm(cublasLtContext* handle, CUstream_st* stream, void* workspace, size_t workspace_bytes)
    : handle_(handle), stream_(stream), workspace_(workspace), workspace_bytes_(workspace_bytes) {}

LtGemm::~LtGemm() {
  plans_.clear();
  Lt().cublasLtDestroy(handle_);
}

bool LtGemm::Aligned(const GemmMatrix& m) {
  const int64_t size = m.bf16 ? 2 : 4;
  return reinterpret_cast<uintptr_t>(m.data) % kAlignment == 0 && (m.ld * size) % kAlignment == 0;
}

absl::StatusOr<LtGemm::Plan*> LtGemm::PlanFor(const Key& key) {
  if (auto it = plans_.find(key); it != plans_.end()) return it->second.get();
  const auto [n, k, in_bf16, out_bf16] = key;
  const std::string shape = absl::StrCat("N=", n, " K=", k, " ", in_bf16 ? "bf16" : "f32", "->",
                                         out_bf16 ? "bf16" : "f32");
  // Plan for kPlanRows rows with packed, aligned strides.
  const int64_t element_in = in_bf16 ? 2 : 4, element_out = out_bf16 ? 2 : 4;
  Layouts layouts;
  if (absl::Status s = layouts.Make(in_bf16, out_bf16, kPlanRows, n, k, RoundUp(k, kAlignment / element_in),
                                    RoundUp(k, kAlignment / element_in), RoundUp(n, kAlignment / element_out));
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("cuBLASLt plan for ", shape, ": ", s.message()));
  }
  // f32 inputs: pedantic fp32 first (no TF32, no bf16x9 emulation), then
  // plain COMPUTE_32F (also true fp32 unless TF32 or emulation is asked for).
  std::vector<cublasComputeType_t> computes = {CUBLAS_COMPUTE_32F};
  if (!in_bf16) computes.insert(computes.begin(), CUBLAS_COMPUTE_32F_PEDANTIC);
  std::string tried;
  for (const cublasComputeType_t compute : computes) {
    // Ask for algorithms without a K split first; failing that, take any and
    // force split-K 1 (cublasLtMatmulAlgoCheck then says whether it runs).
    for (const bool mask_splits : {true, false}) {
      std::string why;
      std::vector<std::unique_ptr<Plan>> candidates = Candidates(compute, mask_splits, layouts, &why);
      if (candidates.empty()) absl::StrAppend(&tried, tried.empty() ? "" : "; ", why);
      // The first whose rows are verifiably independent of M (a stream-K
      // style kernel would fail this even with split-K 1).
      for (size_t c = 0; c < candidates.size(); ++c) {
        std::string rejected;
        absl::StatusOr<bool> independent = RowsIndependent(*candidates[c], key, &rejected);
        if (!independent.ok()) {
          return absl::Status(independent.status().code(),
                              absl::StrCat("cuBLASLt plan for ", shape, ": ", independent.status().message()));
        }
        if (!*independent) {
          absl::StrAppend(&tried, tried.empty() ? "" : "; ", candidates[c]->description, ": ",
                          rejected.empty() ? absl::StrCat("a row alone differs from the same row in ", kPlanRows,
                                                          " rows")
                                           : rejected);
          continue;
        }
        candidates[c]->description = absl::StrCat(shape, ": ", candidates[c]->description);
        Plan* raw = candidates[c].get();
        plans_[key] = std::move(candidates[c]);
        return raw;
      }
    }
  }
  return absl::InternalError(absl::StrCat("cuBLASLt plan for ", shape,
                                          ": no algorithm runs K in one sequence with rows independent of M (",
                                          tried, ")"));
}

namespace {

// The heuristic query's preference: the workspace limit, the operands'
// alignment and, with `mask_splits`, no split-K reduction.
cublasStatus_t MakePreference(bool mask_splits, size_t workspace_bytes, cublasLtMatmulPreference_t* preference) {
  const cublasStatus_t status = Lt().cublasLtMatmulPreferenceCreate(preference);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  const uint64_t max_workspace = workspace_bytes;
  const uint32_t no_split = CUBLASLT_REDUCTION_SCHEME_NONE;
  const uint32_t alignment = LtGemm::kAlignment;
  Lt().cublasLtMatmulPreferenceSetAttribute(*preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace,
                                       sizeof(max_workspace));
  if (mask_splits) {
    Lt().cublasLtMatmulPreferenceSetAttribute(*preference, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &no_split,
                                         sizeof(no_split));
  }
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    Lt().cublasLtMatmulPreferenceSetAttribute(*preference, attr, &alignment, sizeof(alignment));
  }
  return CUBLAS_STATUS_SUCCESS;
}

// A matmul descriptor for y^T = W^T-op · x^T in `compute`, f32 scale (one per
// candidate: a plan owns its descriptor).
cublasStatus_t MakeDesc(int compute, cublasLtMatmulDesc_t* desc) {
  cublasStatus_t s = Lt().cublasLtMatmulDescCreate(desc, static_cast<cublasComputeType_t>(compute), CUDA_R_32F);
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
  Lt().cublasLtMatmulDescSetAttribute(*desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose));
  Lt().cublasLtMatmulDescSetAttribute(*desc, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof(keep));
  return CUBLAS_STATUS_SUCCESS;
}

// Makes `algo` run K in one sequence (split-K 1, no reduction scheme); false
// when cuBLASLt refuses the setting.
bool ForceOneSequence(cublasLtMatmulAlgo_t* algo) {
  int32_t splits = 1;
  uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_NONE;
  size_t written = 0;
  Lt().cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits, sizeof(splits), &written);
  Lt().cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme, sizeof(scheme),
                                       &written);
  if (splits > 1 || scheme != CUBLASLT_REDUCTION_SCHEME_NONE) {
    const int32_t one = 1;
    const uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
    if (Lt().cublasLtMatmulAlgoConfigSetAttribute(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof(one)) !=
            CUBLAS_STATUS_SUCCESS ||
        Lt().cublasLtMatmulAlgoConfigSetAttribute(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &none, sizeof(none)) !=
            CUBLAS_STATUS_SUCCESS) {
      return false;
    }
  }
  return true;
}

// "algo <id> tile <tile>", the algorithm's configuration for a plan's description.
std::string AlgoName(const cublasLtMatmulAlgo_t& algo) {
  size_t written = 0;
  int32_t id = 0, tile = 0;
  Lt().cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &written);
  Lt().cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &written);
  return absl::StrCat("algo ", id, " tile ", tile);
}

}  // namespace

std::vector<std::unique_ptr<LtGemm::Plan>> LtGemm::Candidates(int compute, bool mask_splits, const Layouts& layouts,
                                                              std::string* why) {
  std::vector<std::unique_ptr<Plan>> plans;
  const std::string attempt = absl::StrCat("compute type ", compute, mask_splits ? ", no-split mask" : "");
  auto fail = [&](const char* what, cublasStatus_t status) {
    *why = absl::StrCat(attempt, ": ", what, ": ", LtError(status));
    return std::vector<std::unique_ptr<Plan>>();
  };
  cublasLtMatmulPreference_t preference = nullptr;
  cublasStatus_t status = MakePreference(mask_splits, workspace_bytes_, &preference);
  if (status != CUBLAS_STATUS_SUCCESS) return fail("cublasLtMatmulPreferenceCreate", status);
  Plan query;
  status = MakeDesc(compute, &query.desc);
  if (status != CUBLAS_STATUS_SUCCESS) {
    Lt().cublasLtMatmulPreferenceDestroy(preference);
    return fail("cublasLtMatmulDescCreate", status);
  }
  std::vector<cublasLtMatmulHeuristicResult_t> results(8);
  int found = 0;
  status = Lt().cublasLtMatmulAlgoGetHeuristic(handle_, query.desc, layouts.a, layouts.b, layouts.d, layouts.d,
                                          preference, static_cast<int>(results.size()), results.data(), &found);
  Lt().cublasLtMatmulPreferenceDestroy(preference);
  if (status != CUBLAS_STATUS_SUCCESS) return fail("cublasLtMatmulAlgoGetHeuristic", status);
  for (int i = 0; i < found; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
    cublasLtMatmulAlgo_t algo = results[i].algo;
    if (!ForceOneSequence(&algo)) continue;
    cublasLtMatmulHeuristicResult_t checked{};
    if (Lt().cublasLtMatmulAlgoCheck(handle_, query.desc, layouts.a, layouts.b, layouts.d, layouts.d, &algo, &checked) !=
            CUBLAS_STATUS_SUCCESS ||
        checked.workspaceSize > workspace_bytes_) {
      continue;
    }
    auto plan = std::make_unique<Plan>();
    if (MakeDesc(compute, &plan->desc) != CUBLAS_STATUS_SUCCESS) continue;
    plan->algo = algo;
    plan->workspace = checked.workspaceSize;
    plan->description = absl::StrCat(AlgoName(algo), " split-k 1, ", attempt, ", workspace ",
                                     checked.workspaceSize, " (heuristic rank ", i, " of ", found, ")");
    plans.push_back(std::move(plan));
  }
  if (plans.empty()) *why = absl::StrCat(attempt, ": none of ", found, " heuristic algorithms runs without split-K");
  return plans;
}

absl::StatusOr<bool> LtGemm::RowsIndependent(const Plan& plan, const Key& key, std::string* rejected) {
  const auto [n, k, in_bf16, out_bf16] = key;
  const int64_t element_in = in_bf16 ? 2 : 4, element_out = out_bf16 ? 2 : 4;
  const int64_t ldk = RoundUp(k, kAlignment / element_in), ldn = RoundUp(n, kAlignment / element_out);
  // W [n, ldk], X [kPlanRows, ldk], Y [kPlanRows, ldn], Y1 [1, ldn], each 256-byte aligned.
  const size_t w_bytes = RoundUp(n * ldk * element_in, 256), x_bytes = RoundUp(kPlanRows * ldk * element_in, 256);
  const size_t y_bytes = RoundUp(kPlanRows * ldn * element_out, 256), y1_bytes = RoundUp(ldn * element_out, 256);
  void* block = nullptr;
  auto cuda_fail = [&](cudaError_t s, const char* what) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("row-independence check: ", what, ": ", cudaGetErrorString(s)));
  };
  if (cudaError_t s = cudaMallocAsync(&block, w_bytes + x_bytes + y_bytes + y1_bytes, stream_); s != cudaSuccess) {
    return cuda_fail(s, "cudaMallocAsync");
  }
  char* base = static_cast<char*>(block);
  const GemmMatrix w{base, in_bf16, n, k, ldk};
  const GemmMatrix x{base + w_bytes, in_bf16, kPlanRows, k, ldk};
  const GemmMatrix y{base + w_bytes + x_bytes, out_bf16, kPlanRows, n, ldn};
  const GemmMatrix y1{base + w_bytes + x_bytes + y_bytes, out_bf16, 1, n, ldn};
  absl::Status status = absl::OkStatus();
  std::vector<char> in_batch(static_cast<size_t>(n * element_out)), alone(in_batch.size());
  int error = LaunchFillPattern(const_cast<void*>(w.data), n * ldk, in_bf16, 7, stream_);
  if (error == cudaSuccess) error = LaunchFillPattern(const_cast<void*>(x.data), kPlanRows * ldk, in_bf16, 8, stream_);
  if (error != cudaSuccess) status = cuda_fail(static_cast<cudaError_t>(error), "filling the operands");
  // Row r near the end, alone and in a product whose last row tile is
  // partial (kPlanRows - 5 rows: no power-of-two tile divides it).
  const int64_t r = kPlanRows - 7;
  // A candidate cuBLASLt will not run at one of these M (it was checked at
  // kPlanRows only) is not usable, rather than the end of planning: the next
  // candidate is tried. (A sticky device error under it fails the next
  // candidate's CUDA calls, so it is still reported.)
  bool ran = status.ok();
  if (ran) {
    const absl::Status multiplied = Run(plan, GemmMatrix{x.data, in_bf16, kPlanRows - 5, k, ldk}, w,
                                        GemmMatrix{y.data, out_bf16, kPlanRows - 5, n, ldn});
    if (!multiplied.ok()) *rejected = absl::StrCat("at M = ", kPlanRows - 5, ": ", multiplied.message());
    ran = multiplied.ok();
  }
  if (ran) {
    const GemmMatrix x_row{static_cast<const char*>(x.data) + r * ldk * element_in, in_bf16, 1, k, ldk};
    const absl::Status multiplied = Run(plan, x_row, w, y1);
    if (!multiplied.ok()) *rejected = absl::StrCat("at M = 1: ", multiplied.message());
    ran = multiplied.ok();
  }
  if (ran) {
    cudaError_t s = cudaMemcpyAsync(in_batch.data(), static_cast<const char*>(y.data) + r * ldn * element_out,
                                    in_batch.size(), cudaMemcpyDeviceToHost, stream_);
    if (s == cudaSuccess) s = cudaMemcpyAsync(alone.data(), y1.data, alone.size(), cudaMemcpyDeviceToHost, stream_);
    if (s == cudaSuccess) s = cudaStreamSynchronize(stream_);
    if (s != cudaSuccess) status = cuda_fail(s, "comparing rows");
  }
  cudaFreeAsync(block, stream_);
  if (!status.ok()) return status;
  return ran && in_batch == alone;
}

absl::Status LtGemm::Run(const Plan& plan, const GemmMatrix& x, const GemmMatrix& w, const GemmMatrix& y) {
  Layouts layouts;
  if (absl::Status s = layouts.Make(x.bf16, y.bf16, x.rows, w.rows, w.cols, w.ld, x.ld, y.ld); !s.ok()) return s;
  const float alpha = 1.0f, beta = 0.0f;
  // The whole workspace, not the size cublasLtMatmulAlgoCheck gave for
  // kPlanRows rows: the plan runs at every M, and an algorithm that needs more
  // at another M would fail the multiply (the algorithm itself, split-K 1
  // included, is fixed by plan.algo whatever the workspace).
  const cublasStatus_t status =
      Lt().cublasLtMatmul(handle_, plan.desc, &alpha, w.data, layouts.a, x.data, layouts.b, &beta, y.data, layouts.d,
                     const_cast<void*>(y.data), layouts.d, &plan.algo, workspace_, workspace_bytes_, stream_);
  if (status != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrCat("cublasLtMatmul failed (", LtError(status), "): x [", x.rows, ", ",
                                            x.cols, "] ", x.bf16 ? "bf16" : "f32", ", W [", w.rows, ", ", w.cols,
                                            "], y [", y.rows, ", ", y.cols, "] ", y.bf16 ? "bf16" : "f32"));
  }
  return absl::OkStatus();
}

absl::Status LtGemm::Multiply(const GemmMatrix& x, const GemmMatrix& w, const GemmMatrix& y, const char* op) {
  if (x.rows == 0 || w.rows == 0) return absl::OkStatus();
  if (!Aligned(x) || !Aligned(w) || !Aligned(y)) {
    return absl::InternalError(absl::StrCat(op, ": GEMM operands not 16-byte aligned"));
  }
  absl::StatusOr<Plan*> plan = PlanFor(Key{w.rows, w.cols, x.bf16, y.bf16});
  if (!plan.ok()) return absl::Status(plan.status().code(), absl::StrCat(op, ": ", plan.status().message()));
  if (absl::Status s = Run(**plan, x, w, y); !s.ok()) return absl::Status(s.code(), absl::StrCat(op, ": ", s.message()));
  return absl::OkStatus();
}

std::string LtGemm::DescribePlans() const {
  std::string out;
  for (const auto& [key, plan] : plans_) absl::StrAppend(&out, plan->description, "\n");
  return out;
}

}  // namespace hsx::cuda
