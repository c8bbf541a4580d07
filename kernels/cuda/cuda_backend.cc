// cuda_backend.cc: the CudaBackend's op dispatch: checks each op's sizes
// (the same checks, and messages, as the CPU backend) and enqueues its kernel
// (ops.h), cuBLASLt GEMM (gemm.h) or cuDNN graph on the compute stream; and
// the per-batch handles (the staged batch, the rope table). Memory and errors
// are cuda_device.cc's, captures capture_staging.cc's, routing and experts
// moe_experts.cc's. See cuda_backend.h for the guarantees.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_backend_internal.h"
#include "kernels/cuda/cudnn_attention.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/ops.h"
#include "kernels/op_checks.h"

namespace hsx {

using cuda::GemmMatrix;

class CudaStagedBatch : public StagedBatch {
 public:
  ~CudaStagedBatch() override { FreeAsync(block, stream); }
  int64_t tokens() const override { return num_tokens; }
  int64_t num_samples() const override { return static_cast<int64_t>(cu_host.size()) - 1; }
  int64_t longest() const override { return longest_length; }

  cudaStream_t stream = nullptr;
  void* block = nullptr;  // one allocation holding the arrays below
  const int32_t* token_ids = nullptr;
  const int32_t* positions = nullptr;
  const int64_t* cu_seqlens = nullptr;
  const cuda::AttentionTile* tiles = nullptr;
  int64_t num_tiles = 0;
  int64_t num_tokens = 0;
  int64_t longest_length = 0;
  std::vector<int64_t> cu_host;
};

class CudaRopeTable : public RopeTable {
 public:
  ~CudaRopeTable() override { FreeAsync(cos, stream); }
  int64_t positions() const override { return num_positions; }
  int64_t half_dim() const override { return half; }

  cudaStream_t stream = nullptr;
  float* cos = nullptr;  // [positions, half], then sin in the same block
  float* sin = nullptr;
  int64_t num_positions = 0;
  int64_t half = 0;
};

// ---- Per batch -------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<StagedBatch>> CudaBackend::Stage(std::span<const int32_t> tokens,
                                                                std::span<const int64_t> cu_seqlens) {
  if (cu_seqlens.size() < 2 || cu_seqlens.front() != 0 ||
      cu_seqlens.back() != static_cast<int64_t>(tokens.size())) {
    return absl::InvalidArgumentError(absl::StrCat(name(), " Stage: cu_seqlens must run from 0 to the token count"));
  }
  auto batch = std::make_unique<CudaStagedBatch>();
  batch->stream = stream_;
  batch->num_tokens = static_cast<int64_t>(tokens.size());
  batch->cu_host.assign(cu_seqlens.begin(), cu_seqlens.end());
  std::vector<int32_t> positions(tokens.size());
  std::vector<cuda::AttentionTile> tiles;
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    const int64_t length = cu_seqlens[s + 1] - cu_seqlens[s];
    if (length <= 0) return absl::InvalidArgumentError(absl::StrCat(name(), " Stage: sample ", s, " is empty"));
    if (length > INT32_MAX) return absl::InvalidArgumentError(absl::StrCat(name(), " Stage: sample ", s, " too long"));
    batch->longest_length = std::max(batch->longest_length, length);
    for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) positions[t] = static_cast<int32_t>(t - cu_seqlens[s]);
    for (int64_t q0 = 0; q0 < length; q0 += cuda::kAttentionQueryTile) {
      tiles.push_back({static_cast<int32_t>(s), static_cast<int32_t>(q0)});
    }
  }
  batch->num_tiles = static_cast<int64_t>(tiles.size());
  // One block: cu_seqlens (int64) first for alignment, then tiles, tokens, positions.
  const size_t cu_bytes = cu_seqlens.size() * sizeof(int64_t);
  const size_t tile_bytes = tiles.size() * sizeof(cuda::AttentionTile);
  const size_t token_bytes = tokens.size() * sizeof(int32_t);
  std::vector<char> host(cu_bytes + tile_bytes + 2 * token_bytes);
  std::memcpy(host.data(), cu_seqlens.data(), cu_bytes);
  std::memcpy(host.data() + cu_bytes, tiles.data(), tile_bytes);
  std::memcpy(host.data() + cu_bytes + tile_bytes, tokens.data(), token_bytes);
  std::memcpy(host.data() + cu_bytes + tile_bytes + token_bytes, positions.data(), token_bytes);
  absl::StatusOr<Scratch> block = Take(host.size(), "Stage");
  if (!block.ok()) return block.status();
  if (cudaError_t s = cudaMemcpyAsync(block->get(), host.data(), host.size(), cudaMemcpyHostToDevice, stream_);
      s != cudaSuccess) {
    return CudaError(s, "Stage", absl::StrCat(tokens.size(), " tokens"));
  }
  char* base = static_cast<char*>(block->get());
  batch->cu_seqlens = reinterpret_cast<const int64_t*>(base);
  batch->tiles = reinterpret_cast<const cuda::AttentionTile*>(base + cu_bytes);
  batch->token_ids = reinterpret_cast<const int32_t*>(base + cu_bytes + tile_bytes);
  batch->positions = reinterpret_cast<const int32_t*>(base + cu_bytes + tile_bytes + token_bytes);
  batch->block = block->release();  // now owned by the batch
  return batch;
}

