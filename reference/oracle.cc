// The forward pass follows llama.cpp's graphs: src/models/qwen3moe.cpp,
// olmoe.cpp, qwen2moe.cpp and llama.cpp (its MoE branch, i.e. mixtral), with
// build_qkv / build_attn / build_moe_ffn from src/llama-graph.cpp:
//
//   x = token_embd[tokens]
//   per layer:  h = rms_norm(x) * attn_norm
//               q, k, v = wq h (+ bq), wk h (+ bk), wv h (+ bv)   (biases: qwen2moe)
//               olmoe:    q, k = rms_norm over all of q / k, times q_norm / k_norm
//               qwen3moe: q, k = rms_norm per head, times q_norm / k_norm
//               q, k = rope(q, k)   (NORM for llama, NEOX for the others:
//                                    llama_model_rope_type in src/llama-model.cpp)
//               x = x + wo attention(q, k, v), kq_scale = 1/sqrt(head_dim)
//               x = x + moe_ffn(rms_norm(x) * ffn_norm)
//   logits = output (rms_norm(x) * output_norm)
//
// None of the four scales its logits or embeddings, and none clamps q/k/v
// (f_clamp_kqv is read only for other architectures).
//
// gpt-oss (src/models/openai-moe.cpp) adds: q/k/v biases, YaRN RoPE, windowed
// attention on alternate layers and per-head sinks, an output bias; its FFN
// norm is attn_post_norm; the router has a bias and softmaxes the k chosen
// logits; experts have biases and swiglu_oai.
//
// glm4moe (src/models/glm4-moe.cpp): q/k/v biases, optional per-head q/k norm,
// NEOX RoPE on the first n_rot dimensions, attn_post_norm as the FFN norm; the
// leading layers have a dense FFN; the others route by sigmoid with
// exp_probs_b added to choose, normalize and scale the weights, and add an
// ungated shared expert. NextN layers (after block n_layer) are not read.
//
// qwen35moe (src/models/qwen35moe.cpp, docs/QWEN35MOE.md): its plan's layers
// are Gated DeltaNets (reference/delta_net.h: qkv, z, alpha and beta
// projected from h, the mixer, ssm_out), with a state per layer instead of a
// KV cache, or gated attention (each head's q row followed by its gate,
// per-head q/k norm, NEOX RoPE on the first n_rot dimensions, the attention
// times sigmoid(gate) before wo); attn_post_norm is the FFN norm, routing is
// softmax with normalized weights, plus a shared expert times
// sigmoid(ffn_gate_inp_shexp h).
#include "reference/oracle.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "loader/check.h"
#include "loader/quantize.h"
#include "reference/delta_net.h"
#include "reference/ops.h"

