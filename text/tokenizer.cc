#include "text/tokenizer.h"

#include <algorithm>
#include <queue>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "loader/status_util.h"
#include "text/unicode.h"

namespace moegraph {
namespace {

// A stretch of the text still to tokenize, or a special token found in it.
struct Fragment {
  int32_t token = kNoToken;  // kNoToken: text
  size_t offset = 0;
  size_t length = 0;
};

// One piece of a word during merging: a run of its bytes, linked to its neighbours.
struct Symbol {
  int prev = -1;
  int next = -1;
  size_t offset = 0;
  size_t n = 0;
};

// The text as one symbol per UTF-8 character, linked in order.
std::vector<Symbol> CharacterSymbols(std::string_view text) {
  std::vector<Symbol> symbols;
  for (size_t offset = 0; offset < text.size();) {
    Symbol s;
    s.n = std::min(text.size() - offset,
                   static_cast<size_t>(Utf8SequenceLength(static_cast<uint8_t>(text[offset]))));
    s.offset = offset;
    offset += s.n;
    s.prev = static_cast<int>(symbols.size()) - 1;
    s.next = offset == text.size() ? -1 : static_cast<int>(symbols.size()) + 1;
    symbols.push_back(s);
  }
  return symbols;
}

// Merges the symbol right into left, its neighbour, and unlinks it.
void MergeSymbols(std::vector<Symbol>* symbols, int left, int right) {
  Symbol& l = (*symbols)[static_cast<size_t>(left)];
  Symbol& r = (*symbols)[static_cast<size_t>(right)];
  l.n += r.n;
  r.n = 0;
  l.next = r.next;
  if (r.next >= 0) (*symbols)[static_cast<size_t>(r.next)].prev = left;
}

struct Bigram {
  int left = 0;
  int right = 0;
  int32_t rank = 0;
  std::string text;
};

// The queue pops the lowest rank, then the leftmost pair.
struct LaterBigram {
  bool operator()(const Bigram& a, const Bigram& b) const {
    return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
  }
};

// SentencePiece: the pair whose token scores highest merges first, then the leftmost.
struct ScoredBigram {
  int left = 0;
  int right = 0;
  float score = 0;
  size_t size = 0;  // bytes of the pair when queued: a pair that changed since is stale
};

struct LowerScoredBigram {
  bool operator()(const ScoredBigram& a, const ScoredBigram& b) const {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  }
};

constexpr std::string_view kSpmSpace = "\xe2\x96\x81";  // U+2581, SentencePiece's space

// llama.cpp's clean_up_tokenization_spaces, pass for pass (llama_detokenize):
// " ?" " !" " ." " ," lose the space, a lone " ' " its spaces, " 's" " 'm"
// " 're" " 've" theirs. In place, as llama.cpp does it (a later pass reads what
// an earlier one wrote).
void CleanSpaces(std::string* s) {
  char* text = s->data();
  int total = static_cast<int>(s->size());
  const int total1 = total;
  total = total ? 1 : 0;
  for (int i = 1; i < total1; ++i) {
    const char x = text[i];
    if (text[i - 1] == ' ' && (x == '?' || x == '!' || x == '.' || x == ',')) total--;
    text[total++] = x;
  }
  const int total2 = total;
  total = total ? 1 : 0;
  for (int i = 1; i < total2; ++i) {
    const char x = text[i];
    if (x == '\'' && i + 1 < total2 && text[i - 1] == ' ' && text[i + 1] == ' ') {
      total--;
      text[++i] = '\0';
    }
    text[total++] = x;
  }
  const int total3 = total;
  total = total ? 1 : 0;
  for (int i = 1; i < total3; ++i) {
    const char x = text[i];
    if (text[i - 1] == ' ' && x == '\'' && i + 1 < total3) {
      const char x1 = text[i + 1];
      if (x1 == 's' || x1 == 'm') {
        total--;
      } else if (i + 2 < total3) {
        const char x2 = text[i + 2];
        if ((x1 == 'r' && x2 == 'e') || (x1 == 'v' && x2 == 'e')) total--;
      }
    }
    text[total++] = x;
  }
  s->resize(static_cast<size_t>(total));
}

}  // namespace

Tokenizer::Tokenizer(Vocab vocab, std::optional<PreTokenizer> pre)
    : vocab_(std::move(vocab)), pre_(std::move(pre)) {
  ignore_merges_ = vocab_.pre == "llama-bpe" || vocab_.pre == "llama3" || vocab_.pre == "llama-v3";
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Create(Vocab vocab) {
  std::optional<PreTokenizer> pre;
  // SentencePiece has no pre-tokenizer: llama.cpp ignores tokenizer.ggml.pre for it.
  if (vocab.model == TokenizerModel::kGpt2) {
    MG_ASSIGN_OR_RETURN(pre, PreTokenizer::ForName(vocab.pre));
  }
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(vocab), std::move(pre)));
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Tokenize(std::string_view text, bool add_special,
                                                         bool parse_special) const {
  if (const size_t bad = FindInvalidUtf8(text); bad != std::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the text is not valid UTF-8 at byte %d (0x%02x)", bad, static_cast<uint8_t>(text[bad])));
  }
  std::vector<Fragment> fragments;
  if (!text.empty()) fragments.push_back({kNoToken, 0, text.size()});
  std::vector<Fragment> split;
  for (const int32_t id : vocab_.special_tokens) {
    const TokenType type = vocab_.types[static_cast<size_t>(id)];
    if (!parse_special && type != TokenType::kUserDefined) continue;
    const std::string& special = vocab_.tokens[static_cast<size_t>(id)];
    if (special.empty()) continue;
    split.clear();
    for (const Fragment& f : fragments) {
      if (f.token != kNoToken) {
        split.push_back(f);
        continue;
      }
      size_t begin = f.offset;
      const size_t end = f.offset + f.length;
      while (begin < end) {
        const size_t at = text.substr(0, end).find(special, begin);
        if (at == std::string_view::npos) break;
        if (at > begin) split.push_back({kNoToken, begin, at - begin});
        split.push_back({id, at, special.size()});
        begin = at + special.size();
      }
      if (begin < end) split.push_back({kNoToken, begin, end - begin});
    }
    std::swap(fragments, split);
  }

  std::vector<int32_t> out;
  if (add_special && vocab_.add_bos) out.push_back(vocab_.bos);
  bool after_special = true;  // the start of the text counts as following one
  for (const Fragment& f : fragments) {
    if (f.token != kNoToken) {
      out.push_back(f.token);
      after_special = true;
      continue;
    }
    const std::string_view stretch = text.substr(f.offset, f.length);
    if (pre_.has_value()) {
      for (const std::string& word : pre_->Split(stretch)) TokenizeWord(word, &out);
    } else {
      std::string escaped(vocab_.add_space_prefix && after_special ? kSpmSpace : "");
      escaped += absl::StrReplaceAll(Av(stretch), {{" ", Av(kSpmSpace)}});
      MG_RETURN_IF_ERROR(TokenizeSentencePiece(escaped, &out));
    }
    after_special = false;
  }
  if (add_special && vocab_.add_eos) out.push_back(vocab_.eos);
  return out;
}

void Tokenizer::TokenizeWord(const std::string& word, std::vector<int32_t>* out) const {
  if (ignore_merges_) {
    if (const int32_t id = vocab_.Find(word); id != kNoToken) {
      out->push_back(id);
      return;
    }
  }
  std::vector<Symbol> symbols = CharacterSymbols(word);
  auto text_of = [&](const Symbol& s) { return std::string_view(word).substr(s.offset, s.n); };

  std::priority_queue<Bigram, std::vector<Bigram>, LaterBigram> queue;
  auto add_bigram = [&](int left, int right) {
    if (left == -1 || right == -1) return;
    const std::string_view a = text_of(symbols[static_cast<size_t>(left)]);
    const std::string_view b = text_of(symbols[static_cast<size_t>(right)]);
    const int32_t rank = vocab_.MergeRank(a, b);
    if (rank < 0) return;
    queue.push({left, right, rank, std::string(a) + std::string(b)});
  };
  for (int i = 1; i < static_cast<int>(symbols.size()); ++i) add_bigram(i - 1, i);

  while (!queue.empty()) {
    const Bigram bigram = queue.top();
    queue.pop();
    const Symbol& left = symbols[static_cast<size_t>(bigram.left)];
    const Symbol& right = symbols[static_cast<size_t>(bigram.right)];
    // Outdated: one side was merged away or grew since the pair was queued.
    if (left.n == 0 || right.n == 0 ||
        std::string(text_of(left)) + std::string(text_of(right)) != bigram.text) {
      continue;
    }
    MergeSymbols(&symbols, bigram.left, bigram.right);
    add_bigram(left.prev, bigram.left);
    add_bigram(bigram.left, left.next);
  }

  for (int i = 0; i != -1 && !symbols.empty(); i = symbols[static_cast<size_t>(i)].next) {
    const Symbol& s = symbols[static_cast<size_t>(i)];
    if (s.n == 0) continue;
    const std::string_view piece = text_of(s);
    if (const int32_t id = vocab_.Find(piece); id != kNoToken) {
      out->push_back(id);
      continue;
    }
    // Not in the vocabulary: each byte on its own, where it is a token.
    for (char c : piece) {
      if (const int32_t id = vocab_.Find(std::string(1, c)); id != kNoToken) out->push_back(id);
    }
  }
}

absl::Status Tokenizer::TokenizeSentencePiece(std::string_view text,
                                              std::vector<int32_t>* out) const {
  std::vector<Symbol> symbols = CharacterSymbols(text);

  std::priority_queue<ScoredBigram, std::vector<ScoredBigram>, LowerScoredBigram> queue;
  // Linked symbols are adjacent in text, so a pair's text is one substring.
  auto add_bigram = [&](int left, int right) {
    if (left == -1 || right == -1) return;
    const Symbol& l = symbols[static_cast<size_t>(left)];
    const size_t size = l.n + symbols[static_cast<size_t>(right)].n;
    const int32_t id = vocab_.Find(text.substr(l.offset, size));
    if (id == kNoToken) return;
    queue.push({left, right, vocab_.scores[static_cast<size_t>(id)], size});
  };
  for (int i = 1; i < static_cast<int>(symbols.size()); ++i) add_bigram(i - 1, i);

  while (!queue.empty()) {
    const ScoredBigram bigram = queue.top();
    queue.pop();
    const Symbol& left = symbols[static_cast<size_t>(bigram.left)];
    const Symbol& right = symbols[static_cast<size_t>(bigram.right)];
    if (left.n == 0 || right.n == 0 || left.n + right.n != bigram.size) continue;
    MergeSymbols(&symbols, bigram.left, bigram.right);
    add_bigram(left.prev, bigram.left);
    add_bigram(bigram.left, left.next);
  }

  // Every merge made a token, so a symbol that is not one is a single
  // character the vocabulary lacks: its bytes as byte tokens.
  for (int i = 0; i != -1 && !symbols.empty(); i = symbols[static_cast<size_t>(i)].next) {
    const Symbol& s = symbols[static_cast<size_t>(i)];
    const std::string_view piece = text.substr(s.offset, s.n);
    if (const int32_t id = vocab_.Find(piece); id != kNoToken) {
      out->push_back(id);
      continue;
    }
    for (const char c : piece) {
      const int32_t id = vocab_.byte_token[static_cast<uint8_t>(c)];
      if (id == kNoToken) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "the vocabulary has no token for '%s' and no byte token <0x%02X> to spell it", piece,
            static_cast<uint8_t>(c)));
      }
      out->push_back(id);
    }
  }
  return absl::OkStatus();
}

