// Model hyper-parameters from GGUF metadata and the tensors bound to them.
//
// LoadModel() reads {arch}.* keys, then checks every tensor the architecture
// needs against them; all missing or mismatched tensors are reported in one
// error, each by name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "loader/ggml_type.h"
#include "loader/gguf.h"

namespace moegraph {

enum class Arch { kQwen3Moe, kOlmoe, kQwen2Moe, kMixtral, kGptOss, kGlm4Moe, kQwen35Moe };

// The GGUF general.architecture string: "qwen3moe", "olmoe", "qwen2moe", "llama",
// "gpt-oss", "glm4moe", "qwen35moe".
std::string_view arch_gguf_name(Arch arch);
// Accepts the names above and "mixtral" (an alias for llama with experts).
bool arch_from_name(std::string_view name, Arch* out);

enum class RopeType { kNorm, kNeox };

// How the router's logits become the chosen experts' weights
// (llama_expert_gating_func_type): kSoftmax takes the top k of the softmax over
// all experts; kSoftmaxWeight (gpt-oss) the top k of the logits, then the
// softmax over those k; kSigmoid (glm4moe) the top k of the sigmoids (plus the
// score bias where the layer has one), weighted by the sigmoids alone.
enum class ExpertGating { kSoftmax, kSoftmaxWeight, kSigmoid };

// The routed experts' activation: silu(gate) * up, or gpt-oss's swiglu_oai
// (llm_ffn_op_type LLM_FFN_SWIGLU_OAI_MOE: gate clamped above at 7, up to
// [-7, 7], gate * sigmoid(1.702 gate) * (up + 1)).
enum class ExpertAct { kSilu, kSwigluOai };

// RoPE frequency scaling as llama_context derives it from {arch}.rope.scaling.*
// (ggml_rope_ext's freq_scale, ext_factor, attn_factor, beta_fast, beta_slow,
// n_ctx_orig): none unless the file asks, linear (freq_scale only) or YaRN.
struct RopeScaling {
  float freq_scale = 1.0f;  // 1 / rope.scaling.factor
  float ext_factor = 0.0f;  // 1 for YaRN
  float attn_factor = 1.0f;
  float beta_fast = 32.0f;
  float beta_slow = 1.0f;
  int n_ctx_orig = 0;  // rope.scaling.original_context_length, else context_length
  bool scaled() const { return freq_scale != 1.0f || ext_factor != 0.0f || attn_factor != 1.0f; }
};

// A layer's token mixer, as the model's plan says (ModelConfig::mixers):
// attention over the KV cache; qwen35moe's attention, whose q projection
// carries an output gate (per head [q | gate], the attention times
// sigmoid(gate) before attn_output); or qwen35moe's Gated DeltaNet, linear
// attention with a recurrent state (reference/delta_net.h).
enum class LayerMixer { kAttention, kGatedAttention, kDeltaNet };

// A Gated DeltaNet's sizes, from the file's ssm.* keys: d_conv
// (ssm.conv_kernel), head_dim (ssm.state_size: the key and the value head
// size), n_k_heads (ssm.group_count), n_v_heads (ssm.time_step_rank;
// ssm.inner_size is n_v_heads * head_dim).
struct DeltaNetShape {
  int d_conv = 0;
  int head_dim = 0;
  int n_k_heads = 0;
  int n_v_heads = 0;
  int key_dim() const { return head_dim * n_k_heads; }
  int value_dim() const { return head_dim * n_v_heads; }
  int conv_dim() const { return 2 * key_dim() + value_dim(); }
  // The state's floats per sequence (llama.cpp's n_embd_r and n_embd_s).
  int64_t conv_state_floats() const { return int64_t{d_conv - 1} * conv_dim(); }
  int64_t delta_state_floats() const { return int64_t{head_dim} * head_dim * n_v_heads; }
};

struct ModelConfig {
  Arch arch = Arch::kQwen3Moe;
  int n_layer = 0;
  int n_embd = 0;
  int n_head = 0;
  int n_head_kv = 0;
  int head_dim = 0;  // {arch}.attention.key_length, default n_embd / n_head
  int n_vocab = 0;
  int n_ctx_train = 0;
  int n_expert = 0;
  int n_expert_used = 0;  // top-k
  int n_ff_exp = 0;       // per routed expert
  int n_ff_shexp = 0;     // shared expert (qwen2moe, glm4moe), 0 when absent
  float rope_freq_base = 10000.0f;
  float rms_eps = 1e-6f;
  RopeType rope_type = RopeType::kNeox;
  bool norm_topk_prob = false;  // renormalise the top-k weights to sum 1
  bool qk_norm = false;         // per-head RMSNorm of q and k (qwen3moe)
  bool qk_norm_full = false;    // RMSNorm over all of q and all of k (olmoe)
  bool qkv_bias = false;        // q/k/v biases (qwen2moe; gpt-oss where the file has them)
  bool tied_embeddings = false; // output.weight absent: lm_head is token_embd
  RopeScaling rope_scaling;
  // gpt-oss: attention.sliding_window n_swa on the layers swa_layer says (a key
  // at p0 is seen from p1 while p1 - p0 < n_swa), per-head sink logits, an
  // output bias; router and expert biases; the gating and activation above.
  int n_swa = 0;
  int swa_pattern = 0;
  bool attn_sinks = false;
  bool attn_out_bias = false;
  bool router_bias = false;
  bool expert_bias = false;
  ExpertGating gating = ExpertGating::kSoftmax;
  ExpertAct expert_act = ExpertAct::kSilu;
  // glm4moe: RoPE on the first n_rot dimensions of each head (rope.dimension_count),
  // n_layer_dense_lead leading layers with a dense FFN of n_ff_dense, a score
  // bias per expert (exp_probs_b) that chooses but does not weight, the weights
  // times expert_weights_scale, a shared expert without a gate; the file's
  // n_layer_nextn NextN (multi-token prediction) layers follow the n_layer
  // decode layers and are not read.
  int n_rot = 0;
  int n_layer_dense_lead = 0;
  int n_ff_dense = 0;
  int n_layer_nextn = 0;
  bool expert_score_bias = false;
  float expert_weights_scale = 1.0f;
  bool shexp_gated = false;  // qwen2moe: the shared expert times sigmoid(ffn_gate_inp_shexp x)
  // The token mixer of each of the n_layer decode layers (empty: attention
  // everywhere); qwen35moe's Gated DeltaNet layers' sizes.
  std::vector<LayerMixer> mixers;
  DeltaNetShape delta_net;