namespace moegraph {
namespace {

// Norm weights and biases, widened to f32 once (they are small).
struct LayerVectors {
  std::vector<float> attn_norm, ffn_norm, q_norm, k_norm, bq, bk, bv, bo, sinks;
  // A Gated DeltaNet's conv taps, dt bias, ssm_a and norm.
  std::vector<float> conv, dt_bias, ssm_a, ssm_norm;
};

std::vector<float> OptionalTensor(const GgufTensor* t) {
  return t == nullptr ? std::vector<float>() : TensorToFloat(*t);
}

// Every tensor the forward pass reads, for the up-front type check.
std::vector<const GgufTensor*> TensorsRead(const Model& model) {
  std::vector<const GgufTensor*> all = {model.token_embd, model.output_norm, model.output};
  for (const LayerTensors& lt : model.layers) {
    for (const GgufTensor* t : {lt.attn_norm,   lt.wq,
                                lt.wk,          lt.wv,
                                lt.wo,          lt.bq,
                                lt.bk,          lt.bv,
                                lt.bo,          lt.sinks,
                                lt.q_norm,      lt.k_norm,
                                lt.ffn_norm,    lt.router,
                                lt.router_b,    lt.gate_exps,
                                lt.up_exps,     lt.down_exps,
                                lt.gate_exps_b, lt.up_exps_b,
                                lt.down_exps_b, lt.shexp_gate_inp,
                                lt.shexp_gate,  lt.shexp_up,
                                lt.shexp_down,  lt.score_b,
                                lt.ffn_gate,    lt.ffn_up,
                                lt.ffn_down}) {
      all.push_back(t);
    }
    for (const auto* legacy : {&lt.gate_legacy, &lt.up_legacy, &lt.down_legacy}) {
      all.insert(all.end(), legacy->begin(), legacy->end());
    }
    const LayerTensors::DeltaNet& d = lt.delta_net;
    for (const GgufTensor* t :
         {d.qkv, d.gate, d.conv, d.dt_bias, d.a, d.beta, d.alpha, d.norm, d.out}) {
      all.push_back(t);
    }
  }
  return all;
}

class CpuOracle final : public Oracle {
 public:
  CpuOracle(const Model& model, int max_ctx, ExpertProvider* experts)
      : model_(model), max_ctx_(max_ctx), model_experts_(model),
        experts_(experts != nullptr ? experts : &model_experts_) {
    for (const LayerTensors& lt : model.layers) {
      const LayerTensors::DeltaNet& d = lt.delta_net;
      layers_.push_back({TensorToFloat(*lt.attn_norm), TensorToFloat(*lt.ffn_norm),
                         OptionalTensor(lt.q_norm), OptionalTensor(lt.k_norm),
                         OptionalTensor(lt.bq), OptionalTensor(lt.bk), OptionalTensor(lt.bv),
                         OptionalTensor(lt.bo), OptionalTensor(lt.sinks), OptionalTensor(d.conv),
                         OptionalTensor(d.dt_bias), OptionalTensor(d.a),
                         OptionalTensor(d.norm)});
    }
    output_norm_ = TensorToFloat(*model.output_norm);
    k_cache_.resize(model.layers.size());
    v_cache_.resize(model.layers.size());
    ResetStates();
  }

  absl::StatusOr<std::vector<float>> Forward(absl::Span<const int32_t> tokens) override;
  int n_past() const override { return n_past_; }
  int ResumePosition(int n_keep) const override {
    const int kept = std::clamp(n_keep, 0, n_past_);
    return !states_.empty() && kept < n_past_ ? 0 : kept;
  }
  void Truncate(int n_keep) override {
    n_keep = std::clamp(n_keep, 0, n_past_);
    if (!states_.empty() && n_keep < n_past_) {
      // A Gated DeltaNet's state holds every position: the kept ones run again
      // from a zero state (llama.cpp's recurrent memory keeps no older state).
      const std::vector<int32_t> kept(history_.begin(), history_.begin() + n_keep);
      n_past_ = 0;
      history_.clear();
      for (auto& c : k_cache_) c.clear();
      for (auto& c : v_cache_) c.clear();
      ResetStates();
      if (!kept.empty()) MG_CHECK(Forward(kept).ok(), "oracle: replaying kept tokens failed");
      return;
    }
    n_past_ = n_keep;
    history_.resize(static_cast<size_t>(n_past_));
    const size_t kept = static_cast<size_t>(n_past_) * model_.config.n_head_kv *
                        static_cast<size_t>(model_.config.head_dim);
    for (auto& c : k_cache_) c.resize(kept);
    for (auto& c : v_cache_) c.resize(kept);
  }

 private:
  // Zero states for the plan's Gated DeltaNet layers (one sequence).
  void ResetStates() {
    states_.clear();
    for (int il = 0; il < model_.config.n_layer; ++il) {
      if (model_.config.mixer(il) == LayerMixer::kDeltaNet) {
        states_.emplace(il, DeltaNetState(model_.config.delta_net));
      }
    }
  }

