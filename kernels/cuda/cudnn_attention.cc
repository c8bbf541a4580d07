// cudnn_attention.cc: cuDNN SDPA through the frontend's graph API (see
// cudnn_attention.h). Compiled with NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING:
// every cuDNN call goes through cudnn_frontend::cudnn_dlhandle, set here.
#include "kernels/cuda/cudnn_attention.h"

#include "absl/strings/str_cat.h"

#ifndef HSX_HAVE_CUDNN_FRONTEND

namespace hsx::cuda {

std::string CudnnAttentionMissing() { return HSX_CUDNN_MISSING; }

absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(CUstream_st*) {
  return absl::FailedPreconditionError(absl::StrCat("cuDNN attention is not built in: ", HSX_CUDNN_MISSING));
}

}  // namespace hsx::cuda

#else  // HSX_HAVE_CUDNN_FRONTEND

#include <dlfcn.h>

#include <cstdlib>
#include <exception>
#include <map>
#include <tuple>
#include <unordered_map>
#include <utility>

#include <cudnn_frontend.h>

#include "kernels/cuda/lt_api.h"

namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;  // the frontend's dynamic-loading handle (cudnn_frontend_shim.h)
}  // namespace cudnn_frontend

namespace hsx::cuda {
namespace {

namespace fe = cudnn_frontend;

enum Uid : int64_t { kQ = 1, kK, kV, kO, kOffsetsQk, kOffsetsV, kLengths };

using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, float>;

Key KeyOf(const SdpaShape& s) { return {s.samples, s.longest, s.heads, s.qk_dim, s.v_dim, s.scale}; }

std::string ShapeText(const SdpaShape& s) {
  return absl::StrCat(s.samples, " samples up to ", s.longest, " tokens, ", s.heads, " heads, head dims ", s.qk_dim,
                      "/", s.v_dim);
}

absl::Status Fail(const char* step, const SdpaShape& shape, fe::error_t error) {
  return absl::UnimplementedError(
      absl::StrCat("cuDNN SDPA ", step, " for ", ShapeText(shape), ": ", error.get_message()));
}

// THD: dims [samples, heads, longest, d], token stride heads * d; the batch
// stride is never used (ragged offsets place each sample).
std::shared_ptr<fe::graph::Tensor_attributes> Thd(fe::graph::Graph& graph, const char* name, int64_t uid,
                                                  const SdpaShape& s, int64_t d,
                                                  std::shared_ptr<fe::graph::Tensor_attributes> offsets) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim({s.samples, s.heads, s.longest, d})
                          .set_stride({s.longest * s.heads * d, d, s.heads * d, 1})
                          .set_ragged_offset(offsets));
}

std::shared_ptr<fe::graph::Tensor_attributes> Int32(fe::graph::Graph& graph, const char* name, int64_t uid,
                                                    int64_t n) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim({n, 1, 1, 1})
                          .set_stride({1, 1, 1, 1})
                          .set_data_type(fe::DataType_t::INT32));
}

class Sdpa : public CudnnAttention {
 public:
  Sdpa(cudnnHandle_t handle, int64_t version) : handle_(handle), version_(version) {}
  ~Sdpa() override {
    graphs_.clear();
    fe::detail::destroy_handle(handle_);
  }

  std::string Describe() const override { return absl::StrCat("cuDNN ", version_, " (SDPA attention)"); }

  absl::StatusOr<int64_t> Prepare(const SdpaShape& shape) override {
    if (auto it = graphs_.find(KeyOf(shape)); it != graphs_.end()) return it->second.workspace;
    try {
      absl::StatusOr<Built> built = Build(shape);
      if (!built.ok()) return built.status();
      const int64_t workspace = built->workspace;
      graphs_.emplace(KeyOf(shape), *std::move(built));
      return workspace;
    } catch (const std::exception& e) {  // the frontend's loader throws (missing symbol, no libcudart)
      return absl::FailedPreconditionError(absl::StrCat("cuDNN SDPA for ", ShapeText(shape), ": ", e.what()));
    }
  }

