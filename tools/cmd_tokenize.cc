// moegraph tokenize: text to token ids with a GGUF file's own vocabulary, as
// llama-tokenize prints them. Reads the file's metadata only (text/tokenizer.h).
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
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
#include "tools/commands.h"

ABSL_FLAG(std::string, f, "", "tokenize: read the text from this file instead of -p");
ABSL_FLAG(bool, ids, false, "tokenize: print the ids as [1, 2, 3] instead of one token a line");
ABSL_FLAG(bool, no_bos, false, "tokenize: add no BOS or EOS, even where the vocabulary adds them");
ABSL_FLAG(bool, no_parse_special, false,
          "tokenize: special tokens written in the text stay text (user-defined ones are "
          "still matched, as in llama.cpp)");

namespace moegraph {
namespace {

absl::StatusOr<std::string> Text() {
  const std::string path = absl::GetFlag(FLAGS_f);
  const std::string prompt = absl::GetFlag(FLAGS_p);
  if (!path.empty() && !prompt.empty()) {
    return absl::InvalidArgumentError("-p TEXT and -f FILE: give one of them");
  }
  if (path.empty()) return prompt;
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("-f ", path, ": cannot read the file"));
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

absl::Status Tokenize() {
  const std::string path = absl::GetFlag(FLAGS_m);
  if (path.empty()) return absl::InvalidArgumentError("-m FILE is required");
  MG_ASSIGN_OR_RETURN(const std::string text, Text());
  MG_ASSIGN_OR_RETURN(const std::unique_ptr<GgufFile> file, GgufFile::Open(path));
  MG_ASSIGN_OR_RETURN(Vocab vocab, Vocab::FromGguf(*file));
  MG_ASSIGN_OR_RETURN(const std::unique_ptr<Tokenizer> tokenizer,
                      Tokenizer::Create(std::move(vocab)));
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer->Tokenize(
      text, !absl::GetFlag(FLAGS_no_bos), !absl::GetFlag(FLAGS_no_parse_special));
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
