// moegraph chat: a conversation with the model, one user message a line (a
// terminal shows a "> " prompt; a pipe gives one message per line; EOF ends).
// The chat template is the file's tokenizer.chat_template as llama.cpp detects
// it (text/chat_template.h), or --chat-template. The KV cache carries over: a
// turn prefills only what the template adds since the last reply (and the
// reply's last token, which generation never feeds back unless it ended the
// turn). Ctrl-C stops the reply being written, not the program.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "loader/gguf.h"
#include "loader/model_config.h"
#include "loader/status_util.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "text/vocab.h"
#include "tools/cli/commands.h"
#include "tools/cli/decoder.h"

ABSL_FLAG(std::string, system, "", "chat: a system message before the first turn");
ABSL_FLAG(std::string, chat_template, "",
          "chat: a template name (chatml, llama2, mistral-v7, ...) or Jinja text to detect one "
          "from, instead of the file's tokenizer.chat_template");
ABSL_FLAG(bool, verbose_prompt, false,
          "chat: print the text each turn prefills (JSON-quoted) to stderr");

namespace moegraph {
namespace {

constexpr int kChatDefaultContext = 4096;

std::atomic<bool> g_generating{false};
std::atomic<bool> g_interrupted{false};

// Ctrl-C during a reply ends the reply; anywhere else it ends the program.
void OnInterrupt(int) {
  if (g_generating.load()) {
    g_interrupted.store(true);
    return;
  }
  constexpr char kNewline[] = "\n";
  (void)!write(STDERR_FILENO, kNewline, 1);
  _exit(130);
}

// text as a JSON string, for --verbose-prompt.
std::string Quoted(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppendFormat(&out, "\\u%04x", c);
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

// The template: --chat-template, else the file's, else chatml (as llama.cpp).
absl::StatusOr<ChatTemplate> PickTemplate(const GgufFile& file, std::string* source) {
  if (const std::string flag = absl::GetFlag(FLAGS_chat_template); !flag.empty()) {
    *source = "--chat-template";
    absl::StatusOr<ChatTemplate> t = DetectChatTemplate(flag);
    if (!t.ok())
      return absl::InvalidArgumentError(absl::StrCat("--chat-template: ", t.status().message()));
    return t;
  }
  *source = file.FindKey("tokenizer.chat_template") == nullptr
                ? "none in the file; llama.cpp's default"
                : "the file's tokenizer.chat_template";
  return FileChatTemplate(file);
}

// A conversation: its messages, the text the model has seen (rendered turns and
// the replies as generated), and where the KV cache stands.
struct Conversation {
  std::vector<ChatMessage> messages;
  std::string seen;
  int n_past = 0;
  std::optional<int32_t> unfed;  // the last reply's last token, when it did not end the turn
};

absl::Status Chat() {
  const std::string path = absl::GetFlag(FLAGS_m);
  if (path.empty()) return absl::InvalidArgumentError("-m FILE is required");
  const int n_flag = absl::GetFlag(FLAGS_n);
  if (n_flag < kDefaultTokensFlag || n_flag == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("-n %d: a reply's tokens must be positive (unset: until the end)", n_flag));
  }
  int ctx = absl::GetFlag(FLAGS_ctx);
  if (ctx < 0) return absl::InvalidArgumentError(absl::StrFormat("--ctx %d is negative", ctx));
  if (ctx == 0) ctx = kChatDefaultContext;
  MG_ASSIGN_OR_RETURN(const DecoderFlags flags, ReadDecoderFlags());

  MG_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file, GgufFile::Open(path));
  MG_ASSIGN_OR_RETURN(const Model model, LoadModel(*file));
  MG_ASSIGN_OR_RETURN(Vocab vocab, Vocab::FromGguf(*file));
  MG_ASSIGN_OR_RETURN(const std::unique_ptr<Tokenizer> tokenizer,
                      Tokenizer::Create(std::move(vocab)));
  std::string template_source;
  MG_ASSIGN_OR_RETURN(const ChatTemplate chat_template, PickTemplate(*file, &template_source));

  std::fprintf(stderr, "%s\n%s\nchat template: %s (%s); context %d\n", flags.doors.banner.c_str(),
               DescribeSampling(flags.sampling).c_str(),
               std::string(ChatTemplateName(chat_template)).c_str(), template_source.c_str(), ctx);
  MG_ASSIGN_OR_RETURN(std::unique_ptr<Decoder> decoder, Decoder::Create(model, flags, ctx, stderr));

  struct sigaction action = {};
  action.sa_handler = OnInterrupt;
  action.sa_flags = SA_RESTART;
  sigaction(SIGINT, &action, nullptr);

