// cuda_backend.cc: CudaBackend, the host side of the CUDA ops: checks sizes
// (the same checks, and messages, as the CPU backend), manages device memory
// and enqueues kernels (ops.h), cuBLASLt GEMMs (gemm.h) and copies on one
// stream, and captures' device-to-host copies on a second. See cuda_backend.h
// for the guarantees.
#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cuda/cuda_errors.h"
#include "kernels/cuda/cudnn_attention.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/int4_dequant.h"
#include "kernels/cuda/ops.h"
#include "kernels/device_lost.h"
#include "kernels/op_checks.h"

namespace hsx {
namespace {

using cuda::DeviceMatrix;
using cuda::GemmMatrix;

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // cuBLASLt workspace

std::string MiB(int64_t bytes) { return absl::StrFormat("%.1f MiB", static_cast<double>(bytes) / (1 << 20)); }

int64_t RoundUp(int64_t value, int64_t to) { return (value + to - 1) / to * to; }

DeviceMatrix Dev(const Matrix& m) { return {m.data, m.type == ElementType::kBf16, m.rows, m.cols, m.ld}; }

// Stream-ordered free. Null is skipped: a failed runtime call would otherwise
// linger as the thread's last error and be blamed on the next launch.
void FreeAsync(void* data, cudaStream_t stream) {
  if (data != nullptr) cudaFreeAsync(data, stream);
}

class CudaBackend;

// ---- Handles ----------------------------------------------------------------

class CudaBuffer : public Buffer {
 public:
  CudaBuffer(cudaStream_t stream, const Matrix& matrix) : stream_(stream), matrix_(matrix) {}
  ~CudaBuffer() override { FreeAsync(matrix_.data, stream_); }  // stream-ordered
  Matrix matrix() const override { return matrix_; }

 private:
  cudaStream_t stream_;
  Matrix matrix_;
};

class PinnedBuffer : public HostBuffer {
 public:
  PinnedBuffer(void* data, size_t bytes) : data_(data), bytes_(bytes) {}
  ~PinnedBuffer() override { cudaFreeHost(data_); }
  void* data() const override { return data_; }
  size_t bytes() const override { return bytes_; }

 private:
  void* data_;
  size_t bytes_;
};

class CudaStagedBatch : public StagedBatch {
 public:
  ~CudaStagedBatch() override { FreeAsync(block, stream); }
  int64_t tokens() const override { return num_tokens; }
  int64_t num_samples() const override { return static_cast<int64_t>(cu_host.size()) - 1; }
  int64_t longest() const override { return longest_length; }

  cudaStream_t stream = nullptr;
  void* block = nullptr;  // one allocation holding the arrays below
  const int32_t* token_ids = nullptr;
  const int32_t* positions = nullptr;
  const int64_t* cu_seqlens = nullptr;
  const cuda::AttentionTile* tiles = nullptr;
  int64_t num_tiles = 0;
  int64_t num_tokens = 0;
  int64_t longest_length = 0;
  std::vector<int64_t> cu_host;
};

class CudaRopeTable : public RopeTable {
 public:
  ~CudaRopeTable() override { FreeAsync(cos, stream); }
  int64_t positions() const override { return num_positions; }
  int64_t half_dim() const override { return half; }

  cudaStream_t stream = nullptr;
  float* cos = nullptr;  // [positions, half], then sin in the same block
  float* sin = nullptr;
  int64_t num_positions = 0;
  int64_t half = 0;
};

class CudaRouting : public Routing {
 public:
  ~CudaRouting() override { FreeAsync(experts, stream); }
  int64_t tokens() const override { return num_tokens; }
  int64_t top_k() const override { return k; }

  cudaStream_t stream = nullptr;
  int32_t* experts = nullptr;  // [tokens, top_k], then the weights in the same block
  float* weights = nullptr;
  int64_t num_tokens = 0;
  int64_t k = 0;
};

// One held expert in device memory: INT4 (packed + scales per projection) or bf16.
struct DeviceExpert {
  bool int4 = false;
  const int32_t* packed[3] = {nullptr, nullptr, nullptr};  // gate, up, down
  const uint16_t* scale[3] = {nullptr, nullptr, nullptr};
  const uint16_t* gate_up = nullptr;  // bf16: [2 * inter, hidden], gate rows then up rows
  const uint16_t* down = nullptr;     // bf16: [hidden, inter]
};

class CudaExpertTable : public ExpertTable {
 public:
  int64_t num_experts() const override { return static_cast<int64_t>(held.size()); }
  bool holds(int64_t expert) const override { return held[expert]; }

  std::vector<bool> held;
  std::vector<DeviceExpert> experts;  // by global id; only held ones are filled
  const uint8_t* held_device = nullptr;
  int64_t hidden = 0;
  int64_t inter = 0;
  int64_t group_size = 0;
};

// ---- The backend ---------------------------------------------------------------

class CudaBackend : public Backend {
 public:
  CudaBackend(int device, Precision precision, CudaAttention attention)
      : device_(device), precision_(precision), attention_(attention) {}
  ~CudaBackend() override;
  absl::Status Init();

  Precision precision() const override { return precision_; }
  std::string name() const override { return absl::StrCat("cuda:", device_); }
  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  // SetCudaCaptureOptions (a new ring size waits for the copies in flight).
  absl::Status SetCaptureOptions(const CudaCaptureOptions& options);

  absl::StatusOr<std::unique_ptr<Buffer>> Allocate(int64_t rows, int64_t cols, ElementType type) override;
  absl::StatusOr<std::unique_ptr<HostBuffer>> AllocateHost(size_t bytes) override;
  void CopyToHost(const Matrix& src, void* dst) override;
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

  bool bf16() const { return precision_ == Precision::kBf16; }
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

  // CopyToHost through the staging ring and the copy stream (cuda_backend.h,
  // "Captures"), in chunks of whole rows that fit the ring.
  void CopyToHostOverlapped(const Matrix& src, char* dst);
  // The copy stream, its events and the ring, made at the first overlapped copy.
  absl::Status EnsureStaging();
  // Waits for the copy stream, then frees the ring (stream-ordered).
  absl::Status ReleaseStaging();
  cudaEvent_t Copied(int64_t ticket) const { return copied_[ticket % kCaptureMaxPendingCopies]; }

  int device_;
  Precision precision_;
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

absl::Status CudaBackend::Init() {
  auto fail = [&](cudaError_t status, const char* what) {
    return absl::InternalError(absl::StrCat(name(), ": ", what, ": ", cudaGetErrorString(status)));
  };
  if (cudaError_t s = cudaSetDevice(device_); s != cudaSuccess) return fail(s, "cudaSetDevice");
  if (cudaError_t s = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); s != cudaSuccess) {
    return fail(s, "cudaStreamCreate");
  }
  // Keep freed pool memory for reuse instead of returning it at every sync.
  cudaMemPool_t pool = nullptr;
  if (cudaError_t s = cudaDeviceGetDefaultMemPool(&pool, device_); s != cudaSuccess) {
    return fail(s, "cudaDeviceGetDefaultMemPool");
  }
  uint64_t threshold = UINT64_MAX;
  if (cudaError_t s = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold); s != cudaSuccess) {
    return fail(s, "cudaMemPoolSetAttribute");
  }
  if (cudaError_t s = cudaMalloc(&workspace_, kWorkspaceBytes); s != cudaSuccess) {
    return CudaError(s, "cuBLASLt workspace", MiB(kWorkspaceBytes));
  }
  if (cudaError_t s = cudaHostAlloc(reinterpret_cast<void**>(&host_counts_), sizeof(int32_t) * cuda::kMaxExperts,
                                    cudaHostAllocDefault);
      s != cudaSuccess) {
    return fail(s, "cudaHostAlloc");
  }
  absl::StatusOr<std::unique_ptr<cuda::LtGemm>> gemm = cuda::LtGemm::Create(stream_, workspace_, kWorkspaceBytes);
  if (!gemm.ok()) return absl::InternalError(absl::StrCat(name(), ": ", gemm.status().message()));
  gemm_ = *std::move(gemm);
  if (attention_ == CudaAttention::kCudnn) {
    if (!bf16()) {
      return absl::FailedPreconditionError(
          absl::StrCat(name(), ": --attention=cudnn needs bf16 activations (cuDNN's SDPA is bf16 in and out)"));
    }
    absl::StatusOr<std::unique_ptr<cuda::CudnnAttention>> cudnn = cuda::CudnnAttention::Create(stream_);
    if (!cudnn.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(name(), ": --attention=cudnn: ", cudnn.status().message()));
    }
    cudnn_ = *std::move(cudnn);
  }
  return absl::OkStatus();
}