std::string Tokenizer::Piece(int32_t id, bool special) const {
  if (id < 0 || id >= vocab_.size()) return "";
  const TokenType type = vocab_.types[static_cast<size_t>(id)];
  const std::string& text = vocab_.tokens[static_cast<size_t>(id)];
  if (type == TokenType::kUserDefined) return text;
  if (type == TokenType::kControl || type == TokenType::kUnknown) return special ? text : "";
  const bool spm = vocab_.model == TokenizerModel::kLlama;
  if (type == TokenType::kByte && spm)
    return std::string(1, static_cast<char>(vocab_.TokenByte(id)));
  if (type != TokenType::kNormal) return "";
  if (spm) return absl::StrReplaceAll(text, {{Av(kSpmSpace), " "}});
  std::string bytes;
  if (ByteDecode(text, &bytes)) return bytes;
  // A symbol outside the byte alphabet, written as llama.cpp writes it.
  std::string out;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t n =
        std::min(text.size() - pos,
                 static_cast<size_t>(Utf8SequenceLength(static_cast<uint8_t>(text[pos]))));
    const std::string_view symbol = std::string_view(text).substr(pos, n);
    std::string byte;
    if (ByteDecode(symbol, &byte)) {
      out += byte;
    } else {
      out += "[UNK_BYTE_0x";
      for (char c : symbol) out += absl::StrFormat("%02x", static_cast<uint8_t>(c));
      out += text + "]";
    }
    pos += n;
  }
  return out;
}

std::string TextStream::Push(std::string_view piece) {
  pending_.append(piece.data(), piece.size());
  // Hold back a lead byte at the end whose character has not arrived whole.
  size_t complete = pending_.size();
  for (size_t back = 1; back <= 3 && back <= pending_.size(); ++back) {
    const auto b = static_cast<uint8_t>(pending_[pending_.size() - back]);
    if ((b & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    if (b >= 0xC0 && static_cast<size_t>(Utf8SequenceLength(b)) > back) {
      complete = pending_.size() - back;
    }
    break;
  }
  std::string out = pending_.substr(0, complete);
  pending_.erase(0, complete);
  return out;
}

std::string TextStream::Flush() { return std::exchange(pending_, std::string()); }

std::string Tokenizer::Detokenize(const std::vector<int32_t>& ids, bool special) const {
  std::string out;
  bool remove_space = vocab_.add_space_prefix;
  for (const int32_t id : ids) {
    std::string piece = Piece(id, special);
    if (remove_space && !piece.empty() && piece.front() == ' ') piece.erase(0, 1);
    remove_space = false;  // only the first token's, whatever it is
    out += piece;
  }
  if (vocab_.clean_spaces) CleanSpaces(&out);
  return out;
}

}  // namespace moegraph