absl::StatusOr<std::unique_ptr<RopeTable>> CudaBackend::PlaceRopeTable(std::span<const float> cos,
                                                                      std::span<const float> sin, int64_t half_dim) {
  if (half_dim <= 0 || cos.size() != sin.size() || cos.size() % half_dim != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name(), " PlaceRopeTable: cos and sin must be [positions, half_dim]"));
  }
  absl::StatusOr<Scratch> block = Take(2 * cos.size() * sizeof(float), "PlaceRopeTable");
  if (!block.ok()) return block.status();
  auto table = std::make_unique<CudaRopeTable>();
  table->stream = stream_;
  table->cos = static_cast<float*>(block->release());  // now owned by the table
  table->sin = table->cos + cos.size();
  table->half = half_dim;
  table->num_positions = static_cast<int64_t>(cos.size()) / half_dim;
  if (cudaError_t s = cudaMemcpyAsync(table->cos, cos.data(), cos.size_bytes(), cudaMemcpyHostToDevice, stream_);
      s != cudaSuccess) {
    return CudaError(s, "PlaceRopeTable", "cos");
  }
  if (cudaError_t s = cudaMemcpyAsync(table->sin, sin.data(), sin.size_bytes(), cudaMemcpyHostToDevice, stream_);
      s != cudaSuccess) {
    return CudaError(s, "PlaceRopeTable", "sin");
  }
  return table;
}

// ---- GEMM plumbing ---------------------------------------------------------------------

absl::StatusOr<Matrix> CudaBackend::AlignedCopy(const Matrix& m, bool load, Scratch& storage, const char* op) {
  const int64_t per_16 = 16 / static_cast<int64_t>(ElementSize(m.type));
  Matrix copy{nullptr, m.type, m.rows, m.cols, RoundUp(std::max<int64_t>(m.cols, 1), per_16)};
  absl::StatusOr<Scratch> block = Take(static_cast<size_t>(copy.rows * copy.ld) * ElementSize(m.type), op);
  if (!block.ok()) return block.status();
  storage = *std::move(block);
  copy.data = storage.get();
  if (load && !Cuda(cuda::LaunchConvert(Dev(m), Dev(copy), stream_), op, "aligned copy")) {
    return absl::InternalError("launch failed");  // already recorded
  }
  return copy;
}