CudaBackend::~CudaBackend() {
  // Everything below belongs to device_, and the destroying thread may have
  // another device current (a test tearing down ranks of several GPUs on its
  // main thread); the engine destroys a backend on its rank's thread.
  if (stream_ != nullptr && cudaSetDevice(device_) != cudaSuccess) cudaGetLastError();
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  ReleaseStaging().IgnoreError();  // the destructor has nowhere to report it
  if (snapshot_ != nullptr) cudaEventDestroy(snapshot_);
  for (cudaEvent_t event : copied_) cudaEventDestroy(event);
  if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);  // the ring's stream-ordered free
  gemm_.reset();
  cudnn_.reset();
  for (void* w : weights_) cudaFree(w);
  if (workspace_ != nullptr) cudaFree(workspace_);
  if (host_counts_ != nullptr) cudaFreeHost(host_counts_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::Status CudaBackend::CudaError(cudaError_t status, const char* op, const std::string& what) const {
  if (status == cudaErrorMemoryAllocation) {
    size_t free = 0, total = 0;
    cudaMemGetInfo(&free, &total);
    return absl::ResourceExhaustedError(absl::StrCat(name(), " ", op, ": out of device memory (", what, "; ",
                                                     MiB(static_cast<int64_t>(free)), " free of ",
                                                     MiB(static_cast<int64_t>(total)), ")"));
  }
  return cuda::ClassifyCudaError(absl::InternalError(absl::StrCat(name(), " ", op, ": ", cudaGetErrorName(status), ": ",
                                                                cudaGetErrorString(status), " (", what, ")")),
                                 status, device_);
}

absl::StatusOr<CudaBackend::Scratch> CudaBackend::Take(size_t bytes, const char* op) {
  void* data = nullptr;
  if (bytes == 0) return Scratch();
  if (cudaError_t s = cudaMallocAsync(&data, bytes, stream_); s != cudaSuccess) {
    cudaGetLastError();  // an allocation failure is not sticky: clear it
    return CudaError(s, op, absl::StrCat("asked ", MiB(static_cast<int64_t>(bytes))));
  }
  return Scratch(stream_, data);
}

absl::StatusOr<void*> CudaBackend::PlaceBytes(size_t bytes, const char* what) {
  size_t free = 0, total = 0;
  if (cudaError_t s = cudaMemGetInfo(&free, &total); s != cudaSuccess) {
    return CudaError(s, "placement", what);
  }
  if (static_cast<int64_t>(free) - static_cast<int64_t>(bytes) < kCudaReservedBytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        name(), ": the weights do not fit: placing ", what, " (", MiB(static_cast<int64_t>(bytes)), ") would leave ",
        MiB(static_cast<int64_t>(free) - static_cast<int64_t>(bytes)), " of ", MiB(static_cast<int64_t>(total)),
        " free, below the ", MiB(kCudaReservedBytes), " kept for activations; ", MiB(placed_bytes_),
        " of weights placed so far"));
  }
  void* data = nullptr;
  if (cudaError_t s = cudaMalloc(&data, std::max<size_t>(bytes, 1)); s != cudaSuccess) {
    cudaGetLastError();
    return CudaError(s, "placement", absl::StrCat(what, ": asked ", MiB(static_cast<int64_t>(bytes))));
  }
  weights_.push_back(data);
  placed_bytes_ += static_cast<int64_t>(bytes);
  return data;
}

absl::StatusOr<const void*> CudaBackend::Upload(const void* host, size_t bytes, const char* what) {
  absl::StatusOr<void*> data = PlaceBytes(bytes, what);
  if (!data.ok()) return data.status();
  // A pageable source is staged by the driver before the call returns, so
  // the host view may go away afterwards.
  if (cudaError_t s = cudaMemcpyAsync(*data, host, bytes, cudaMemcpyHostToDevice, stream_); s != cudaSuccess) {
    return CudaError(s, "placement copy", what);
  }
  return *data;
}

// ---- Memory ----------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Buffer>> CudaBackend::Allocate(int64_t rows, int64_t cols, ElementType type) {
  if (rows < 0 || cols < 0) {
    return absl::InvalidArgumentError(absl::StrCat(name(), " Allocate: bad shape [", rows, ", ", cols, "]"));
  }
  const size_t bytes = static_cast<size_t>(rows * cols) * ElementSize(type);
  void* data = nullptr;
  if (bytes > 0) {
    if (cudaError_t s = cudaMallocAsync(&data, bytes, stream_); s != cudaSuccess) {
      cudaGetLastError();
      return CudaError(s, "Allocate", absl::StrCat("[", rows, ", ", cols, "] ", ElementTypeName(type), ": asked ",
                                                   MiB(static_cast<int64_t>(bytes))));
    }
  }
  return std::make_unique<CudaBuffer>(stream_, Matrix{data, type, rows, cols, cols});
}

absl::StatusOr<std::unique_ptr<HostBuffer>> CudaBackend::AllocateHost(size_t bytes) {
  void* data = nullptr;
  if (cudaError_t s = cudaHostAlloc(&data, std::max<size_t>(bytes, 1), cudaHostAllocDefault); s != cudaSuccess) {
    cudaGetLastError();
    // Out of pinned memory fails this batch; a sticky error here means the
    // context was poisoned before.
    return cuda::ClassifyCudaError(
        absl::ResourceExhaustedError(absl::StrCat(name(), " AllocateHost: ", cudaGetErrorString(s), " (asked ",
                                                  MiB(static_cast<int64_t>(bytes)), " of pinned memory)")),
        s, device_);
  }
  return std::make_unique<PinnedBuffer>(data, bytes);
}

void CudaBackend::CopyToHost(const Matrix& src, void* dst) {
  if (src.rows == 0 || src.cols == 0) return;
  const size_t row = static_cast<size_t>(src.cols) * ElementSize(src.type);
  // A row larger than the ring (only a test's tiny ring) copies in line.
  if (capture_.overlap && static_cast<int64_t>(row) <= capture_.staging_bytes) {
    return CopyToHostOverlapped(src, static_cast<char*>(dst));
  }
  // Pinned targets (HostBuffers) copy asynchronously; pageable ones work too,
  // but the driver may make the call synchronous.
  Cuda(cudaMemcpy2DAsync(dst, row, src.data, static_cast<size_t>(src.ld) * ElementSize(src.type), row,
                         static_cast<size_t>(src.rows), cudaMemcpyDeviceToHost, stream_),
       "CopyToHost", ShapeOf(src));
}

// Why a snapshot rather than copying `src` itself on the copy stream: the
// residual stream is updated in place by the next layer, and a Buffer may be
// freed right after the op that reads it (backend.h: "releases its memory in
// stream order"). Reading `src` on another stream would need every later op
// that writes or frees those bytes to wait for the device-to-host copy,
// which the backend cannot know without tracking every op's outputs, and the
// wait would stall the next layer for a PCIe-speed copy (by arithmetic, a
// 32k-token Kimi-K2 layer is 470 MB: ~9 ms at ~50 GB/s). The snapshot costs a
// device-to-device copy at HBM speed (~0.2 ms for the same layer at ~4 TB/s)
// and leaves the compute stream free.
void CudaBackend::CopyToHostOverlapped(const Matrix& src, char* dst) {
  if (absl::Status s = EnsureStaging(); !s.ok()) return Record(std::move(s));
  const size_t row = static_cast<size_t>(src.cols) * ElementSize(src.type);
  const size_t pitch = static_cast<size_t>(src.ld) * ElementSize(src.type);
  const int64_t chunk_rows = capture_.staging_bytes / static_cast<int64_t>(row);
  for (int64_t r = 0; r < src.rows; r += chunk_rows) {
    const int64_t rows = std::min(chunk_rows, src.rows - r);
    const size_t bytes = static_cast<size_t>(rows) * row;
    absl::StatusOr<StagingRing::Reservation> slot = ring_->Reserve(static_cast<int64_t>(bytes));
    if (!slot.ok()) return Record(absl::InternalError(absl::StrCat(name(), " CopyToHost: ", slot.status().message())));
    char* staged = static_cast<char*>(staging_) + slot->offset;
    const std::string what = absl::StrCat(ShapeOf(src), ", rows ", r, "..", r + rows);
    // In order: the compute stream waits until the region's last reader has
    // finished, snapshots the rows, and signals the copy stream, which copies
    // the snapshot out and marks the ticket done. A failure is recorded, so
    // the batch fails and no later copy's bytes are ever read.
    if ((slot->wait_for >= 0 &&
         !Cuda(cudaStreamWaitEvent(stream_, Copied(slot->wait_for), 0), "CopyToHost", "waiting for the ring")) ||
        !Cuda(cudaMemcpy2DAsync(staged, row, src.at(r, 0), pitch, row, static_cast<size_t>(rows),
                                cudaMemcpyDeviceToDevice, stream_),
              "CopyToHost snapshot", what) ||
        !Cuda(cudaEventRecord(snapshot_, stream_), "CopyToHost", "recording the snapshot") ||
        !Cuda(cudaStreamWaitEvent(copy_stream_, snapshot_, 0), "CopyToHost", "waiting for the snapshot") ||
        !Cuda(cudaMemcpyAsync(dst + static_cast<size_t>(r) * row, staged, bytes, cudaMemcpyDeviceToHost,
                              copy_stream_),
              "CopyToHost", what) ||
        !Cuda(cudaEventRecord(Copied(slot->ticket), copy_stream_), "CopyToHost", "recording the copy")) {
      return;
    }
  }
}

