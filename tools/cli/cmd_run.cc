// moegraph run: decode of a text prompt (-p, -f), printed as text while it is
// generated, or of token ids (--tokens), printed as ids, with tok/s; greedy, or
// sampled with llama.cpp's flags. The backend (tools/cli/decoder.h) is the CUDA
// engine, each step one graph replay with experts in pinned host memory, or the
// CPU backend, the same expert path on the host.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "loader/gguf.h"
#include "loader/model_config.h"
#include "loader/status_util.h"
#include "reference/oracle.h"
#include "text/tokenizer.h"
#include "text/vocab.h"
#include "tools/cli/commands.h"
#include "tools/cli/decoder.h"

ABSL_FLAG(std::string, tokens, "", "prompt token ids, comma-separated");
// What each flag means to each command: tools/cli/command_line.cc.
ABSL_FLAG(std::string, n, "", "tokens to generate (empty: the command's default)");
ABSL_FLAG(bool, ignore_eos, false, "go on past end-of-generation tokens");
ABSL_FLAG(bool, special, false, "print control tokens' text too");

namespace moegraph {
namespace {

// run -n -1 without --ctx: chat's and serve's default context, or the model's if smaller.
constexpr int kUntilTheEndContext = 4096;

absl::StatusOr<std::vector<int32_t>> ParseTokens(const std::string& text) {
  std::vector<int32_t> ids;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &id)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--tokens '%s': '%s' is not a token id", text, std::string(part)));
    }
    ids.push_back(id);
  }
  return ids;
}

// Where a run's lines go, and what happens to each generated token.
struct RunOutput {
  std::FILE* info = stdout;  // banner, notes, summary: stdout with --tokens, stderr with text
  bool print_ids = true;     // --tokens: the "prompt:" and "generated:" lines
  TokenSink sink;            // text: print each token as it comes; stop at EOG
};

void PrintTokens(const std::vector<int32_t>& prompt, const std::vector<int32_t>& generated) {
  std::printf("prompt: %s\n", absl::StrJoin(prompt, " ").c_str());
  std::printf("generated: %s\n", absl::StrJoin(generated, " ").c_str());
}

// The prompt: token ids from --tokens, or text from -p or -f (exactly one).
struct PromptSource {
  std::vector<int32_t> ids;
  std::optional<std::string> text;
};

absl::StatusOr<PromptSource> ReadPromptSource() {
  const std::string tokens = absl::GetFlag(FLAGS_tokens);
  MG_ASSIGN_OR_RETURN(std::optional<std::string> text, PromptText());
  const bool has_tokens = !absl::StripAsciiWhitespace(tokens).empty();
  if (has_tokens == text.has_value()) {
    return absl::InvalidArgumentError(
        has_tokens ? "give the prompt once: -p TEXT, -f FILE or --tokens IDS"
                   : "a prompt is required: -p TEXT, -f FILE or --tokens IDS (e.g. 1,2,3)");
  }
  PromptSource source;
  if (has_tokens) {
    MG_ASSIGN_OR_RETURN(source.ids, ParseTokens(tokens));
  } else {
    source.text = std::move(text);
  }
  return source;
}

