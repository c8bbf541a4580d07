// cuda_test_util.h: what the CUDA tests share: why there is no device here.
#ifndef HSX_TESTS_CUDA_CUDA_TEST_UTIL_H_
#define HSX_TESTS_CUDA_CUDA_TEST_UTIL_H_

#include <string>

#include "kernels/cuda/cuda_backend.h"

namespace hsx::testing {

// Empty when a CUDA device is usable, else "no CUDA device: <CUDA's reason>".
inline std::string NoCudaDeviceReason() {
  absl::StatusOr<int> count = CudaDeviceCount();
  return count.ok() ? std::string() : std::string(count.status().message());
}

}  // namespace hsx::testing

#define HSX_SKIP_WITHOUT_CUDA()                                                       \
  do {                                                                              \
    if (const std::string hsx_why = ::hsx::testing::NoCudaDeviceReason(); !hsx_why.empty()) \
      GTEST_SKIP() << hsx_why;                                                      \
  } while (0)

#endif  // HSX_TESTS_CUDA_CUDA_TEST_UTIL_H_
