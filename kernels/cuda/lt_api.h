// lt_api.h: the cuBLASLt entry points the CUDA backend uses, loaded with
// dlopen at first use instead of linked.
//
// Why: libcublasLt.so carries about 92 KiB of static TLS. Linked into an
// executable, it is loaded at start-up and every thread's stack must hold that
// TLS, so libraries that start threads with small fixed stacks fail: civetweb
// (behind hsx-server's --metrics-listen) got EINVAL from pthread_create in
// every CUDA build, GPU or not. Loaded with dlopen, its TLS is allocated
// dynamically, and processes that never create a CUDA backend never load it.
#ifndef HSX_KERNELS_CUDA_LT_API_H_
#define HSX_KERNELS_CUDA_LT_API_H_

#include <cublasLt.h>

#include <string>

#include "absl/status/statusor.h"

namespace hsx::cuda {

#define HSX_LT_FUNCTIONS(X)                                                                               \
  X(cublasLtCreate) X(cublasLtDestroy) X(cublasLtMatrixLayoutCreate) X(cublasLtMatrixLayoutDestroy)        \
  X(cublasLtMatmulDescCreate) X(cublasLtMatmulDescDestroy) X(cublasLtMatmulDescSetAttribute)              \
  X(cublasLtMatmulPreferenceCreate) X(cublasLtMatmulPreferenceDestroy)                                     \
  X(cublasLtMatmulPreferenceSetAttribute) X(cublasLtMatmulAlgoGetHeuristic)                                \
  X(cublasLtMatmulAlgoConfigGetAttribute) X(cublasLtMatmulAlgoConfigSetAttribute) X(cublasLtMatmulAlgoCheck) \
  X(cublasLtMatmul)

struct LtApi {
#define HSX_LT_MEMBER(name) decltype(&::name) name = nullptr;
  HSX_LT_FUNCTIONS(HSX_LT_MEMBER)
#undef HSX_LT_MEMBER
};

// dlopen of a CUDA library by soname, from the loader's path or else the
// toolkit's library directory this was built with; the handle stays open for
// the process's life. FailedPrecondition naming `what`, the soname and
// dlopen's reasons.
absl::StatusOr<void*> OpenCudaLibrary(const std::string& soname, const char* what);

// The loaded API (loaded once; later calls return the same table), or
// FailedPrecondition naming the library and dlopen's reason.
absl::StatusOr<const LtApi*> LoadLtApi();

}  // namespace hsx::cuda

#endif  // HSX_KERNELS_CUDA_LT_API_H_
