// A `moegraph serve --port 0` child for tests: its stderr goes to a file, read
// for the port it listens on and for its per-request log lines.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace moegraph::testing_util {

class ServeProcess {
 public:
  explicit ServeProcess(std::string binary) : binary_(std::move(binary)) {}
  ~ServeProcess();
  ServeProcess(const ServeProcess&) = delete;
  ServeProcess& operator=(const ServeProcess&) = delete;

  // `BINARY serve --port 0 ARGS`; the port it listens on, or -1 (the log says
  // why). Waits up to 5 minutes (the sanitized and emulated trees load slowly).
  int Start(const std::vector<std::string>& args);
  // Sends signal and returns the exit code (-1: killed by a signal or still
  // running after 30 s).
  int Stop(int signal);
  std::string Log() const;
  pid_t pid() const { return pid_; }

 private:
  std::string binary_;
  pid_t pid_ = -1;
  std::string log_;
  int starts_ = 0;
};

}  // namespace moegraph::testing_util
