// moegraph chat: a conversation with the model, one user message a line (a
// terminal shows a "> " prompt; a pipe gives one message per line; EOF ends).
// The chat template is the file's tokenizer.chat_template as llama.cpp detects
// it (text/chat_template.h), or --chat-template. The KV cache carries over: a
// turn prefills only what the template adds since the last reply (and the
// reply's last token, which generation never feeds back unless it ended the
// turn). When a turn does not fit in the context, the oldest turns are dropped
// and the rest prefilled again from position 0 (llama.cpp's context shift drops
// tokens; whole turns keep the template's structure). Ctrl-C stops the reply
// being written, not the program; at the prompt it ends the chat with its
// summary (status 130). /exit, /clear and /help are commands.
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "loader/gguf.h"
#include "loader/model_config.h"
#include "loader/status_util.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "text/unicode.h"
#include "text/vocab.h"
#include "tools/cli/commands.h"
#include "tools/cli/decoder.h"

// What each flag means: tools/cli/command_line.cc.
ABSL_FLAG(std::string, system, "", "a system message before the first turn");
ABSL_FLAG(std::string, chat_template, "", "a template name or Jinja text");
ABSL_FLAG(bool, verbose_prompt, false, "print the text each turn prefills");

namespace moegraph {
namespace {

constexpr int kChatDefaultContext = 4096;

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

constexpr char kCommandsHelp[] =
    "/exit ends the chat (as EOF does), /clear starts a new conversation (the system message "
    "kept), /help prints this";

// What a turn prefills: the text the template adds since the last reply when it
// keeps the earlier text as it was, else the whole conversation from position 0.
struct Prefill {
  std::string rendered;  // the whole conversation, rendered
  std::string text;      // the part prefilled
  std::vector<int32_t> tokens;
  int start = 0;  // its first position
};

absl::StatusOr<Prefill> PlanPrefill(const ChatTemplate& chat_template, const Tokenizer& tokenizer,
                                    const Conversation& chat, bool keep_cache, int turn) {
  Prefill p;
  p.rendered = ApplyChatTemplate(chat_template, chat.messages, true);
  const bool carry = keep_cache && chat.n_past > 0 && p.rendered.starts_with(chat.seen);
  p.text = carry ? p.rendered.substr(chat.seen.size()) : p.rendered;
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer.Tokenize(p.text, !carry, true);
  if (!ids.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("turn ", turn, ": ", ids.status().message()));
  }
  if (carry && chat.unfed.has_value()) p.tokens.push_back(*chat.unfed);
  p.tokens.insert(p.tokens.end(), ids->begin(), ids->end());
  p.start = carry ? chat.n_past : 0;
  return p;
}

// Drops the oldest turn (a user message and its reply; the system message
// stays); false when only the newest message is left.
bool DropOldestTurn(Conversation& chat) {
  const size_t first = !chat.messages.empty() && chat.messages[0].role == "system" ? 1 : 0;
  if (chat.messages.size() < first + 2) return false;
  const bool pair = chat.messages[first + 1].role == "assistant";
  chat.messages.erase(chat.messages.begin() + static_cast<ptrdiff_t>(first),
                      chat.messages.begin() + static_cast<ptrdiff_t>(first + (pair ? 2 : 1)));
  return true;
}

absl::Status Chat() {
  const std::string path = absl::GetFlag(FLAGS_m);
  if (path.empty()) return absl::InvalidArgumentError("-m FILE is required");
  MG_ASSIGN_OR_RETURN(const int n_flag, TokensToGenerate(kUntilTheEnd));
  if (n_flag == 0) {
    return absl::InvalidArgumentError(
        "-n 0: a reply's tokens must be positive (-1: until its end)");
  }
  int ctx = absl::GetFlag(FLAGS_ctx);
  if (ctx < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--ctx %d must not be negative (0: %d)", ctx, kChatDefaultContext));
  }
  if (ctx == 0) ctx = kChatDefaultContext;
  MG_ASSIGN_OR_RETURN(DecoderFlags flags, ReadDecoderFlags());

  MG_ASSIGN_OR_RETURN(const std::unique_ptr<GgufFile> file, GgufFile::Open(path));
  MG_ASSIGN_OR_RETURN(Model model, LoadModel(*file));
  MG_RETURN_IF_ERROR(ApplyExpertsUsed(flags, path, &model, stderr));
  MG_ASSIGN_OR_RETURN(Vocab vocab, Vocab::FromGguf(*file));
  MG_ASSIGN_OR_RETURN(const std::unique_ptr<Tokenizer> tokenizer,
                      Tokenizer::Create(std::move(vocab)));
  std::string template_source;
  MG_ASSIGN_OR_RETURN(const ChatTemplate chat_template, PickTemplate(*file, &template_source));
  MG_RETURN_IF_ERROR(CheckContext(model, flags.cuda, flags.cpu, ctx, stderr));
  MG_RETURN_IF_ERROR(AutoHostCache(model, ctx, &flags, stderr));
  MG_RETURN_IF_ERROR(CheckHostCache(model, flags.host_cache_bytes));
  MG_RETURN_IF_ERROR(ReadWeights(file.get(), flags.load, stderr));

  std::fprintf(stderr, "%schat template: %s (%s); context %d; %s\n", StartupLines(flags).c_str(),
               std::string(ChatTemplateName(chat_template)).c_str(), template_source.c_str(), ctx,
               kCommandsHelp);
  // Ctrl-C during a reply ends the reply; at the prompt it ends the chat with
  // its summary (status 130), as llama-cli's.
  std::unique_ptr<Decoder> decoder;
  {
    const InterruptsBlocked blocked;
    MG_ASSIGN_OR_RETURN(decoder, Decoder::Create(model, flags, ctx, stderr));
  }
  CatchInterrupts();

  const bool terminal = isatty(STDIN_FILENO) != 0;
  const bool special = absl::GetFlag(FLAGS_special);
  const bool verbose = absl::GetFlag(FLAGS_verbose_prompt);
  Conversation chat;
  const std::string system = absl::GetFlag(FLAGS_system);
  auto clear = [&] {
    chat = Conversation();
    if (!system.empty()) chat.messages.push_back({"system", system});
  };
  clear();
  // Room a turn keeps for its reply before older turns are dropped.
  const int reply_room = n_flag > 0 ? std::min(n_flag, ctx / 2) : ctx / 4;
  GenerateStats total;
  size_t generated_total = 0;
  std::string line;
  for (int turn = 1;;) {
    if (terminal) {
      std::fputs("> ", stdout);
      std::fflush(stdout);
    }
    if (!std::getline(std::cin, line)) {
      // EOF (Ctrl-D) or Ctrl-C: on a terminal the summary starts its own line.
      if (terminal) std::fputc('\n', stdout);
      std::fflush(stdout);
      break;
    }
    const absl::string_view command = absl::StripAsciiWhitespace(line);
    if (command.empty()) continue;
    if (command == "/exit" || command == "/quit") break;
    if (command == "/help") {
      std::fprintf(stderr, "%s\n", kCommandsHelp);
      continue;
    }
    if (command == "/clear") {
      clear();
      std::fprintf(stderr, "chat: a new conversation\n");
      continue;
    }
    chat.messages.push_back({"user", line});
    // When this turn and its reply's room do not fit, drop the oldest turns
    // until what is prefilled again takes at most half the context, as
    // llama-cli's context shift discards half at once: the next turns then
    // extend the cache instead of prefilling it all again each time.
    int dropped = 0;
    MG_ASSIGN_OR_RETURN(Prefill prefill,
                        PlanPrefill(chat_template, *tokenizer, chat, /*keep_cache=*/true, turn));
    if (prefill.start + static_cast<int>(prefill.tokens.size()) + reply_room > ctx) {
      const auto fits = [&] {
        const int used = prefill.start + static_cast<int>(prefill.tokens.size()) + reply_room;
        return dropped > 0 && used <= ctx / 2;
      };
      while (!fits() && DropOldestTurn(chat)) {
        ++dropped;
        MG_ASSIGN_OR_RETURN(prefill, PlanPrefill(chat_template, *tokenizer, chat,
                                                 /*keep_cache=*/false, turn));
      }
    }
    if (dropped > 0) {
      std::fprintf(stderr,
                   "chat: the context (--ctx %d) is full: dropped the oldest %d turn%s, "
                   "prefilling the rest again\n",
                   ctx, dropped, dropped == 1 ? "" : "s");
    } else if (prefill.start == 0 && chat.n_past > 0) {
      std::fprintf(stderr,
                   "chat: the template renders earlier turns anew; prefilling them again\n");
    }
    const int room = ctx - prefill.start - static_cast<int>(prefill.tokens.size()) + 1;
    if (room < 1) {
      // Not even the message alone fits: say so and wait for the next one.
      std::fprintf(stderr,
                   "chat: this message needs %d positions with the template, more than --ctx %d "
                   "holds; it was not sent\n",
                   prefill.start + static_cast<int>(prefill.tokens.size()), ctx);
      chat.messages.pop_back();
      continue;
    }
    if (verbose) {
      std::fprintf(stderr, "turn %d prefill text: %s\n", turn, Quoted(prefill.text).c_str());
    }
    const int n_predict = n_flag == kUntilTheEnd ? room : std::min(n_flag, room);

    // Each token: printed as it comes, until an end-of-generation token or Ctrl-C.
    TextStream stream;
    std::string reply;
    std::string ended_by = n_predict < n_flag || n_flag == kUntilTheEnd ? "context full" : "-n";
    bool last_taken = true;
    const TokenSink sink = [&](int32_t token) {
      if (Interrupted()) {
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
    GenerateStats stats;
    const std::vector<int32_t>& prompt = prefill.tokens;
    const int start = prefill.start;
    absl::StatusOr<std::vector<int32_t>> generated =
        decoder->Generate(prompt, n_predict, start, &stats, sink);
    // That Ctrl-C ended the reply, not the chat.
    ClearInterrupted();
    const std::string rest = stream.Flush();
    std::fwrite(rest.data(), 1, rest.size(), stdout);
    std::fputc('\n', stdout);
    std::fflush(stdout);
    if (!generated.ok()) return generated.status();

    // Generation feeds back every token but the last.
    chat.n_past = start + static_cast<int>(prompt.size()) + static_cast<int>(generated->size()) - 1;
    const bool ended = ended_by == "end of generation";
    chat.unfed = last_taken && !ended ? std::optional<int32_t>(generated->back()) : std::nullopt;
    // Rendered into later turns and tokenized again: bytes a reply cut inside
    // a character (or a model wrote) are not UTF-8 there, so U+FFFD, as JSON has it.
    const std::string said = ReplaceInvalidUtf8(reply);
    chat.messages.push_back({"assistant", said});
    chat.seen = prefill.rendered + said;
    const int taken = static_cast<int>(generated->size()) - (last_taken && !ended ? 0 : 1);
    std::fprintf(stderr,
                 "turn %d: prefill %d token%s at positions %d..%d, %d generated (%s); %.2f tok/s "
                 "prefill, %.2f tok/s generation\n",
                 turn, static_cast<int>(prompt.size()), prompt.size() == 1 ? "" : "s", start,
                 start + static_cast<int>(prompt.size()) - 1, taken, ended_by.c_str(),
                 stats.prompt_seconds > 0 ? stats.prompt_tokens / stats.prompt_seconds : 0.0,
                 stats.decode_seconds > 0 ? stats.decode_steps / stats.decode_seconds : 0.0);
    total.prompt_tokens += stats.prompt_tokens;
    total.prompt_seconds += stats.prompt_seconds;
    total.decode_steps += stats.decode_steps;
    total.decode_seconds += stats.decode_seconds;
    generated_total += static_cast<size_t>(taken);
    ++turn;
  }
  MG_RETURN_IF_ERROR(decoder->PrintSummary(stderr, total, generated_total));
  if (Interrupted()) ExitInterrupted();
  return absl::OkStatus();
}

}  // namespace

int RunChat(const std::vector<std::string>& args) { return RunModelCommand("chat", args, Chat); }

}  // namespace moegraph
