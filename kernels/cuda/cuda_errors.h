// cuda_errors.h: which CUDA failures lose the device (kernels/device_lost.h)
// and which fail only the batch.
//
// A sticky error poisons the process's context on that device: the CUDA
// documentation says of each that "any further CUDA work will return the same
// error. To continue using CUDA, the process must be terminated and
// relaunched". Those are an illegal or misaligned address, an illegal
// instruction, a launch failure or timeout, a device-side assert, a hardware
// stack error, an uncorrectable ECC or NVLink error, a contained error, and
// a few more (the list is in cuda_errors.cc, with the reason for the ones
// added beyond the documented set: the device gone or unavailable, an unknown
// driver error). Everything else (out of memory, an invalid argument, a
// launch out of resources) fails the call and leaves the device usable.
//
// Failures that carry no cudaError_t (a cuBLASLt or cuDNN status, an NCCL
// result) may hide a sticky error underneath: ClassifyOnDevice asks the
// device itself, with one cudaStreamQuery on the rank's stream, which returns
// the sticky error once the context is poisoned.
#ifndef HSX_KERNELS_CUDA_CUDA_ERRORS_H_
#define HSX_KERNELS_CUDA_CUDA_ERRORS_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"

namespace hsx::cuda {

// Whether `error` leaves the device's context unusable.
bool IsStickyError(cudaError_t error);

// `status` (made from `error`) marked as a lost "cuda:<device>" when `error`
// is sticky; unchanged otherwise.
absl::Status ClassifyCudaError(absl::Status status, cudaError_t error, int device);

// `status` (a failure of anything on `device`) marked as lost when the
// device's context is poisoned, as a query of `stream` tells; the sticky
// error is then named in the message. Already-marked and OK statuses are
// returned unchanged. Call on error paths only (it is one driver call).
absl::Status ClassifyOnDevice(absl::Status status, int device, cudaStream_t stream);

}  // namespace hsx::cuda

#endif  // HSX_KERNELS_CUDA_CUDA_ERRORS_H_
