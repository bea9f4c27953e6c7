#include "residency/trace_synth.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "loader/quant.h"

namespace moegraph {
namespace {

constexpr int64_t kMaxLayers = 1 << 16;
constexpr int64_t kMaxExperts = kMissingExpert;  // ids are u16; 0xffff marks a missing row
constexpr int64_t kMaxIds = int64_t{1} << 31;
constexpr int kLogitLevels = 32;
// 2^(j / 4) for j = 0..3, correctly rounded.
constexpr std::array<double, 4> kQuarterPowers = {1.0, 0x1.306fe0a31b715p+0,
                                                  0x1.6a09e667f3bcdp+0, 0x1.ae89f995ad3adp+0};

uint64_t SplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// xoshiro256** (Blackman and Vigna), seeded through splitmix64 as its authors advise.
class Rng {
 public:
  explicit Rng(uint64_t seed) {
    for (uint64_t& s : state_) s = SplitMix64(&seed);
  }

  uint64_t Next() {
    const uint64_t result = Rotl(state_[1] * 5, 7) * 9;
    const uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = Rotl(state_[3], 45);
    return result;
  }

  // Uniform in [0, bound), unbiased (Lemire's multiply-and-reject).
  uint64_t Below(uint64_t bound) {
    unsigned __int128 product = static_cast<unsigned __int128>(Next()) * bound;
    uint64_t low = static_cast<uint64_t>(product);
    if (low < bound) {
      const uint64_t threshold = -bound % bound;
      while (low < threshold) {
        product = static_cast<unsigned __int128>(Next()) * bound;
        low = static_cast<uint64_t>(product);
      }
    }
    return static_cast<uint64_t>(product >> 64);
  }

  // True with probability p, compared on 53 bits so that p * 2^53 is exact.
  bool Chance(double p) {
    if (p >= 1.0) return true;
    return (Next() >> 11) < static_cast<uint64_t>(p * 0x1p53);
  }

 private:
  static uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::array<uint64_t, 4> state_;
};

enum class Mark : uint8_t { kFree, kChosen, kDropped };

// One layer's popularity order and the scratch state of one step's draw.
struct LayerModel {
  std::vector<int32_t> expert_at_rank;
  std::vector<int32_t> rank_of_expert;
  std::vector<Mark> mark;  // by expert
  std::vector<int32_t> previous;

  void Swap(int32_t rank) {
    std::swap(expert_at_rank[rank], expert_at_rank[rank + 1]);
    rank_of_expert[expert_at_rank[rank]] = rank;
    rank_of_expert[expert_at_rank[rank + 1]] = rank + 1;
  }
};

absl::Status CheckSpec(const SynthSpec& spec) {
  auto out_of_range = [](const char* flag, auto value, const std::string& range) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", value, " is out of range ", range));
  };
  if (spec.n_layer < 1 || spec.n_layer > kMaxLayers) {
    return out_of_range("--layers", spec.n_layer, absl::StrCat("[1, ", kMaxLayers, "]"));
  }
  if (spec.n_expert < 1 || spec.n_expert > kMaxExperts) {
    return out_of_range("--experts", spec.n_expert, absl::StrCat("[1, ", kMaxExperts, "]"));
  }
  if (spec.k < 1 || spec.k > spec.n_expert) {
    return absl::InvalidArgumentError(
        absl::StrCat("--top-k ", spec.k, " must be in [1, --experts ", spec.n_expert, "]"));
  }
  if (spec.n_steps < 1) return out_of_range("--steps", spec.n_steps, "[1, ...)");
  if (spec.n_steps > kMaxIds / (int64_t{spec.n_layer} * spec.k)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--steps ", spec.n_steps, " x --layers ", spec.n_layer, " x --top-k ", spec.k,
        " is more than ", kMaxIds, " expert ids"));
  }
  if (!(spec.zipf_s >= 0.0 && std::isfinite(spec.zipf_s))) {
    return out_of_range("--zipf", spec.zipf_s, "[0, inf)");
  }
  if (!(spec.reuse >= 0.0 && spec.reuse <= 1.0)) {
    return out_of_range("--reuse", spec.reuse, "[0, 1]");
  }
  if (spec.drift_period < 0) return out_of_range("--drift", spec.drift_period, "[0, ...)");
  return absl::OkStatus();
}

// Draws one expert by popularity among those marked `from`, whose weights sum to `total`.
int32_t Draw(const LayerModel& model, const std::vector<uint64_t>& weight_at_rank, Mark from,
             uint64_t total, Rng* rng) {
  uint64_t target = rng->Below(total);
  for (size_t rank = 0;; ++rank) {
    const int32_t expert = model.expert_at_rank[rank];
    if (model.mark[expert] != from) continue;
    if (target < weight_at_rank[rank]) return expert;
    target -= weight_at_rank[rank];
  }
}

