// Token log-probabilities as a server reports them (OpenAI's logprobs and
// top_logprobs, llama-server's n_probs) and lm-evaluation-harness reads them:
// the model's own distribution, log-softmax of the logits at temperature 1
// with no truncation (llama-server's post_sampling_probs false), computed as
// perplexity's TokenNll so that a text scored here and by `moegraph
// perplexity` gives the same numbers.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moegraph {

class Oracle;

// log p(token) under logits: the max in float, the sum of expf in double
// (llama.cpp's log_softmax in tools/perplexity/perplexity.cpp).
double TokenLogprob(absl::Span<const float> logits, int32_t token);

struct TokenLogprobs {
  int32_t token = 0;
  double logprob = 0;                           // log p(token)
  std::vector<std::pair<int32_t, double>> top;  // the likeliest, first first; ties: lower id
};

// token's log-probability and the top_n likeliest tokens' at one position;
// each value is TokenLogprob's for its token, so the token's own equals its
// entry in top where it is there (lm-evaluation-harness's is_greedy test).
TokenLogprobs LogprobsAt(absl::Span<const float> logits, int32_t token, int top_n);

// The log-probabilities of tokens[from..] each after the tokens before it
// (from >= 1), computed on model from position start (its cache below start
// kept; start < from), pieces of at most `piece` positions at a time so a
// long text's logits are never held at once. The cache then holds
// tokens[0, size - 1). Errors: model's (a full cache, a token out of range).
absl::StatusOr<std::vector<TokenLogprobs>> ScoreTokens(Oracle& model,
                                                       absl::Span<const int32_t> tokens,
                                                       int start, int from, int top_n,
                                                       int piece);

}  // namespace moegraph
