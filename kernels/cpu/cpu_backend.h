// cpu_backend.h: the reference implementation of kernels/backend.h.
//
// Float32 arithmetic throughout; in Precision::kBf16 it rounds to bfloat16
// exactly where the Hugging Face BF16 reference does (model-spec.md §4). All
// parallelism is over independent outputs (GEMM panels, attention heads,
// experts, rows), so results are identical for any thread count.
#ifndef HSX_KERNELS_CPU_CPU_BACKEND_H_
#define HSX_KERNELS_CPU_CPU_BACKEND_H_

#include <memory>

#include "kernels/backend.h"
#include "kernels/cpu/thread_pool.h"

namespace hsx {

class CpuBackend : public Backend {
 public:
  CpuBackend(Precision precision, int threads);
  ~CpuBackend() override;
  class BlockPool;  // reusable activation memory (buffers must not outlive the backend)

  Precision precision() const override { return precision_; }
  std::unique_ptr<Buffer> Allocate(int64_t rows, int64_t cols) override;
  void CopyToHost(const Matrix& src, float* dst) override;
  void Embed(std::span<const int32_t> tokens, const uint16_t* table, int64_t vocab_begin,
             int64_t vocab_rows, const Matrix& out) override;
  void Linear(const Matrix& x, const LinearWeight& w, const Matrix& y, bool partial) override;
  void Round(const Matrix& x) override;
  void RmsNorm(const Matrix& x, const uint16_t* weight, float eps, const Matrix& y) override;
  void Add(const Matrix& a, const Matrix& b, const Matrix& out) override;
  void SiluMul(const Matrix& gate, const Matrix& up, const Matrix& out) override;
  void Rope(const Matrix& x, int64_t heads, int64_t stride, int64_t offset,
            std::span<const int32_t> positions, const RopeTable& table) override;
  void Attention(const Matrix& q, const Matrix& kv, const Matrix& k_rope, int64_t heads,
                 int64_t nope_dim, int64_t rope_dim, int64_t v_dim,
                 std::span<const int64_t> cu_seqlens, float scale, const Matrix& out) override;
  void Route(const Matrix& x, const RouterParams& router, Routing* routing) override;
  void MoeExperts(const Matrix& x, const Routing& routing,
                  std::span<const ExpertWeights* const> experts, const Matrix& out,
                  bool partial) override;

 private:
  // Rounds to bfloat16 in kBf16 mode, identity in kFp32.
  float R(float value) const;
  // Runs one expert's MLP on rows of x (single-threaded): y [rows.size(), hidden].
  void RunExpert(const Matrix& x, const std::vector<int64_t>& rows, const ExpertWeights& expert,
                 std::vector<float>& y);

  Precision precision_;
  ThreadPool pool_;
  std::unique_ptr<BlockPool> blocks_;
};

}  // namespace hsx

#endif  // HSX_KERNELS_CPU_CPU_BACKEND_H_
