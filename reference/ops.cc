#include "reference/ops.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>

#include "loader/quant.h"

namespace moegraph {
namespace {

// A broken size contract between the oracle and its ops is a programming error.
void CheckOrDie(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "moegraph oracle: check failed: %s\n", what);
  std::abort();
}

int64_t RowCount(size_t total, int64_t row_len, const char* what) {
  CheckOrDie(row_len > 0 && total % static_cast<size_t>(row_len) == 0, what);
  return static_cast<int64_t>(total) / row_len;
}

}  // namespace

void DequantizeRow(const WeightView& w, int64_t row, float* dst) {
  CheckOrDie(row >= 0 && row < w.rows, "DequantizeRow: row in range");
  CheckOrDie(dequantize_row(w.type, w.data + row * w.row_bytes, dst, w.cols),
             "DequantizeRow: type supported and cols a multiple of its block");
}

std::vector<float> TensorToFloat(const GgufTensor& t) {
  std::vector<float> out(static_cast<size_t>(t.n_elements()));
  CheckOrDie(dequantize_row(t.ggml_type(), t.data, out.data(), t.n_elements()),
             "TensorToFloat: type supported");
  return out;
}

void RmsNorm(absl::Span<const float> x, absl::Span<const float> weight, float eps,
             absl::Span<float> out) {
  const int64_t n = static_cast<int64_t>(weight.size());
  const int64_t n_rows = RowCount(x.size(), n, "RmsNorm: x rows of weight.size()");
  CheckOrDie(out.size() == x.size(), "RmsNorm: out size");
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* xr = x.data() + r * n;
    double sum_sq = 0.0;
    for (int64_t i = 0; i < n; ++i) sum_sq += static_cast<double>(xr[i]) * xr[i];
    const double scale = 1.0 / std::sqrt(sum_sq / static_cast<double>(n) + eps);
    for (int64_t i = 0; i < n; ++i) {
      out[r * n + i] = static_cast<float>(xr[i] * scale * weight[i]);
    }
  }
}

void MatMul(const WeightView& w, absl::Span<const float> x, absl::Span<float> out) {
  const int64_t n_rows = RowCount(x.size(), w.cols, "MatMul: x rows of w.cols");
  CheckOrDie(out.size() == static_cast<size_t>(n_rows * w.rows), "MatMul: out size");
  std::vector<float> w_row(static_cast<size_t>(w.cols));
  for (int64_t r = 0; r < w.rows; ++r) {
    DequantizeRow(w, r, w_row.data());
    for (int64_t t = 0; t < n_rows; ++t) {
      const float* xt = x.data() + t * w.cols;
      double acc = 0.0;
      for (int64_t i = 0; i < w.cols; ++i) acc += static_cast<double>(w_row[i]) * xt[i];
      out[t * w.rows + r] = static_cast<float>(acc);
    }
  }
}

void AddBias(absl::Span<const float> bias, absl::Span<float> x) {
  const int64_t n = static_cast<int64_t>(bias.size());
  const int64_t n_rows = RowCount(x.size(), n, "AddBias: x rows of bias.size()");
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int64_t i = 0; i < n; ++i) x[r * n + i] += bias[i];
  }
}

void AddInPlace(absl::Span<const float> b, absl::Span<float> a) {
  CheckOrDie(a.size() == b.size(), "AddInPlace: sizes");
  for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
}

RopeYarn YarnOf(const RopeScaling& scaling, int n_rot, float freq_base) {
  return rope_yarn_init(scaling.freq_scale, scaling.ext_factor, scaling.attn_factor,
                        scaling.beta_fast, scaling.beta_slow, scaling.n_ctx_orig, n_rot, freq_base);
}

void RopeCosSin(int32_t pos, int n_rot, float freq_base, const RopeScaling& scaling,
                float* cos_out, float* sin_out) {
  const RopeYarn yarn = YarnOf(scaling, n_rot, freq_base);
  for (int i = 0; i < n_rot / 2; ++i) {
    rope_cos_sin(pos, i, n_rot, freq_base, yarn, cos_out + i, sin_out + i);
  }
}

