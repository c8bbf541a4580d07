// capture_staging.cc: the CudaBackend's captures (cuda_backend.h,
// "Captures"): CopyToHost and CopyToHostFp8 through the device staging ring
// and the copy stream, the ring's life (made at the first overlapped copy, replaced when
// its size changes), the capture options, and the waits on both streams
// (Synchronize, FenceCopies).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_backend_internal.h"
#include "kernels/cuda/cuda_errors.h"
#include "kernels/cuda/ops.h"
#include "kernels/fp8_e4m3.h"
#include "kernels/op_checks.h"
#include "kernels/staging_ring.h"

namespace hsx {

void CudaBackend::CopyToHost(const Matrix& src, void* dst) {
  if (src.rows == 0 || src.cols == 0) return;
  const size_t row = static_cast<size_t>(src.cols) * ElementSize(src.type);
  // A row larger than the ring (only a test's tiny ring) copies in line.
  if (capture_.overlap && static_cast<int64_t>(row) <= capture_.staging_bytes) {
    return CopyToHostOverlapped(src, static_cast<char*>(dst), false);
  }
  // Pinned targets (HostBuffers) copy asynchronously; pageable ones work too,
  // but the driver may make the call synchronous.
  Cuda(cudaMemcpy2DAsync(dst, row, src.data, static_cast<size_t>(src.ld) * ElementSize(src.type), row,
                         static_cast<size_t>(src.rows), cudaMemcpyDeviceToHost, stream_),
       "CopyToHost", ShapeOf(src));
}

// The rows are encoded on the device (fp8_rows.cu), so only fp8 rows cross
// PCIe: with the overlap, into the staging ring in place of the snapshot
// (the encoding is the snapshot, at about half its bytes); without it, into
// pool scratch on the compute stream, copied out from there.
void CudaBackend::CopyToHostFp8(const Matrix& src, void* dst) {
  if (src.rows == 0 || src.cols == 0) return;
  if (!Check(src.cols < (int64_t{1} << 31), "CopyToHostFp8", absl::StrCat(ShapeOf(src), ": rows too long"))) return;
  const int64_t row = src.cols + kFp8ScaleBytes;
  if (capture_.overlap && row <= capture_.staging_bytes) {
    return CopyToHostOverlapped(src, static_cast<char*>(dst), true);
  }
  const size_t bytes = static_cast<size_t>(src.rows * row);
  absl::StatusOr<Scratch> encoded = Take(bytes, "CopyToHostFp8");
  if (!encoded.ok()) return Record(encoded.status());
  if (Cuda(cuda::LaunchFp8Rows(Dev(src), encoded->get(), stream_), "CopyToHostFp8", ShapeOf(src))) {
    Cuda(cudaMemcpyAsync(dst, encoded->get(), bytes, cudaMemcpyDeviceToHost, stream_), "CopyToHostFp8",
         ShapeOf(src));
  }
}  // the scratch is freed in stream order, after the copy

bool CudaBackend::Snapshot(const Matrix& rows, char* staged, bool fp8, const std::string& what) {
  if (fp8) return Cuda(cuda::LaunchFp8Rows(Dev(rows), staged, stream_), "CopyToHostFp8", what);
  const size_t row = static_cast<size_t>(rows.cols) * ElementSize(rows.type);
  return Cuda(cudaMemcpy2DAsync(staged, row, rows.data, static_cast<size_t>(rows.ld) * ElementSize(rows.type), row,
                                static_cast<size_t>(rows.rows), cudaMemcpyDeviceToDevice, stream_),
              "CopyToHost snapshot", what);
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
void CudaBackend::CopyToHostOverlapped(const Matrix& src, char* dst, bool fp8) {
  if (absl::Status s = EnsureStaging(); !s.ok()) return Record(std::move(s));
  const size_t row = fp8 ? static_cast<size_t>(src.cols + kFp8ScaleBytes)
                         : static_cast<size_t>(src.cols) * ElementSize(src.type);
  const int64_t chunk_rows = capture_.staging_bytes / static_cast<int64_t>(row);
  for (int64_t r = 0; r < src.rows; r += chunk_rows) {
    const int64_t rows = std::min(chunk_rows, src.rows - r);
    const size_t bytes = static_cast<size_t>(rows) * row;
    absl::StatusOr<StagingRing::Reservation> slot = ring_->Reserve(static_cast<int64_t>(bytes));
    if (!slot.ok()) return Record(absl::InternalError(absl::StrCat(name(), " CopyToHost: ", slot.status().message())));
    char* staged = static_cast<char*>(staging_) + slot->offset;
    const std::string what = absl::StrCat(ShapeOf(src), ", rows ", r, "..", r + rows);
    // In order: the compute stream waits until the region's last reader has
    // finished, snapshots (or encodes) the rows, and signals the copy stream,
    // which copies the snapshot out and marks the ticket done. A failure is
    // recorded, so the batch fails and no later copy's bytes are ever read.
    if ((slot->wait_for >= 0 &&
         !Cuda(cudaStreamWaitEvent(stream_, Copied(slot->wait_for), 0), "CopyToHost", "waiting for the ring")) ||
        !Snapshot(src.Rows(r, rows), staged, fp8, what) ||
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

}  // namespace hsx
