// cuda_errors_test.cc: which CUDA failures lose the device
// (kernels/cuda/cuda_errors.h). The table needs no device and runs wherever
// the CUDA tests build; a real sticky error (an op reading an unmapped device
// address) runs on a GPU, in a child process: a poisoned context would fail
// every later test of this binary.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_errors.h"
#include "kernels/device_lost.h"
#include "tests/cuda/cuda_test_util.h"

namespace hsx {
namespace {

TEST(CudaErrors, StickyErrorsLoseTheDeviceOthersFailOnlyTheCall) {
  for (const cudaError_t error :
       {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorLaunchTimeout, cudaErrorAssert,
        cudaErrorMisalignedAddress, cudaErrorIllegalInstruction, cudaErrorHardwareStackError,
        cudaErrorECCUncorrectable, cudaErrorNvlinkUncorrectable, cudaErrorContained, cudaErrorDevicesUnavailable,
        cudaErrorNoDevice, cudaErrorUnknown}) {
    SCOPED_TRACE(cudaGetErrorName(error));
    EXPECT_TRUE(cuda::IsStickyError(error));
    const absl::Status status = cuda::ClassifyCudaError(absl::InternalError("cuda:3 Add: failed"), error, 3);
    EXPECT_TRUE(IsDeviceLost(status));
    EXPECT_EQ(LostDevice(status), "cuda:3");
    EXPECT_EQ(status.code(), absl::StatusCode::kInternal);  // code and message stay the backend's
    EXPECT_EQ(status.message(), "cuda:3 Add: failed");
  }
  for (const cudaError_t error : {cudaSuccess, cudaErrorMemoryAllocation, cudaErrorInvalidValue,
                                  cudaErrorLaunchOutOfResources, cudaErrorNotReady, cudaErrorInvalidDevicePointer,
                                  cudaErrorInvalidConfiguration}) {
    SCOPED_TRACE(cudaGetErrorName(error));
    EXPECT_FALSE(cuda::IsStickyError(error));
    const absl::Status status = cuda::ClassifyCudaError(absl::ResourceExhaustedError("out of memory"), error, 0);
    EXPECT_FALSE(IsDeviceLost(status));
    EXPECT_EQ(LostDevice(status), "");
  }
  EXPECT_TRUE(cuda::ClassifyCudaError(absl::OkStatus(), cudaErrorIllegalAddress, 0).ok());
}

TEST(CudaErrorsDeathTest, AnIllegalAddressInAnOpLosesTheDevice) {
  if (const std::string why = testing::NoCudaDeviceReason(); !why.empty()) GTEST_SKIP() << why;
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // a fresh process, whose context the fault poisons
  EXPECT_EXIT(
      {
        absl::StatusOr<std::unique_ptr<Backend>> backend = MakeCudaBackend(0, ElementType::kF32);
        if (!backend.ok()) {
          std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
          std::_Exit(2);
        }
        absl::StatusOr<std::unique_ptr<Buffer>> buffer = (*backend)->Allocate(4, 256, ElementType::kF32);
        if (!buffer.ok()) std::_Exit(3);
        const Matrix good = (*buffer)->matrix();
        Matrix unmapped = good;
        unmapped.data = reinterpret_cast<void*>(uintptr_t{1} << 12);  // aligned, never mapped
        (*backend)->Add(good, unmapped, good);
        const absl::Status status = (*backend)->Synchronize();
        std::fprintf(stderr, "%s\n", status.ToString().c_str());
        // The next batch would fail the same way: the context is poisoned.
        const absl::Status again = (*backend)->Synchronize();
        std::fprintf(stderr, "next: %s\n", again.ToString().c_str());
        std::_Exit(IsDeviceLost(status) && LostDevice(status) == "cuda:0" ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "cudaError(IllegalAddress|LaunchFailure)");
}

}  // namespace
}  // namespace hsx