void Rope(absl::Span<float> x, int n_head, int head_dim, absl::Span<const int32_t> positions,
          float freq_base, RopeType type, const RopeScaling& scaling, int n_rot) {
  if (n_rot == 0) n_rot = head_dim;
  CheckOrDie(n_rot > 0 && n_rot % 2 == 0 && n_rot <= head_dim, "Rope: n_rot even, <= head_dim");
  const int64_t row_len = static_cast<int64_t>(n_head) * head_dim;
  const int64_t n_rows = RowCount(x.size(), row_len, "Rope: x rows of n_head * head_dim");
  CheckOrDie(positions.size() == static_cast<size_t>(n_rows), "Rope: one position per row");
  const int half = n_rot / 2;
  std::vector<float> c(static_cast<size_t>(half)), s(c.size());
  for (int64_t t = 0; t < n_rows; ++t) {
    RopeCosSin(positions[t], n_rot, freq_base, scaling, c.data(), s.data());
    for (int h = 0; h < n_head; ++h) {
      float* head = x.data() + t * row_len + static_cast<int64_t>(h) * head_dim;
      for (int i = 0; i < half; ++i) {
        // rotate_pairs in ggml-cpu/ops.cpp: NORM (x[2i], x[2i+1]), NEOX (x[i], x[i + n/2]),
        // n = n_rot; dimensions from n_rot on are copied unturned.
        float* a = type == RopeType::kNorm ? head + 2 * i : head + i;
        float* b = type == RopeType::kNorm ? head + 2 * i + 1 : head + i + half;
        rope_rotate_cs(a, b, c[i], s[i]);
      }
    }
  }
}

void Softmax(int64_t row_len, absl::Span<float> x) {
  const int64_t n_rows = RowCount(x.size(), row_len, "Softmax: x rows of row_len");
  for (int64_t r = 0; r < n_rows; ++r) {
    float* row = x.data() + r * row_len;
    router_softmax(row, static_cast<int32_t>(row_len), row);
  }
}

std::vector<int32_t> TopK(absl::Span<const float> row, int k) {
  CheckOrDie(k >= 0 && static_cast<size_t>(k) <= row.size(), "TopK: k <= row size");
  std::vector<int32_t> order(row.size());
  std::iota(order.begin(), order.end(), 0);
  // topk_precedes: a strict weak order even with NaNs (row[a] > row[b] is not).
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return topk_precedes(row[a], a, row[b], b); });
  order.resize(static_cast<size_t>(k));
  return order;
}

int32_t ArgMax(absl::Span<const float> row) {
  CheckOrDie(!row.empty(), "ArgMax: non-empty row");
  int32_t best = 0;
  for (size_t i = 1; i < row.size(); ++i) {
    if (row[i] > row[best]) best = static_cast<int32_t>(i);
  }
  return best;
}

float Sigmoid(float x) {
  return static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(x))));
}

float Silu(float x) { return static_cast<float>(x / (1.0 + std::exp(-static_cast<double>(x)))); }

void Swiglu(absl::Span<const float> gate, absl::Span<const float> up, absl::Span<float> out) {
  CheckOrDie(gate.size() == up.size() && out.size() == up.size(), "Swiglu: sizes");
  for (size_t i = 0; i < out.size(); ++i) {
    const double g = gate[i];
    out[i] = static_cast<float>(g / (1.0 + std::exp(-g)) * up[i]);
  }
}

void SwigluOai(absl::Span<const float> gate, absl::Span<const float> up, absl::Span<float> out) {
  CheckOrDie(gate.size() == up.size() && out.size() == up.size(), "SwigluOai: sizes");
  constexpr double kAlpha = 1.702f, kLimit = 7.0f;
  for (size_t i = 0; i < out.size(); ++i) {
    const double x = std::min<double>(gate[i], kLimit);
    const double y = std::clamp<double>(up[i], -kLimit, kLimit);
    out[i] = static_cast<float>(x / (1.0 + std::exp(-kAlpha * x)) * (y + 1.0));
  }
}

