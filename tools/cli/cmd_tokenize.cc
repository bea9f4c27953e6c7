// moegraph tokenize: text to token ids with a GGUF file's own vocabulary, as
// llama-tokenize prints them. Reads the file's metadata only (text/tokenizer.h).
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "loader/gguf.h"
#include "loader/status_util.h"
#include "text/tokenizer.h"
#include "text/vocab.h"
#include "tools/cli/commands.h"

ABSL_FLAG(bool, ids, false, "tokenize: print the ids as [1, 2, 3] instead of one token a line");
ABSL_FLAG(bool, no_bos, false, "tokenize: add no BOS or EOS, even where the vocabulary adds them");
ABSL_FLAG(bool, no_parse_special, false,
          "tokenize: special tokens written in the text stay text (user-defined ones are "
          "still matched, as in llama.cpp)");

namespace moegraph {
namespace {

absl::Status Tokenize() {
  const std::string path = absl::GetFlag(FLAGS_m);
  if (path.empty()) return absl::InvalidArgumentError("-m FILE is required");
  MG_ASSIGN_OR_RETURN(const std::optional<std::string> text, PromptText());
  if (!text.has_value()) return absl::InvalidArgumentError("-p TEXT or -f FILE is required");
  MG_ASSIGN_OR_RETURN(const std::unique_ptr<GgufFile> file, GgufFile::Open(path));
  MG_ASSIGN_OR_RETURN(Vocab vocab, Vocab::FromGguf(*file));
  MG_ASSIGN_OR_RETURN(const std::unique_ptr<Tokenizer> tokenizer,
                      Tokenizer::Create(std::move(vocab)));
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer->Tokenize(
      *text, !absl::GetFlag(FLAGS_no_bos), !absl::GetFlag(FLAGS_no_parse_special));
  if (!ids.ok()) return absl::InvalidArgumentError(absl::StrCat("-p/-f: ", ids.status().message()));
  if (absl::GetFlag(FLAGS_ids)) {
    std::printf("[%s]\n", absl::StrJoin(*ids, ", ").c_str());
    return absl::OkStatus();
  }
  for (const int32_t id : *ids) {
    std::printf("%6d -> '%s'\n", id, tokenizer->Piece(id, /*special=*/true).c_str());
  }
  return absl::OkStatus();
}

}  // namespace

int RunTokenize(const std::vector<std::string>& args) {
  return RunModelCommand("tokenize", args, Tokenize);
}

}  // namespace moegraph