absl::Status CudaBackend::EnsureStaging() {
  if (ring_ != nullptr) return absl::OkStatus();
  auto fail = [&](cudaError_t status, const char* what) {
    cudaGetLastError();
    return CudaError(status, "CopyToHost", what);
  };
  // The stream and events belong to the current device: make it this rank's.
  if (cudaError_t s = cudaSetDevice(device_); s != cudaSuccess) return fail(s, "cudaSetDevice");
  if (copy_stream_ == nullptr) {
    if (cudaError_t s = cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking); s != cudaSuccess) {
      copy_stream_ = nullptr;
      return fail(s, "creating the copy stream");
    }
  }
  if (snapshot_ == nullptr) {
    if (cudaError_t s = cudaEventCreateWithFlags(&snapshot_, cudaEventDisableTiming); s != cudaSuccess) {
      snapshot_ = nullptr;
      return fail(s, "creating an event");
    }
  }
  while (static_cast<int64_t>(copied_.size()) < kCaptureMaxPendingCopies) {
    cudaEvent_t event = nullptr;
    if (cudaError_t s = cudaEventCreateWithFlags(&event, cudaEventDisableTiming); s != cudaSuccess) {
      return fail(s, "creating an event");
    }
    copied_.push_back(event);
  }
  if (cudaError_t s = cudaMallocAsync(&staging_, static_cast<size_t>(capture_.staging_bytes), stream_);
      s != cudaSuccess) {
    staging_ = nullptr;
    return fail(s, absl::StrCat("the capture staging ring: asked ", MiB(capture_.staging_bytes)).c_str());
  }
  ring_ = std::make_unique<StagingRing>(capture_.staging_bytes, kCaptureMaxPendingCopies);
  return absl::OkStatus();
}

absl::Status CudaBackend::ReleaseStaging() {
  absl::Status status;
  if (copy_stream_ != nullptr) {
    if (cudaError_t s = cudaStreamSynchronize(copy_stream_); s != cudaSuccess) {
      status = CudaError(s, "CopyToHost", "waiting for the capture copies");
    }
  }
  // The copy stream is idle, so every snapshot it read has been written:
  // freeing in the compute stream's order is safe.
  FreeAsync(staging_, stream_);
  staging_ = nullptr;
  ring_.reset();
  return status;
}

absl::Status CudaBackend::SetCaptureOptions(const CudaCaptureOptions& options) {
  if (options.staging_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": capture staging ring of ", options.staging_bytes, " bytes (at least 1)"));
  }
  // A ring of another size replaces this one once its copies have finished;
  // switching the overlap alone keeps it (copies in flight finish either way:
  // Synchronize waits for both streams).
  absl::Status status;
  if (options.staging_bytes != capture_.staging_bytes) status = ReleaseStaging();
  capture_ = options;
  return status;
}

void CudaBackend::CopyFromHost(const void* src, const Matrix& dst) {
  if (dst.rows == 0 || dst.cols == 0) return;
  const size_t row = static_cast<size_t>(dst.cols) * ElementSize(dst.type);
  Cuda(cudaMemcpy2DAsync(dst.data, static_cast<size_t>(dst.ld) * ElementSize(dst.type), src, row, row,
                         static_cast<size_t>(dst.rows), cudaMemcpyHostToDevice, stream_),
       "CopyFromHost", ShapeOf(dst));
}

void CudaBackend::RecordStreamError(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return;
  Record(cuda::ClassifyCudaError(
      absl::InternalError(absl::StrCat(name(), " Synchronize: ", what, " enqueued since the last Synchronize "
                                       "failed on the device: ", cudaGetErrorName(status), ": ",
                                       cudaGetErrorString(status))),
      status, device_));
}

absl::Status CudaBackend::Synchronize() {
  const cudaError_t compute = cudaStreamSynchronize(stream_);
  const cudaError_t copy = copy_stream_ != nullptr ? cudaStreamSynchronize(copy_stream_) : cudaSuccess;
  // An error of either stream, as the device reported it (a sticky one marks the device lost).
  RecordStreamError(compute, "an op");
  RecordStreamError(copy, "a capture copy");
  // Both streams are idle: no copy reads the ring any more.
  if (compute == cudaSuccess && copy == cudaSuccess && ring_ != nullptr) ring_->Clear();
  absl::Status error = std::move(error_);
  error_ = absl::OkStatus();
  return error;
}

namespace {

// The end of the copies on a backend's copy stream: an event recorded after
// them. Waited for on the batcher's delivery thread, so it sets the device
// itself and gives the thread's previous device back.
class CudaCopyFence : public CopyFence {
 public:
  CudaCopyFence(cudaEvent_t done, int device, std::string name) : done_(done), device_(device), name_(std::move(name)) {}
  ~CudaCopyFence() override {
    OnDevice([&] { return cudaEventDestroy(done_); });
  }

  absl::Status Wait() override {
    std::call_once(waited_, [&] {
      const cudaError_t s = OnDevice([&] { return cudaEventSynchronize(done_); });
      if (s == cudaSuccess) return;
      status_ = cuda::ClassifyCudaError(
          absl::InternalError(absl::StrCat(name_, ": a capture copy failed on the device: ", cudaGetErrorName(s),
                                           ": ", cudaGetErrorString(s))),
          s, device_);
    });
    return status_;
  }

 private:
  template <typename Call>
  cudaError_t OnDevice(Call call) {
    int previous = -1;
    const bool had = cudaGetDevice(&previous) == cudaSuccess;
    cudaError_t s = cudaSetDevice(device_);
    if (s == cudaSuccess) s = call();
    if (had && previous != device_) cudaSetDevice(previous);
    return s;
  }

  cudaEvent_t done_;
  const int device_;
  const std::string name_;
  std::once_flag waited_;
  absl::Status status_;
};

}  // namespace

// Why: the last capture point's device-to-host copy (nothing computes after
// it but the final norm) would otherwise be paid in full before the next
// batch can start; with the fence the batcher waits for it on its delivery
// thread while the next batch is staged and runs (docs/design.md, "CUDA
// captures"). The ring is not cleared here: the next batch's snapshots wait,
// on the device, only for the copies whose regions they reuse.
absl::StatusOr<std::shared_ptr<CopyFence>> CudaBackend::FenceCopies() {
  if (copy_stream_ == nullptr) return Backend::FenceCopies();  // every copy ran on the compute stream
  RecordStreamError(cudaStreamSynchronize(stream_), "an op");
  cudaEvent_t done = nullptr;
  // The event belongs to the current device: make it this rank's.
  if (error_.ok() && Cuda(cudaSetDevice(device_), "FenceCopies", "cudaSetDevice") &&
      Cuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "FenceCopies", "creating an event")) {
    if (!Cuda(cudaEventRecord(done, copy_stream_), "FenceCopies", "recording the copies' end")) {
      cudaEventDestroy(done);
      done = nullptr;
    }
  }
  // A failed batch's buffers may go at once: its copies must end first.
  if (!error_.ok()) return Synchronize();
  return std::shared_ptr<CopyFence>(std::make_shared<CudaCopyFence>(done, device_, name()));
}

// ---- Placement ---------------------------------------------------------------------

