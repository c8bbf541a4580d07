// forwarding_backend.h: a Backend that hands every call to another one.
//
// For decorators that change a few calls and keep the rest: the fault
// injectors of the tests (tests/unit/engine_test.cc) and of hsx-server's
// --inject-device-loss-after-batches (server/runtime/fault_injection.h)
// override what they fail and inherit the rest. It owns the inner backend and
// meets the contract exactly as the inner one does.
#ifndef HSX_KERNELS_FORWARDING_BACKEND_H_
#define HSX_KERNELS_FORWARDING_BACKEND_H_

#include <memory>
#include <span>
#include <string>
#include <utility>

#include "kernels/backend.h"

namespace hsx {

class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}

  ElementType precision() const override { return inner_->precision(); }
  std::string name() const override { return inner_->name(); }
  absl::StatusOr<std::unique_ptr<Buffer>> Allocate(int64_t rows, int64_t cols, ElementType type) override {
    return inner_->Allocate(rows, cols, type);
  }
  absl::StatusOr<std::unique_ptr<HostBuffer>> AllocateHost(size_t bytes) override {
    return inner_->AllocateHost(bytes);
  }
  void CopyToHost(const Matrix& src, void* dst) override { inner_->CopyToHost(src, dst); }
  void CopyToHostFp8(const Matrix& src, void* dst) override { inner_->CopyToHostFp8(src, dst); }
  // copies_land_on_return() is not forwarded either: a decorator may change
  // when its copies land (one in tests/unit/engine_test.cc defers them), so
  // its callers read the rows only after the fence.
  void CopyFromHost(const void* src, const Matrix& dst) override { inner_->CopyFromHost(src, dst); }
  absl::Status Synchronize() override { return inner_->Synchronize(); }
  // FenceCopies() is not forwarded: the default calls this->Synchronize(), so
  // a decorator's Synchronize (an injected loss) is never bypassed. The
  // decorated backend's copies are then waited for at the end of each batch.
  absl::StatusOr<LinearWeight> PlaceLinear(const LinearWeight& host) override { return inner_->PlaceLinear(host); }
  absl::StatusOr<const void*> PlaceTensor(const void* host, size_t bytes) override {
    return inner_->PlaceTensor(host, bytes);
  }
  absl::StatusOr<std::unique_ptr<ExpertTable>> PlaceExperts(std::span<const ExpertWeights> host,
                                                            std::span<const bool> held) override {
    return inner_->PlaceExperts(host, held);
  }
  int64_t placed_bytes() const override { return inner_->placed_bytes(); }
  absl::StatusOr<std::unique_ptr<StagedBatch>> Stage(std::span<const int32_t> tokens,
                                                     std::span<const int64_t> cu_seqlens) override {
    return inner_->Stage(tokens, cu_seqlens);
  }
  absl::StatusOr<std::unique_ptr<RopeTable>> PlaceRopeTable(std::span<const float> cos, std::span<const float> sin,
                                                           int64_t half_dim) override {
    return inner_->PlaceRopeTable(cos, sin, half_dim);
  }
  absl::StatusOr<std::unique_ptr<Routing>> AllocateRouting(int64_t tokens, int64_t top_k) override {
    return inner_->AllocateRouting(tokens, top_k);
  }
  void Embed(const StagedBatch& batch, const uint16_t* table, int64_t vocab_begin, int64_t vocab_rows,
             const Matrix& out) override {
    inner_->Embed(batch, table, vocab_begin, vocab_rows, out);
  }
  void Linear(const Matrix& x, const LinearWeight& w, const Matrix& y, bool partial) override {
    inner_->Linear(x, w, y, partial);
  }
  void Round(const Matrix& partial, const Matrix& out) override { inner_->Round(partial, out); }
  void RmsNorm(const Matrix& x, const uint16_t* weight, float eps, const Matrix& y) override {
    inner_->RmsNorm(x, weight, eps, y);
  }
  void Add(const Matrix& a, const Matrix& b, const Matrix& out) override { inner_->Add(a, b, out); }
  void SiluMul(const Matrix& gate, const Matrix& up, const Matrix& out) override { inner_->SiluMul(gate, up, out); }
  void Rope(const Matrix& x, int64_t heads, int64_t stride, int64_t offset, const StagedBatch& batch,
            const RopeTable& table) override {
    inner_->Rope(x, heads, stride, offset, batch, table);
  }
  void Attention(const Matrix& q, const Matrix& kv, const Matrix& k_rope, int64_t heads, int64_t nope_dim,
                 int64_t rope_dim, int64_t v_dim, const StagedBatch& batch, float scale,
                 const Matrix& out) override {
    inner_->Attention(q, kv, k_rope, heads, nope_dim, rope_dim, v_dim, batch, scale, out);
  }
  void Route(const Matrix& x, const RouterParams& router, Routing& routing) override {
    inner_->Route(x, router, routing);
  }
  void MoeExperts(const Matrix& x, const Routing& routing, const ExpertTable& experts, const Matrix& out,
                  bool partial) override {
    inner_->MoeExperts(x, routing, experts, out, partial);
  }
  void CopyRoutingToHost(const Routing& routing, int32_t* experts, float* weights) override {
    inner_->CopyRoutingToHost(routing, experts, weights);
  }

 protected:
  Backend& inner() { return *inner_; }

 private:
  std::unique_ptr<Backend> inner_;
};

}  // namespace hsx

#endif  // HSX_KERNELS_FORWARDING_BACKEND_H_
