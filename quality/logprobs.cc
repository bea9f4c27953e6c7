#include "quality/logprobs.h"

#include <algorithm>
#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "reference/oracle.h"

namespace moegraph {
namespace {

// max and log(sum exp(l - max)), as TokenLogprob takes them.
struct LogSumExp {
  float max_logit;
  double log_sum;
};

LogSumExp Normalizer(absl::Span<const float> logits) {
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  double sum_exp = 0;
  for (float l : logits) sum_exp += std::exp(l - max_logit);
  return {max_logit, std::log(sum_exp)};
}

double Logprob(absl::Span<const float> logits, int32_t token, const LogSumExp& n) {
  return logits[token] - n.max_logit - n.log_sum;
}

}  // namespace

double TokenLogprob(absl::Span<const float> logits, int32_t token) {
  return Logprob(logits, token, Normalizer(logits));
}

TokenLogprobs LogprobsAt(absl::Span<const float> logits, int32_t token, int top_n) {
  const LogSumExp n = Normalizer(logits);
  TokenLogprobs out;
  out.token = token;
  out.logprob = Logprob(logits, token, n);
  const int k = std::clamp(top_n, 0, static_cast<int>(logits.size()));
  if (k == 0) return out;
  std::vector<int32_t> ids(logits.size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  for (int i = 0; i < k; ++i) out.top.emplace_back(ids[i], Logprob(logits, ids[i], n));
  return out;
}

absl::StatusOr<std::vector<TokenLogprobs>> ScoreTokens(Oracle& model,
                                                       absl::Span<const int32_t> tokens,
                                                       int start, int from, int top_n,
                                                       int piece) {
  const int size = static_cast<int>(tokens.size());
  if (from < 1 || start < 0 || start >= from || from > size || piece < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "scoring %d tokens from %d (computed from %d, %d at a time)", size, from, start, piece));
  }
  model.Truncate(start);
  std::vector<TokenLogprobs> out;
  out.reserve(size - from);
  // Position p's logits predict token p + 1; the last token is not fed.
  for (int first = start; first < size - 1; first += piece) {
    const int count = std::min(piece, size - 1 - first);
    absl::StatusOr<std::vector<float>> logits = model.Forward(tokens.subspan(first, count));
    if (!logits.ok()) return logits.status();
    const size_t n_vocab = logits->size() / count;
    for (int p = std::max(first, from - 1); p < first + count; ++p) {
      const absl::Span<const float> row(logits->data() + (p - first) * n_vocab, n_vocab);
      out.push_back(LogprobsAt(row, tokens[p + 1], top_n));
    }
  }
  return out;
}

}  // namespace moegraph