absl::StatusOr<LinearWeight> CudaBackend::PlaceLinear(const LinearWeight& host) {
  if (host.out <= 0 || host.in <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(name(), " PlaceLinear: bad shape [", host.out, ", ", host.in, "]"));
  }
  LinearWeight placed;
  placed.kind = LinearWeight::Kind::kBf16;
  placed.out = host.out;
  placed.in = host.in;
  placed.ld = RoundUp(host.in, 8);  // 16-byte rows for cuBLASLt
  const size_t bytes = static_cast<size_t>(placed.out * placed.ld) * 2;
  const std::string what = absl::StrCat("Linear [", host.out, ", ", host.in, "]");
  absl::StatusOr<void*> data = PlaceBytes(bytes, what.c_str());
  if (!data.ok()) return data.status();
  placed.bf16 = static_cast<const uint16_t*>(*data);
  if (host.kind == LinearWeight::Kind::kBf16) {
    // Compacts a column slice (host.ld > in) to the padded stride.
    if (cudaError_t s = cudaMemcpy2DAsync(*data, static_cast<size_t>(placed.ld) * 2, host.bf16,
                                          static_cast<size_t>(host.ld) * 2, static_cast<size_t>(host.in) * 2,
                                          static_cast<size_t>(host.out), cudaMemcpyHostToDevice, stream_);
        s != cudaSuccess) {
      return CudaError(s, "PlaceLinear", what);
    }
    return placed;
  }
  // INT4 dense weight: dequantised once (in % 8 == 0, so the stride is in).
  if (host.in % 8 != 0 || host.group_size <= 0 || host.in % host.group_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name(), " PlaceLinear: INT4 ", what, " with group size ",
                                                   host.group_size, " is not a whole number of packed words/groups"));
  }
  const size_t packed_bytes = static_cast<size_t>(host.out * host.in / 8) * 4;
  const size_t scale_bytes = static_cast<size_t>(host.out * (host.in / host.group_size)) * 2;
  absl::StatusOr<Scratch> staging = Take(packed_bytes + scale_bytes, "PlaceLinear");
  if (!staging.ok()) return staging.status();
  char* base = static_cast<char*>(staging->get());
  if (cudaError_t s = cudaMemcpyAsync(base, host.packed, packed_bytes, cudaMemcpyHostToDevice, stream_);
      s != cudaSuccess) {
    return CudaError(s, "PlaceLinear", what);
  }
  if (cudaError_t s = cudaMemcpyAsync(base + packed_bytes, host.scale, scale_bytes, cudaMemcpyHostToDevice, stream_);
      s != cudaSuccess) {
    return CudaError(s, "PlaceLinear", what);
  }
  if (int s = LaunchDequantizeInt4(reinterpret_cast<const int32_t*>(base),
                                   reinterpret_cast<const uint16_t*>(base + packed_bytes), host.out, host.in,
                                   host.group_size, static_cast<uint16_t*>(*data), stream_);
      s != cudaSuccess) {
    return CudaError(static_cast<cudaError_t>(s), "PlaceLinear dequantise", what);
  }
  return placed;
}

absl::StatusOr<const void*> CudaBackend::PlaceTensor(const void* host, size_t bytes) {
  return Upload(host, bytes, absl::StrCat("tensor of ", bytes, " bytes").c_str());
}

absl::StatusOr<std::unique_ptr<ExpertTable>> CudaBackend::PlaceExperts(std::span<const ExpertWeights> host,
                                                                       std::span<const bool> held) {
  if (host.size() != held.size()) {
    return absl::InvalidArgumentError(absl::StrCat(name(), " PlaceExperts: one held flag per expert expected"));
  }
  if (static_cast<int64_t>(host.size()) > cuda::kMaxExperts) {
    return absl::InvalidArgumentError(absl::StrCat(name(), " PlaceExperts: ", host.size(), " experts, at most ",
                                                   cuda::kMaxExperts, " supported"));
  }
  auto table = std::make_unique<CudaExpertTable>();
  table->held.assign(held.begin(), held.end());
  table->experts.resize(host.size());
  bool first = true;
  for (size_t e = 0; e < host.size(); ++e) {
    if (!held[e]) continue;
    const ExpertWeights& w = host[e];
    const std::string what = absl::StrCat("expert ", e);
    if (first) {
      table->hidden = w.gate.in;
      table->inter = w.gate.out;
      table->group_size = w.gate.group_size;
      first = false;
    }
    const bool int4 = w.gate.kind == LinearWeight::Kind::kInt4;
    const LinearWeight* parts[3] = {&w.gate, &w.up, &w.down};
    for (const LinearWeight* p : parts) {
      const bool is_down = p == &w.down;
      const int64_t out = is_down ? table->hidden : table->inter;
      const int64_t in = is_down ? table->inter : table->hidden;
      if (p->out != out || p->in != in || (p->kind == LinearWeight::Kind::kInt4) != int4 ||
          (int4 && (p->group_size != table->group_size || in % 8 != 0 || in % p->group_size != 0))) {
        return absl::InvalidArgumentError(absl::StrCat(
            name(), " PlaceExperts: ", what, " has a projection of [", p->out, ", ", p->in, "] (",
            p->kind == LinearWeight::Kind::kInt4 ? "INT4" : "bf16", "), expected [", out, ", ", in,
            "] like expert 0 of the table, INT4 with whole packed words and groups or bf16"));
      }
    }
    DeviceExpert& d = table->experts[e];
    d.int4 = int4;
    if (int4) {
      for (int i = 0; i < 3; ++i) {
        const LinearWeight& p = *parts[i];
        absl::StatusOr<const void*> packed = Upload(p.packed, static_cast<size_t>(p.out * p.in / 8) * 4, what.c_str());
        if (!packed.ok()) return packed.status();
        absl::StatusOr<const void*> scale =
            Upload(p.scale, static_cast<size_t>(p.out * (p.in / p.group_size)) * 2, what.c_str());
        if (!scale.ok()) return scale.status();
        d.packed[i] = static_cast<const int32_t*>(*packed);
        d.scale[i] = static_cast<const uint16_t*>(*scale);
      }
      continue;
    }
    // bf16 experts: gate and up stacked into one [2 * inter, hidden] weight,
    // rows compacted (hidden % 8 == 0 keeps them 16-byte aligned; else the
    // GEMM copies).
    const size_t gu_bytes = static_cast<size_t>(2 * table->inter * table->hidden) * 2;
    absl::StatusOr<void*> gate_up = PlaceBytes(gu_bytes, what.c_str());
    if (!gate_up.ok()) return gate_up.status();
    for (int i = 0; i < 2; ++i) {
      const LinearWeight& p = *parts[i];
      char* dst = static_cast<char*>(*gate_up) + static_cast<size_t>(i * table->inter * table->hidden) * 2;
      if (cudaError_t s = cudaMemcpy2DAsync(dst, static_cast<size_t>(p.in) * 2, p.bf16, static_cast<size_t>(p.ld) * 2,
                                            static_cast<size_t>(p.in) * 2, static_cast<size_t>(p.out),
                                            cudaMemcpyHostToDevice, stream_);
          s != cudaSuccess) {
        return CudaError(s, "PlaceExperts", what);
      }
    }
    absl::StatusOr<void*> down = PlaceBytes(static_cast<size_t>(table->hidden * table->inter) * 2, what.c_str());
    if (!down.ok()) return down.status();
    if (cudaError_t s = cudaMemcpy2DAsync(*down, static_cast<size_t>(w.down.in) * 2, w.down.bf16,
                                          static_cast<size_t>(w.down.ld) * 2, static_cast<size_t>(w.down.in) * 2,
                                          static_cast<size_t>(w.down.out), cudaMemcpyHostToDevice, stream_);
        s != cudaSuccess) {
      return CudaError(s, "PlaceExperts", what);
    }
    d.gate_up = static_cast<const uint16_t*>(*gate_up);
    d.down = static_cast<const uint16_t*>(*down);
  }
  std::vector<uint8_t> flags(held.begin(), held.end());
  absl::StatusOr<const void*> flags_device = Upload(flags.data(), flags.size(), "expert flags");
  if (!flags_device.ok()) return flags_device.status();
  table->held_device = static_cast<const uint8_t*>(*flags_device);
  return table;
}