  // The Gated DeltaNet of layer il on the attn-normed rows h (one sequence's
  // consecutive tokens), advancing its state.
  void DeltaNetBlock(int il, absl::Span<const float> h, absl::Span<float> out);

  // Self-attention of layer il on the attn-normed rows h; appends to the cache.
  void AttentionBlock(int il, absl::Span<const float> h, absl::Span<const int32_t> positions,
                      absl::Span<float> out);

  const Model& model_;
  const int max_ctx_;
  ModelExpertProvider model_experts_;
  ExpertProvider* experts_;  // model_experts_ or the caller's
  int n_past_ = 0;
  std::vector<LayerVectors> layers_;
  std::vector<float> output_norm_;
  // Per layer, rows of [n_head_kv][head_dim] for positions 0..n_past-1, after RoPE.
  std::vector<std::vector<float>> k_cache_, v_cache_;
  std::map<int, DeltaNetState> states_;  // per Gated DeltaNet layer
  std::vector<int32_t> history_;         // the tokens at positions 0..n_past-1
};

void CpuOracle::DeltaNetBlock(int il, absl::Span<const float> h, absl::Span<float> out) {
  const ModelConfig& cfg = model_.config;
  const DeltaNetShape& s = cfg.delta_net;
  const LayerTensors::DeltaNet& d = model_.layers[il].delta_net;
  const LayerVectors& lv = layers_[il];
  const size_t n_tokens = h.size() / static_cast<size_t>(cfg.n_embd);
  std::vector<float> qkv(n_tokens * s.conv_dim()), z(n_tokens * s.value_dim());
  std::vector<float> alpha(n_tokens * s.n_v_heads), beta(alpha.size());
  MatMul(weight_view(*d.qkv), h, absl::MakeSpan(qkv));
  MatMul(weight_view(*d.gate), h, absl::MakeSpan(z));
  MatMul(weight_view(*d.alpha), h, absl::MakeSpan(alpha));
  MatMul(weight_view(*d.beta), h, absl::MakeSpan(beta));
  std::vector<float> mixed(z.size());
  DeltaNetMix(s, {lv.conv, lv.dt_bias, lv.ssm_a, lv.ssm_norm}, qkv, z, alpha, beta, cfg.rms_eps,
              &states_.at(il), absl::MakeSpan(mixed));
  MatMul(weight_view(*d.out), mixed, out);
}

void CpuOracle::AttentionBlock(int il, absl::Span<const float> h,
                               absl::Span<const int32_t> positions, absl::Span<float> out) {
  const ModelConfig& cfg = model_.config;
  const LayerTensors& lt = model_.layers[il];
  const LayerVectors& lv = layers_[il];
  const size_t n_tokens = positions.size();
  const int64_t q_len = static_cast<int64_t>(cfg.n_head) * cfg.head_dim;
  const int64_t kv_len = static_cast<int64_t>(cfg.n_head_kv) * cfg.head_dim;

  std::vector<float> q(n_tokens * q_len), k(n_tokens * kv_len), v(n_tokens * kv_len);
  std::vector<float> gate;
  if (cfg.mixer(il) == LayerMixer::kGatedAttention) {
    // Each head's q row is followed by its gate's: [q_h | gate_h].
    const int64_t d = cfg.head_dim;
    std::vector<float> q_gate(n_tokens * 2 * q_len);
    MatMul(weight_view(*lt.wq), h, absl::MakeSpan(q_gate));
    gate.resize(q.size());
    for (size_t t = 0; t < n_tokens; ++t) {
      for (int hd = 0; hd < cfg.n_head; ++hd) {
        const float* row = q_gate.data() + (t * cfg.n_head + hd) * 2 * d;
        std::copy(row, row + d, q.data() + (t * cfg.n_head + hd) * d);
        std::copy(row + d, row + 2 * d, gate.data() + (t * cfg.n_head + hd) * d);
      }
    }
  } else {
    MatMul(weight_view(*lt.wq), h, absl::MakeSpan(q));
  }
  MatMul(weight_view(*lt.wk), h, absl::MakeSpan(k));
  MatMul(weight_view(*lt.wv), h, absl::MakeSpan(v));
  if (!lv.bq.empty()) AddBias(lv.bq, absl::MakeSpan(q));
  if (!lv.bk.empty()) AddBias(lv.bk, absl::MakeSpan(k));
  if (!lv.bv.empty()) AddBias(lv.bv, absl::MakeSpan(v));
  // RmsNorm takes its row length from the weight: [n_head * head_dim] for
  // olmoe (before the reshape), [head_dim] for qwen3moe (after it).
  if (!lv.q_norm.empty()) RmsNorm(q, lv.q_norm, cfg.rms_eps, absl::MakeSpan(q));
  if (!lv.k_norm.empty()) RmsNorm(k, lv.k_norm, cfg.rms_eps, absl::MakeSpan(k));
  Rope(absl::MakeSpan(q), cfg.n_head, cfg.head_dim, positions, cfg.rope_freq_base, cfg.rope_type,
       cfg.rope_scaling, cfg.n_rot);
  Rope(absl::MakeSpan(k), cfg.n_head_kv, cfg.head_dim, positions, cfg.rope_freq_base, cfg.rope_type,
       cfg.rope_scaling, cfg.n_rot);

  std::vector<float>& k_cache = k_cache_[il];
  std::vector<float>& v_cache = v_cache_[il];
  k_cache.insert(k_cache.end(), k.begin(), k.end());
  v_cache.insert(v_cache.end(), v.begin(), v.end());

  std::vector<float> attn(q.size());
  // The graphs pass 1.0f/sqrtf(float(n_embd_head)).
  const float kq_scale = 1.0f / std::sqrt(static_cast<float>(cfg.head_dim));
  Attention(q, positions, k_cache, v_cache, cfg.n_head, cfg.n_head_kv, cfg.head_dim, kq_scale,
            absl::MakeSpan(attn), cfg.swa_layer(il) ? cfg.n_swa : 0, lv.sinks);
  for (size_t i = 0; i < gate.size(); ++i) attn[i] *= Sigmoid(gate[i]);
  MatMul(weight_view(*lt.wo), attn, out);
  if (!lv.bo.empty()) AddBias(lv.bo, out);
}

absl::StatusOr<std::vector<float>> CpuOracle::Forward(absl::Span<const int32_t> tokens) {
  const ModelConfig& cfg = model_.config;
  if (tokens.empty()) return absl::InvalidArgumentError("oracle: Forward needs at least one token");
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= cfg.n_vocab) {
      return absl::InvalidArgumentError(
          absl::StrFormat("oracle: token %d at index %d is outside the vocabulary [0, %d)",
                          tokens[i], i, cfg.n_vocab));
    }
  }
  const int n_tokens = static_cast<int>(tokens.size());
  if (n_tokens > max_ctx_ - n_past_) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("oracle: %d cached + %d new tokens exceed the context size %d", n_past_,
                        n_tokens, max_ctx_));
  }

  const int64_t n_embd = cfg.n_embd;
  std::vector<int32_t> positions(tokens.size());
  for (int t = 0; t < n_tokens; ++t) positions[t] = n_past_ + t;

  std::vector<float> x(tokens.size() * n_embd);
  const WeightView embd = weight_view(*model_.token_embd);
  for (int t = 0; t < n_tokens; ++t) DequantizeRow(embd, tokens[t], x.data() + t * n_embd);

  std::vector<float> h(x.size());
  std::vector<float> block_out(x.size());
  for (int il = 0; il < cfg.n_layer; ++il) {
    RmsNorm(x, layers_[il].attn_norm, cfg.rms_eps, absl::MakeSpan(h));
    if (cfg.mixer(il) == LayerMixer::kDeltaNet) {
      DeltaNetBlock(il, h, absl::MakeSpan(block_out));
    } else {
      AttentionBlock(il, h, positions, absl::MakeSpan(block_out));
    }
    AddInPlace(block_out, absl::MakeSpan(x));
    RmsNorm(x, layers_[il].ffn_norm, cfg.rms_eps, absl::MakeSpan(h));
    if (cfg.moe_layer(il)) {
      MoeFfn(model_, il, *experts_, h, absl::MakeSpan(block_out));
    } else {
      DenseFfn(model_, il, h, absl::MakeSpan(block_out));
    }
    AddInPlace(block_out, absl::MakeSpan(x));
  }
  n_past_ += n_tokens;
  history_.insert(history_.end(), tokens.begin(), tokens.end());

  RmsNorm(x, output_norm_, cfg.rms_eps, absl::MakeSpan(h));
  std::vector<float> logits(tokens.size() * static_cast<size_t>(cfg.n_vocab));
  MatMul(weight_view(*model_.output), h, absl::MakeSpan(logits));
  return logits;
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Oracle>> Oracle::Create(const Model& model, int max_ctx,
                                                       ExpertProvider* experts) {
  if (max_ctx <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("oracle: context size %d must be positive", max_ctx));
  }
  for (const GgufTensor* t : TensorsRead(model)) {
    if (t != nullptr && !quant_supported(t->ggml_type())) {
      return model.file->TensorError(
          *t,
          absl::StrFormat("type %s is not supported by the CPU oracle", ggml_type_name(t->type)));
    }
  }
  return std::unique_ptr<Oracle>(new CpuOracle(model, max_ctx, experts));
}

