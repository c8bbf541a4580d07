// status_macros.h: early returns for absl::Status and absl::StatusOr.
//
//   HSX_RETURN_IF_ERROR(DoThing());
//   HSX_ASSIGN_OR_RETURN(Matrix q, Scratch(rows, cols));
#ifndef HSX_BASE_STATUS_MACROS_H_
#define HSX_BASE_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define HSX_RETURN_IF_ERROR(expr)                      \
  do {                                                 \
    if (absl::Status hsx_status = (expr); !hsx_status.ok()) return hsx_status; \
  } while (0)

#define HSX_STATUS_CONCAT_INNER(a, b) a##b
#define HSX_STATUS_CONCAT(a, b) HSX_STATUS_CONCAT_INNER(a, b)

#define HSX_ASSIGN_OR_RETURN(lhs, expr) \
  HSX_ASSIGN_OR_RETURN_IMPL(HSX_STATUS_CONCAT(hsx_statusor_, __LINE__), lhs, expr)

#define HSX_ASSIGN_OR_RETURN_IMPL(statusor, lhs, expr) \
  auto statusor = (expr);                              \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = *std::move(statusor)

#endif  // HSX_BASE_STATUS_MACROS_H_