absl::Status Run() {
  const std::string path = absl::GetFlag(FLAGS_m);
  if (path.empty()) return absl::InvalidArgumentError("-m FILE is required");
  MG_ASSIGN_OR_RETURN(PromptSource source, ReadPromptSource());
  MG_ASSIGN_OR_RETURN(const int n_flag, TokensToGenerate(kRunDefaultTokens));
  const int ctx_flag = absl::GetFlag(FLAGS_ctx);
  if (ctx_flag < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--ctx %d must not be negative (0: the prompt and -n, at most the "
                        "model's context length)",
                        ctx_flag));
  }
  MG_ASSIGN_OR_RETURN(DecoderFlags flags, ReadDecoderFlags());

  MG_ASSIGN_OR_RETURN(const std::unique_ptr<GgufFile> file, GgufFile::Open(path));
  MG_ASSIGN_OR_RETURN(Model model, LoadModel(*file));

  // Text: the file's own tokenizer, specials parsed and BOS added as llama-cli does.
  std::unique_ptr<Tokenizer> tokenizer;
  std::vector<int32_t>& prompt = source.ids;
  if (source.text.has_value()) {
    MG_ASSIGN_OR_RETURN(Vocab vocab, Vocab::FromGguf(*file));
    MG_ASSIGN_OR_RETURN(tokenizer, Tokenizer::Create(std::move(vocab)));
    absl::StatusOr<std::vector<int32_t>> ids = tokenizer->Tokenize(*source.text, true, true);
    if (!ids.ok())
      return absl::InvalidArgumentError(absl::StrCat("-p/-f: ", ids.status().message()));
    if (ids->empty()) return absl::InvalidArgumentError("-p/-f: the prompt has no tokens");
    prompt = std::move(*ids);
  }
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= model.config.n_vocab) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--tokens: token %d (position %d) is outside the vocabulary [0, %d) of %s", prompt[i], i,
          model.config.n_vocab, path));
    }
  }
  // Generate feeds every generated token back but the last.
  const int n_prompt = static_cast<int>(prompt.size());
  int ctx = ctx_flag;
  int n_predict = n_flag;
  if (n_flag == kUntilTheEnd) {
    const int trained = model.config.n_ctx_train;
    if (ctx == 0) ctx = trained > 0 ? std::min(kUntilTheEndContext, trained) : kUntilTheEndContext;
    if (n_prompt >= ctx) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--ctx %d: the prompt's %d token%s leave no room to generate (-n -1)", ctx, n_prompt,
          n_prompt == 1 ? "" : "s"));
    }
    n_predict = ctx - n_prompt + 1;
  } else {
    const int64_t needed = int64_t{n_prompt} + (n_predict > 0 ? n_predict - 1 : 0);
    if (ctx > 0 && ctx < needed) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--ctx %d is too small: the prompt's %d token%s and -n %d need %d", ctx,
                          n_prompt, n_prompt == 1 ? "" : "s", n_predict, needed));
    }
    if (ctx == 0) {
      // As llama.cpp's -c 0, the context is at most the model's: -n never
      // sizes memory past it; a longer -n stops when the context is full.
      const int trained = model.config.n_ctx_train;
      const int64_t most = std::max<int64_t>(trained > 0 ? trained : kUntilTheEndContext,
                                             int64_t{n_prompt} + 1);
      ctx = static_cast<int>(std::min(needed, most));
      if (needed > ctx) {
        n_predict = ctx - n_prompt + 1;
        std::fprintf(stderr,
                     "note: -n %d: the context (--ctx 0: %d positions, the model's context "
                     "length) holds %d generated tokens after the prompt's %d; generation stops "
                     "there (--ctx N sizes it)\n",
                     n_flag, ctx, n_predict, n_prompt);
      }
    }
  }

  RunOutput out;
  TextStream stream;
  if (tokenizer != nullptr) {
    // The text goes to stdout as it comes, everything else to stderr.
    out.info = stderr;
    out.print_ids = false;
    const bool ignore_eos = absl::GetFlag(FLAGS_ignore_eos);
    const bool special = absl::GetFlag(FLAGS_special);
    out.sink = [&, ignore_eos, special](int32_t token) {
      if (!ignore_eos && tokenizer->vocab().IsEog(token)) return false;
      const std::string text = stream.Push(tokenizer->Piece(token, special));
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fflush(stdout);
      return true;
    };
  }
  MG_RETURN_IF_ERROR(ApplyExpertsUsed(flags, path, &model, out.info));
  MG_RETURN_IF_ERROR(CheckContext(model, flags.cuda, flags.cpu, ctx, out.info));
  MG_RETURN_IF_ERROR(AutoHostCache(model, ctx, &flags, out.info));
  MG_RETURN_IF_ERROR(CheckHostCache(model, flags.host_cache_bytes));
  MG_RETURN_IF_ERROR(ReadWeights(file.get(), flags.load, stderr));
  std::fputs(StartupLines(flags).c_str(), out.info);
  std::unique_ptr<Decoder> decoder;
  {
    const InterruptsBlocked blocked;
    MG_ASSIGN_OR_RETURN(decoder, Decoder::Create(model, flags, ctx, out.info));
  }
  // Ctrl-C ends the generation at the next token; the summary follows (130).
  // (Ids with several steps a launch keep no sink: it would add a readback a
  // launch; there the run goes on to -n before its summary, and a second
  // Ctrl-C ends it at once.)
  CatchInterrupts();
  TokenSink sink;
  if (out.sink || flags.steps_per_launch == 1) {
    sink = [&out](int32_t token) { return !Interrupted() && (!out.sink || out.sink(token)); };
  }
  GenerateStats stats;
  absl::StatusOr<std::vector<int32_t>> generated =
      decoder->Generate(prompt, n_predict, /*start=*/0, &stats, sink);
  if (tokenizer != nullptr) {
    // The text ends its line before the summary starts one (on a terminal the
    // two streams share the screen).
    const std::string rest = stream.Flush();
    std::fwrite(rest.data(), 1, rest.size(), stdout);
    std::fputc('\n', stdout);
    std::fflush(stdout);
  }
  if (!generated.ok()) return generated.status();
  if (out.print_ids) PrintTokens(prompt, *generated);
  MG_RETURN_IF_ERROR(decoder->PrintSummary(out.info, stats, generated->size()));
  if (Interrupted()) ExitInterrupted();
  return absl::OkStatus();
}

}  // namespace

int RunRun(const std::vector<std::string>& args) { return RunModelCommand("run", args, Run); }

}  // namespace moegraph