// ---- Per batch -------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<StagedBatch>> CudaBackend::Stage(std::span<const int32_t> tokens,
                                                                std::span<const int64_t> cu_seqlens) {
  if (cu_seqlens.size() < 2 || cu_seqlens.front() != 0 ||
      cu_seqlens.back() != static_cast<int64_t>(tokens.size())) {
    return absl::InvalidArgumentError(absl::StrCat(name(), " Stage: cu_seqlens must run from 0 to the token count"));
  }
  auto batch = std::make_unique<CudaStagedBatch>();
  batch->stream = stream_;
  batch->num_tokens = static_cast<int64_t>(tokens.size());
  batch->cu_host.assign(cu_seqlens.begin(), cu_seqlens.end());
  std::vector<int32_t> positions(tokens.size());
  std::vector<cuda::AttentionTile> tiles;
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    const int64_t length = cu_seqlens[s + 1] - cu_seqlens[s];
    if (length <= 0) return absl::InvalidArgumentError(absl::StrCat(name(), " Stage: sample ", s, " is empty"));
    if (length > INT32_MAX) return absl::InvalidArgumentError(absl::StrCat(name(), " Stage: sample ", s, " too long"));
    batch->longest_length = std::max(batch->longest_length, length);
    for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) positions[t] = static_cast<int32_t>(t - cu_seqlens[s]);
    for (int64_t q0 = 0; q0 < length; q0 += cuda::kAttentionQueryTile) {
      tiles.push_back({static_cast<int32_t>(s), static_cast<int32_t>(q0)});
    }
  }
  batch->num_tiles = static_cast<int64_t>(tiles.size());
  // One block: cu_seqlens (int64) first for alignment, then tiles, tokens, positions.
  const size_t cu_bytes = cu_seqlens.size() * sizeof(int64_t);
  const size_t tile_bytes = tiles.size() * sizeof(cuda::AttentionTile);
  const size_t token_bytes = tokens.size() * sizeof(int32_t);
  std::vector<char> host(cu_bytes + tile_bytes + 2 * token_bytes);
  std::memcpy(host.data(), cu_seqlens.data(), cu_bytes);
  std::memcpy(host.data() + cu_bytes, tiles.data(), tile_bytes);
  std::memcpy(host.data() + cu_bytes + tile_bytes, tokens.data(), token_bytes);
  std::memcpy(host.data() + cu_bytes + tile_bytes + token_bytes, positions.data(), token_bytes);
  absl::StatusOr<Scratch> block = Take(host.size(), "Stage");
  if (!block.ok()) return block.status();
  if (cudaError_t s = cudaMemcpyAsync(block->get(), host.data(), host.size(), cudaMemcpyHostToDevice, stream_);
      s != cudaSuccess) {
    return CudaError(s, "Stage", absl::StrCat(tokens.size(), " tokens"));
  }
  char* base = static_cast<char*>(block->get());
  batch->cu_seqlens = reinterpret_cast<const int64_t*>(base);
  batch->tiles = reinterpret_cast<const cuda::AttentionTile*>(base + cu_bytes);
  batch->token_ids = reinterpret_cast<const int32_t*>(base + cu_bytes + tile_bytes);
  batch->positions = reinterpret_cast<const int32_t*>(base + cu_bytes + tile_bytes + token_bytes);
  batch->block = block->release();  // now owned by the batch
  return batch;
}

absl::StatusOr<std::unique_ptr<RopeTable>> CudaBackend::PlaceRopeTable(std::span<const float> cos,
                                                                      std::span<const float> sin, int64_t half_dim) {
  if (half_dim <= 0 || cos.size() != sin.size() || cos.size() % half_dim != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name(), " PlaceRopeTable: cos and sin must be [positions, half_dim]"));
  }
  absl::StatusOr<Scratch> block = Take(2 * cos.size() * sizeof(float), "PlaceRopeTable");
  if (!block.ok()) return block.status();
  auto table = std::make_unique<CudaRopeTable>();
  table->stream = stream_;
  table->cos = static_cast<float*>(block->release());  // now owned by the table
  table->sin = table->cos + cos.size();
  table->half = half_dim;
  table->num_positions = static_cast<int64_t>(cos.size()) / half_dim;
  if (cudaError_t s = cudaMemcpyAsync(table->cos, cos.data(), cos.size_bytes(), cudaMemcpyHostToDevice, stream_);
      s != cudaSuccess) {
    return CudaError(s, "PlaceRopeTable", "cos");
  }
  if (cudaError_t s = cudaMemcpyAsync(table->sin, sin.data(), sin.size_bytes(), cudaMemcpyHostToDevice, stream_);
      s != cudaSuccess) {
    return CudaError(s, "PlaceRopeTable", "sin");
  }
  return table;
}

absl::StatusOr<std::unique_ptr<Routing>> CudaBackend::AllocateRouting(int64_t tokens, int64_t top_k) {
  if (tokens < 0 || top_k < 1 || top_k > cuda::kMaxTopK) {
    return absl::InvalidArgumentError(absl::StrCat(name(), " AllocateRouting: ", tokens, " tokens x top ", top_k,
                                                   " (top_k must be in [1, ", cuda::kMaxTopK, "])"));
  }
  absl::StatusOr<Scratch> block = Take(static_cast<size_t>(tokens * top_k) * 8, "AllocateRouting");
  if (!block.ok()) return block.status();
  auto routing = std::make_unique<CudaRouting>();
  routing->stream = stream_;
  routing->num_tokens = tokens;
  routing->k = top_k;
  routing->experts = static_cast<int32_t*>(block->release());  // now owned by the routing
  routing->weights = reinterpret_cast<float*>(routing->experts + tokens * top_k);
  return routing;
}

// ---- GEMM plumbing ---------------------------------------------------------------------

absl::StatusOr<Matrix> CudaBackend::AlignedCopy(const Matrix& m, bool load, Scratch& storage, const char* op) {
  const int64_t per_16 = 16 / static_cast<int64_t>(ElementSize(m.type));
  Matrix copy{nullptr, m.type, m.rows, m.cols, RoundUp(std::max<int64_t>(m.cols, 1), per_16)};
  absl::StatusOr<Scratch> block = Take(static_cast<size_t>(copy.rows * copy.ld) * ElementSize(m.type), op);
  if (!block.ok()) return block.status();
  storage = *std::move(block);
  copy.data = storage.get();
  if (load && !Cuda(cuda::LaunchConvert(Dev(m), Dev(copy), stream_), op, "aligned copy")) {
    return absl::InternalError("launch failed");  // already recorded
  }
  return copy;
}

void CudaBackend::Gemm(const Matrix& x, const uint16_t* w, int64_t n, int64_t k, int64_t ldw, const Matrix& y,
                       const char* op) {
  if (x.rows == 0 || n == 0) return;
  auto gemm_view = [](const Matrix& m) {
    return GemmMatrix{m.data, m.type == ElementType::kBf16, m.rows, m.cols, m.ld};
  };
  Scratch x_storage, y_storage, w_storage;
  Matrix xa = x;
  if (!cuda::LtGemm::Aligned(gemm_view(x))) {
    absl::StatusOr<Matrix> copy = AlignedCopy(x, true, x_storage, op);
    if (!copy.ok()) return Record(copy.status());
    xa = *copy;
  }
  // The weight: bf16 [n, k] with stride ldw, widened to f32 for f32 activations.
  Matrix weight{const_cast<uint16_t*>(w), ElementType::kBf16, n, k, ldw};
  if (x.type == ElementType::kF32 || !cuda::LtGemm::Aligned(gemm_view(weight))) {
    const ElementType type = x.type == ElementType::kF32 ? ElementType::kF32 : ElementType::kBf16;
    Matrix wide{nullptr, type, n, k, RoundUp(k, 16 / static_cast<int64_t>(ElementSize(type)))};
    absl::StatusOr<Scratch> block = Take(static_cast<size_t>(n * wide.ld) * ElementSize(type), op);
    if (!block.ok()) return Record(block.status());
    w_storage = *std::move(block);
    wide.data = w_storage.get();
    if (!Cuda(cuda::LaunchConvert(Dev(weight), Dev(wide), stream_), op, "weight copy")) return;
    weight = wide;
  }
  Matrix ya = y;
  const bool y_copy = !cuda::LtGemm::Aligned(gemm_view(y));
  if (y_copy) {
    absl::StatusOr<Matrix> copy = AlignedCopy(y, false, y_storage, op);
    if (!copy.ok()) return Record(copy.status());
    ya = *copy;
  }
  if (absl::Status s = gemm_->Multiply(gemm_view(xa), gemm_view(weight), gemm_view(ya), op); !s.ok()) {
    return Record(absl::Status(s.code(), absl::StrCat(name(), " ", s.message())));
  }
  if (y_copy) Cuda(cuda::LaunchConvert(Dev(ya), Dev(y), stream_), op, "result copy");
}

// ---- Ops ----------------------------------------------------------------------------------

void CudaBackend::Embed(const StagedBatch& staged, const uint16_t* table, int64_t vocab_begin, int64_t vocab_rows,
                        const Matrix& out) {
  const auto& batch = static_cast<const CudaStagedBatch&>(staged);
  if (!Check(CheckEmbed(out, batch.tokens()))) return;
  Cuda(cuda::LaunchEmbed(batch.token_ids, table, vocab_begin, vocab_rows, Dev(out), stream_), "Embed", ShapeOf(out));
}

