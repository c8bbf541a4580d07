// nccl_api.cc: dlopen of libnccl (see nccl_api.h).
#include "kernels/cuda/nccl_api.h"

#include <dlfcn.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/lt_api.h"

namespace hsx::cuda {
namespace {

absl::StatusOr<NcclApi> Load() {
  absl::StatusOr<void*> library = OpenCudaLibrary(absl::StrCat("libnccl.so.", NCCL_MAJOR), "NCCL");
  if (!library.ok()) return library.status();
  NcclApi api;
  const char* missing = nullptr;
#define HSX_NCCL_LOAD(function)                                                        \
  api.function = reinterpret_cast<decltype(api.function)>(dlsym(*library, #function)); \
  if (api.function == nullptr && missing == nullptr) missing = #function;
  HSX_NCCL_FUNCTIONS(HSX_NCCL_LOAD)
#undef HSX_NCCL_LOAD
  if (missing != nullptr) return absl::FailedPreconditionError(absl::StrCat("NCCL has no ", missing));
  return api;  // the library stays loaded for the process's lifetime
}

}  // namespace

absl::StatusOr<const NcclApi*> LoadNcclApi() {
  static const absl::StatusOr<NcclApi>* const api = new absl::StatusOr<NcclApi>(Load());
  if (!api->ok()) return api->status();
  return &**api;
}

}  // namespace hsx::cuda
