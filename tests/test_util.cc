#include "tests/test_util.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"

namespace moegraph::testing_util {

absl::StatusOr<std::unique_ptr<LoadedModel>> LoadFixture(const FixtureSpec& spec) {
  absl::StatusOr<std::vector<uint8_t>> bytes = FixtureBytes(spec);
  if (!bytes.ok()) return bytes.status();
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes("fixture", *bytes);
  if (!file.ok()) return file.status();
  auto loaded = std::make_unique<LoadedModel>();
  loaded->file = std::move(*file);
  absl::StatusOr<Model> model = LoadModel(*loaded->file);
  if (!model.ok()) return model.status();
  loaded->model = std::move(*model);
  return loaded;
}

std::unique_ptr<GgufFile> ParseOrFail(const std::vector<uint8_t>& bytes, const std::string& name) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes(name, bytes);
  EXPECT_TRUE(file.ok()) << file.status();
  return file.ok() ? std::move(*file) : nullptr;
}

std::unique_ptr<GgufFile> FixtureFileOrFail(const FixtureSpec& spec) {
  absl::StatusOr<std::vector<uint8_t>> bytes = FixtureBytes(spec);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  return bytes.ok() ? ParseOrFail(*bytes, "fixture.gguf") : nullptr;
}

::testing::AssertionResult Contains(absl::string_view text, absl::string_view part) {
  if (text.find(part) != absl::string_view::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << text << "' does not contain '" << part << "'";
}

bool MessageHas(const absl::Status& status, const std::string& text) {
  return std::string(status.message()).find(text) != std::string::npos;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

namespace {

int ExitCode(int wait_status) { return WIFEXITED(wait_status) ? WEXITSTATUS(wait_status) : -1; }

}  // namespace

CommandResult RunCommand(const std::string& shell_command) {
  CommandResult result;
  FILE* pipe = popen(shell_command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  size_t n = 0;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) result.output.append(buffer, n);
  result.exit_code = ExitCode(pclose(pipe));
  return result;
}

ProcessResult RunProcess(const std::vector<std::string>& argv, const std::string& stdin_text) {
  ProcessResult result;
  if (argv.empty()) return result;
  std::string input_path;
  if (!stdin_text.empty()) {
    input_path = TempPath("stdin_" + std::to_string(::getpid()));
    std::ofstream(input_path, std::ios::binary) << stdin_text;
  }
  int out_pipe[2];
  int err_pipe[2];
  if (::pipe(out_pipe) != 0) return result;
  if (::pipe(err_pipe) != 0) {
    ::close(out_pipe[0]);
    ::close(out_pipe[1]);
    return result;
  }
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (!input_path.empty()) {
      const int in = ::open(input_path.c_str(), O_RDONLY);
      if (in < 0) ::_exit(126);
      ::dup2(in, STDIN_FILENO);
      ::close(in);
    }
    ::dup2(out_pipe[1], STDOUT_FILENO);
    ::dup2(err_pipe[1], STDERR_FILENO);
    for (const int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]}) ::close(fd);
    std::vector<char*> args;
    for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  // Both pipes are drained together: a child that fills one while we block on
  // the other would never exit.
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  std::string* sinks[2] = {&result.out, &result.err};
  int open_pipes = pid > 0 ? 2 : 0;
  while (open_pipes > 0) {
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      char buffer[4096];
      const ssize_t n = ::read(fds[i].fd, buffer, sizeof(buffer));
      if (n > 0) {
        sinks[i]->append(buffer, static_cast<size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open_pipes;
      }
    }
  }
  for (const pollfd& fd : fds) {
    if (fd.fd >= 0) ::close(fd.fd);
  }
  int status = 0;
  rusage usage{};
  if (pid > 0 && ::wait4(pid, &status, 0, &usage) == pid) {
    result.exit_code = ExitCode(status);
    result.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    result.peak_rss_kib = static_cast<uint64_t>(usage.ru_maxrss);
  }
  if (!input_path.empty()) std::remove(input_path.c_str());
  return result;
}

ProcessResult RunProcessWithArgs(std::vector<std::string> argv, const std::string& args) {
  for (absl::string_view word : absl::StrSplit(args, ' ', absl::SkipEmpty())) {
    argv.emplace_back(word);
  }
  return RunProcess(argv);
}

std::string Qwen3TokenizerJson(const std::string& source_dir) {
  const char* dir = std::getenv("MOEGRAPH_VOCAB");
  return (dir != nullptr ? std::string(dir) : source_dir + "/vocab") + "/qwen3/tokenizer.json";
}

ProcessResult MakeVocabFixture(const std::string& bin, const std::string& tokenizer_json,
                               const std::string& out, const std::string& arch) {
  std::vector<std::string> args = {bin,     "make-fixture", "--arch",  arch,  "--layers", "2",
                                   "--experts", "4",        "--top-k", "2",   "--embd",   "64",
                                   "--ff",      "32",       "--quant", "f32", "--tokenizer-json",
                                   tokenizer_json, "-o",    out};
  if (arch == "qwen35moe") args.insert(args.end(), {"--full-attn-interval", "2"});
  return RunProcess(args);
}

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "moegraph_" + std::to_string(::getpid()) + "_" + name;
}

