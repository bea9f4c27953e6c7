#include "tests/serve_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <regex>
#include <thread>

#include "tests/test_util.h"

extern char** environ;

namespace moegraph::testing_util {

ServeProcess::~ServeProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

int ServeProcess::Start(const std::vector<std::string>& args) {
  log_ = TempPath("serve-" + std::to_string(++starts_) + ".err");
  std::vector<std::string> argv = {binary_, "serve", "--port", "0"};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargv;
  for (std::string& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, log_.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  const int spawned = posix_spawn(&pid_, cargv[0], &actions, nullptr, cargv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) return -1;
  const std::regex listening(R"(listening on http://(127\.0\.0\.1|\[::1\]):(\d+))");
  for (int i = 0; i < 3000; ++i) {
    std::smatch m;
    const std::string log = Log();
    if (std::regex_search(log, m, listening)) return std::stoi(m[2]);
    if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
      pid_ = -1;
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return -1;
}

int ServeProcess::Stop(int signal) {
  kill(pid_, signal);
  int status = 0;
  for (int i = 0; i < 300; ++i) {
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return -1;
}

std::string ServeProcess::Log() const { return ReadFileToString(log_); }

}  // namespace moegraph::testing_util