void SelectStep(const SynthSpec& spec, const std::vector<uint64_t>& weight_at_rank,
                uint64_t total_weight, LayerModel* model, Rng* rng, uint16_t* out) {
  std::vector<int32_t> chosen;
  chosen.reserve(spec.k);
  uint64_t free_weight = total_weight;
  uint64_t dropped_weight = 0;
  int64_t free_count = spec.n_expert;
  for (int32_t expert : model->previous) {
    const uint64_t w = weight_at_rank[model->rank_of_expert[expert]];
    free_weight -= w;
    --free_count;
    if (rng->Chance(spec.reuse)) {
      model->mark[expert] = Mark::kChosen;
      chosen.push_back(expert);
    } else {
      model->mark[expert] = Mark::kDropped;
      dropped_weight += w;
    }
  }
  while (static_cast<int32_t>(chosen.size()) < spec.k) {
    const bool from_free = free_count > 0;
    const int32_t expert = Draw(*model, weight_at_rank, from_free ? Mark::kFree : Mark::kDropped,
                                from_free ? free_weight : dropped_weight, rng);
    const uint64_t w = weight_at_rank[model->rank_of_expert[expert]];
    if (from_free) {
      free_weight -= w;
      --free_count;
    } else {
      dropped_weight -= w;
    }
    model->mark[expert] = Mark::kChosen;
    chosen.push_back(expert);
  }
  for (int32_t expert : model->previous) model->mark[expert] = Mark::kFree;
  for (int32_t expert : chosen) model->mark[expert] = Mark::kFree;
  std::sort(chosen.begin(), chosen.end(), [&](int32_t a, int32_t b) {
    return model->rank_of_expert[a] < model->rank_of_expert[b];
  });
  for (int32_t i = 0; i < spec.k; ++i) out[i] = static_cast<uint16_t>(chosen[i]);
  model->previous = std::move(chosen);
}

void DrawWeights(int32_t k, Rng* rng, uint16_t* out) {
  std::vector<double> values(k);
  double sum = 0.0;
  for (double& v : values) {
    const int level = static_cast<int>(rng->Below(kLogitLevels));
    v = std::ldexp(kQuarterPowers[level % 4], level / 4);
    sum += v;
  }
  std::sort(values.begin(), values.end(), [](double a, double b) { return a > b; });
  for (int32_t i = 0; i < k; ++i) out[i] = f32_to_f16(static_cast<float>(values[i] / sum));
}

}  // namespace

absl::StatusOr<RoutingTrace> SynthesizeTrace(const SynthSpec& spec) {
  if (absl::Status status = CheckSpec(spec); !status.ok()) return status;
  Rng rng(spec.seed);

  std::vector<uint64_t> weight_at_rank(spec.n_expert);
  uint64_t total_weight = 0;
  for (int32_t rank = 0; rank < spec.n_expert; ++rank) {
    const double scaled = std::ldexp(std::pow(static_cast<double>(rank + 1), -spec.zipf_s), 32);
    weight_at_rank[rank] = std::max<uint64_t>(1, static_cast<uint64_t>(std::llround(scaled)));
    total_weight += weight_at_rank[rank];
  }

  std::vector<LayerModel> layers(spec.n_layer);
  for (LayerModel& model : layers) {
    model.expert_at_rank.resize(spec.n_expert);
    model.rank_of_expert.resize(spec.n_expert);
    model.mark.assign(spec.n_expert, Mark::kFree);
    for (int32_t i = 0; i < spec.n_expert; ++i) model.expert_at_rank[i] = i;
    for (int32_t i = spec.n_expert - 1; i > 0; --i) {  // Fisher-Yates
      std::swap(model.expert_at_rank[i], model.expert_at_rank[rng.Below(i + 1)]);
    }
    for (int32_t r = 0; r < spec.n_expert; ++r) model.rank_of_expert[model.expert_at_rank[r]] = r;
  }

  RoutingTrace trace;
  trace.n_layer = spec.n_layer;
  trace.n_expert = spec.n_expert;
  trace.k = spec.k;
  trace.n_steps = spec.n_steps;
  trace.ids.resize(static_cast<size_t>(spec.n_steps) * spec.n_layer * spec.k);
  if (spec.weights) trace.weights.resize(trace.ids.size());
  for (int64_t step = 0; step < spec.n_steps; ++step) {
    const bool drift = spec.drift_period > 0 && step > 0 && step % spec.drift_period == 0;
    for (int32_t layer = 0; layer < spec.n_layer; ++layer) {
      LayerModel& model = layers[layer];
      if (drift && spec.n_expert > 1) {
        model.Swap(static_cast<int32_t>(rng.Below(spec.n_expert - 1)));
      }
      const size_t offset = trace.row_offset(step, layer);
      SelectStep(spec, weight_at_rank, total_weight, &model, &rng, &trace.ids[offset]);
      if (spec.weights) DrawWeights(spec.k, &rng, &trace.weights[offset]);
    }
  }
  return trace;
}

}  // namespace moegraph
