// MG_CHECK: programming errors abort with the condition and a message. User
// errors (files, flags, memory) are absl::Status values instead. Light: no Abseil.
#pragma once

namespace moegraph {

[[noreturn]] void check_failed(const char* file, int line, const char* condition,
                               const char* message);

}  // namespace moegraph

#define MG_CHECK(condition, message)                                          \
  do {                                                                        \
    if (!(condition)) {                                                       \
      ::moegraph::check_failed(__FILE__, __LINE__, #condition, (message));    \
    }                                                                         \
  } while (0)
