// Perplexity and KL divergence as llama.cpp's llama-perplexity computes them
// (tools/perplexity/perplexity.cpp in llama.cpp v0.5.0: perplexity(),
// kl_divergence() and their log_softmax/process_logits helpers), so the numbers
// `moegraph perplexity` prints compare with llama.cpp's: the text in chunks of
// n_ctx tokens, each from an empty context (BOS first where the vocabulary adds
// it), scored on its second half: the logits of position j (n_ctx/2 <= j <
// n_ctx - 1) predict the token at j + 1. A base file of log-probabilities
// (--kl-divergence-base) is llama.cpp's format, so either engine reads the
// other's: "_logits_", n_ctx (u32), n_vocab and n_chunk (i32), the chunks'
// tokens (i32), then per scored position CompressedRowWidth(n_vocab) u16s (two
// floats, scale and the smallest log-probability kept, then each token's
// log-probability quantized to 16 bits over the top 16 nats).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moegraph {

// The chunks a text of n_tokens makes at n_ctx: n_tokens / n_ctx, at most
// max_chunks (< 0: all). Errors (naming -c, --chunks and the file): n_ctx below
// 4 (no second half to score), fewer than 2 * n_ctx tokens (llama.cpp's rule).
absl::StatusOr<int> PerplexityChunks(int64_t n_tokens, int n_ctx, int max_chunks,
                                     const std::string& text_file);

// Positions a chunk scores: n_ctx - 1 - n_ctx / 2.
inline int ScoredPositions(int n_ctx) { return n_ctx - 1 - n_ctx / 2; }

// -log p(tok) under logits, as llama.cpp's log_softmax: the max in float, the
// sum of expf in double.
double TokenNll(absl::Span<const float> logits, int32_t tok);

// Running sums of the negative log-likelihoods of scored tokens.
struct NllSums {
  double nll = 0, nll2 = 0;
  int64_t count = 0;
  void Add(double v) { nll += v, nll2 += v * v, ++count; }
  double Perplexity() const;
  // The final line's +/-: perplexity x the standard error of the mean nll.
  double PerplexityError() const;
};

// u16s a compressed row takes: 2 * ((n_vocab + 1) / 2) + 4.
inline int64_t CompressedRowWidth(int n_vocab) { return 2 * ((int64_t{n_vocab} + 1) / 2) + 4; }

// Writes logits' log-probabilities into out (CompressedRowWidth u16s) as
// llama.cpp's log_softmax(..., log_prob, tok) does; returns -log p(tok).
double CompressLogProbs(absl::Span<const float> logits, int32_t tok, uint16_t* out);

// What --kl-divergence accumulates over scored positions (llama.cpp's
// kl_divergence_result).
struct KlStats {
  double sum_nll = 0, sum_nll2 = 0, sum_nll_base = 0, sum_nll_base2 = 0, sum_nll_nll_base = 0;
  double sum_kld = 0, sum_kld2 = 0, sum_p_diff = 0, sum_p_diff2 = 0, sum_p_diff4 = 0;
  float max_p_diff = 0;
  int64_t n_same_top = 0, count = 0;
  std::vector<float> kld_values, p_diff_values;  // one a position, for the percentiles
};

// One scored position: logits against the base's compressed row (as written by
// CompressLogProbs), tok the token that follows.
void AccumulateKl(absl::Span<const float> logits, const uint16_t* base_row, int32_t tok,
                  KlStats* stats);

// The per-chunk line of --kl-divergence (chunk, PPL, ln ratio, KLD, RMS dp, same top).
std::string KlChunkLine(int chunk, const KlStats& s);
// The header line above the chunk lines.
std::string KlChunkHeader();
// The closing statistics (perplexity, KL divergence, token probability), or
// empty under 100 positions (llama.cpp prints none then).
std::string KlSummary(KlStats s);

// A base file being written (--kl-divergence-base): the header at Create, then
// each chunk's scored rows.
class BaseLogitsWriter {
 public:
  static absl::StatusOr<BaseLogitsWriter> Create(const std::string& path, int n_ctx, int n_vocab,
                                                 absl::Span<const int32_t> chunk_tokens,
                                                 int n_chunk);
  BaseLogitsWriter(BaseLogitsWriter&& other) noexcept;
  BaseLogitsWriter& operator=(BaseLogitsWriter&& other) noexcept;
  ~BaseLogitsWriter();
  absl::Status Write(absl::Span<const uint16_t> rows);
  absl::Status Close();

 private:
  BaseLogitsWriter(std::string path, std::FILE* file) : path_(std::move(path)), file_(file) {}
  std::string path_;
  std::FILE* file_;
};

// A base file read whole (--kl-divergence): errors name the file and what is
// wrong (not a base file, truncated, a vocabulary other than n_vocab).
struct BaseLogits {
  int n_ctx = 0, n_vocab = 0, n_chunk = 0;
  std::vector<int32_t> tokens;  // n_chunk * n_ctx
  std::vector<uint16_t> rows;   // n_chunk * ScoredPositions(n_ctx) * CompressedRowWidth
  static absl::StatusOr<BaseLogits> Read(const std::string& path, int n_vocab);
  const uint16_t* Row(int chunk, int scored) const;
};

}  // namespace moegraph