void Attention(absl::Span<const float> q, absl::Span<const int32_t> q_pos,
               absl::Span<const float> k_cache, absl::Span<const float> v_cache, int n_head,
               int n_head_kv, int head_dim, float kq_scale, absl::Span<float> out, int window,
               absl::Span<const float> sinks) {
  CheckOrDie(n_head_kv > 0 && n_head % n_head_kv == 0, "Attention: n_head multiple of n_head_kv");
  const int64_t q_len = static_cast<int64_t>(n_head) * head_dim;
  const int64_t kv_len = static_cast<int64_t>(n_head_kv) * head_dim;
  const int64_t n_rows = RowCount(q.size(), q_len, "Attention: q rows of n_head * head_dim");
  const int64_t n_cache = RowCount(k_cache.size(), kv_len, "Attention: k rows");
  CheckOrDie(v_cache.size() == k_cache.size(), "Attention: v size equals k size");
  CheckOrDie(q_pos.size() == static_cast<size_t>(n_rows), "Attention: one position per row");
  CheckOrDie(out.size() == q.size(), "Attention: out size");
  CheckOrDie(sinks.empty() || sinks.size() == static_cast<size_t>(n_head), "Attention: sinks");
  const int group = n_head / n_head_kv;
  std::vector<double> weights;
  std::vector<double> acc(static_cast<size_t>(head_dim));
  for (int64_t t = 0; t < n_rows; ++t) {
    const int64_t n_seen = static_cast<int64_t>(q_pos[t]) + 1;  // causal: keys 0..pos
    CheckOrDie(q_pos[t] >= 0 && n_seen <= n_cache, "Attention: position inside the cache");
    const int64_t first = window > 0 ? std::max<int64_t>(0, n_seen - window) : 0;
    weights.assign(static_cast<size_t>(n_seen), 0.0);
    for (int h = 0; h < n_head; ++h) {
      const float* qh = q.data() + t * q_len + static_cast<int64_t>(h) * head_dim;
      const int64_t kv_off = static_cast<int64_t>(h / group) * head_dim;
      double max = sinks.empty() ? -INFINITY : sinks[h];
      for (int64_t j = first; j < n_seen; ++j) {
        const float* kj = k_cache.data() + j * kv_len + kv_off;
        double dot = 0.0;
        for (int d = 0; d < head_dim; ++d) dot += static_cast<double>(qh[d]) * kj[d];
        weights[j] = dot * kq_scale;
        max = std::max(max, weights[j]);
      }
      double sum = sinks.empty() ? 0.0 : std::exp(sinks[h] - max);
      for (int64_t j = first; j < n_seen; ++j) {
        weights[j] = std::exp(weights[j] - max);
        sum += weights[j];
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = first; j < n_seen; ++j) {
        const float* vj = v_cache.data() + j * kv_len + kv_off;
        for (int d = 0; d < head_dim; ++d) acc[d] += weights[j] * vj[d];
      }
      float* oh = out.data() + t * q_len + static_cast<int64_t>(h) * head_dim;
      for (int d = 0; d < head_dim; ++d) oh[d] = static_cast<float>(acc[d] / sum);
    }
  }
}

namespace {

// One expert's biases (gpt-oss), empty when the model has none.
struct ExpertBiases {
  absl::Span<const float> gate, up, down;
};

// Gated FFN (build_ffn with LLM_FFN_PAR, build_moe_ffn's expert body):
// down(act(gate x + gate_b, up x + up_b)) + down_b, act silu(g) * u or swiglu_oai.
std::vector<float> GatedFfn(const WeightView& gate, const WeightView& up, const WeightView& down,
                            absl::Span<const float> x, ExpertAct act = ExpertAct::kSilu,
                            const ExpertBiases& bias = {}) {
  const int64_t n_rows = RowCount(x.size(), gate.cols, "GatedFfn: x rows of n_embd");
  std::vector<float> g(static_cast<size_t>(n_rows * gate.rows));
  std::vector<float> u(g.size());
  MatMul(gate, x, absl::MakeSpan(g));
  MatMul(up, x, absl::MakeSpan(u));
  if (!bias.gate.empty()) AddBias(bias.gate, absl::MakeSpan(g));
  if (!bias.up.empty()) AddBias(bias.up, absl::MakeSpan(u));
  if (act == ExpertAct::kSwigluOai) {
    SwigluOai(g, u, absl::MakeSpan(g));
  } else {
    Swiglu(g, u, absl::MakeSpan(g));
  }
  std::vector<float> y(static_cast<size_t>(n_rows * down.rows));
  MatMul(down, g, absl::MakeSpan(y));
  if (!bias.down.empty()) AddBias(bias.down, absl::MakeSpan(y));
  return y;
}

}  // namespace

void ModelExpertProvider::Provide(int layer, absl::Span<const int32_t> experts,
                                  absl::Span<ExpertWeights> weights) {
  CheckOrDie(weights.size() == experts.size(), "ModelExpertProvider: one view per expert");
  for (size_t r = 0; r < experts.size(); ++r) {
    weights[r] = {model_.expert(layer, ExpertProj::kGate, experts[r]),
                  model_.expert(layer, ExpertProj::kUp, experts[r]),
                  model_.expert(layer, ExpertProj::kDown, experts[r])};
  }
}