void CudaBackend::Gemm(const Matrix& x, const uint16_t* w, int64_t n, int64_t k, int64_t ldw, const Matrix& y,
                       const char* op) {
  if (x.rows == 0 || n == 0) return;
  auto gemm_view = [](const Matrix& m) {
    return GemmMatrix{m.data, m.type == ElementType::kBf16, m.rows, m.cols, m.ld};
  };
  Scratch x_storage, y_storage, w_storage;
  Matrix xa = x;
  if (!cuda::LtGemm::Aligned(gemm_view(x))) {
    absl::StatusOr<Matrix> copy = AlignedCopy(x, true, x_storage, op);
    if (!copy.ok()) return Record(copy.status());
    xa = *copy;
  }
  // The weight: bf16 [n, k] with stride ldw, widened to f32 for f32 activations.
  Matrix weight{const_cast<uint16_t*>(w), ElementType::kBf16, n, k, ldw};
  if (x.type == ElementType::kF32 || !cuda::LtGemm::Aligned(gemm_view(weight))) {
    const ElementType type = x.type == ElementType::kF32 ? ElementType::kF32 : ElementType::kBf16;
    Matrix wide{nullptr, type, n, k, RoundUp(k, 16 / static_cast<int64_t>(ElementSize(type)))};
    absl::StatusOr<Scratch> block = Take(static_cast<size_t>(n * wide.ld) * ElementSize(type), op);
    if (!block.ok()) return Record(block.status());
    w_storage = *std::move(block);
    wide.data = w_storage.get();
    if (!Cuda(cuda::LaunchConvert(Dev(weight), Dev(wide), stream_), op, "weight copy")) return;
    weight = wide;
  }
  Matrix ya = y;
  const bool y_copy = !cuda::LtGemm::Aligned(gemm_view(y));
  if (y_copy) {
    absl::StatusOr<Matrix> copy = AlignedCopy(y, false, y_storage, op);
    if (!copy.ok()) return Record(copy.status());
    ya = *copy;
  }
  if (absl::Status s = gemm_->Multiply(gemm_view(xa), gemm_view(weight), gemm_view(ya), op); !s.ok()) {
    return Record(absl::Status(s.code(), absl::StrCat(name(), " ", s.message())));
  }
  if (y_copy) Cuda(cuda::LaunchConvert(Dev(ya), Dev(y), stream_), op, "result copy");
}

// ---- Ops ----------------------------------------------------------------------------------

void CudaBackend::Embed(const StagedBatch& staged, const uint16_t* table, int64_t vocab_begin, int64_t vocab_rows,
                        const Matrix& out) {
  const auto& batch = static_cast<const CudaStagedBatch&>(staged);
  if (!Check(CheckEmbed(out, batch.tokens()))) return;
  Cuda(cuda::LaunchEmbed(batch.token_ids, table, vocab_begin, vocab_rows, Dev(out), stream_), "Embed", ShapeOf(out));
}

void CudaBackend::Linear(const Matrix& x, const LinearWeight& w, const Matrix& y, bool partial) {
  if (!Check(CheckLinear(x, w, y, partial, precision()))) return;
  // Dense weights only (routed INT4 experts go through PlaceExperts).
  if (!Check(w.kind == LinearWeight::Kind::kBf16, "Linear", "an INT4 weight outside an expert table")) return;
  Gemm(x, w.bf16, w.out, w.in, w.ld, y, "Linear");
}

void CudaBackend::Round(const Matrix& partial, const Matrix& out) {
  if (!Check(CheckRound(partial, out, precision()))) return;
  if (out.data == partial.data && out.ld == partial.ld) return;  // f32 in place: nothing rounds
  Cuda(cuda::LaunchConvert(Dev(partial), Dev(out), stream_), "Round", ShapeOf(out));
}

void CudaBackend::RmsNorm(const Matrix& x, const uint16_t* weight, float eps, const Matrix& y) {
  if (!Check(CheckRmsNorm(x, y, precision()))) return;
  Cuda(cuda::LaunchRmsNorm(Dev(x), weight, eps, bf16(), Dev(y), stream_), "RmsNorm", ShapeOf(x));
}