  LayerMixer mixer(int il) const {
    return mixers.empty() ? LayerMixer::kAttention : mixers[static_cast<size_t>(il)];
  }
  // Whether layer il keeps keys and values (every layer but a Gated DeltaNet).
  bool kv_layer(int il) const { return mixer(il) != LayerMixer::kDeltaNet; }
  int n_kv_layers() const {
    int n = 0;
    for (int il = 0; il < n_layer; ++il) n += kv_layer(il);
    return n;
  }

  // Whether layer il routes experts (the leading dense layers do not).
  bool moe_layer(int il) const { return il >= n_layer_dense_lead; }
  int n_moe_layer() const { return n_layer - n_layer_dense_lead; }

  // llama_hparams::set_swa_pattern without dense_first: layer il is windowed
  // when il % swa_pattern < swa_pattern - 1 (gpt-oss: the even layers).
  bool swa_layer(int il) const {
    return n_swa > 0 && swa_pattern > 0 && il % swa_pattern < swa_pattern - 1;
  }
};

// One weight matrix as stored: rows of `cols` elements in the file's quant type.
struct WeightView {
  const uint8_t* data = nullptr;
  GgmlType type = GgmlType::kF32;
  int64_t cols = 0;  // ne[0]
  int64_t rows = 0;  // ne[1]
  size_t row_bytes = 0;
};

enum class ExpertProj { kGate, kUp, kDown };

struct LayerTensors {
  const GgufTensor* attn_norm = nullptr;
  const GgufTensor* wq = nullptr;
  const GgufTensor* wk = nullptr;
  const GgufTensor* wv = nullptr;
  const GgufTensor* wo = nullptr;
  const GgufTensor* bq = nullptr;  // qwen2moe
  const GgufTensor* bk = nullptr;
  const GgufTensor* bv = nullptr;
  const GgufTensor* bo = nullptr;      // gpt-oss attn_output.bias [n_embd]
  const GgufTensor* sinks = nullptr;   // gpt-oss attn_sinks [n_head]
  const GgufTensor* q_norm = nullptr;  // qwen3moe [head_dim], olmoe [n_head*head_dim]
  const GgufTensor* k_norm = nullptr;
  const GgufTensor* ffn_norm = nullptr;  // gpt-oss: post_attention_norm, in the same place
  const GgufTensor* router = nullptr;    // ffn_gate_inp [n_embd, n_expert]
  const GgufTensor* router_b = nullptr;  // gpt-oss ffn_gate_inp.bias [n_expert]
  const GgufTensor* score_b = nullptr;   // glm4moe exp_probs_b.bias [n_expert]
  // Merged experts: [n_embd, n_ff_exp, n_expert] (down: [n_ff_exp, n_embd, n_expert]).
  const GgufTensor* gate_exps = nullptr;
  const GgufTensor* up_exps = nullptr;
  const GgufTensor* down_exps = nullptr;
  // gpt-oss expert biases: [n_ff_exp, n_expert] (down: [n_embd, n_expert]).
  const GgufTensor* gate_exps_b = nullptr;
  const GgufTensor* up_exps_b = nullptr;
  const GgufTensor* down_exps_b = nullptr;
  // Legacy per-expert tensors (mixtral ffn_gate.N.weight ...), indexed by expert.
  std::vector<const GgufTensor*> gate_legacy, up_legacy, down_legacy;
  // glm4moe's leading dense layers: ffn_gate/up [n_embd, n_ff_dense], ffn_down.
  const GgufTensor* ffn_gate = nullptr;
  const GgufTensor* ffn_up = nullptr;
  const GgufTensor* ffn_down = nullptr;
  // Shared expert (qwen2moe, glm4moe).
  const GgufTensor* shexp_gate_inp = nullptr;  // qwen2moe [n_embd] (one logit)
  const GgufTensor* shexp_gate = nullptr;
  const GgufTensor* shexp_up = nullptr;
  const GgufTensor* shexp_down = nullptr;
  // qwen35moe's Gated DeltaNet layers, in place of wq .. wo (LayerMixer::kDeltaNet).
  struct DeltaNet {
    const GgufTensor* qkv = nullptr;      // attn_qkv [n_embd, conv_dim]: q | k | v channels
    const GgufTensor* gate = nullptr;     // attn_gate [n_embd, value_dim]: z
    const GgufTensor* conv = nullptr;     // ssm_conv1d [d_conv, conv_dim]
    const GgufTensor* dt_bias = nullptr;  // ssm_dt.bias [n_v_heads]
    const GgufTensor* a = nullptr;        // ssm_a [n_v_heads]: -exp(A_log)
    const GgufTensor* beta = nullptr;     // ssm_beta [n_embd, n_v_heads]
    const GgufTensor* alpha = nullptr;    // ssm_alpha [n_embd, n_v_heads]
    const GgufTensor* norm = nullptr;     // ssm_norm [head_dim]
    const GgufTensor* out = nullptr;      // ssm_out [value_dim, n_embd]
  } delta_net;
};

struct Model {
  const GgufFile* file = nullptr;
  ModelConfig config;
  const GgufTensor* token_embd = nullptr;  // [n_embd, n_vocab]
  const GgufTensor* output_norm = nullptr;
  const GgufTensor* output = nullptr;  // == token_embd when tied
  std::vector<LayerTensors> layers;