  const bool terminal = isatty(STDIN_FILENO) != 0;
  const bool special = absl::GetFlag(FLAGS_special);
  const bool verbose = absl::GetFlag(FLAGS_verbose_prompt);
  Conversation chat;
  if (const std::string system = absl::GetFlag(FLAGS_system); !system.empty()) {
    chat.messages.push_back({"system", system});
  }
  GenerateStats total;
  size_t generated_total = 0;
  std::string line;
  for (int turn = 1;; ++turn) {
    if (terminal) {
      std::fputs("> ", stdout);
      std::fflush(stdout);
    }
    if (!std::getline(std::cin, line)) break;
    if (line.empty()) {
      --turn;
      continue;
    }
    chat.messages.push_back({"user", line});
    // What the template adds since the last reply, when it keeps the earlier
    // text as it was; else the whole conversation again from position 0.
    const std::string rendered = ApplyChatTemplate(chat_template, chat.messages, true);
    const bool carry = turn > 1 && rendered.starts_with(chat.seen);
    const std::string fresh = carry ? rendered.substr(chat.seen.size()) : rendered;
    absl::StatusOr<std::vector<int32_t>> ids = tokenizer->Tokenize(fresh, !carry, true);
    if (!ids.ok())
      return absl::InvalidArgumentError(absl::StrCat("turn ", turn, ": ", ids.status().message()));
    std::vector<int32_t> prompt;
    if (carry && chat.unfed.has_value()) prompt.push_back(*chat.unfed);
    prompt.insert(prompt.end(), ids->begin(), ids->end());
    const int start = carry ? chat.n_past : 0;
    if (!carry && turn > 1) {
      std::fprintf(stderr,
                   "chat: the template renders earlier turns anew; prefilling them again\n");
    }
    if (verbose) std::fprintf(stderr, "turn %d prefill text: %s\n", turn, Quoted(fresh).c_str());
    const int room = ctx - start - static_cast<int>(prompt.size()) + 1;
    if (room < 1) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "turn %d: the conversation needs %d positions, more than the context (--ctx %d)", turn,
          start + static_cast<int>(prompt.size()), ctx));
    }
    const int n_predict = n_flag == kDefaultTokensFlag ? room : std::min(n_flag, room);

    // Each token: printed as it comes, until an end-of-generation token or Ctrl-C.
    TextStream stream;
    std::string reply;
    std::string ended_by =
        n_predict < n_flag || n_flag == kDefaultTokensFlag ? "context full" : "-n";
    bool last_taken = true;
    const TokenSink sink = [&](int32_t token) {
      if (g_interrupted.load()) {
        ended_by = "interrupted";
        last_taken = false;
        return false;
      }
      if (tokenizer->vocab().IsEog(token)) {
        ended_by = "end of generation";
        return false;
      }
      const std::string text = stream.Push(tokenizer->Piece(token, special));
      reply += tokenizer->Piece(token, /*special=*/false);
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fflush(stdout);
      return true;
    };
    g_interrupted.store(false);
    g_generating.store(true);
    GenerateStats stats;
    absl::StatusOr<std::vector<int32_t>> generated =
        decoder->Generate(prompt, n_predict, start, &stats, sink);
    g_generating.store(false);
    const std::string rest = stream.Flush();
    std::fwrite(rest.data(), 1, rest.size(), stdout);
    std::fputc('\n', stdout);
    std::fflush(stdout);
    if (!generated.ok()) return generated.status();

    // Generation feeds back every token but the last.
    chat.n_past = start + static_cast<int>(prompt.size()) + static_cast<int>(generated->size()) - 1;
    const bool ended = ended_by == "end of generation";
    chat.unfed = last_taken && !ended ? std::optional<int32_t>(generated->back()) : std::nullopt;
    chat.messages.push_back({"assistant", reply});
    chat.seen = rendered + reply;
    const int taken = static_cast<int>(generated->size()) - (last_taken && !ended ? 0 : 1);
    std::fprintf(stderr,
                 "turn %d: prefill %d tokens at positions %d..%d, %d generated (%s); %.2f tok/s "
                 "prefill, %.2f tok/s generation\n",
                 turn, static_cast<int>(prompt.size()), start,
                 start + static_cast<int>(prompt.size()) - 1, taken, ended_by.c_str(),
                 stats.prompt_seconds > 0 ? stats.prompt_tokens / stats.prompt_seconds : 0.0,
                 stats.decode_seconds > 0 ? stats.decode_steps / stats.decode_seconds : 0.0);
    total.prompt_tokens += stats.prompt_tokens;
    total.prompt_seconds += stats.prompt_seconds;
    total.decode_steps += stats.decode_steps;
    total.decode_seconds += stats.decode_seconds;
    generated_total += static_cast<size_t>(taken);
  }
  return decoder->PrintSummary(stderr, total, generated_total);
}

}  // namespace

int RunChat(const std::vector<std::string>& args) { return RunModelCommand("chat", args, Chat); }

}  // namespace moegraph
