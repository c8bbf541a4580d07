// cuda_backend_internal.h: the CudaBackend class and the helpers its source
// files share; private to kernels/cuda (users include cuda_backend.h).
//
// The class is defined in pieces, one concept per file:
//   cuda_device.cc      device set-up, memory, errors, weight placement, and
//                       the device queries of cuda_backend.h;
//   capture_staging.cc  captures' copies to the host through the staging
//                       ring, Synchronize and FenceCopies;
//   moe_experts.cc      routing, expert placement and the MoE path;
//   cuda_backend.cc     staging of batches and the op dispatch (GEMMs,
//                       elementwise kernels, attention).
// The guarantees are cuda_backend.h's.
#ifndef HSX_KERNELS_CUDA_CUDA_BACKEND_INTERNAL_H_
#define HSX_KERNELS_CUDA_CUDA_BACKEND_INTERNAL_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_errors.h"
#include "kernels/cuda/cudnn_attention.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/ops.h"
#include "kernels/device_lost.h"
#include "kernels/staging_ring.h"

namespace hsx {

inline std::string MiB(int64_t bytes) {
  return absl::StrFormat("%.1f MiB", static_cast<double>(bytes) / (1 << 20));
}

inline int64_t RoundUp(int64_t value, int64_t to) { return (value + to - 1) / to * to; }

inline cuda::DeviceMatrix Dev(const Matrix& m) {
  return {m.data, m.type == ElementType::kBf16, m.rows, m.cols, m.ld};
}

// Stream-ordered free. Null is skipped: a failed runtime call would otherwise
// linger as the thread's last error and be blamed on the next launch.
inline void FreeAsync(void* data, cudaStream_t stream) {
  if (data != nullptr) cudaFreeAsync(data, stream);
}

// The backend's handles, defined where they are made (cuda_backend.cc: the
// staged batch; moe_experts.cc: the routing and the expert table).
class CudaStagedBatch;
class CudaExpertTable;
struct DeviceExpert;

// One rank's backend on one device (see cuda_backend.h). An op that fails
// records the error (the first since the last Synchronize, unless a lost
// device outranks it) and returns; Synchronize() reports it.
class CudaBackend : public Backend {
 public:
  CudaBackend(int device, ElementType precision, CudaAttention attention)
      : device_(device), precision_(precision), attention_(attention) {}
  ~CudaBackend() override;
  absl::Status Init();

  ElementType precision() const override { return precision_; }
  std::string name() const override { return absl::StrCat("cuda:", device_); }
  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  // SetCudaCaptureOptions (a new ring size waits for the copies in flight).
  absl::Status SetCaptureOptions(const CudaCaptureOptions& options);

  absl::StatusOr<std::unique_ptr<Buffer>> Allocate(int64_t rows, int64_t cols, ElementType type) override;
  absl::StatusOr<std::unique_ptr<HostBuffer>> AllocateHost(size_t bytes) override;
  void CopyToHost(const Matrix& src, void* dst) override;
  void CopyToHostFp8(const Matrix& src, void* dst) override;
  void CopyFromHost(const void* src, const Matrix& dst) override;
  absl::Status Synchronize() override;
  absl::StatusOr<std::shared_ptr<CopyFence>> FenceCopies() override;

  absl::StatusOr<LinearWeight> PlaceLinear(const LinearWeight& host) override;
  absl::StatusOr<const void*> PlaceTensor(const void* host, size_t bytes) override;
  absl::StatusOr<std::unique_ptr<ExpertTable>> PlaceExperts(std::span<const ExpertWeights> host,
                                                            std::span<const bool> held) override;
  int64_t placed_bytes() const override { return placed_bytes_; }

  absl::StatusOr<std::unique_ptr<StagedBatch>> Stage(std::span<const int32_t> tokens,
                                                     std::span<const int64_t> cu_seqlens) override;
  absl::StatusOr<std::unique_ptr<RopeTable>> PlaceRopeTable(std::span<const float> cos,
                                                           std::span<const float> sin, int64_t half_dim) override;
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
  // Device memory from the stream-ordered pool, freed (in stream order) when
  // it goes out of scope: scratch for one op.
  class Scratch {
   public:
    Scratch() = default;
    Scratch(cudaStream_t stream, void* data) : stream_(stream), data_(data) {}
    Scratch(Scratch&& other) noexcept : stream_(other.stream_), data_(other.data_) { other.data_ = nullptr; }
    Scratch& operator=(Scratch&& other) noexcept {
      if (this != &other) {
        FreeAsync(data_, stream_);
        stream_ = other.stream_;
        data_ = other.release();
      }
      return *this;
    }
    ~Scratch() { FreeAsync(data_, stream_); }
    void* get() const { return data_; }
    // Hands the memory to a longer-lived owner (which frees it with FreeAsync).
    void* release() {
      void* data = data_;
      data_ = nullptr;
      return data;
    }

   private:
    cudaStream_t stream_ = nullptr;
    void* data_ = nullptr;
  };