void GateProbs(ExpertGating gating, int n_expert, absl::Span<float> logits) {
  switch (gating) {
    case ExpertGating::kSoftmax:
      Softmax(n_expert, logits);
      return;
    case ExpertGating::kSigmoid:
      for (float& l : logits) l = router_sigmoid(l);
      return;
    case ExpertGating::kSoftmaxWeight:
      return;
  }
}

void SelectExperts(absl::Span<const float> probs, int n_expert, int k, bool norm,
                   std::vector<int32_t>* chosen, std::vector<double>* weight, ExpertGating gating,
                   absl::Span<const float> score_bias, float scale) {
  const int64_t n_rows = RowCount(probs.size(), n_expert, "SelectExperts: rows of n_expert");
  CheckOrDie(score_bias.empty() || score_bias.size() == static_cast<size_t>(n_expert),
             "SelectExperts: one score bias per expert");
  chosen->assign(static_cast<size_t>(n_rows * k), 0);
  weight->assign(chosen->size(), 0.0);
  std::vector<float> biased(score_bias.size());
  for (int64_t t = 0; t < n_rows; ++t) {
    absl::Span<const float> row(probs.data() + t * n_expert, static_cast<size_t>(n_expert));
    // exp_probs_b: the choice is made on probs + bias (ggml_add, f32), the
    // weights come from probs.
    absl::Span<const float> selection = row;
    if (!score_bias.empty()) {
      for (int e = 0; e < n_expert; ++e) biased[e] = row[e] + score_bias[e];
      selection = biased;
    }
    const std::vector<int32_t> top = TopK(selection, k);
    std::copy(top.begin(), top.end(), chosen->begin() + t * k);
    ChosenWeights(row, top, norm, gating, scale, absl::MakeSpan(*weight).subspan(t * k, k));
  }
}

RouterGating RouterGatingOf(ExpertGating gating) {
  switch (gating) {
    case ExpertGating::kSoftmax: return RouterGating::kSoftmax;
    case ExpertGating::kSoftmaxWeight: return RouterGating::kSoftmaxWeight;
    case ExpertGating::kSigmoid: return RouterGating::kSigmoid;
  }
  return RouterGating::kSoftmax;
}

void ChosenWeights(absl::Span<const float> probs, absl::Span<const int32_t> ids, bool norm,
                   ExpertGating gating, float scale, absl::Span<double> weights) {
  CheckOrDie(weights.size() == ids.size(), "ChosenWeights: one weight per id");
  CheckOrDie(ids.size() <= static_cast<size_t>(kMaxTopK), "ChosenWeights: at most kMaxTopK ids");
  float chosen_values[kMaxTopK], chosen_weights[kMaxTopK];
  for (size_t r = 0; r < ids.size(); ++r) chosen_values[r] = probs[ids[r]];
  topk_weights(chosen_values, static_cast<int32_t>(ids.size()), RouterGatingOf(gating), norm,
               scale, chosen_weights);
  std::copy(chosen_weights, chosen_weights + ids.size(), weights.begin());
}

void MoeFfn(const Model& model, int layer, absl::Span<const float> x, absl::Span<float> out,
            std::vector<int32_t>* selected) {
  ModelExpertProvider experts(model);
  MoeFfn(model, layer, experts, x, out, selected);
}

