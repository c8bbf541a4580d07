// lt_api.cc: dlopen of libcublasLt (see lt_api.h).
#include "kernels/cuda/lt_api.h"

#include <dlfcn.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace hsx::cuda {

absl::StatusOr<void*> OpenCudaLibrary(const std::string& soname, const char* what) {
  // The loader's path first, then the toolkit's own library directory
  // (HSX_CUDA_LIBRARY_DIR, from CMake) for machines without it on the path.
  void* library = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::string why = library == nullptr ? dlerror() : "";
#ifdef HSX_CUDA_LIBRARY_DIR
  if (library == nullptr) {
    library = dlopen(absl::StrCat(HSX_CUDA_LIBRARY_DIR, "/", soname).c_str(), RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) absl::StrAppend(&why, "; ", dlerror());
  }
#endif
  if (library == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("cannot load ", what, " (", soname, "): ", why));
  }
  return library;
}

namespace {

absl::StatusOr<LtApi> Load() {
  const std::string name = absl::StrCat("libcublasLt.so.", CUBLAS_VER_MAJOR);
  absl::StatusOr<void*> library = OpenCudaLibrary(name, "cuBLASLt");
  if (!library.ok()) return library.status();
  LtApi api;
  const char* missing = nullptr;
#define HSX_LT_LOAD(function)                                                          \
  api.function = reinterpret_cast<decltype(api.function)>(dlsym(*library, #function)); \
  if (api.function == nullptr && missing == nullptr) missing = #function;
  HSX_LT_FUNCTIONS(HSX_LT_LOAD)
#undef HSX_LT_LOAD
  if (missing != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(name, " has no ", missing));
  }
  return api;  // the library stays loaded for the process's lifetime
}

}  // namespace

absl::StatusOr<const LtApi*> LoadLtApi() {
  static const absl::StatusOr<LtApi>* const api = new absl::StatusOr<LtApi>(Load());
  if (!api->ok()) return api->status();
  return &**api;
}

}  // namespace hsx::cuda
