#include "text/tokenizer.h"

#include <algorithm>
#include <queue>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
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

// One piece of a word during BPE: a run of its bytes, linked to its neighbours.
struct Symbol {
  int prev = -1;
  int next = -1;
  size_t offset = 0;
  size_t n = 0;
};

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

}  // namespace

Tokenizer::Tokenizer(Vocab vocab, PreTokenizer pre)
    : vocab_(std::move(vocab)), pre_(std::move(pre)) {
  ignore_merges_ = vocab_.pre == "llama-bpe" || vocab_.pre == "llama3" || vocab_.pre == "llama-v3";
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Create(Vocab vocab) {
  if (vocab.model != TokenizerModel::kGpt2) {
    return absl::UnimplementedError(absl::StrFormat(
        "tokenizer.ggml.model '%s': SentencePiece tokenization is not in moegraph yet (issue 10); "
        "gpt2 (byte-level BPE) is",
        Av(vocab.model_name)));
  }
  MG_ASSIGN_OR_RETURN(PreTokenizer pre, PreTokenizer::ForName(vocab.pre));
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(vocab), std::move(pre)));
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Tokenize(std::string_view text, bool add_special,
                                                         bool parse_special) const {
  if (const size_t bad = FindInvalidUtf8(text); bad != std::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the text is not valid UTF-8 at byte %d (0x%02x)", bad, static_cast<uint8_t>(text[bad])));
  }
  std::vector<Fragment> fragments = {{kNoToken, 0, text.size()}};
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
  for (const Fragment& f : fragments) {
    if (f.token != kNoToken) {
      out.push_back(f.token);
      continue;
    }
    for (const std::string& word : pre_.Split(text.substr(f.offset, f.length))) {
      TokenizeWord(word, &out);
    }
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
  std::vector<Symbol> symbols;
  for (size_t offset = 0; offset < word.size();) {
    Symbol s;
    s.n = std::min(word.size() - offset,
                   static_cast<size_t>(Utf8SequenceLength(static_cast<uint8_t>(word[offset]))));
    s.offset = offset;
    offset += s.n;
    s.prev = static_cast<int>(symbols.size()) - 1;
    s.next = offset == word.size() ? -1 : static_cast<int>(symbols.size()) + 1;
    symbols.push_back(s);
  }
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
    Symbol& left = symbols[static_cast<size_t>(bigram.left)];
    Symbol& right = symbols[static_cast<size_t>(bigram.right)];
    // Outdated: one side was merged away or grew since the pair was queued.
    if (left.n == 0 || right.n == 0 ||
        std::string(text_of(left)) + std::string(text_of(right)) != bigram.text) {
      continue;
    }
    left.n += right.n;
    right.n = 0;
    left.next = right.next;
    if (right.next >= 0) symbols[static_cast<size_t>(right.next)].prev = bigram.left;
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

std::string Tokenizer::Piece(int32_t id, bool special) const {
  if (id < 0 || id >= vocab_.size()) return "";
  const TokenType type = vocab_.types[static_cast<size_t>(id)];
  const std::string& text = vocab_.tokens[static_cast<size_t>(id)];
  if (type == TokenType::kUserDefined) return text;
  if (type == TokenType::kControl || type == TokenType::kUnknown) return special ? text : "";
  if (type != TokenType::kNormal) return "";
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
  for (int32_t id : ids) out += Piece(id, special);
  return out;
}

}  // namespace moegraph