void CudaBackend::Linear(const Matrix& x, const LinearWeight& w, const Matrix& y, bool partial) {
  if (!Check(CheckLinear(x, w, y, partial, activation_type()))) return;
  // Dense weights only (routed INT4 experts go through PlaceExperts).
  if (!Check(w.kind == LinearWeight::Kind::kBf16, "Linear", "an INT4 weight outside an expert table")) return;
  Gemm(x, w.bf16, w.out, w.in, w.ld, y, "Linear");
}

void CudaBackend::Round(const Matrix& partial, const Matrix& out) {
  if (!Check(CheckRound(partial, out, activation_type()))) return;
  if (out.data == partial.data && out.ld == partial.ld) return;  // f32 in place: nothing rounds
  Cuda(cuda::LaunchConvert(Dev(partial), Dev(out), stream_), "Round", ShapeOf(out));
}

void CudaBackend::RmsNorm(const Matrix& x, const uint16_t* weight, float eps, const Matrix& y) {
  if (!Check(CheckRmsNorm(x, y, activation_type()))) return;
  Cuda(cuda::LaunchRmsNorm(Dev(x), weight, eps, bf16(), Dev(y), stream_), "RmsNorm", ShapeOf(x));
}

void CudaBackend::Add(const Matrix& a, const Matrix& b, const Matrix& out) {
  if (!Check(CheckAdd(a, b, out))) return;
  Cuda(cuda::LaunchAdd(Dev(a), Dev(b), bf16(), Dev(out), stream_), "Add", ShapeOf(out));
}

void CudaBackend::SiluMul(const Matrix& gate, const Matrix& up, const Matrix& out) {
  if (!Check(CheckSiluMul(gate, up, out))) return;
  Cuda(cuda::LaunchSiluMul(Dev(gate), Dev(up), bf16(), Dev(out), stream_), "SiluMul", ShapeOf(out));
}

void CudaBackend::Rope(const Matrix& x, int64_t heads, int64_t stride, int64_t offset, const StagedBatch& staged,
                       const RopeTable& rope) {
  const auto& batch = static_cast<const CudaStagedBatch&>(staged);
  const auto& table = static_cast<const CudaRopeTable&>(rope);
  const int64_t half = table.half;
  if (!Check(CheckRope(x, heads, stride, offset, half, batch, table))) return;
  if (!Check(heads <= 65535 && half <= 1024, "Rope",
             absl::StrCat(heads, " heads of half dim ", half, " (the kernel takes up to 65535 and 1024)"))) {
    return;
  }
  Cuda(cuda::LaunchRope(Dev(x), heads, stride, offset, half, batch.positions, table.cos, table.sin, bf16(), stream_),
       "Rope", ShapeOf(x));
}

void CudaBackend::Attention(const Matrix& q, const Matrix& kv, const Matrix& k_rope, int64_t heads, int64_t nope_dim,
                            int64_t rope_dim, int64_t v_dim, const StagedBatch& staged, float scale,
                            const Matrix& out) {
  const auto& batch = static_cast<const CudaStagedBatch&>(staged);
  const int64_t qk_dim = nope_dim + rope_dim;
  const std::string what = absl::StrCat("q ", ShapeOf(q), ", kv ", ShapeOf(kv), ", k_rope ", ShapeOf(k_rope), ", out ",
                                        ShapeOf(out), ", ", heads, " heads");
  if (!Check(CheckAttention(q, kv, k_rope, heads, nope_dim, rope_dim, v_dim, batch, out))) return;
  if (cudnn_ != nullptr) return CudnnSdpa(q, kv, k_rope, heads, nope_dim, rope_dim, v_dim, batch, scale, out);
  Cuda(cuda::LaunchAttention(Dev(q), Dev(kv), Dev(k_rope), heads, nope_dim, rope_dim, v_dim, batch.cu_seqlens,
                             batch.tiles, batch.num_tiles, scale, bf16(), Dev(out), stream_),
       "Attention", absl::StrCat(what, " (head dims ", qk_dim, "/", v_dim, ")"));
}

namespace {

// The graph cache's buckets: the next power of two (at least `floor`), so a
// server builds a few graphs rather than one per batch.
int64_t Bucket(int64_t n, int64_t floor) {
  int64_t b = floor;
  while (b < n) b *= 2;
  return b;
}

constexpr size_t kAlign = 256;
size_t Aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

}  // namespace

void CudaBackend::CudnnSdpa(const Matrix& q, const Matrix& kv, const Matrix& k_rope, int64_t heads, int64_t nope_dim,
                            int64_t rope_dim, int64_t v_dim, const CudaStagedBatch& batch, float scale,
                            const Matrix& out) {
  const int64_t qk_dim = nope_dim + rope_dim;
  const int64_t tokens = q.rows;
  const std::string what = absl::StrCat(tokens, " tokens, ", heads, " heads, head dims ", qk_dim, "/", v_dim);
  // Both offset arrays are int32 (offsets_v counts v_dim elements per head).
  if (!Check(tokens * heads * std::max(qk_dim, v_dim) <= INT32_MAX, "Attention (cuDNN)",
             absl::StrCat(what, ": the ragged offsets exceed int32; use --attention=reference"))) {
    return;
  }
  const cuda::SdpaShape shape{Bucket(batch.num_samples(), 1), Bucket(batch.longest(), 64), heads, qk_dim, v_dim, scale};
  absl::StatusOr<int64_t> workspace = cudnn_->Prepare(shape);
  if (!workspace.ok()) return Record(absl::Status(workspace.status().code(), absl::StrCat(name(), " Attention: ", workspace.status().message())));
  const size_t qk_bytes = Aligned(static_cast<size_t>(tokens * heads * qk_dim) * 2);
  const size_t v_bytes = Aligned(static_cast<size_t>(tokens * heads * v_dim) * 2);
  const size_t index_bytes = Aligned(static_cast<size_t>(shape.samples + 1) * 4);
  absl::StatusOr<Scratch> scratch =
      Take(2 * qk_bytes + 2 * v_bytes + 3 * index_bytes + static_cast<size_t>(*workspace), "Attention (cuDNN)");
  if (!scratch.ok()) return Record(scratch.status());
  char* p = static_cast<char*>(scratch->get());
  auto* q_packed = reinterpret_cast<uint16_t*>(p);
  auto* k_packed = reinterpret_cast<uint16_t*>(p + qk_bytes);
  auto* v_packed = reinterpret_cast<uint16_t*>(p + 2 * qk_bytes);
  auto* o_packed = reinterpret_cast<uint16_t*>(p + 2 * qk_bytes + v_bytes);
  char* index = p + 2 * qk_bytes + 2 * v_bytes;
  auto* offsets_qk = reinterpret_cast<int32_t*>(index);
  auto* offsets_v = reinterpret_cast<int32_t*>(index + index_bytes);
  auto* lengths = reinterpret_cast<int32_t*>(index + 2 * index_bytes);
  void* work = *workspace > 0 ? index + 3 * index_bytes : nullptr;
  if (!Cuda(cuda::LaunchPackSdpa(Dev(q), Dev(kv), Dev(k_rope), heads, nope_dim, rope_dim, v_dim, batch.cu_seqlens,
                                 batch.num_samples(), shape.samples, q_packed, k_packed, v_packed, offsets_qk,
                                 offsets_v, lengths, stream_),
            "Attention (cuDNN pack)", what)) {
    return;
  }
  const cuda::SdpaOperands operands{q_packed, k_packed, v_packed, o_packed, offsets_qk, offsets_v, lengths};
  if (absl::Status s = cudnn_->Run(shape, operands, work); !s.ok()) {
    return Record(absl::Status(s.code(), absl::StrCat(name(), " Attention: ", s.message())));
  }
  Cuda(cuda::LaunchUnpackRows(o_packed, Dev(out), stream_), "Attention (cuDNN unpack)", what);
}