void CudaBackend::Add(const Matrix& a, const Matrix& b, const Matrix& out) {
  if (!Check(CheckAdd(a, b, out))) return;
  Cuda(cuda::LaunchAdd(Dev(a), Dev(b), bf16(), Dev(out), stream_), "Add", ShapeOf(out));
}

void CudaBackend::SiluMul(const Matrix& gate, const Matrix& up, const Matrix& out) {
  if (!Check(CheckSiluMul(gate, up, out))) return;
  Cuda(cuda::LaunchSiluMul(Dev(gate), Dev(up), bf16(), Dev(out), stream_), "SiluMul", ShapeOf(out));
}

void CudaBackend::Rope(const Matrix& x, int64_t heads, int64_t stride, int64_t offset, const StagedBatch& staged,
                       const RopeTable& rope) {
  const auto& batch = static_cast<const CudaStagedBatch&>(staged);
  const auto& table = static_cast<const CudaRopeTable&>(rope);
  const int64_t half = table.half;
  if (!Check(CheckRope(x, heads, stride, offset, half, batch, table))) return;
  if (!Check(heads <= 65535 && half <= 1024, "Rope",
             absl::StrCat(heads, " heads of half dim ", half, " (the kernel takes up to 65535 and 1024)"))) {
    return;
  }
  Cuda(cuda::LaunchRope(Dev(x), heads, stride, offset, half, batch.positions, table.cos, table.sin, bf16(), stream_),
       "Rope", ShapeOf(x));
}

void CudaBackend::Attention(const Matrix& q, const Matrix& kv, const Matrix& k_rope, int64_t heads, int64_t nope_dim,
                            int64_t rope_dim, int64_t v_dim, const StagedBatch& staged, float scale,
                            const Matrix& out) {
  const auto& batch = static_cast<const CudaStagedBatch&>(staged);
  const int64_t qk_dim = nope_dim + rope_dim;
  const std::string what = absl::StrCat("q ", ShapeOf(q), ", kv ", ShapeOf(kv), ", k_rope ", ShapeOf(k_rope), ", out ",
                                        ShapeOf(out), ", ", heads, " heads");
  if (!Check(CheckAttention(q, kv, k_rope, heads, nope_dim, rope_dim, v_dim, batch, out))) return;
  if (cudnn_ != nullptr) return CudnnSdpa(q, kv, k_rope, heads, nope_dim, rope_dim, v_dim, batch, scale, out);
  Cuda(cuda::LaunchAttention(Dev(q), Dev(kv), Dev(k_rope), heads, nope_dim, rope_dim, v_dim, batch.cu_seqlens,
                             batch.tiles, batch.num_tiles, scale, bf16(), Dev(out), stream_),
       "Attention", absl::StrCat(what, " (head dims ", qk_dim, "/", v_dim, ")"));
}

namespace {

// The graph cache's buckets: the next power of two (at least `floor`), so a
// server builds a few graphs rather than one per batch.
int64_t Bucket(int64_t n, int64_t floor) {
  int64_t b = floor;
  while (b < n) b *= 2;
  return b;
}

constexpr size_t kAlign = 256;
size_t Aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

}  // namespace

