// cuda_backend.h: the CUDA implementation of kernels/backend.h (contract v2)
// for one rank on one device.
//
// Every op is enqueued on one stream of the device (a capture's copy to the
// host finishes on a second one: "Captures" below); Synchronize() waits for
// both and returns the first error recorded since the previous call (a bad
// size, a failed launch, a cuBLASLt failure, or a device fault while a stream
// ran).
// Every error names the device, the op and the sizes.
//
// Memory. Activations, staged batches, routings and per-op scratch come from
// the device's stream-ordered pool (cudaMallocAsync, release threshold
// raised so freed blocks are reused, not returned to the driver); freeing is
// stream-ordered, so a Buffer destroyed right after the op that reads it is
// safe. Weights are plain cudaMalloc allocations held until the backend is
// destroyed; each placement first checks that it leaves kCudaReservedBytes free
// for activations, and fails with the plan (asked, free, placed so far)
// otherwise. Out of memory anywhere says how much was asked and how much was
// free (cudaMemGetInfo).
//
// Weights. Dense Linear weights are copied to the device as bf16 rows with a
// row stride padded to 16 bytes (a column slice is compacted); an INT4 dense
// weight is dequantised to bf16 once, at placement. Routed experts stay INT4
// in device memory (the checkpoint's pack-quantized layout, unchanged); per
// MoE call, the experts that received tokens are dequantised into bf16
// scratch by the int4_dequant kernel and run as cuBLASLt GEMMs. MoeExperts
// waits for the stream once per call: the per-expert row counts are host
// arguments of those GEMMs (a device-side grouped GEMM would remove the wait).
//
// Arithmetic. In ElementType::kBf16 activations are bf16; GEMMs take bf16
// operands with float32 accumulation (gemm.h: one pinned algorithm per shape,
// no split-K, so rows are batch-independent). In kF32 activations are f32
// and GEMMs run in true fp32 (bf16 weights are widened exactly to f32 first).
// Everything else (ops.h) repeats the CPU reference's float32 operations in
// the same order; see tests/cuda for what agrees bitwise and what within a
// tolerance. The exception is Attention under CudaAttention::kCudnn: cuDNN's
// SDPA (fp32 scores, online softmax) agrees with the reference only within
// bf16 tolerance.
//
// Captures. CopyToHost, with capture overlap on (the default), does not copy
// to the host on the compute stream: it snapshots the rows into a device
// staging ring there (a device-to-device copy, at HBM speed) and copies the
// snapshot to the pinned host buffer on a second stream, which waits for the
// snapshot with an event. The device-to-host copy (PCIe speed, the slow part)
// then runs while the ops enqueued after it compute, and the source may be
// overwritten (the residual stream is updated in place) or freed at once, as
// the contract allows. The ring (kCaptureStagingBytes from the pool, taken at
// the backend's first overlapped copy, so only a capturing rank holds one)
// takes copies in chunks of whole rows; a region is reused only after the
// compute stream has waited, on the device, for the copy that read it
// (kernels/staging_ring.h), so a copy-out that falls behind slows the compute
// stream down instead of losing rows. Synchronize() waits for both streams and
// reports errors from either. With overlap off, CopyToHost copies on the
// compute stream, in line with every other op. CopyToHostFp8 takes the same
// path with the encoding in place of the snapshot: a kernel (fp8_rows.cu,
// one block per row) writes each row's fp8 bytes into the ring, about half
// the bytes of bf16 rows, and only those cross PCIe; with overlap off it
// encodes into pool scratch on the compute stream and copies out from there.
#ifndef HSX_KERNELS_CUDA_CUDA_BACKEND_H_
#define HSX_KERNELS_CUDA_CUDA_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cuda_attention.h"
#include "kernels/staging_ring.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace hsx {

// A CUDA backend on device `device`, with the capture options of
// CudaCaptureOptionsFromEnv() (whose error comes first). FailedPrecondition
// "no CUDA device: ..." (with the CUDA error string) where the machine has
// none or fewer than device + 1. With CudaAttention::kCudnn, FailedPrecondition with the reason
// where cuDNN cannot serve (not built in, library missing, fp32 activations):
// an explicit request is never silently replaced by the reference kernel.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device, ElementType precision,
                                                         CudaAttention attention = CudaAttention::kReference);

// Start-up check of --attention=cudnn on device `device`: builds the SDPA
// graph for one sample of `longest` tokens with the model's heads per rank and
// head dims. Returns a line naming the cuDNN version, or the reason it cannot
// serve (FailedPrecondition: not loadable; Unimplemented: no engine supports
// the shape).
absl::StatusOr<std::string> ProbeCudnnAttention(int device, ElementType precision, int64_t heads, int64_t qk_dim,
                                                int64_t v_dim, int64_t longest);

// The number of CUDA devices, or FailedPrecondition "no CUDA device: <why>".
absl::StatusOr<int> CudaDeviceCount();

// One line for start-up logs: device name, compute capability, memory (free
// of total), driver and runtime versions.
absl::StatusOr<std::string> DescribeCudaDevice(int device);

// Free and total bytes of device `device` (cudaMemGetInfo), or
// FailedPrecondition naming the device and CUDA's error.
struct CudaMemory {
  int64_t free = 0;
  int64_t total = 0;
};
absl::StatusOr<CudaMemory> CudaMemoryInfo(int device);

// The device and stream of a CUDA backend, for a communicator that enqueues
// its copies and kernels on the rank's own stream (so they are ordered with
// the rank's ops, as kernels/communicator.h requires). InvalidArgument for a
// backend that is not one of MakeCudaBackend's.
struct CudaRank {
  int device = 0;
  CUstream_st* stream = nullptr;
};
absl::StatusOr<CudaRank> CudaRankOf(Backend& backend);

// How a CUDA backend copies captures to the host (see "Captures" above).
struct CudaCaptureOptions {
  bool overlap = true;                            // on a second stream, through the staging ring
  int64_t staging_bytes = kCaptureStagingBytes;  // the ring, allocated at the first overlapped copy
};

// The options the environment asks for: HSX_CUDA_CAPTURE_OVERLAP=0 turns the
// overlap off, 1 (or unset, or empty) leaves it on; any other value is
// InvalidArgument naming the variable. MakeCudaBackend applies them.
absl::StatusOr<CudaCaptureOptions> CudaCaptureOptionsFromEnv();

// Changes the capture options of a backend made by MakeCudaBackend, between
// batches (a new ring size first waits for the copies in flight and frees the
// old ring).
// InvalidArgument for another backend or staging_bytes < 1; the error of a
// copy that failed while it waited.
absl::Status SetCudaCaptureOptions(Backend& backend, const CudaCaptureOptions& options);

// Memory every weight placement leaves free for activations and scratch.
inline constexpr int64_t kCudaReservedBytes = int64_t{1} << 30;

}  // namespace hsx

#endif  // HSX_KERNELS_CUDA_CUDA_BACKEND_H_
