// Synthetic MoE models as GGUF: random weights under the real tensor names and
// metadata keys llama.cpp uses for each architecture, plus a minimal tokenizer,
// so that moegraph and other GGUF tools can load them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "loader/ggml_type.h"
#include "loader/model_config.h"

namespace moegraph {

// A real vocabulary to write instead of the synthetic one, keyed as llama.cpp's
// converter writes a model's (text/hf_tokenizer.h reads one from a Hugging Face
// tokenizer.json).
struct FixtureVocab {
  std::string model = "gpt2";  // tokenizer.ggml.model
  std::string pre;             // tokenizer.ggml.pre
  std::vector<std::string> tokens;
  std::vector<int32_t> types;       // llama.cpp's token types
  std::vector<std::string> merges;  // "left right" (gpt2)
  std::vector<float> scores;        // one per token (llama)
  // tokenizer.ggml.add_space_prefix; absent when not set.
  std::optional<bool> add_space_prefix;
  // ("bos", id) -> tokenizer.ggml.bos_token_id; also eos, unknown, padding, seperator, eot.
  std::vector<std::pair<std::string, uint32_t>> special_ids;
  // ("bos", true) -> tokenizer.ggml.add_bos_token; also eos.
  std::vector<std::pair<std::string, bool>> add_special;
  std::string chat_template;  // tokenizer.chat_template; empty: none
};

struct FixtureSpec {
  Arch arch = Arch::kQwen3Moe;
  int n_layer = 2;
  int n_expert = 8;
  int n_expert_used = 2;
  int n_embd = 64;
  int n_ff_exp = 32;    // routed expert hidden size
  int n_ff_shexp = 0;   // qwen2moe shared expert hidden size; 0 picks 2 * n_ff_exp
                        // (glm4moe's is n_ff_exp: one shared expert)
  int n_head = 4;
  int n_head_kv = 2;
  int head_dim = 0;     // 0: n_embd / n_head
  int n_vocab = 256;
  int n_ctx_train = 4096;
  GgmlType dense_type = GgmlType::kF32;   // attention, embeddings, output, shared expert
  GgmlType expert_type = GgmlType::kF32;  // routed experts
  bool legacy_experts = false;  // mixtral: per-expert ffn_gate.N.weight tensors
  bool tied_output = false;     // omit output.weight
  float router_skew = 0.0f;     // 0: uniform router; larger: a few experts dominate
  // 0: every expert distinct. V > 0: expert e of each layer and projection holds
  // the bytes of expert e % V (experts 0..V-1 are those of V = 0), so a large
  // fixture quantizes V experts per layer and projection, not all. Meant for
  // benchmarks whose routing comes from a trace, where what experts compute
  // does not matter, only which bytes move.
  int expert_variants = 0;
  // gpt-oss: the attention window of the even layers (attention.sliding_window),
  // shorter than a test's context so the window matters.
  int n_swa = 4;
  // glm4moe: leading layers with a dense FFN (of 2 * n_ff_exp); glm4moe and
  // qwen35moe: NextN (MTP) layers written after the decode layers as GLM-4.5's
  // and Qwen3.5's files carry them.
  int n_dense_lead = 1;
  int n_nextn = 1;
  // glm4moe: per-head q/k RMSNorms (attn_q_norm / attn_k_norm of head_dim, as
  // GLM-4.5 355B's files carry; llama.cpp's glm4moe loads them where present).
  bool qk_norm = false;
  // qwen35moe: every full_attention_interval-th layer is gated attention, the
  // others Gated DeltaNets of ssm_v_heads value heads over ssm_k_heads key
  // heads of ssm_head_dim (0: the attention's head size), conv kernel 4; RoPE
  // turns a quarter of each attention head (partial_rotary_factor 0.25); a
  // gated shared expert of n_ff_exp.
  int full_attention_interval = 4;
  int ssm_k_heads = 2;
  int ssm_v_heads = 4;
  int ssm_head_dim = 0;
  uint64_t seed = 1;
  // Non-null: this vocabulary, and n_vocab must be its size (embedding and
  // lm_head rows). Must outlive the call.
  const FixtureVocab* vocab = nullptr;
};

// Checks the spec (names the bad field, e.g. "--embd 63 is not a multiple of 32
// (q8_0 block size)") and returns the serialized file.
absl::StatusOr<std::vector<uint8_t>> FixtureBytes(const FixtureSpec& spec);
// Same, streamed to path.
absl::Status WriteFixture(const FixtureSpec& spec, const std::string& path);

}  // namespace moegraph
