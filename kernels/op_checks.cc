// op_checks.cc: one rule per op; the message only when it fails.
#include "kernels/op_checks.h"

#include "absl/strings/str_cat.h"

namespace hsx {
namespace {

absl::Status Fail(const char* op, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", what));
}

}  // namespace

std::string ShapeOf(const Matrix& m) { return absl::StrCat("[", m.rows, ", ", m.cols, "] ", ElementTypeName(m.type)); }

absl::Status CheckEmbed(const Matrix& out, int64_t tokens) {
  if (out.rows == tokens) return absl::OkStatus();
  return Fail("Embed", absl::StrCat("out ", ShapeOf(out), " for ", tokens, " tokens"));
}

absl::Status CheckLinear(const Matrix& x, const LinearWeight& w, const Matrix& y, bool partial,
                         ElementType activation) {
  const ElementType want = partial ? ElementType::kF32 : activation;
  if (x.cols == w.in && y.cols == w.out && x.rows == y.rows && x.type == activation && y.type == want) {
    return absl::OkStatus();
  }
  return Fail("Linear", absl::StrCat("x ", ShapeOf(x), ", W [", w.out, ", ", w.in, "], y ", ShapeOf(y),
                                     partial ? " (partial: f32)" : ""));
}

absl::Status CheckRound(const Matrix& partial, const Matrix& out, ElementType activation) {
  if (partial.type == ElementType::kF32 && out.type == activation && partial.rows == out.rows &&
      partial.cols == out.cols) {
    return absl::OkStatus();
  }
  return Fail("Round", absl::StrCat("partial ", ShapeOf(partial), " into ", ShapeOf(out)));
}

absl::Status CheckRmsNorm(const Matrix& x, const Matrix& y, ElementType activation) {
  if (x.rows == y.rows && x.cols == y.cols && y.type == activation) return absl::OkStatus();
  return Fail("RmsNorm", absl::StrCat("x ", ShapeOf(x), ", y ", ShapeOf(y)));
}

absl::Status CheckAdd(const Matrix& a, const Matrix& b, const Matrix& out) {
  if (a.rows == b.rows && a.cols == b.cols && out.rows == a.rows && out.cols == a.cols) return absl::OkStatus();
  return Fail("Add", absl::StrCat(ShapeOf(a), " + ", ShapeOf(b), " into ", ShapeOf(out)));
}

absl::Status CheckSiluMul(const Matrix& gate, const Matrix& up, const Matrix& out) {
  if (gate.rows == up.rows && gate.cols == up.cols && out.rows == gate.rows && out.cols == gate.cols) {
    return absl::OkStatus();
  }
  return Fail("SiluMul", absl::StrCat(ShapeOf(gate), " * ", ShapeOf(up), " into ", ShapeOf(out)));
}

absl::Status CheckRope(const Matrix& x, int64_t heads, int64_t stride, int64_t offset, int64_t half_dim,
                       const StagedBatch& batch, const RopeTable& table) {
  if (x.rows == batch.tokens() && batch.longest() <= table.positions() && heads >= 0 &&
      offset + (heads - 1) * stride + 2 * half_dim <= x.cols) {
    return absl::OkStatus();
  }
  return Fail("Rope", absl::StrCat("x ", ShapeOf(x), ", ", heads, " heads at ", offset, " + h * ", stride,
                                   ", table of ", table.positions(), " positions for samples up to ",
                                   batch.longest()));
}

absl::Status CheckAttention(const Matrix& q, const Matrix& kv, const Matrix& k_rope, int64_t heads, int64_t nope_dim,
                            int64_t rope_dim, int64_t v_dim, const StagedBatch& batch, const Matrix& out) {
  if (q.rows == batch.tokens() && kv.rows == q.rows && k_rope.rows == q.rows && out.rows == q.rows &&
      q.cols >= heads * (nope_dim + rope_dim) && kv.cols >= heads * (nope_dim + v_dim) && k_rope.cols == rope_dim &&
      out.cols == heads * v_dim) {
    return absl::OkStatus();
  }
  return Fail("Attention", absl::StrCat("q ", ShapeOf(q), ", kv ", ShapeOf(kv), ", k_rope ", ShapeOf(k_rope),
                                        ", out ", ShapeOf(out), ", ", heads, " heads"));
}

absl::Status CheckRoute(const Matrix& x, const RouterParams& router, const Routing& routing, ElementType activation) {
  if (routing.tokens() == x.rows && routing.top_k() == router.top_k && x.type == activation) return absl::OkStatus();
  return Fail("Route", absl::StrCat("x ", ShapeOf(x), ", routing for ", routing.tokens(), " tokens x top ",
                                    routing.top_k(), ", router top ", router.top_k));
}

absl::Status CheckMoeExperts(const Matrix& x, const Routing& routing, const Matrix& out, bool partial,
                             ElementType activation) {
  const ElementType want = partial ? ElementType::kF32 : activation;
  if (routing.tokens() == x.rows && out.rows == x.rows && out.cols == x.cols && out.type == want &&
      x.type == activation) {
    return absl::OkStatus();
  }
  return Fail("MoeExperts", absl::StrCat("x ", ShapeOf(x), ", out ", ShapeOf(out), ", routing for ",
                                         routing.tokens(), " tokens", partial ? " (partial: f32)" : ""));
}

}  // namespace hsx
