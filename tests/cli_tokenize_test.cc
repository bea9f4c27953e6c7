// `moegraph tokenize` as a user runs it, on a fixture with the synthetic
// byte-level vocabulary: llama-tokenize's two output forms, and errors that name
// the flag or file.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "loader/fixture.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::ProcessResult;
using testing_util::RunProcessWithArgs;
using testing_util::TempPath;

ProcessResult Tokenize(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {MOEGRAPH_BIN, "tokenize"};
  argv.insert(argv.end(), args.begin(), args.end());
  return testing_util::RunProcess(argv);
}

class CliTokenizeTest : public testing_util::FixtureFileTest {
 protected:
  static void SetUpTestSuite() { WriteSuiteFixture(FixtureSpec(), "cli_tokenize.gguf"); }
};

TEST_F(CliTokenizeTest, OneTokenALineOrTheIdsAsAList) {
  const std::string text = "hi there,\tyou <|im_end|>!";
  const ProcessResult lines = Tokenize({"-m", fixture_path(), "-p", text});
  ASSERT_EQ(lines.exit_code, 0) << lines.err;
  // "    id -> 'piece'" a line (the text has no newline), the pieces spelling it out.
  std::vector<std::string> ids;
  std::string pieces;
  std::istringstream in(lines.out);
  for (std::string line; std::getline(in, line);) {
    const size_t arrow = line.find(" -> '");
    ASSERT_NE(arrow, std::string::npos) << line;
    ASSERT_EQ(line.back(), '\'') << line;
    ids.push_back(line.substr(line.find_first_not_of(' '), arrow - line.find_first_not_of(' ')));
    pieces += line.substr(arrow + 5, line.size() - arrow - 6);
  }
  EXPECT_EQ(pieces, text);
  const ProcessResult list = Tokenize({"-m", fixture_path(), "-p", text, "--ids"});
  ASSERT_EQ(list.exit_code, 0) << list.err;
  std::string want = "[";
  for (size_t i = 0; i < ids.size(); ++i) want += (i > 0 ? ", " : "") + ids[i];
  EXPECT_EQ(list.out, want + "]\n");
  // Without special parsing the control token is text, so more ids.
  const ProcessResult plain =
      Tokenize({"-m", fixture_path(), "-p", text, "--ids", "--no-parse-special"});
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  EXPECT_GT(plain.out.size(), list.out.size());
}

// -p and -f's text has its escapes processed as llama.cpp's
// string_process_escapes does, unless --no-escape: the escaped spelling
// tokenizes as the characters themselves.
TEST_F(CliTokenizeTest, EscapesAreProcessedAsLlamaCppDoes) {
  const std::string escaped = R"(a\nb\t\x41\"\'\\ \q \x4 \xZZ end\)";
  const std::string meant = "a\nb\tA\"'\\ \\q \\x4 \\xZZ end\\";
  const ProcessResult raw = Tokenize({"-m", fixture_path(), "-p", meant, "--ids", "--no-escape"});
  ASSERT_EQ(raw.exit_code, 0) << raw.err;
  for (const std::string& flag : {"", "-e", "--escape"}) {
    std::vector<std::string> args = {"-m", fixture_path(), "-p", escaped, "--ids"};
    if (!flag.empty()) args.push_back(flag);
    const ProcessResult r = Tokenize(args);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.out, raw.out) << flag;
  }
  const ProcessResult kept = Tokenize({"-m", fixture_path(), "-p", escaped, "--ids", "--no-escape"});
  ASSERT_EQ(kept.exit_code, 0) << kept.err;
  EXPECT_NE(kept.out, raw.out);
  const std::string file = TempPath("escapes.txt");
  {
    std::ofstream out(file, std::ios::binary);
    out << escaped;
  }
  const ProcessResult from_file = Tokenize({"-m", fixture_path(), "-f", file, "--ids"});
  ASSERT_EQ(from_file.exit_code, 0) << from_file.err;
  EXPECT_EQ(from_file.out, raw.out);
  std::remove(file.c_str());
}

// SentencePiece: BOS, a space in front, pairs merged by score ("el" outscores
// "ll" in the fixture's vocabulary).
TEST_F(CliTokenizeTest, SentencePieceVocabulariesTokenizeToo) {
  FixtureSpec spm;
  spm.arch = Arch::kMixtral;
  spm.n_vocab = 600;
  const std::string path = TempPath("cli_tokenize_spm600.gguf");
  ASSERT_TRUE(WriteFixture(spm, path).ok());
  const ProcessResult r = Tokenize({"-m", path, "-p", "hello"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "     1 -> '<s>'\n   448 -> ' h'\n   379 -> 'el'\n   571 -> 'lo'\n");
  std::remove(path.c_str());
}

TEST_F(CliTokenizeTest, ErrorsNameTheFlagOrFile) {
  const std::string missing = TempPath("no-such-text.txt");
  ProcessResult r = Tokenize({"-m", fixture_path(), "-p", "a", "-f", missing});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(testing_util::Contains(r.err, "-p TEXT and -f FILE"));
  r = Tokenize({"-m", fixture_path(), "-f", missing});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(testing_util::Contains(r.err, missing));
  r = Tokenize({"-p", "a"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(testing_util::Contains(r.err, "-m FILE is required"));

  const std::string bad = TempPath("not-utf8.txt");
  std::ofstream(bad, std::ios::binary) << "ok \xff\xfe";
  r = Tokenize({"-m", fixture_path(), "-f", bad});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(testing_util::Contains(r.err, "not valid UTF-8 at byte 3"));
  std::remove(bad.c_str());

  // A SentencePiece vocabulary without a token for a character and without byte
  // tokens to spell it (a 64-token fixture has those of 0x00..0x3C only).
  FixtureSpec spm;
  spm.arch = Arch::kMixtral;
  spm.n_vocab = 64;
  const std::string spm_path = TempPath("cli_tokenize_spm.gguf");
  ASSERT_TRUE(WriteFixture(spm, spm_path).ok());
  r = Tokenize({"-m", spm_path, "-p", "\xc3\xbf"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(testing_util::Contains(r.err, "-p/-f: the vocabulary has no token for"));
  std::remove(spm_path.c_str());
}

}  // namespace
}  // namespace moegraph
