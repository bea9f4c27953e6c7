#include "loader/check.h"

#include <cstdio>
#include <cstdlib>

namespace moegraph {

void check_failed(const char* file, int line, const char* condition, const char* message) {
  std::fprintf(stderr, "moegraph: %s:%d: CHECK failed: %s: %s\n", file, line, condition, message);
  std::abort();
}

}  // namespace moegraph
