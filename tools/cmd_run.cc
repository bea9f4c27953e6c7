// moegraph run: greedy decode of token ids, printed as ids, with tok/s.
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "loader/gguf.h"
#include "loader/model_config.h"
#include "reference/oracle.h"
#include "tools/commands.h"

ABSL_FLAG(std::string, tokens, "", "run: prompt token ids, comma-separated (e.g. 1,2,3)");
ABSL_FLAG(int32_t, n, 16, "run: number of tokens to generate");
ABSL_FLAG(std::string, backend, "auto", "run: cpu | cuda | auto (auto picks the best built in)");
ABSL_FLAG(int32_t, ctx, 0, "run: context size; 0 fits the prompt and the generated tokens");

namespace moegraph {
namespace {

absl::StatusOr<std::vector<int32_t>> ParseTokens(const std::string& text) {
  if (absl::StripAsciiWhitespace(text).empty()) {
    return absl::InvalidArgumentError("--tokens is required (e.g. --tokens 1,2,3)");
  }
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

std::string Rate(int tokens, double seconds) {
  return tokens > 0 && seconds > 0 ? absl::StrFormat("%.2f tok/s", tokens / seconds) : "n/a";
}

absl::Status Run() {
  const std::string path = absl::GetFlag(FLAGS_m);
  if (path.empty()) return absl::InvalidArgumentError("-m FILE is required");
  absl::StatusOr<std::vector<int32_t>> prompt = ParseTokens(absl::GetFlag(FLAGS_tokens));
  if (!prompt.ok()) return prompt.status();
  const int n_predict = absl::GetFlag(FLAGS_n);
  if (n_predict < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("-n %d must not be negative", n_predict));
  }
  const std::string backend = absl::GetFlag(FLAGS_backend);
  if (backend == "cuda") {
    return absl::UnimplementedError(
        "--backend cuda: the CUDA backend is not built in this version (use cpu or auto)");
  }
  if (backend != "cpu" && backend != "auto") {
    return absl::InvalidArgumentError(
        absl::StrFormat("--backend '%s' is not one of cpu, cuda, auto", backend));
  }
  // Generate feeds every generated token back but the last.
  const int needed = static_cast<int>(prompt->size()) + (n_predict > 0 ? n_predict - 1 : 0);
  int ctx = absl::GetFlag(FLAGS_ctx);
  if (ctx < 0 || (ctx > 0 && ctx < needed)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--ctx %d is too small: %d prompt tokens and %d generated need %d", ctx,
                        prompt->size(), n_predict, needed));
  }
  if (ctx == 0) ctx = needed;

  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  if (!file.ok()) return file.status();
  absl::StatusOr<Model> model = LoadModel(**file);
  if (!model.ok()) return model.status();
  for (size_t i = 0; i < prompt->size(); ++i) {
    const int32_t id = (*prompt)[i];
    if (id < 0 || id >= model->config.n_vocab) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--tokens: token %d (position %d) is outside the vocabulary [0, %d) of %s", id, i,
          model->config.n_vocab, path));
    }
  }

  // No GPU backend is built yet, so auto runs the CPU oracle.
  absl::StatusOr<std::unique_ptr<Oracle>> oracle = Oracle::Create(*model, ctx);
  if (!oracle.ok()) return oracle.status();
  GenerateStats stats;
  absl::StatusOr<std::vector<int32_t>> generated = (*oracle)->Generate(*prompt, n_predict, &stats);
  if (!generated.ok()) return generated.status();

  std::printf("prompt: %s\n", absl::StrJoin(*prompt, " ").c_str());
  std::printf("generated: %s\n", absl::StrJoin(*generated, " ").c_str());
  std::printf("backend cpu: %d prompt tokens, %s; %d generated, %s (%d decode steps)\n",
              stats.prompt_tokens, Rate(stats.prompt_tokens, stats.prompt_seconds).c_str(),
              static_cast<int>(generated->size()),
              Rate(stats.decode_steps, stats.decode_seconds).c_str(), stats.decode_steps);
  return absl::OkStatus();
}

}  // namespace

int RunRun(const std::vector<std::string>& args) {
  if (!args.empty()) {
    std::fprintf(stderr, "moegraph run: unexpected argument '%s' (the model goes in -m FILE)\n",
                 args[0].c_str());
    return 1;
  }
  const absl::Status status = Run();
  if (!status.ok()) {
    std::fprintf(stderr, "moegraph run: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}

}  // namespace moegraph
