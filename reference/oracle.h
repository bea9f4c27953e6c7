// The CPU oracle: a plain, obviously correct forward pass of the supported MoE
// architectures, computed as llama.cpp's src/models/*.cpp do, in f32 from
// dequantized weights (f64 accumulation where it is cheap). It is the reference
// every other backend is checked against; speed is not its concern.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/sample_math.h"
#include "loader/model_config.h"

namespace moegraph {

// Where Generate's time went, for tok/s reports.
struct GenerateStats {
  int prompt_tokens = 0;
  double prompt_seconds = 0;  // the one Forward over the prompt
  int decode_steps = 0;       // one-token Forwards after it (n_predict - 1)
  double decode_seconds = 0;
};

// Called with each generated token as soon as it is picked; false stops the
// generation after that token (an end-of-generation token, a user's stop).
using TokenSink = std::function<bool(int32_t token)>;

class ExpertProvider;  // reference/ops.h

class Oracle {
 public:
  // model (and the file behind it) must outlive the oracle. max_ctx bounds the KV cache.
  // experts, when not null, supplies the routed experts' weights (and must outlive
  // the oracle); null reads them from the model's own tensors.
  static absl::StatusOr<std::unique_ptr<Oracle>> Create(const Model& model, int max_ctx,
                                                        ExpertProvider* experts = nullptr);
  virtual ~Oracle() = default;

  // Appends tokens at positions n_past() .. n_past()+T-1 with causal attention over
  // the cache; returns logits, T rows of n_vocab. Tokens out of range and a full
  // cache are errors naming the token or the context size.
  virtual absl::StatusOr<std::vector<float>> Forward(absl::Span<const int32_t> tokens) = 0;
  // Forward, returning the last row's logits only (a prompt's other rows are
  // not read; a backend may skip computing them).
  virtual absl::StatusOr<std::vector<float>> ForwardLast(absl::Span<const int32_t> tokens);
  virtual int n_past() const = 0;
  // Keeps the KV cache's first n_keep positions (at most n_past()) and drops
  // the rest: the next Forward continues at position n_keep.
  virtual void Truncate(int n_keep) = 0;
  void Reset() { Truncate(0); }
  // The first position Truncate(n_keep) and the next Forward would compute
  // again: n_keep (at most n_past()) where every position below it is kept
  // (a KV cache); earlier where a recurrent state cannot go back that far
  // (its newest checkpoint at or below n_keep, or 0).
  virtual int ResumePosition(int n_keep) const { return std::clamp(n_keep, 0, n_past()); }

  // Feeds the prompt, then picks n_predict tokens by sampling's settings
  // (sample_token of kernels/sample_math.h, drawing for the logits of position p
  // with counter p; the default is greedy: the argmax, ties to the lowest id),
  // feeding each back but the last, so the cache must hold
  // prompt.size() + n_predict - 1 more tokens. Continues from n_past(). With a
  // sink, each token goes to it as it is picked, and the tokens up to the one
  // the sink stopped at are returned. Errors: settings outside
  // sampling_params_valid, and Forward's.
  absl::StatusOr<std::vector<int32_t>> Generate(absl::Span<const int32_t> prompt, int n_predict,
                                                GenerateStats* stats = nullptr,
                                                const TokenSink& sink = nullptr,
                                                const SamplingParams& sampling = {});
};

}  // namespace moegraph