void CudaBackend::Route(const Matrix& x, const RouterParams& router, Routing& routing_handle) {
  auto& routing = static_cast<CudaRouting&>(routing_handle);
  const int64_t tokens = x.rows;
  const int64_t experts = router.num_experts;
  if (!Check(CheckRoute(x, router, routing, activation_type()))) return;
  if (!Check(experts >= 1 && experts <= cuda::kMaxExperts && router.top_k >= 1 && router.top_k <= experts &&
                 router.n_group >= 1 && router.n_group <= 64 && experts % router.n_group == 0 &&
                 router.topk_group >= 1 && router.topk_group <= router.n_group,
             "Route", absl::StrCat(experts, " experts, top ", router.top_k, ", ", router.n_group, " groups keeping ",
                                   router.topk_group, " (supported: up to ", cuda::kMaxExperts,
                                   " experts in up to 64 equal groups)"))) {
    return;
  }
  if (tokens == 0) return;
  // Router logits in float32 (HF keeps the gate in float32 in every mode).
  absl::StatusOr<Scratch> logits = Take(static_cast<size_t>(tokens * experts) * 4, "Route");
  if (!logits.ok()) return Record(logits.status());
  const Matrix logit_matrix{logits->get(), ElementType::kF32, tokens, experts, experts};
  Gemm(x, router.weight, experts, x.cols, x.cols, logit_matrix, "Route");
  cuda::RouterArgs args;
  args.bias = router.bias;
  args.num_experts = experts;
  args.top_k = router.top_k;
  args.n_group = router.n_group;
  args.topk_group = router.topk_group;
  args.softmax_scores = router.softmax_scores;
  args.normalize = router.normalize;
  args.scaling = router.scaling;
  Cuda(cuda::LaunchRoute(static_cast<const float*>(logits->get()), tokens, args, routing.experts, routing.weights,
                         stream_),
       "Route", absl::StrCat(tokens, " tokens, ", experts, " experts"));
}

void CudaBackend::MoeExperts(const Matrix& x, const Routing& routing_handle, const ExpertTable& table_handle,
                             const Matrix& out, bool partial) {
  const auto& routing = static_cast<const CudaRouting&>(routing_handle);
  const auto& table = static_cast<const CudaExpertTable&>(table_handle);
  const int64_t tokens = x.rows;
  const int64_t top_k = routing.top_k();
  const std::string what = absl::StrCat("x ", ShapeOf(x), ", out ", ShapeOf(out), ", routing for ", routing.tokens(),
                                        " tokens", partial ? " (partial: f32)" : "");
  if (!Check(CheckMoeExperts(x, routing, out, partial, activation_type()))) return;
  if (!Check(table.hidden == 0 || table.hidden == x.cols, "MoeExperts", absl::StrCat(what, ", experts of hidden ",
                                                                                      table.hidden))) {
    return;
  }
  if (tokens == 0) return;
  const int64_t num_experts = table.num_experts();
  const int64_t hidden = x.cols;
  const int64_t inter = table.inter;
  // 1. Tokens per held expert, brought to the host: GEMM sizes are host
  //    arguments (a device-side grouped GEMM would remove this sync).
  absl::StatusOr<Scratch> counts = Take(static_cast<size_t>(num_experts) * 4, "MoeExperts");
  if (!counts.ok()) return Record(counts.status());
  auto* counts_device = static_cast<int32_t*>(counts->get());
  if (!Cuda(cuda::LaunchExpertCounts(routing.experts, tokens, top_k, table.held_device, num_experts, counts_device,
                                     stream_),
            "MoeExperts", what) ||
      !Cuda(cudaMemcpyAsync(host_counts_, counts_device, static_cast<size_t>(num_experts) * 4, cudaMemcpyDeviceToHost,
                            stream_),
            "MoeExperts", "expert counts") ||
      !Cuda(cudaStreamSynchronize(stream_), "MoeExperts", "waiting for expert counts")) {
    return;
  }
  std::vector<int32_t> offsets(static_cast<size_t>(num_experts), 0);
  std::vector<int64_t> active;  // held experts with tokens, ascending id
  int64_t rows = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    offsets[e] = static_cast<int32_t>(rows);
    if (!table.held[e] || host_counts_[e] == 0) continue;
    active.push_back(e);
    rows += host_counts_[e];
  }
  // 2. The permutation: rows of each active expert, and each slot's row.
  const size_t index_bytes = static_cast<size_t>(num_experts + std::max<int64_t>(rows, 1) + tokens * top_k) * 4;
  absl::StatusOr<Scratch> index = Take(index_bytes, "MoeExperts");
  if (!index.ok()) return Record(index.status());
  auto* offsets_device = static_cast<int32_t*>(index->get());
  int32_t* rows_device = offsets_device + num_experts;
  int32_t* slot_row = rows_device + std::max<int64_t>(rows, 1);
  // Every slot starts as -1 ("no row"): ExpertRows writes only the slots whose
  // expert id is in [0, num_experts), so a routing that never got written (a
  // Route that failed, and recorded it, before this op) would otherwise leave
  // pool garbage for Combine to use as a row index of y: an out-of-bounds read
  // that poisons the context and turns one failed batch into a lost device.
  if (!Cuda(cudaMemsetAsync(slot_row, 0xff, static_cast<size_t>(tokens * top_k) * 4, stream_), "MoeExperts",
            "slot rows") ||
      !Cuda(cudaMemcpyAsync(offsets_device, offsets.data(), offsets.size() * 4, cudaMemcpyHostToDevice, stream_),
            "MoeExperts", "offsets") ||
      !Cuda(cuda::LaunchExpertRows(routing.experts, tokens, top_k, table.held_device, num_experts, offsets_device,
                                   rows_device, slot_row, stream_),
            "MoeExperts", what)) {
    return;
  }
  Scratch gathered, gate_up, y, weights, pointers;
  Matrix y_matrix{nullptr, activation_type(), rows, hidden, hidden};
  if (rows > 0) {
    const ElementType act = activation_type();
    const size_t element = ElementSize(act);
    // 3. Gather the rows, expert by expert.
    absl::StatusOr<Scratch> block = Take(static_cast<size_t>(rows * hidden) * element, "MoeExperts");
    if (!block.ok()) return Record(block.status());
    gathered = *std::move(block);
    const Matrix xg{gathered.get(), act, rows, hidden, hidden};
    if (!Cuda(cuda::LaunchGatherRows(Dev(x), rows_device, Dev(xg), stream_), "MoeExperts", what)) return;
    // 4. Dequantise the active INT4 experts into bf16 scratch: per expert a
    //    [2 * inter, hidden] gate-up weight then a [hidden, inter] down weight.
    const int64_t expert_elements = 3 * inter * hidden;
    std::vector<const uint16_t*> gate_up_w(active.size()), down_w(active.size());
    std::vector<const int32_t*> gu_packed, d_packed;
    std::vector<const uint16_t*> gu_scale, d_scale;
    std::vector<uint16_t*> gu_out, d_out;
    int64_t int4_count = 0;
    for (int64_t e : active) int4_count += table.experts[e].int4 ? 1 : 0;
    if (int4_count > 0) {
      absl::StatusOr<Scratch> w_block = Take(static_cast<size_t>(int4_count * expert_elements) * 2, "MoeExperts");
      if (!w_block.ok()) return Record(w_block.status());
      weights = *std::move(w_block);
    }
    int64_t slot = 0;
    for (size_t a = 0; a < active.size(); ++a) {
      const DeviceExpert& d = table.experts[active[a]];
      if (!d.int4) {
        gate_up_w[a] = d.gate_up;
        down_w[a] = d.down;
        continue;
      }
      uint16_t* base = static_cast<uint16_t*>(weights.get()) + slot++ * expert_elements;
      gate_up_w[a] = base;
      down_w[a] = base + 2 * inter * hidden;
      for (int i = 0; i < 2; ++i) {
        gu_packed.push_back(d.packed[i]);
        gu_scale.push_back(d.scale[i]);
        gu_out.push_back(base + i * inter * hidden);
      }
      d_packed.push_back(d.packed[2]);
      d_scale.push_back(d.scale[2]);
      d_out.push_back(base + 2 * inter * hidden);
    }
    if (int4_count > 0) {
      // Pointer arrays for the batched kernel: gate/up (2 per expert) then down.
      std::vector<const void*> host_pointers;
      for (auto* p : gu_packed) host_pointers.push_back(p);
      for (auto* p : gu_scale) host_pointers.push_back(p);
      for (auto* p : gu_out) host_pointers.push_back(p);
      for (auto* p : d_packed) host_pointers.push_back(p);
      for (auto* p : d_scale) host_pointers.push_back(p);
      for (auto* p : d_out) host_pointers.push_back(p);
      absl::StatusOr<Scratch> p_block = Take(host_pointers.size() * sizeof(void*), "MoeExperts");
      if (!p_block.ok()) return Record(p_block.status());
      pointers = *std::move(p_block);
      if (!Cuda(cudaMemcpyAsync(pointers.get(), host_pointers.data(), host_pointers.size() * sizeof(void*),
                                cudaMemcpyHostToDevice, stream_),
                "MoeExperts", "dequant pointers")) {
        return;
      }
      auto* p = static_cast<void**>(pointers.get());
      const int64_t gu = 2 * int4_count, dn = int4_count;
      const std::string shapes = absl::StrCat(int4_count, " experts, inter ", inter, ", hidden ", hidden);
      if (!Cuda(LaunchDequantizeInt4Batched(reinterpret_cast<const int32_t* const*>(p),
                                            reinterpret_cast<const uint16_t* const*>(p + gu),
                                            reinterpret_cast<uint16_t* const*>(p + 2 * gu), gu, inter, hidden,
                                            table.group_size, stream_),
                "MoeExperts dequantise gate/up", shapes) ||
          !Cuda(LaunchDequantizeInt4Batched(reinterpret_cast<const int32_t* const*>(p + 3 * gu),
                                            reinterpret_cast<const uint16_t* const*>(p + 3 * gu + dn),
                                            reinterpret_cast<uint16_t* const*>(p + 3 * gu + 2 * dn), dn, hidden, inter,
                                            table.group_size, stream_),
                "MoeExperts dequantise down", shapes)) {
        return;
      }
    }
    // 5. Per expert: [gate | up] = x_e · W_guᵀ (each rounded as the CPU's
    //    separate GEMMs), then silu(gate) * up in place, then y_e = h_e · W_dᵀ.
    absl::StatusOr<Scratch> gu_block = Take(static_cast<size_t>(rows * 2 * inter) * element, "MoeExperts");
    if (!gu_block.ok()) return Record(gu_block.status());
    gate_up = *std::move(gu_block);
    const Matrix gu_matrix{gate_up.get(), act, rows, 2 * inter, 2 * inter};
    absl::StatusOr<Scratch> y_block = Take(static_cast<size_t>(rows * hidden) * element, "MoeExperts");
    if (!y_block.ok()) return Record(y_block.status());
    y = *std::move(y_block);
    y_matrix.data = y.get();
    for (size_t a = 0; a < active.size(); ++a) {
      const int64_t e = active[a];
      Gemm(xg.Rows(offsets[e], host_counts_[e]), gate_up_w[a], 2 * inter, hidden, hidden,
           gu_matrix.Rows(offsets[e], host_counts_[e]), "MoeExperts gate/up");
    }
    const Matrix gate = gu_matrix.Cols(0, inter);
    if (!Cuda(cuda::LaunchSiluMul(Dev(gate), Dev(gu_matrix.Cols(inter, inter)), bf16(), Dev(gate), stream_),
              "MoeExperts", what)) {
      return;
    }
    for (size_t a = 0; a < active.size(); ++a) {
      const int64_t e = active[a];
      Gemm(gate.Rows(offsets[e], host_counts_[e]), down_w[a], hidden, inter, inter,
           y_matrix.Rows(offsets[e], host_counts_[e]), "MoeExperts down");
    }
  }
  // 6. Combine per token over its slots (ascending expert id).
  Cuda(cuda::LaunchCombine(Dev(y_matrix), slot_row, routing.weights, top_k, !partial && bf16(), Dev(out), stream_),
       "MoeExperts", what);
}

