// nccl_api.h: the NCCL entry points the CUDA communicator uses, loaded with
// dlopen at first use instead of linked (as lt_api.h does for cuBLASLt).
//
// Why: libnccl is hundreds of MB with its kernels and is not carried in the
// device check's bundle (60 MiB); the GPU machine has its own in the CUDA
// toolkit. Loaded with dlopen, binaries start without it, single-GPU runs
// never load it, and its absence is an error naming the library only when
// ranks on several GPUs need it.
#ifndef HSX_KERNELS_CUDA_NCCL_API_H_
#define HSX_KERNELS_CUDA_NCCL_API_H_

#include <nccl.h>

#include "absl/status/statusor.h"

namespace hsx::cuda {

#define HSX_NCCL_FUNCTIONS(X)                                                                       \
  X(ncclGetVersion) X(ncclGetErrorString) X(ncclCommInitAll) X(ncclCommDestroy) X(ncclCommAbort)   \
  X(ncclGroupStart) X(ncclGroupEnd) X(ncclSend) X(ncclRecv)

struct NcclApi {
#define HSX_NCCL_MEMBER(name) decltype(&::name) name = nullptr;
  HSX_NCCL_FUNCTIONS(HSX_NCCL_MEMBER)
#undef HSX_NCCL_MEMBER
};

// The loaded API (loaded once), or FailedPrecondition naming the library and
// dlopen's reason.
absl::StatusOr<const NcclApi*> LoadNcclApi();

}  // namespace hsx::cuda

#endif  // HSX_KERNELS_CUDA_NCCL_API_H_