void MoeFfn(const Model& model, int layer, ExpertProvider& experts, absl::Span<const float> x,
            absl::Span<float> out, std::vector<int32_t>* selected) {
  const ModelConfig& cfg = model.config;
  const LayerTensors& lt = model.layers[static_cast<size_t>(layer)];
  const int64_t n_embd = cfg.n_embd;
  const int n_expert = cfg.n_expert;
  const int k = cfg.n_expert_used;
  const int64_t n_rows = RowCount(x.size(), n_embd, "MoeFfn: x rows of n_embd");
  CheckOrDie(out.size() == x.size(), "MoeFfn: out size");

  // Router: softmax over all experts, then top-k of the probabilities
  // (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX, ggml_top_k = argsort descending);
  // gpt-oss adds a bias to the logits and softmaxes the k chosen ones; glm4moe
  // takes sigmoids, chooses with its score bias, scales the weights.
  std::vector<float> probs(static_cast<size_t>(n_rows * n_expert));
  MatMul(weight_view(*lt.router), x, absl::MakeSpan(probs));
  if (lt.router_b != nullptr) AddBias(TensorToFloat(*lt.router_b), absl::MakeSpan(probs));
  GateProbs(cfg.gating, n_expert, absl::MakeSpan(probs));
  std::vector<int32_t> chosen;
  std::vector<double> weight;
  const std::vector<float> score_b = lt.score_b ? TensorToFloat(*lt.score_b) : std::vector<float>();
  SelectExperts(probs, n_expert, k, cfg.norm_topk_prob, &chosen, &weight, cfg.gating, score_b,
                cfg.expert_weights_scale);
  // ggml_add_id: expert e's bias is row e of [n, n_expert].
  std::vector<float> gate_b, up_b, down_b;
  if (lt.gate_exps_b != nullptr) {
    gate_b = TensorToFloat(*lt.gate_exps_b);
    up_b = TensorToFloat(*lt.up_exps_b);
    down_b = TensorToFloat(*lt.down_exps_b);
  }
  auto biases = [&](int32_t e) {
    if (gate_b.empty()) return ExpertBiases{};
    const size_t ff = gate_b.size() / n_expert;
    return ExpertBiases{absl::MakeConstSpan(gate_b).subspan(e * ff, ff),
                        absl::MakeConstSpan(up_b).subspan(e * ff, ff),
                        absl::MakeConstSpan(down_b).subspan(e * n_embd, n_embd)};
  };
  for (int64_t t = 0; t < n_rows; ++t) {
    experts.Route(layer, absl::MakeConstSpan(probs).subspan(t * n_expert, n_expert),
                  absl::MakeSpan(chosen).subspan(t * k, k), absl::MakeSpan(weight).subspan(t * k, k));
  }

  // Row by row, each selected expert runs on the row; outputs land per (row,
  // rank) so the weighted sum below adds them in rank order, as llama.cpp's chain
  // of ggml_add over cur_experts[0..k) does. Every op treats rows independently,
  // so this equals running each expert once on all of its rows, bit for bit.
  std::vector<float> expert_out(static_cast<size_t>(n_rows * k * n_embd));
  std::vector<ExpertWeights> views(static_cast<size_t>(k));
  for (int64_t t = 0; t < n_rows; ++t) {
    experts.Provide(layer, absl::MakeConstSpan(chosen).subspan(t * k, k), absl::MakeSpan(views));
    const absl::Span<const float> row = x.subspan(t * n_embd, n_embd);
    for (int r = 0; r < k; ++r) {
      const std::vector<float> y = GatedFfn(views[r].gate, views[r].up, views[r].down, row,
                                            cfg.expert_act, biases(chosen[t * k + r]));
      std::copy_n(y.data(), n_embd, expert_out.data() + (t * k + r) * n_embd);
    }
  }

  // The shared expert. qwen2moe's ffn_gate_inp_shexp gives one logit per row;
  // the graph computes silu(l) / l, which is sigmoid(l) (and NaN at l == 0
  // exactly, a corner the oracle does not copy). glm4moe's is ungated.
  std::vector<float> shared;
  std::vector<float> shared_logit;
  if (lt.shexp_gate != nullptr) {
    shared = GatedFfn(weight_view(*lt.shexp_gate), weight_view(*lt.shexp_up),
                      weight_view(*lt.shexp_down), x);
    if (lt.shexp_gate_inp != nullptr) {
      shared_logit.resize(static_cast<size_t>(n_rows));
      MatMul(weight_view(*lt.shexp_gate_inp), x, absl::MakeSpan(shared_logit));
    }
  }

  for (int64_t t = 0; t < n_rows; ++t) {
    const double shared_scale = shared.empty()         ? 0.0
                                : shared_logit.empty() ? 1.0
                                                       : Sigmoid(shared_logit[t]);
    for (int64_t i = 0; i < n_embd; ++i) {
      double acc = 0.0;
      for (int r = 0; r < k; ++r) acc += weight[t * k + r] * expert_out[(t * k + r) * n_embd + i];
      if (!shared.empty()) acc += shared_scale * shared[t * n_embd + i];
      out[t * n_embd + i] = static_cast<float>(acc);
    }
  }
  if (selected != nullptr) *selected = std::move(chosen);
}

void DenseFfn(const Model& model, int layer, absl::Span<const float> x, absl::Span<float> out) {
  const LayerTensors& lt = model.layers[static_cast<size_t>(layer)];
  CheckOrDie(lt.ffn_gate != nullptr, "DenseFfn: a layer without a dense FFN");
  const std::vector<float> y =
      GatedFfn(weight_view(*lt.ffn_gate), weight_view(*lt.ffn_up), weight_view(*lt.ffn_down), x);
  CheckOrDie(out.size() == y.size(), "DenseFfn: out size");
  std::copy(y.begin(), y.end(), out.begin());
}

}  // namespace moegraph
