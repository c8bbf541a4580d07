// cuda_device.cc: the CudaBackend's device and memory: set-up and tear-down,
// errors that name the device and the free memory, the stream-ordered pool
// (buffers, pinned host buffers, per-op scratch), weight placement (the plan
// check and dense Linear weights), host-to-device copies, and the device
// queries and factory of cuda_backend.h.
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_backend_internal.h"
#include "kernels/cuda/cuda_errors.h"
#include "kernels/op_checks.h"
#include "kernels/cuda/int4_dequant.h"

namespace hsx {
namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // cuBLASLt workspace

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

}  // namespace

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

void CudaBackend::CopyFromHost(const void* src, const Matrix& dst) {
  if (dst.rows == 0 || dst.cols == 0) return;
  const size_t row = static_cast<size_t>(dst.cols) * ElementSize(dst.type);
  Cuda(cudaMemcpy2DAsync(dst.data, static_cast<size_t>(dst.ld) * ElementSize(dst.type), src, row, row,
                         static_cast<size_t>(dst.rows), cudaMemcpyHostToDevice, stream_),
       "CopyFromHost", ShapeOf(dst));
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

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device, ElementType precision, CudaAttention attention) {
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

}  // namespace hsx