absl::StatusOr<std::vector<float>> Oracle::ForwardLast(absl::Span<const int32_t> tokens) {
  absl::StatusOr<std::vector<float>> logits = Forward(tokens);
  if (!logits.ok() || tokens.size() == 1) return logits;
  const size_t n_vocab = logits->size() / tokens.size();
  logits->erase(logits->begin(), logits->end() - static_cast<std::ptrdiff_t>(n_vocab));
  return logits;
}

absl::StatusOr<std::vector<int32_t>> Oracle::Generate(absl::Span<const int32_t> prompt,
                                                      int n_predict, GenerateStats* stats,
                                                      const TokenSink& sink,
                                                      const SamplingParams& sampling) {
  if (prompt.empty()) return absl::InvalidArgumentError("oracle: Generate needs a prompt");
  if (!sampling_params_valid(sampling)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "oracle: sampling temperature %g, top-k %d, top-p %g, min-p %g out of range",
        sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p));
  }
  if (n_predict < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("oracle: n_predict %d must not be negative", n_predict));
  }
  GenerateStats local;
  GenerateStats& st = stats != nullptr ? *stats : local;
  st = GenerateStats();

  auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::vector<float>> logits = ForwardLast(prompt);
  if (!logits.ok()) return logits.status();
  st.prompt_tokens = static_cast<int>(prompt.size());
  st.prompt_seconds = SecondsSince(start);

  std::vector<int32_t> out;
  if (n_predict == 0) return out;
  const size_t n_vocab = logits->size();
  // The logits are those of position n_past() - 1.
  auto pick = [&]() {
    const float* row = logits->data();
    return sample_token(row, static_cast<int32_t>(n_vocab), sampling,
                        sample_uniform(sampling.seed, n_past() - 1));
  };
  out.push_back(pick());
  bool go_on = sink == nullptr || sink(out.back());
  start = std::chrono::steady_clock::now();
  while (go_on && static_cast<int>(out.size()) < n_predict) {
    logits = ForwardLast({out.back()});
    if (!logits.ok()) return logits.status();
    out.push_back(pick());
    ++st.decode_steps;
    go_on = sink == nullptr || sink(out.back());
  }
  st.decode_seconds = SecondsSince(start);
  return out;
}

}  // namespace moegraph