  // Matrix of one routed expert's projection, merged or legacy storage alike.
  WeightView expert(int layer, ExpertProj proj, int expert) const;
};

absl::StatusOr<ModelConfig> LoadConfig(const GgufFile& file);

absl::StatusOr<Model> LoadModel(const GgufFile& file);

WeightView weight_view(const GgufTensor& t);

// The KV cache's element type (--kv-type), on either backend.
enum class KvCacheType { kF16, kF32 };

// Rows of layer il's K and V caches for max_ctx positions: none for a Gated
// DeltaNet layer (its state is not a cache of positions); max_ctx, or with
// ring_slack >= 0 on a windowed layer (ModelConfig::swa_layer) a ring of
// n_swa + ring_slack rows where that is fewer (the CUDA engine's, its slack a
// ubatch: llama.cpp's SWA cache of n_swa + n_ubatch cells).
int KvLayerRows(const ModelConfig& config, int il, int max_ctx, int ring_slack = -1);
// The bytes of the K and V caches of every layer (KvLayerRows each).
size_t KvCacheBytes(const ModelConfig& config, int max_ctx, KvCacheType type, int ring_slack = -1);

// The bytes of one sequence's recurrent state, every Gated DeltaNet layer's
// conv and delta state in f32 (DeltaNetShape): what a sequence holds beside
// its KV cache, whatever its length.
size_t RecurrentStateBytes(const ModelConfig& config);

// The position each row of a model's windowed-layer rings holds (they all have
// one size), and so whether a step at a position still finds the keys its
// window reads below it once a rewind has gone back past what the rings kept.
class KvRingPositions {
 public:
  KvRingPositions() = default;  // no rings
  // The rings of KvLayerRows(config, ., max_ctx, ring_slack); none (every
  // position held) where no windowed layer's ring is shorter than max_ctx.
  KvRingPositions(const ModelConfig& config, int max_ctx, int ring_slack);
  bool has_rings() const { return !positions_.empty(); }
  // Whether a step at position start finds every key its window reads below it.
  bool Holds(int start) const;
  // Steps wrote positions [first, end).
  void Wrote(int first, int end);

 private:
  int window_ = 0;
  std::vector<int32_t> positions_;  // per ring row; -1: none yet
};

}  // namespace moegraph