std::string ReadFileToString(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::vector<int32_t> IdsAfter(const std::string& output, const std::string& label) {
  std::istringstream lines(output);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind(label + ":", 0) != 0) continue;
    std::istringstream ids(line.substr(label.size() + 1));
    std::vector<int32_t> out;
    int32_t id = 0;
    while (ids >> id) out.push_back(id);
    return out;
  }
  return {};
}

std::vector<std::vector<std::string>> BenchTableRows(const std::string& out) {
  std::vector<std::vector<std::string>> rows;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("| ", 0) != 0 || line.rfind("| model", 0) == 0 || line.rfind("| -", 0) == 0) {
      continue;
    }
    std::vector<std::string> cells;
    for (absl::string_view cell : absl::StrSplit(line, '|')) {
      cells.emplace_back(absl::StripAsciiWhitespace(cell));
    }
    // Leading and trailing '|' leave empty cells at both ends.
    rows.emplace_back(cells.begin() + 1, cells.end() - 1);
  }
  return rows;
}

std::vector<std::map<std::string, std::string>> BenchJsonRows(const std::string& out) {
  std::vector<std::map<std::string, std::string>> rows;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    const size_t open = line.find('{');
    if (open == std::string::npos) continue;
    std::map<std::string, std::string> fields;
    size_t pos = open + 1;
    while ((pos = line.find('"', pos)) != std::string::npos) {
      const size_t key_end = line.find('"', pos + 1);
      const std::string key = line.substr(pos + 1, key_end - pos - 1);
      size_t value_start = line.find(':', key_end) + 1;
      while (line[value_start] == ' ') ++value_start;
      size_t value_end = value_start;
      if (line[value_start] == '[') {
        value_end = line.find(']', value_start) + 1;
      } else if (line[value_start] == '"') {
        value_end = line.find('"', value_start + 1) + 1;
      } else {
        value_end = line.find_first_of(",}", value_start);
      }
      fields[key] = line.substr(value_start, value_end - value_start);
      pos = value_end;
      if (line[pos] == '}') break;
      pos = line.find('"', pos);
    }
    rows.push_back(fields);
  }
  return rows;
}

std::string SharedPath(const std::string& relative) {
  const char* shared = std::getenv("MOEGRAPH_SHARED");
  return std::string(shared != nullptr ? shared : "/work/shared") + "/" + relative;
}

std::string* FixtureFileTest::path_ = nullptr;
absl::Status* FixtureFileTest::status_ = nullptr;

void FixtureFileTest::WriteSuiteFixture(const FixtureSpec& spec, const std::string& name) {
  path_ = new std::string(TempPath(name));
  status_ = new absl::Status(WriteFixture(spec, *path_));
}

void FixtureFileTest::TearDownTestSuite() {
  std::remove(path_->c_str());
  delete path_;
  delete status_;
  path_ = nullptr;
  status_ = nullptr;
}

void FixtureFileTest::SetUp() { ASSERT_TRUE(status_->ok()) << *status_; }

bool JsonChecker::Valid() {
  Space();
  if (!Value(0)) return false;
  Space();
  return pos_ == text_.size();
}

void JsonChecker::Space() {
  while (pos_ < text_.size() && std::string_view(" \t\r\n").find(text_[pos_]) !=
                                    std::string_view::npos) {
    ++pos_;
  }
}

bool JsonChecker::Eat(char c) {
  Space();
  if (pos_ < text_.size() && text_[pos_] == c) {
    ++pos_;
    return true;
  }
  return false;
}

bool JsonChecker::Digits() {
  const size_t start = pos_;
  while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
  return pos_ > start;
}

bool JsonChecker::String() {
  if (!Eat('"')) return false;
  while (pos_ < text_.size() && text_[pos_] != '"') pos_ += text_[pos_] == '\\' ? 2 : 1;
  return pos_++ < text_.size();
}

bool JsonChecker::Value(int depth) {
  Space();
  if (depth > 32 || pos_ >= text_.size()) return false;
  const char c = text_[pos_];
  if (c == '{' || c == '[') {
    ++pos_;
    const char close = c == '{' ? '}' : ']';
    if (Eat(close)) return true;
    do {
      if (c == '{' && (!String() || !Eat(':'))) return false;
      if (!Value(depth + 1)) return false;
    } while (Eat(','));
    return Eat(close);
  }
  if (c == '"') return String();
  for (std::string_view word : {"true", "false", "null"}) {
    if (text_.substr(pos_, word.size()) == word) {
      pos_ += word.size();
      return true;
    }
  }
  if (c == '-') ++pos_;
  if (!Digits()) return false;
  if (pos_ < text_.size() && text_[pos_] == '.' && (++pos_, !Digits())) return false;
  if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
    ++pos_;
    if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
    if (!Digits()) return false;
  }
  return true;
}

}  // namespace moegraph::testing_util
