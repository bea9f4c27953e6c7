// Small helpers for absl::Status code.
#pragma once

#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

// Returns the status of expr from the enclosing function when it is not OK.
#define MG_RETURN_IF_ERROR(expr)                  \
  do {                                            \
    if (absl::Status mg_status_ = (expr); !mg_status_.ok()) { \
      return mg_status_;                          \
    }                                             \
  } while (0)

#define MG_STATUS_CONCAT_INNER(a, b) a##b
#define MG_STATUS_CONCAT(a, b) MG_STATUS_CONCAT_INNER(a, b)

// MG_ASSIGN_OR_RETURN(auto x, StatusOrExpr()): x = the value, or return the error.
#define MG_ASSIGN_OR_RETURN(lhs, expr) \
  MG_ASSIGN_OR_RETURN_IMPL(MG_STATUS_CONCAT(mg_statusor_, __LINE__), lhs, expr)
#define MG_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()

namespace moegraph {

// Debian's Abseil has its own string_view type: bridge std::string_view into it.
inline absl::string_view Av(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// The same status with "prefix: " before its message.
inline absl::Status Prefixed(const absl::Status& status, std::string_view prefix) {
  return absl::Status(status.code(), absl::StrCat(Av(prefix), ": ", status.message()));
}

}  // namespace moegraph