  absl::Status Run(const SdpaShape& shape, const SdpaOperands& op, void* workspace) override {
    auto it = graphs_.find(KeyOf(shape));
    if (it == graphs_.end()) return absl::InternalError(absl::StrCat("cuDNN SDPA not prepared for ", ShapeText(shape)));
    std::unordered_map<int64_t, void*> pack = {
        {kQ, const_cast<void*>(op.q)},
        {kK, const_cast<void*>(op.k)},
        {kV, const_cast<void*>(op.v)},
        {kO, op.o},
        {kOffsetsQk, const_cast<int32_t*>(op.offsets_qk)},
        {kOffsetsV, const_cast<int32_t*>(op.offsets_v)},
        {kLengths, const_cast<int32_t*>(op.lengths)}};
    try {
      if (fe::error_t e = it->second.graph->execute(handle_, pack, workspace); e.is_bad()) {
        return absl::InternalError(absl::StrCat("cuDNN SDPA execute for ", ShapeText(shape), ": ", e.get_message()));
      }
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("cuDNN SDPA execute for ", ShapeText(shape), ": ", e.what()));
    }
    return absl::OkStatus();
  }

 private:
  struct Built {
    std::shared_ptr<fe::graph::Graph> graph;
    int64_t workspace = 0;
  };

  absl::StatusOr<Built> Build(const SdpaShape& s) {
    auto graph = std::make_shared<fe::graph::Graph>();
    graph->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    auto offsets_qk = Int32(*graph, "offsets_qk", kOffsetsQk, s.samples + 1);
    auto offsets_v = Int32(*graph, "offsets_v", kOffsetsV, s.samples + 1);
    auto lengths = Int32(*graph, "lengths", kLengths, s.samples);
    auto q = Thd(*graph, "Q", kQ, s, s.qk_dim, offsets_qk);
    auto k = Thd(*graph, "K", kK, s, s.qk_dim, offsets_qk);
    auto v = Thd(*graph, "V", kV, s, s.v_dim, offsets_v);
    auto options = fe::graph::SDPA_attributes()
                       .set_name("hsx_attention")
                       .set_generate_stats(false)
                       .set_causal_mask(true)  // top-left: query i sees keys 0..i of its sample
                       .set_attn_scale(s.scale)
                       .set_padding_mask(true)
                       .set_seq_len_q(lengths)
                       .set_seq_len_kv(lengths);
    auto [o, stats] = graph->sdpa(q, k, v, options);
    (void)stats;
    o->set_output(true)
        .set_uid(kO)
        .set_dim({s.samples, s.heads, s.longest, s.v_dim})
        .set_stride({s.longest * s.heads * s.v_dim, s.v_dim, s.heads * s.v_dim, 1})
        .set_ragged_offset(offsets_v);
    if (fe::error_t e = graph->validate(); e.is_bad()) return Fail("validate", s, e);
    if (fe::error_t e = graph->build_operation_graph(handle_); e.is_bad()) return Fail("build_operation_graph", s, e);
    if (fe::error_t e = graph->create_execution_plans({fe::HeurMode_t::A}); e.is_bad()) {
      return Fail("create_execution_plans", s, e);
    }
    if (fe::error_t e = graph->check_support(handle_); e.is_bad()) return Fail("check_support", s, e);
    if (fe::error_t e = graph->build_plans(); e.is_bad()) return Fail("build_plans", s, e);
    Built built{graph, 0};
    if (fe::error_t e = graph->get_workspace_size(built.workspace); e.is_bad()) {
      return Fail("get_workspace_size", s, e);
    }
    return built;
  }

  cudnnHandle_t handle_;
  int64_t version_;
  std::map<Key, Built> graphs_;
};

// The frontend loads the shared CUDA runtime for its own calls, trying
// libcudart.so.12 and .so.13 and taking the first found; name the one this
// build's headers match (or this toolkit's copy where the loader cannot find
// it), unless the user already did.
void PointFrontendAtCudart() {
  const std::string name = absl::StrCat("libcudart.so.", CUDART_VERSION / 1000);
  std::string choice = name;
  if (void* found = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL); found == nullptr) {
#ifdef HSX_CUDA_LIBRARY_DIR
    choice = absl::StrCat(HSX_CUDA_LIBRARY_DIR, "/", name);
#endif
  }
  setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", choice.c_str(), 0);
}

}  // namespace

std::string CudnnAttentionMissing() { return ""; }

absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(CUstream_st* stream) {
  // Loaded once per process (thread-safe static: TP ranks create their
  // backends on their own threads); the handle stays open.
  static const absl::Status* const loaded = [] {
    absl::StatusOr<void*> library = OpenCudaLibrary(absl::StrCat("libcudnn.so.", CUDNN_MAJOR), "cuDNN");
    if (!library.ok()) return new absl::Status(library.status());
    fe::cudnn_dlhandle = *library;
    PointFrontendAtCudart();
    return new absl::Status();
  }();
  if (!loaded->ok()) return *loaded;
  try {
    const int64_t version = static_cast<int64_t>(fe::detail::get_backend_version());
    if (version / 10000 != CUDNN_MAJOR) {
      return absl::FailedPreconditionError(
          absl::StrCat("cuDNN ", version, " loaded, but this build expects major version ", CUDNN_MAJOR));
    }
    cudnnHandle_t handle = nullptr;
    if (cudnnStatus_t s = fe::detail::create_handle(&handle); s != CUDNN_STATUS_SUCCESS) {
      return absl::FailedPreconditionError(absl::StrCat("cudnnCreate: ", fe::detail::get_error_string(s)));
    }
    if (cudnnStatus_t s = fe::detail::set_stream(handle, stream); s != CUDNN_STATUS_SUCCESS) {
      fe::detail::destroy_handle(handle);
      return absl::FailedPreconditionError(absl::StrCat("cudnnSetStream: ", fe::detail::get_error_string(s)));
    }
    return std::unique_ptr<CudnnAttention>(new Sdpa(handle, version));
  } catch (const std::exception& e) {
    return absl::FailedPreconditionError(absl::StrCat("cuDNN: ", e.what()));
  }
}

}  // namespace hsx::cuda

#endif  // HSX_HAVE_CUDNN_FRONTEND
