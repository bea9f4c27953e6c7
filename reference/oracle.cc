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
#include "reference/oracle.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "loader/quantize.h"
#include "reference/ops.h"

namespace moegraph {
namespace {

// Norm weights and biases, widened to f32 once (they are small).
struct LayerVectors {
  std::vector<float> attn_norm, ffn_norm, q_norm, k_norm, bq, bk, bv, bo, sinks;
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
  }
  return all;
}

class CpuOracle final : public Oracle {
 public:
  CpuOracle(const Model& model, int max_ctx, ExpertProvider* experts)
      : model_(model), max_ctx_(max_ctx), model_experts_(model),
        experts_(experts != nullptr ? experts : &model_experts_) {
    for (const LayerTensors& lt : model.layers) {
      layers_.push_back({TensorToFloat(*lt.attn_norm), TensorToFloat(*lt.ffn_norm),
                         OptionalTensor(lt.q_norm), OptionalTensor(lt.k_norm),
                         OptionalTensor(lt.bq), OptionalTensor(lt.bk), OptionalTensor(lt.bv),
                         OptionalTensor(lt.bo), OptionalTensor(lt.sinks)});
    }
    output_norm_ = TensorToFloat(*model.output_norm);
    k_cache_.resize(model.layers.size());
    v_cache_.resize(model.layers.size());
  }

  absl::StatusOr<std::vector<float>> Forward(absl::Span<const int32_t> tokens) override;
  int n_past() const override { return n_past_; }
  void Truncate(int n_keep) override {
    n_past_ = std::clamp(n_keep, 0, n_past_);
    const size_t kept = static_cast<size_t>(n_past_) * model_.config.n_head_kv *
                        static_cast<size_t>(model_.config.head_dim);
    for (auto& c : k_cache_) c.resize(kept);
    for (auto& c : v_cache_) c.resize(kept);
  }

 private:
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
};

void CpuOracle::AttentionBlock(int il, absl::Span<const float> h,
                               absl::Span<const int32_t> positions, absl::Span<float> out) {
  const ModelConfig& cfg = model_.config;
  const LayerTensors& lt = model_.layers[il];
  const LayerVectors& lv = layers_[il];
  const size_t n_tokens = positions.size();
  const int64_t q_len = static_cast<int64_t>(cfg.n_head) * cfg.head_dim;
  const int64_t kv_len = static_cast<int64_t>(cfg.n_head_kv) * cfg.head_dim;

  std::vector<float> q(n_tokens * q_len), k(n_tokens * kv_len), v(n_tokens * kv_len);
  MatMul(weight_view(*lt.wq), h, absl::MakeSpan(q));
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
    AttentionBlock(il, h, positions, absl::MakeSpan(block_out));
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
