// cuda_errors.cc: the sticky CUDA errors and the device-lost mark.
#include "kernels/cuda/cuda_errors.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/device_lost.h"

namespace hsx::cuda {

bool IsStickyError(cudaError_t error) {
  switch (error) {
    // Documented as sticky in driver_types.h ("the process must be terminated
    // and relaunched"), CUDA 13.0.
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorContained:
    case cudaErrorMpsClientTerminated:
    case cudaErrorExternalDevice:
    // Hardware faults: the data on the device can no longer be trusted.
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    // The device is gone, or the process may no longer use it ("fallen off
    // the bus", a reset, exclusive mode taken by another process): nothing
    // this process does will bring it back.
    case cudaErrorDevicesUnavailable:
    case cudaErrorNoDevice:
    case cudaErrorContextIsDestroyed:
    case cudaErrorDeviceUninitialized:
    // An error the driver cannot name: assume the worst. A restart costs one
    // replica's warm-up; computing on a device in an unknown state could
    // deliver wrong hidden states.
    case cudaErrorUnknown:
      return true;
    default:
      return false;
  }
}

absl::Status ClassifyCudaError(absl::Status status, cudaError_t error, int device) {
  if (status.ok() || !IsStickyError(error)) return status;
  return MarkDeviceLost(std::move(status), absl::StrCat("cuda:", device));
}

absl::Status ClassifyOnDevice(absl::Status status, int device, cudaStream_t stream) {
  if (status.ok() || IsDeviceLost(status)) return status;
  const cudaError_t probe = cudaStreamQuery(stream);
  if (!IsStickyError(probe)) {
    if (probe != cudaSuccess && probe != cudaErrorNotReady) cudaGetLastError();  // not sticky: clear it
    return status;
  }
  absl::Status lost(status.code(), absl::StrCat(status.message(), " (the device reports ", cudaGetErrorName(probe),
                                                ": ", cudaGetErrorString(probe), ")"));
  return MarkDeviceLost(std::move(lost), absl::StrCat("cuda:", device));
}

}  // namespace hsx::cuda
