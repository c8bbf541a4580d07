// cpu_backend.h: the reference implementation of kernels/backend.h.
//
// Float32 arithmetic throughout; in ElementType::kBf16 activations are stored as
// bfloat16 and every op rounds exactly where the Hugging Face BF16 reference
// does (model-spec.md §4). Ops run synchronously on the calling thread and its
// thread pool, so "enqueued" ops have finished when they return. All
// parallelism is over independent outputs (GEMM panels, attention heads,
// experts, rows), so results are identical for any thread count. Weights are
// "placed" by pointing at the checkpoint mapping: nothing is copied.
#ifndef HSX_KERNELS_CPU_CPU_BACKEND_H_
#define HSX_KERNELS_CPU_CPU_BACKEND_H_

#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/thread_pool.h"

namespace hsx {

class CpuBackend : public Backend {
 public:
  CpuBackend(ElementType precision, int threads);
  ~CpuBackend() override;
  class BlockPool;  // reusable activation memory (buffers must not outlive the backend)

  ElementType precision() const override { return precision_; }
  std::string name() const override { return "cpu"; }

  absl::StatusOr<std::unique_ptr<Buffer>> Allocate(int64_t rows, int64_t cols, ElementType type) override;
  absl::StatusOr<std::unique_ptr<HostBuffer>> AllocateHost(size_t bytes) override;
  void CopyToHost(const Matrix& src, void* dst) override;
  // The scalar rule of kernels/fp8_e4m3.h, row by row (EncodeFp8RowScalar).
  void CopyToHostFp8(const Matrix& src, void* dst) override;
  bool copies_land_on_return() const override { return true; }  // a memcpy
  void CopyFromHost(const void* src, const Matrix& dst) override;
  absl::Status Synchronize() override;

  absl::StatusOr<LinearWeight> PlaceLinear(const LinearWeight& host) override;
  absl::StatusOr<const void*> PlaceTensor(const void* host, size_t bytes) override;
  absl::StatusOr<std::unique_ptr<ExpertTable>> PlaceExperts(std::span<const ExpertWeights> host,
                                                            std::span<const bool> held) override;
  int64_t placed_bytes() const override { return placed_bytes_; }

  absl::StatusOr<std::unique_ptr<StagedBatch>> Stage(std::span<const int32_t> tokens,
                                                     std::span<const int64_t> cu_seqlens) override;
  absl::StatusOr<std::unique_ptr<RopeTable>> PlaceRopeTable(std::span<const float> cos,
                                                           std::span<const float> sin,
                                                           int64_t half_dim) override;
  absl::StatusOr<std::unique_ptr<Routing>> AllocateRouting(int64_t tokens, int64_t top_k) override;

  void Embed(const StagedBatch& batch, const uint16_t* table, int64_t vocab_begin, int64_t vocab_rows,
             const Matrix& out) override;
  void Linear(const Matrix& x, const LinearWeight& w, const Matrix& y, bool partial) override;
  void Round(const Matrix& partial, const Matrix& out) override;
  void RmsNorm(const Matrix& x, const uint16_t* weight, float eps, const Matrix& y) override;
  void Add(const Matrix& a, const Matrix& b, const Matrix& out) override;
  void SiluMul(const Matrix& gate, const Matrix& up, const Matrix& out) override;
  void Rope(const Matrix& x, int64_t heads, int64_t stride, int64_t offset, const StagedBatch& batch,
            const RopeTable& table) override;
  void Attention(const Matrix& q, const Matrix& kv, const Matrix& k_rope, int64_t heads, int64_t nope_dim,
                 int64_t rope_dim, int64_t v_dim, const StagedBatch& batch, float scale,
                 const Matrix& out) override;
  void Route(const Matrix& x, const RouterParams& router, Routing& routing) override;
  void MoeExperts(const Matrix& x, const Routing& routing, const ExpertTable& experts, const Matrix& out,
                  bool partial) override;
  void CopyRoutingToHost(const Routing& routing, int32_t* experts, float* weights) override;

 private:
  // Rounds to bfloat16 in kBf16 mode, identity in kF32.
  float R(float value) const;
  // Records `status` if it is the first error since the last Synchronize(); returns status.ok().
  bool Check(const absl::Status& status);
  // Runs one expert's MLP on rows of x (single-threaded): y [rows.size(), hidden].
  void RunExpert(const Matrix& x, const std::vector<int64_t>& rows, const ExpertWeights& expert,
                 std::vector<float>& y);

  ElementType precision_;
  ThreadPool pool_;
  std::unique_ptr<BlockPool> blocks_;
  int64_t placed_bytes_ = 0;
  absl::Status error_;
};

}  // namespace hsx

#endif  // HSX_KERNELS_CPU_CPU_BACKEND_H_
