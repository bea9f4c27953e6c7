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

enum class Arch { kQwen3Moe, kOlmoe, kQwen2Moe, kMixtral };

// The GGUF general.architecture string: "qwen3moe", "olmoe", "qwen2moe", "llama".
std::string_view arch_gguf_name(Arch arch);
// Accepts the names above and "mixtral" (an alias for llama with experts).
bool arch_from_name(std::string_view name, Arch* out);

enum class RopeType { kNorm, kNeox };

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
  int n_ff_shexp = 0;     // shared expert (qwen2moe), 0 when absent
  float rope_freq_base = 10000.0f;
  float rms_eps = 1e-6f;
  RopeType rope_type = RopeType::kNeox;
  bool norm_topk_prob = false;  // renormalise the top-k weights to sum 1
  bool qk_norm = false;         // per-head RMSNorm of q and k (qwen3moe)
  bool qk_norm_full = false;    // RMSNorm over all of q and all of k (olmoe)
  bool qkv_bias = false;        // q/k/v biases (qwen2moe)
  bool tied_embeddings = false; // output.weight absent: lm_head is token_embd
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
  const GgufTensor* q_norm = nullptr;  // qwen3moe [head_dim], olmoe [n_head*head_dim]
  const GgufTensor* k_norm = nullptr;
  const GgufTensor* ffn_norm = nullptr;
  const GgufTensor* router = nullptr;  // ffn_gate_inp [n_embd, n_expert]
  // Merged experts: [n_embd, n_ff_exp, n_expert] (down: [n_ff_exp, n_embd, n_expert]).
  const GgufTensor* gate_exps = nullptr;
  const GgufTensor* up_exps = nullptr;
  const GgufTensor* down_exps = nullptr;
  // Legacy per-expert tensors (mixtral ffn_gate.N.weight ...), indexed by expert.
  std::vector<const GgufTensor*> gate_legacy, up_legacy, down_legacy;
  // Shared expert (qwen2moe).
  const GgufTensor* shexp_gate_inp = nullptr;  // [n_embd] (one logit)
  const GgufTensor* shexp_gate = nullptr;
  const GgufTensor* shexp_up = nullptr;
  const GgufTensor* shexp_down = nullptr;
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

// The bytes of the K and V caches of every layer for max_ctx positions.
size_t KvCacheBytes(const ModelConfig& config, int max_ctx, KvCacheType type);

}  // namespace moegraph