  bool bf16() const { return precision_ == ElementType::kBf16; }
  // Records an error a stream reported to a synchronization (`what` enqueued
  // on it failed on the device).
  void RecordStreamError(cudaError_t status, const char* what);
  // Records the first error since the last Synchronize(), marked as a lost
  // device when the context is poisoned (a cuBLASLt or cuDNN failure may hide
  // a sticky CUDA error; cuda_errors.h). A lost device outranks an earlier
  // batch error: it is what the engine must hear.
  void Record(absl::Status status) {
    if (status.ok() || IsDeviceLost(error_)) return;
    status = cuda::ClassifyOnDevice(std::move(status), device_, stream_);
    if (error_.ok() || IsDeviceLost(status)) error_ = std::move(status);
  }
  // Records an InvalidArgument when `ok` is false; returns ok.
  // Records a failed contract rule (kernels/op_checks.h); returns status.ok().
  bool Check(const absl::Status& status) {
    if (!status.ok()) Record(absl::InvalidArgumentError(absl::StrCat(name(), " ", status.message())));
    return status.ok();
  }
  bool Check(bool ok, const char* op, const std::string& what) {
    if (!ok) Record(absl::InvalidArgumentError(absl::StrCat(name(), " ", op, ": ", what)));
    return ok;
  }
  // Records a failed CUDA call or launch; returns true when it succeeded.
  bool Cuda(int status, const char* op, const std::string& what) {
    if (status == cudaSuccess) return true;
    Record(CudaError(static_cast<cudaError_t>(status), op, what));
    return false;
  }
  absl::Status CudaError(cudaError_t status, const char* op, const std::string& what) const;
  // Pool memory for `bytes`, or ResourceExhausted with asked/free.
  absl::StatusOr<Scratch> Take(size_t bytes, const char* op);
  // Weight memory (cudaMalloc) kept until destruction, after the plan check.
  absl::StatusOr<void*> PlaceBytes(size_t bytes, const char* what);
  absl::StatusOr<const void*> Upload(const void* host, size_t bytes, const char* what);

  // y = x · wᵀ for a device bf16 weight w [n, k] (row stride ldw): makes every
  // operand what the GEMM plan needs (16-byte aligned; f32 weights for f32
  // activations) through exact copies into scratch, then multiplies.
  void Gemm(const Matrix& x, const uint16_t* w, int64_t n, int64_t k, int64_t ldw, const Matrix& y, const char* op);
  // Attention through cuDNN's SDPA: packs Q, K, V into THD scratch, runs the
  // cached graph of the batch's bucketed shape, unpacks O into out.
  void CudnnSdpa(const Matrix& q, const Matrix& kv, const Matrix& k_rope, int64_t heads, int64_t nope_dim,
                 int64_t rope_dim, int64_t v_dim, const CudaStagedBatch& batch, float scale, const Matrix& out);
  // A copy of m (same element type, exact) with a 16-byte aligned row stride.
  absl::StatusOr<Matrix> AlignedCopy(const Matrix& m, bool load, Scratch& storage, const char* op);

  // CopyToHost (or, with `fp8`, CopyToHostFp8) through the staging ring and
  // the copy stream (cuda_backend.h, "Captures"), in chunks of whole rows
  // that fit the ring.
  void CopyToHostOverlapped(const Matrix& src, char* dst, bool fp8);
  // On the compute stream: `rows` into the ring at `staged`, as they are (a
  // device-to-device copy) or encoded as fp8 rows. False when it failed
  // (recorded).
  bool Snapshot(const Matrix& rows, char* staged, bool fp8, const std::string& what);
  // The copy stream, its events and the ring, made at the first overlapped copy.
  absl::Status EnsureStaging();
  // Waits for the copy stream, then frees the ring (stream-ordered).
  absl::Status ReleaseStaging();
  cudaEvent_t Copied(int64_t ticket) const { return copied_[ticket % kCaptureMaxPendingCopies]; }

  // PlaceExperts' steps (moe_experts.cc): one held expert's projections in
  // device memory, as uploaded INT4 words and scales or as bf16 rows.
  absl::Status PlaceInt4Expert(const ExpertWeights& w, const std::string& what, DeviceExpert& placed);
  absl::Status PlaceBf16Expert(const ExpertWeights& w, const CudaExpertTable& table, const std::string& what,
                               DeviceExpert& placed);
  // MoeExperts' steps (moe_experts.cc), in order, on one call's state; each
  // returns false once it has recorded an error (the call then stops).
  struct MoeCall;
  bool CountExpertRows(MoeCall& call);
  bool PermuteRows(MoeCall& call);
  bool GatherRows(MoeCall& call);
  bool DequantizeExperts(MoeCall& call);
  bool LaunchDequantize(MoeCall& call, const std::vector<const void*>& host_pointers, int64_t int4_count);
  bool RunExpertMlps(MoeCall& call);

  int device_;
  ElementType precision_;
  CudaAttention attention_;
  std::unique_ptr<cuda::CudnnAttention> cudnn_;  // set with CudaAttention::kCudnn
  cudaStream_t stream_ = nullptr;
  void* workspace_ = nullptr;
  int32_t* host_counts_ = nullptr;  // pinned, kMaxExperts: MoE expert counts
  CudaCaptureOptions capture_;
  cudaStream_t copy_stream_ = nullptr;  // captures' device-to-host copies
  cudaEvent_t snapshot_ = nullptr;      // compute stream -> copy stream: a snapshot is staged
  std::vector<cudaEvent_t> copied_;     // by ticket % kCaptureMaxPendingCopies: its copy finished
  std::unique_ptr<StagingRing> ring_;   // with staging_: null until the first overlapped copy
  void* staging_ = nullptr;
  std::unique_ptr<cuda::LtGemm> gemm_;
  std::vector<void*> weights_;
  int64_t placed_bytes_ = 0;
  absl::Status error_;
};

}  // namespace hsx

#endif  // HSX_KERNELS_CUDA_CUDA_BACKEND_INTERNAL_H_
