// moegraph run: decode of a text prompt (-p, -f), printed as text while it is
// generated, or of token ids (--tokens), printed as ids, with tok/s; greedy, or
// sampled with llama.cpp's flags. The backend (tools/cli/decoder.h) is the CUDA
// engine, each step one graph replay with experts in pinned host memory, or the
// CPU backend, the same expert path on the host.
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

ABSL_FLAG(std::string, tokens, "",
          "run: prompt token ids, comma-separated (e.g. 1,2,3), instead of -p/-f text; the "
          "output is ids too");
ABSL_FLAG(int32_t, n, moegraph::kDefaultTokensFlag,
          "tokens to generate (default: run 16, bench 128; chat: a reply's limit, default "
          "until its end)");
ABSL_FLAG(bool, ignore_eos, false,
          "run: with -p/-f, go on past end-of-generation tokens (EOS, EOT, <|im_end|>, ...)");
ABSL_FLAG(bool, special, false, "run (with -p/-f), chat: print control tokens' text too");

namespace moegraph {
namespace {

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

// One generation on the backend the flags pick, with its lines.
absl::Status Decode(const Model& model, const DecoderFlags& flags,
                    const std::vector<int32_t>& prompt, int n_predict, int ctx,
                    const RunOutput& out) {
  MG_ASSIGN_OR_RETURN(std::unique_ptr<Decoder> decoder,
                      Decoder::Create(model, flags, ctx, out.info));
  GenerateStats stats;
  MG_ASSIGN_OR_RETURN(std::vector<int32_t> generated,
                      decoder->Generate(prompt, n_predict, /*start=*/0, &stats, out.sink));
  if (out.print_ids) PrintTokens(prompt, generated);
  return decoder->PrintSummary(out.info, stats, generated.size());
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
  const int n_flag = absl::GetFlag(FLAGS_n);
  const int n_predict = n_flag == kDefaultTokensFlag ? kRunDefaultTokens : n_flag;
  if (n_predict < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("-n %d must not be negative", n_predict));
  }
  MG_ASSIGN_OR_RETURN(const DecoderFlags flags, ReadDecoderFlags());

  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  if (!file.ok()) return file.status();
  absl::StatusOr<Model> model = LoadModel(**file);
  if (!model.ok()) return model.status();

  // Text: the file's own tokenizer, specials parsed and BOS added as llama-cli does.
  std::unique_ptr<Tokenizer> tokenizer;
  std::vector<int32_t>& prompt = source.ids;
  if (source.text.has_value()) {
    MG_ASSIGN_OR_RETURN(Vocab vocab, Vocab::FromGguf(**file));
    MG_ASSIGN_OR_RETURN(tokenizer, Tokenizer::Create(std::move(vocab)));
    absl::StatusOr<std::vector<int32_t>> ids = tokenizer->Tokenize(*source.text, true, true);
    if (!ids.ok())
      return absl::InvalidArgumentError(absl::StrCat("-p/-f: ", ids.status().message()));
    if (ids->empty()) return absl::InvalidArgumentError("-p/-f: the prompt has no tokens");
    prompt = std::move(*ids);
  }
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= model->config.n_vocab) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--tokens: token %d (position %d) is outside the vocabulary [0, %d) of %s", prompt[i], i,
          model->config.n_vocab, path));
    }
  }
  // Generate feeds every generated token back but the last.
  const int needed = static_cast<int>(prompt.size()) + (n_predict > 0 ? n_predict - 1 : 0);
  int ctx = absl::GetFlag(FLAGS_ctx);
  if (ctx < 0 || (ctx > 0 && ctx < needed)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--ctx %d is too small: %d prompt tokens and %d generated need %d", ctx,
                        prompt.size(), n_predict, needed));
  }
  if (ctx == 0) ctx = needed;

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
  std::fprintf(out.info, "%s\n%s\n", flags.doors.banner.c_str(),
               DescribeSampling(flags.sampling).c_str());
  const absl::Status status = Decode(*model, flags, prompt, n_predict, ctx, out);
  if (tokenizer != nullptr) {
    const std::string rest = stream.Flush();
    std::fwrite(rest.data(), 1, rest.size(), stdout);
    std::fputc('\n', stdout);
  }
  return status;
}

}  // namespace

int RunRun(const std::vector<std::string>& args) { return RunModelCommand("run", args, Run); }

}  // namespace moegraph