void CudaBackend::CopyRoutingToHost(const Routing& routing_handle, int32_t* experts, float* weights) {
  const auto& routing = static_cast<const CudaRouting&>(routing_handle);
  const size_t n = static_cast<size_t>(routing.tokens() * routing.top_k());
  if (n == 0) return;
  Cuda(cudaMemcpyAsync(experts, routing.experts, n * 4, cudaMemcpyDeviceToHost, stream_), "CopyRoutingToHost",
       "experts");
  Cuda(cudaMemcpyAsync(weights, routing.weights, n * 4, cudaMemcpyDeviceToHost, stream_), "CopyRoutingToHost",
       "weights");
}

}  // namespace

absl::StatusOr<int> CudaDeviceCount() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    return absl::FailedPreconditionError(absl::StrCat("no CUDA device: ", cudaGetErrorString(status)));
  }
  if (count == 0) return absl::FailedPreconditionError("no CUDA device: cudaGetDeviceCount found none");
  return count;
}

absl::StatusOr<std::string> DescribeCudaDevice(int device) {
  absl::StatusOr<int> count = CudaDeviceCount();
  if (!count.ok()) return count.status();
  if (device < 0 || device >= *count) {
    return absl::FailedPreconditionError(absl::StrCat("no CUDA device ", device, ": ", *count, " found"));
  }
  cudaDeviceProp prop{};
  int driver = 0, runtime = 0;
  size_t free = 0, total = 0;
  cudaError_t status = cudaGetDeviceProperties(&prop, device);
  if (status == cudaSuccess) status = cudaDriverGetVersion(&driver);
  if (status == cudaSuccess) status = cudaRuntimeGetVersion(&runtime);
  if (status == cudaSuccess) status = cudaSetDevice(device);
  if (status == cudaSuccess) status = cudaMemGetInfo(&free, &total);
  if (status != cudaSuccess) {
    return absl::FailedPreconditionError(absl::StrCat("CUDA device ", device, ": ", cudaGetErrorString(status)));
  }
  return absl::StrFormat("cuda:%d %s (sm_%d%d, %d SMs), %.1f GiB free of %.1f GiB, driver %d.%d, runtime %d.%d",
                         device, prop.name, prop.major, prop.minor, prop.multiProcessorCount,
                         static_cast<double>(free) / (1 << 30), static_cast<double>(total) / (1 << 30),
                         driver / 1000, driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10);
}

absl::StatusOr<CudaRank> CudaRankOf(Backend& backend) {
  auto* cuda = dynamic_cast<CudaBackend*>(&backend);
  if (cuda == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("backend ", backend.name(), " is not a CUDA backend"));
  }
  return CudaRank{cuda->device(), cuda->stream()};
}

absl::StatusOr<CudaMemory> CudaMemoryInfo(int device) {
  size_t free = 0, total = 0;
  cudaError_t status = cudaSetDevice(device);
  if (status == cudaSuccess) status = cudaMemGetInfo(&free, &total);
  if (status != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", device, ": cudaMemGetInfo: ", cudaGetErrorString(status)));
  }
  return CudaMemory{static_cast<int64_t>(free), static_cast<int64_t>(total)};
}

absl::StatusOr<CudaCaptureOptions> CudaCaptureOptionsFromEnv() {
  CudaCaptureOptions options;
  const char* value = std::getenv("HSX_CUDA_CAPTURE_OVERLAP");
  if (value == nullptr || std::strcmp(value, "") == 0 || std::strcmp(value, "1") == 0) return options;
  if (std::strcmp(value, "0") == 0) {
    options.overlap = false;
    return options;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("HSX_CUDA_CAPTURE_OVERLAP='", value,
                   "': expected 1 (capture copies on a second stream, overlapping compute; the default) or 0 (on "
                   "the compute stream)"));
}

absl::Status SetCudaCaptureOptions(Backend& backend, const CudaCaptureOptions& options) {
  auto* cuda = dynamic_cast<CudaBackend*>(&backend);
  if (cuda == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("backend ", backend.name(), " is not a CUDA backend"));
  }
  return cuda->SetCaptureOptions(options);
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device, Precision precision, CudaAttention attention) {
  absl::StatusOr<CudaCaptureOptions> capture = CudaCaptureOptionsFromEnv();
  if (!capture.ok()) return capture.status();
  absl::StatusOr<int> count = CudaDeviceCount();
  if (!count.ok()) return count.status();
  if (device < 0 || device >= *count) {
    return absl::FailedPreconditionError(
        absl::StrCat("no CUDA device ", device, ": this machine has ", *count, " (rank r runs on device r)"));
  }
  auto backend = std::make_unique<CudaBackend>(device, precision, attention);
  if (absl::Status s = backend->Init(); !s.ok()) return s;
  if (absl::Status s = backend->SetCaptureOptions(*capture); !s.ok()) return s;
  return backend;
}

absl::StatusOr<std::string> ProbeCudnnAttention(int device, Precision precision, int64_t heads, int64_t qk_dim,
                                                int64_t v_dim, int64_t longest) {
  if (precision != Precision::kBf16) {
    return absl::FailedPreconditionError("--attention=cudnn needs bf16 activations (cuDNN's SDPA is bf16 in and out)");
  }
  if (cudaError_t s = cudaSetDevice(device); s != cudaSuccess) {
    return absl::FailedPreconditionError(absl::StrCat("CUDA device ", device, ": ", cudaGetErrorString(s)));
  }
  absl::StatusOr<std::unique_ptr<cuda::CudnnAttention>> cudnn = cuda::CudnnAttention::Create(nullptr);
  if (!cudnn.ok()) return cudnn.status();
  const cuda::SdpaShape shape{1, Bucket(longest, 64), heads, qk_dim, v_dim, 1.0f / std::sqrt(static_cast<float>(qk_dim))};
  if (absl::StatusOr<int64_t> workspace = (*cudnn)->Prepare(shape); !workspace.ok()) return workspace.status();
  return (*cudnn)->Describe();
}

}  // namespace hsx
