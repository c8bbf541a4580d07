// op_checks.h: the shape and element-type rules of kernels/backend.h's ops,
// written once for every backend.
//
// Each function returns OK when the op's arguments are what the contract
// allows, else an InvalidArgument "OP: what was passed". A backend records the
// error (sticky, reported by Synchronize) and skips the op; it may add limits
// of its own on top (a kernel's largest head count, say). The message is built
// only on failure: these run on every op call.
#ifndef HSX_KERNELS_OP_CHECKS_H_
#define HSX_KERNELS_OP_CHECKS_H_

#include <string>

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace hsx {

// "[rows, cols] type", for messages.
std::string ShapeOf(const Matrix& m);

absl::Status CheckEmbed(const Matrix& out, int64_t tokens);
absl::Status CheckLinear(const Matrix& x, const LinearWeight& w, const Matrix& y, bool partial,
                         ElementType activation);
absl::Status CheckRound(const Matrix& partial, const Matrix& out, ElementType activation);
absl::Status CheckRmsNorm(const Matrix& x, const Matrix& y, ElementType activation);
absl::Status CheckAdd(const Matrix& a, const Matrix& b, const Matrix& out);
absl::Status CheckSiluMul(const Matrix& gate, const Matrix& up, const Matrix& out);
absl::Status CheckRope(const Matrix& x, int64_t heads, int64_t stride, int64_t offset, int64_t half_dim,
                       const StagedBatch& batch, const RopeTable& table);
absl::Status CheckAttention(const Matrix& q, const Matrix& kv, const Matrix& k_rope, int64_t heads, int64_t nope_dim,
                            int64_t rope_dim, int64_t v_dim, const StagedBatch& batch, const Matrix& out);
absl::Status CheckRoute(const Matrix& x, const RouterParams& router, const Routing& routing, ElementType activation);
absl::Status CheckMoeExperts(const Matrix& x, const Routing& routing, const Matrix& out, bool partial,
                             ElementType activation);

}  // namespace hsx

#endif  // HSX_KERNELS_OP_CHECKS_H_