void CudaBackend::CudnnSdpa(const Matrix& q, const Matrix& kv, const Matrix& k_rope, int64_t heads, int64_t nope_dim,
                            int64_t rope_dim, int64_t v_dim, const CudaStagedBatch& batch, float scale,
                            const Matrix& out) {
  const int64_t qk_dim = nope_dim + rope_dim;
  const int64_t tokens = q.rows;
  const std::string what = absl::StrCat(tokens, " tokens, ", heads, " heads, head dims ", qk_dim, "/", v_dim);
  // Both offset arrays are int32 (offsets_v counts v_dim elements per head).
  if (!Check(tokens * heads * std::max(qk_dim, v_dim) <= INT32_MAX, "Attention (cuDNN)",
             absl::StrCat(what, ": the ragged offsets exceed int32; use --attention=reference"))) {
    return;
  }
  const cuda::SdpaShape shape{Bucket(batch.num_samples(), 1), Bucket(batch.longest(), 64), heads, qk_dim, v_dim, scale};
  absl::StatusOr<int64_t> workspace = cudnn_->Prepare(shape);
  if (!workspace.ok()) return Record(absl::Status(workspace.status().code(), absl::StrCat(name(), " Attention: ", workspace.status().message())));
  const size_t qk_bytes = Aligned(static_cast<size_t>(tokens * heads * qk_dim) * 2);
  const size_t v_bytes = Aligned(static_cast<size_t>(tokens * heads * v_dim) * 2);
  const size_t index_bytes = Aligned(static_cast<size_t>(shape.samples + 1) * 4);
  absl::StatusOr<Scratch> scratch =
      Take(2 * qk_bytes + 2 * v_bytes + 3 * index_bytes + static_cast<size_t>(*workspace), "Attention (cuDNN)");
  if (!scratch.ok()) return Record(scratch.status());
  char* p = static_cast<char*>(scratch->get());
  auto* q_packed = reinterpret_cast<uint16_t*>(p);
  auto* k_packed = reinterpret_cast<uint16_t*>(p + qk_bytes);
  auto* v_packed = reinterpret_cast<uint16_t*>(p + 2 * qk_bytes);
  auto* o_packed = reinterpret_cast<uint16_t*>(p + 2 * qk_bytes + v_bytes);
  char* index = p + 2 * qk_bytes + 2 * v_bytes;
  auto* offsets_qk = reinterpret_cast<int32_t*>(index);
  auto* offsets_v = reinterpret_cast<int32_t*>(index + index_bytes);
  auto* lengths = reinterpret_cast<int32_t*>(index + 2 * index_bytes);
  void* work = *workspace > 0 ? index + 3 * index_bytes : nullptr;
  if (!Cuda(cuda::LaunchPackSdpa(Dev(q), Dev(kv), Dev(k_rope), heads, nope_dim, rope_dim, v_dim, batch.cu_seqlens,
                                 batch.num_samples(), shape.samples, q_packed, k_packed, v_packed, offsets_qk,
                                 offsets_v, lengths, stream_),
            "Attention (cuDNN pack)", what)) {
    return;
  }
  const cuda::SdpaOperands operands{q_packed, k_packed, v_packed, o_packed, offsets_qk, offsets_v, lengths};
  if (absl::Status s = cudnn_->Run(shape, operands, work); !s.ok()) {
    return Record(absl::Status(s.code(), absl::StrCat(name(), " Attention: ", s.message())));
  }
  Cuda(cuda::LaunchUnpackRows(o_packed, Dev(out), stream_), "Attention (cuDNN unpack)", what);
}

absl::StatusOr<std::string> ProbeCudnnAttention(int device, ElementType precision, int64_t heads, int64_t qk_dim,
                                                int64_t v_dim, int64_t longest) {
  if (precision != ElementType::kBf16) {
    return absl::FailedPreconditionError("--attention=cudnn needs bf16 activations (cuDNN's SDPA is bf16 in and out)");
  }
  if (cudaError_t s = cudaSetDevice(device); s != cudaSuccess) {
    return absl::FailedPreconditionError(absl::StrCat("CUDA device ", device, ": ", cudaGetErrorString(s)));
  }
  absl::StatusOr<std::unique_ptr<cuda::CudnnAttention>> cudnn = cuda::CudnnAttention::Create(nullptr);
  if (!cudnn.ok()) return cudnn.status();
  const cuda::SdpaShape shape{1, Bucket(longest, 64), heads, qk_dim, v_dim, 1.0f / std::sqrt(static_cast<float>(qk_dim))};
  if (absl::StatusOr<int64_t> workspace = (*cudnn)->Prepare(shape); !workspace.ok()) return workspace.status();
  return (*cudnn)->Describe();
}


}  // namespace hsx
