// moegraph against llama.cpp's committed results (tests/data/crosscheck), for
// any backend: greedy tokens on f32 fixtures of every architecture
// (greedy.json, tools/llama-crosscheck/greedy-fixtures.sh) must be equal;
// teacher-forced next-token probabilities on quantized fixtures
// (teacher-forced.json: llama.cpp's top 5 at each of 64 forced positions,
// tools/llama-crosscheck/teacher-forced.sh, llama.cpp's prebuilt CPU backend)
// within a backend's bound. The fixtures are made again with the same
// make-fixture flags (the generator is deterministic). Random weights leave
// near-ties that any rounding difference flips, so the argmax is held to
// llama.cpp's only where its top two are twice the bound apart.
#ifndef MOEGRAPH_TESTS_CROSSCHECK_H_
#define MOEGRAPH_TESTS_CROSSCHECK_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "loader/model_config.h"

namespace moegraph::crosscheck {

struct Backend {
  const char* name = "";
  double bound = 0.0;  // on |p - llama.cpp's p| for its top 5
  int min_close = 0;   // of the 64 positions, those whose top 5 are within kClose
  // The logits of every position of tokens (rows of n_vocab), max_ctx tokens.size().
  std::function<absl::StatusOr<std::vector<float>>(const Model&, absl::Span<const int32_t>)>
      forward;
  // n greedy tokens after prompt.
  std::function<absl::StatusOr<std::vector<int32_t>>(const Model&, absl::Span<const int32_t>, int)>
      greedy;
};

// Agreement to the digits the JSON keeps.
constexpr double kClose = 1e-6;

// A backend's greedy prompt runs in ubatches of kGreedyUbatch tokens: a Gated
// DeltaNet's conv window and state, and the KV cache, cross ubatches within
// greedy.json's prompt of 8.
constexpr int kGreedyUbatch = 3;

// Each backend's greedy tokens on greedy.json's f32 fixtures are llama.cpp's.
void ExpectGreedyTokensEqualLlamaCpps(absl::Span<const Backend> backends);
// Each backend's top-5 probabilities on teacher-forced.json's fixtures are
// within its bound of llama.cpp's, its argmax llama.cpp's past the margin.
void ExpectTeacherForcedProbabilitiesMatchLlamaCpps(absl::Span<const Backend> backends);

}  // namespace moegraph::crosscheck

#endif  // MOEGRAPH_TESTS_CROSSCHECK_H_
