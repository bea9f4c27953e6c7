// Launchers of the decode-step kernels. Every per-step value (token, position,
// selection, slot table, miss flags) is read from device memory, so a captured
// graph replays them unchanged; grids depend only on the configuration (model
// shape, max context, k, slots), never on per-token values.
//
// Each launcher enqueues on `stream`, checks its arguments (cudaErrorInvalidValue
// for a bad one) and returns cudaGetLastError(). Light header: CUDA runtime API
// and loader/*.h, residency/policy.h and the kernels' *_math.h only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/launch_geometry.h"
#include "kernels/mmvq_math.h"
#include "kernels/moe_math.h"
#include "kernels/nn_math.h"
#include "kernels/sample_math.h"
#include "loader/ggml_type.h"
#include "residency/hazard_policy.h"
#include "residency/policy.h"

namespace moegraph {

// A weight matrix in device memory (or inside a slot): `rows` rows of `cols`
// elements, each row `row_bytes` bytes in the file's own quant layout.
struct DeviceMatrix {
  const void* data = nullptr;
  GgmlType type = GgmlType::kF32;
  int32_t cols = 0;
  int32_t rows = 0;
  size_t row_bytes = 0;
};

// The projections of one expert block (placement's ExpertBlockLayout, device side).
struct DeviceBlockLayout {
  GgmlType type[3];        // gate, up, down
  size_t offset[3];        // byte offset of each projection inside the block
  size_t row_bytes[3];
  int32_t n_embd = 0;      // gate/up cols, down rows
  int32_t n_ff = 0;        // gate/up rows, down cols
  size_t block_bytes = 0;  // slot stride
};

// Counters incremented by the kernels that do the work (engagement counters).
struct DeviceCounters {
  unsigned long long hits;
  unsigned long long misses;
  unsigned long long evictions;
  unsigned long long bytes_staged;
  unsigned long long pass_a_experts;
  unsigned long long pass_b_experts;
  unsigned long long copy_waits;  // missed ranks the kReady pass waited for
  unsigned long long chained_launches;  // chained_matvec_kernel launches run to their end
  unsigned long long steps;
};

// ---- programmatic dependent launch ----

// While a scope is open, every launch this thread makes carries CUDA's
// programmatic stream serialization (sm_90): the kernel's blocks may start
// while the kernel before it in the stream finishes, and wait for it
// (griddepcontrol.wait, kernels/launch.cuh) before they touch global memory.
// Each such launch increments *counter. Scopes nest; the innermost wins.
class ProgrammaticLaunchScope {
 public:
  explicit ProgrammaticLaunchScope(uint64_t* counter);
  ~ProgrammaticLaunchScope();
  ProgrammaticLaunchScope(const ProgrammaticLaunchScope&) = delete;
  ProgrammaticLaunchScope& operator=(const ProgrammaticLaunchScope&) = delete;

 private:
  uint64_t* previous_;
};

// The counter of this thread's innermost open scope; nullptr outside every scope.
uint64_t* programmatic_launch_counter();

// ---- dense ops ----

// The Gated DeltaNet mixer of one layer (qwen35moe, issue 41): the CPU
// backend's CpuDeltaNetMix (cpu/delta_net.h) on the device, from the layer's
// projections of `tokens` consecutive tokens to the gated norm's output, the
// per-element math of kernels/delta_net_math.h. A block per value head h and
// kDeltaNetRowsPerBlock of its state rows runs the tokens in order: the causal
// conv and silu of its channels (the q and k channels of key head
// h % n_k_heads, its rows' v channels), q and k l2-normalised, the delta rule
// on its rows; the head's last block then rms_norm(o) * norm * silu(z). The
// conv state is kept per block (the q and k channels in each of a head's
// blocks), so no two blocks share a word of it. The shapes
// delta_net_mix_supports (kernels/launch_geometry.h) takes.
struct DeltaNetMixArgs {
  int32_t n_k_heads = 0, n_v_heads = 0, head_dim = 0, d_conv = 0;
  float eps = 0.0f;                 // layer_norm_rms_epsilon: the l2 norms' and the gated norm's
  const float* conv_taps = nullptr;  // [conv_dim][d_conv], tap d_conv - 1 on the current token
  const float* dt_bias = nullptr;    // [n_v_heads]
  const float* ssm_a = nullptr;      // [n_v_heads]
  const float* norm = nullptr;       // [head_dim]
  const float* qkv = nullptr;        // [tokens][conv_dim]: q | k | v channels
  const float* z = nullptr;          // [tokens][value_dim]
  const float* alpha = nullptr;      // [tokens][n_v_heads]
  const float* beta_logit = nullptr;  // [tokens][n_v_heads]
  // [n_v_heads][head_dim / 32 blocks][2 head_dim + 32 channels][d_conv - 1],
  // oldest input first
  float* conv_state = nullptr;
  float* delta_state = nullptr;  // [n_v_heads][head_dim value j][head_dim key i]
  float* out = nullptr;          // [tokens][value_dim]
  block_q8_1* out_q = nullptr;   // null, or out's q8_1 blocks (ssm_out's input)
  unsigned int* tickets = nullptr;  // [n_v_heads], zero (left zero)
};
// The floats of conv_state (zero for a new sequence; delta_state holds
// n_v_heads * head_dim^2).
int64_t delta_net_conv_state_floats(int32_t n_v_heads, int32_t head_dim, int32_t d_conv);
cudaError_t launch_delta_net_mix(const DeltaNetMixArgs& args, int32_t tokens,
                                 cudaStream_t stream);

// Ops that fuse the op after them: their last block (kernels/epilogue.cuh) runs
// it once every block is done. `tickets` is device memory of zeroed counters
// (the count each launcher names), left zeroed when the launch ends; launches of
// one stream may share it.

// An RMSNorm of an op's n_embd outputs run by the op's last block: out = x /
// rms(x) * weight, and with out_q (n_embd a multiple of 32) out's q8_1 blocks.
// weight null: none.
struct NormEpilogue {
  const float* weight = nullptr;
  float eps = 0.0f;
  float* out = nullptr;
  block_q8_1* out_q = nullptr;
};

// The start of a decode step, which its embed runs: the token is
// prompt[*step] while *step < *n_prompt (teacher forcing), else *sampled (the
// last step's sample); *pos = *step for the step's later kernels. The prompt's
// length is read on the device like its ids, so one captured graph serves
// prompts of any length.
struct StepStart {
  const int32_t* prompt = nullptr;
  const int32_t* n_prompt = nullptr;
  const int32_t* sampled = nullptr;
  const int32_t* step = nullptr;
  int32_t* pos = nullptr;
};

// out[n_embd] = dequantized row (the step's token, StepStart) of table (bit for
// bit the CPU's dequantize_row), in one block; a token outside [0, rows)
// writes nothing.
cudaError_t launch_embed_step(const DeviceMatrix& table, const StepStart& start, float* out,
                              cudaStream_t stream);

// Rows t of out ([tokens][n_embd]) = dequantized row tokens[t] of table, as
// launch_embed_step; a token outside [0, rows) writes nothing.
cudaError_t launch_embed_rows(const DeviceMatrix& table, const int32_t* tokens, int32_t n_tokens,
                              float* out, cudaStream_t stream);

// Whether launch_matvec computes a matrix of type with rows of cols: q8_0,
// q4_0, q4_1, q5_0, q5_1, q2_K, q3_K, q4_K, q5_K, q6_K, iq4_nl, iq4_xs, mxfp4
// (cols a multiple of the block) against q8_1 activations, f32 (cols a multiple
// of 4), f16 and bf16 (of 8) against f32 ones.
bool matvec_supports_type(GgmlType type, int32_t cols);

// The same for launch_qkv, which reads every type but mxfp4: its unaligned
// words inlined beside the other types spill the attention's one kernel
// (gpt-oss files hold mxfp4 in the experts only).
bool qkv_supports_type(GgmlType type, int32_t cols);

// out[rows] = W x (+ bias when not null), the grouped matvec of
// kernels/mmvq_math.h: the quant types read xq, x's q8_1 blocks (cols / 32 of
// them), the element types read x; the other may be null.
cudaError_t launch_matvec(const DeviceMatrix& w, const float* x, const block_q8_1* xq,
                          const float* bias, float* out, cudaStream_t stream);

// residual[rows] += W x (+ bias when not null: gpt-oss's attn_output.bias): the
// projection and its residual add in one launch, one thread writing each row,
// so the sum's bits are those of an add after it; then norm of the residual
// (the ffn_norm). tickets: 1.
cudaError_t launch_matvec_residual(const DeviceMatrix& w, const float* x, const block_q8_1* xq,
                                   const float* bias, float* residual, const NormEpilogue& norm,
                                   unsigned int* tickets, cudaStream_t stream);

// The QK-norm before RoPE: q_weight ([head_dim], or [n_head * head_dim] when
// full) and k_weight likewise; full normalises all of q (and of k) at once, as
// olmoe, else each head, as qwen3moe.
struct QkNorm {
  const float* q_weight = nullptr;
  const float* k_weight = nullptr;
  float eps = 0.0f;
  bool full = false;
};

// What launch_qkv does per head once its rows are done: QK-norm (use_norm),
// RoPE at position *pos on the first n_rot dimensions of each head (0: all;
// rope_type 0 NORM, adjacent pairs; 1 NEOX, halves of n_rot; as ggml) by the
// cosines and sines of cos_sin (fill_rope_table's, kernels/nn_math.h, for
// every position the launches reach: the engine's max context), q into
// q_out ([n_head][head_dim]), k into row *pos of k_cache, v's rows straight
// into row *pos of v_cache (caches [max_ctx][n_head_kv * head_dim], f16 when
// kv_f16, else f32; a ring of kv_rows rows where kv_rows > 0, row *pos mod
// kv_rows, as AttentionMask's). head_dim and n_rot even.
struct QkvRope {
  const int32_t* pos = nullptr;
  int32_t n_head = 0, n_head_kv = 0, head_dim = 0;
  int32_t n_rot = 0;
  const float* cos_sin = nullptr;
  int32_t rope_type = 0;
  bool use_norm = false;
  QkNorm norm;
  float* q_out = nullptr;
  // Gated attention (qwen35moe): q's rows are per head [query | output gate],
  // 2 head_dim of them; only the query is normed and turned (q_out stays
  // [n_head][head_dim]). Not with a full-width norm.
  bool q_gated = false;
  bool kv_f16 = false;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  int32_t kv_rows = 0;
};

// The RMSNorm launch_qkv and launch_projections run on their input first (the
// layer's attn_norm), with norm.weight set: x is then the residual stream, xq
// unused, and the launch's first norm_prologue_blocks(cols) blocks (in the
// order blocks start) write the norm into norm.out and norm.out_q (where a
// matrix reads q8_1), 32 elements a warp, each block computing the scale; the
// matrices' blocks ask L2 for their rows, wait for those blocks, and read it.
// No single block normalizes between the layer before and its projections.
// tickets: 3 more (after the rope's). norm_prologue_blocks: kernels/launch_geometry.h.

// q, k and v (with their biases when not null) in one launch: three matrices
// of any types but mxfp4 against one input, written to q, k and v. With rope, the
// attention's inputs: v goes to the cache (v may be null), and each head's last
// block of q or k runs the QK-norm and RoPE into q_out or the k cache (q and k
// keep the projections). With input_norm.weight set, x is normalized first (as
// above). tickets: n_head + n_head_kv with rope, 3 more with the norm.
cudaError_t launch_qkv(const DeviceMatrix& wq, const DeviceMatrix& wk, const DeviceMatrix& wv,
                       const float* x, const block_q8_1* xq, const float* bq, const float* bk,
                       const float* bv, float* q, float* k, float* v, const QkvRope* rope,
                       const NormEpilogue& input_norm, unsigned int* tickets,
                       cudaStream_t stream);

// Up to kMaxProjections matrices of any types but mxfp4 (qkv_supports_type)
// against one input in one launch, launch_qkv's without its rope: each into
// its out, plus its bias where not null. A Gated DeltaNet's qkv, z, alpha
// and beta projections. With input_norm.weight set, x is normalized first (as
// launch_qkv's; tickets: 3, else unused).
inline constexpr int32_t kMaxProjections = 4;
struct Projection {
  const DeviceMatrix* w = nullptr;
  const float* bias = nullptr;
  float* out = nullptr;
};
cudaError_t launch_projections(const Projection* projections, int32_t n, const float* x,
                               const block_q8_1* xq, const NormEpilogue& input_norm,
                               unsigned int* tickets, cudaStream_t stream);

// The router's top-k, run by its last block's threads (block_router_topk,
// kernels/epilogue.cuh): logit_bias added (gpt-oss), then
// by gating the softmax or the sigmoid of the logits (which replace them), the
// k best of those plus score_bias where set (glm4moe's exp_probs_b; ties to the
// lower id), weights as topk_weights (kernels/moe_math.h) makes them: softmaxed
// over the k for kSoftmaxWeight, renormalised to sum 1 when norm_topk, times
// scale. experts/weights: [k], rank order.
struct RouterEpilogue {
  int32_t k = 0;
  bool norm_topk = false;
  RouterGating gating = RouterGating::kSoftmax;
  const float* logit_bias = nullptr;  // [n_expert] or null
  const float* score_bias = nullptr;  // [n_expert] or null
  float scale = 1.0f;
  int32_t* experts = nullptr;
  float* weights = nullptr;
  RoutingReplay replay;  // with ids set, the trace's choice over the router's
  // W's last row is the shared expert's gate (qwen2moe, qwen35moe): its logit
  // is left in logits[n_expert], outside the top-k, and needs no launch of its own.
  bool shared_gate_row = false;
};

// logits[rows] = W x, then the top-k of its first n_expert = rows (rows - 1
// with shared_gate_row), where router_topk_fits(n_expert, k) (kernels/moe_math.h:
// n_expert <= kMaxRouterExperts, k <= kMaxTopK, k x ceil(n_expert / 128) <= 128).
// tickets: 1.
cudaError_t launch_router(const DeviceMatrix& w, const float* x, const block_q8_1* xq,
                          float* logits, const RouterEpilogue& router, unsigned int* tickets,
                          cudaStream_t stream);

// launch_matvec_residual (with its norm: norm.weight and norm.out set) then
// launch_router over the norm's output (norm.out, norm.out_q), the same bits,
// in one launch (one kernel node fewer a MoE layer): the router's blocks start
// their rows once every block of the residual add is done
// (chained_matvec_kernel, kernels/matvec.cu). An element-type router (f32,
// f16, bf16: llama-quantize never quantizes ffn_gate_inp) normalizes the
// residual itself as it reads it, each block, so no single block runs the norm
// between the two, and its blocks' warps write norm.out and norm.out_q 32
// elements each. A quant type's router reads q8_1 blocks, which the residual
// add's last block makes. tickets: 5. Counts the launch in
// counters->chained_launches (as launch_expert_ffn does).
cudaError_t launch_matvec_residual_router(const DeviceMatrix& w, const float* x,
                                          const block_q8_1* xq, const float* bias,
                                          float* residual, const NormEpilogue& norm,
                                          const DeviceMatrix& router_w, float* logits,
                                          const RouterEpilogue& router, DeviceCounters* counters,
                                          unsigned int* tickets, cudaStream_t stream);

// out = silu(gate x) * (up x), gate and up of one type and shape, and with out_q
// (rows a multiple of 32) out's q8_1 blocks. tickets: rows / 32 (null where
// launch_matvec_swiglu's blocks hold 32 rows each: matvec_geometry).
cudaError_t launch_matvec_swiglu(const DeviceMatrix& gate, const DeviceMatrix& up, const float* x,
                                 const block_q8_1* xq, float* out, block_q8_1* out_q,
                                 unsigned int* tickets, cudaStream_t stream);

// What a head's softmax sees besides the causal keys: with window > 0 only the
// keys at p0 > p - window (gpt-oss's sliding window, llama_hparams::is_masked_swa);
// with sinks ([n_head]) one more logit per head that adds exp(sink) to the
// denominator and nothing to the values (ggml_soft_max_ext's sinks).
// The caches are rings of kv_rows rows where kv_rows > 0 (a windowed layer's:
// position p in row p mod kv_rows, at least window rows, and for a prefill at
// least window + tokens - 1), else rows by position.
// With gate set (qwen35moe's gated attention: the q projection's rows, each
// head's [query | gate], 2 head_dim per head) the output is times
// sigmoid(gate), head by head, before its q8_1 blocks.
struct AttentionMask {
  int32_t window = 0;
  const float* sinks = nullptr;
  int32_t kv_rows = 0;
  const float* gate = nullptr;
};

// Split-K decode attention over positions 0..*pos of the caches (f16 when
// kv_f16, else f32; launch_qkv's layout), as mask restricts it. Head h reads
// KV head h / (n_head / n_head_kv); a block serves the query heads of one KV
// head (at most 8 of them: a larger group takes ceil(group / 8) blocks of
// heads, as even as they go) over one split of 128 positions, so it reads
// that split's keys and values once for all of them. The grid is fixed for
// max_ctx (n_head_kv * ceil(group / 8) columns x ceil(max_ctx / 128) splits;
// splits outside the live keys exit early); the last split of each column to
// finish merges its heads' splits that ran, the sink first. partial:
// attention_partial_floats(...) floats of scratch; tickets: one per column and
// one more (n_head + 1 always suffices). head_dim <= 256. With out_q (n_head *
// head_dim a multiple of 32), out's q8_1 blocks too: written by each column's
// merge when head_dim is a multiple of 32, else by the last column merged.
size_t attention_partial_floats(int32_t n_head, int32_t head_dim, int32_t max_ctx);
cudaError_t launch_attention_decode(const float* q, const void* k_cache, const void* v_cache,
                                    bool kv_f16, const int32_t* pos, int32_t n_head,
                                    int32_t n_head_kv, int32_t head_dim, int32_t max_ctx,
                                    float scale, const AttentionMask& mask, float* partial,
                                    unsigned int* tickets, float* out, block_q8_1* out_q,
                                    cudaStream_t stream);

// Causal attention of a prompt's ubatch (issue 20): row t of q (n_head x
// head_dim, at position *pos0 + t) against cache rows 0..*pos0 + t (as mask
// restricts them), whose rows of the ubatch are already written. A block per
// (column of heads, row), as launch_attention_decode's columns; each row is
// computed split by split and merged as launch_attention_decode does, so it has
// the decode step's bits at its position. tokens <= 65535; the caches and
// head_dim as for decode.
cudaError_t launch_attention_prefill(const float* q, const void* k_cache, const void* v_cache,
                                     bool kv_f16, const int32_t* pos0, int32_t tokens,
                                     int32_t n_head, int32_t n_head_kv, int32_t head_dim,
                                     float scale, const AttentionMask& mask, float* out,
                                     cudaStream_t stream);

// ---- a prompt's ubatch (kernels/prefill.cu) ----

// Each of tokens rows of x (n floats) normed, x / rms(x) * weight, into out
// (f32) and out_f16 (f16 bits), each where not null: the prefill GEMMs' input.
cudaError_t launch_rmsnorm_rows(const float* x, const float* weight, int32_t n, int32_t tokens,
                                float eps, float* out, uint16_t* out_f16, cudaStream_t stream);

// The norm epilogue of one row of n (norm.weight set): the last token's
// output_norm into what the decode step's lm_head reads.
cudaError_t launch_rmsnorm_row(const float* x, int32_t n, const NormEpilogue& norm,
                               cudaStream_t stream);

// n floats of x as f16 bits.
cudaError_t launch_to_f16(const float* x, int64_t n, uint16_t* out, cudaStream_t stream);

// Each of tokens rows of out (n floats) set to row: a bias before a GEMM adds
// into it.
cudaError_t launch_fill_rows(const float* row, int32_t n, int32_t tokens, float* out,
                             cudaStream_t stream);

// Row row added to each of tokens rows of out (n floats): a bias after a GEMM
// that accumulates into the residual.
cudaError_t launch_add_rows(const float* row, int32_t n, int32_t tokens, float* out,
                            cudaStream_t stream);

// The router's top-k (block_router_topk) for each of tokens rows of logits
// ([tokens][n_expert], overwritten by what the router chooses by): router's
// experts and weights are [tokens][k], rank order. Refused (cudaErrorInvalidValue)
// where !router_topk_fits(n_expert, router.k) (kernels/moe_math.h).
cudaError_t launch_router_topk_rows(float* logits, int32_t n_expert, int32_t tokens,
                                    const RouterEpilogue& router, cudaStream_t stream);

// An expert's tokens in a row each: row i of out (f32) and of out_f16 (each
// where not null) is row entries[i] / k of x and of x_f16 (rows of n);
// entries are token * k + rank (residency/prefill_plan.h).
cudaError_t launch_gather_rows(const float* x, const uint16_t* x_f16, int32_t n,
                               const int32_t* entries, int32_t count, int32_t k, float* out,
                               uint16_t* out_f16, cudaStream_t stream);

// out[i] = glu(act, gate[i], up[i]) for n elements, into out and out_f16 (each
// where not null).
cudaError_t launch_swiglu_rows(const float* gate, const float* up, int64_t n, GluAct act,
                               float* out, uint16_t* out_f16, cudaStream_t stream);

// Row i of y (rows of n) to row entries[i] of out: an expert's outputs to
// their (token, rank) rows.
cudaError_t launch_scatter_rows(const float* y, int32_t n, const int32_t* entries, int32_t count,
                                float* out, cudaStream_t stream);

// The decode step's combine for each of tokens rows: residual[t] += sum over
// r in rank order of weights[t][r] * expert_out[t * k + r] (+ shexp_out[t]
// when not null, times sigmoid(shexp_logit[t]) when that is not null), rows of n.
cudaError_t launch_combine_rows(const float* expert_out, const float* weights, int32_t k, int32_t n,
                                int32_t tokens, const float* shexp_out, const float* shexp_logit,
                                float* residual, cudaStream_t stream);

// What launch_qkv's epilogues do for one token, for tokens rows of q, k and v
// ([tokens][n_head or n_head_kv][head_dim], the GEMMs' output; a gated q's
// [tokens][n_head][2 head_dim]) at positions
// *rope.pos + row: QK-norm and RoPE into row `row` of rope.q_out and into the
// k cache's row, v's rows into the v cache's.
cudaError_t launch_rope_append_rows(const float* q, const float* k, const float* v, int32_t tokens,
                                    const QkvRope& rope, cudaStream_t stream);

// ---- MoE ----

// End of a step's routing: while *cursor < record_steps, record[*cursor * n ..
// + n) = selection[0 .. n) (every layer's k ids; record null: nothing written);
// then ++*cursor and, with replay_step set, *replay_step = *cursor mod
// replay_steps: the trace step the next routers' replay reads (RoutingReplay).
cudaError_t launch_routing_step_end(const int32_t* selection, int32_t n, int32_t* record,
                                    int64_t record_steps, int64_t* cursor, int64_t replay_steps,
                                    int64_t* replay_step, cudaStream_t stream);

// residency_step of residency/policy.h for one layer, in one block: thread 0
// makes every state change in the policy's order, and the block finds each
// victim (argmin of victim_rank; the ranks are computed once per step into
// rank_cache, pool.n_slots entries) and each SLRU demotion (argmin of
// demotion_rank, kernels/moe_math.h) by reductions, so the tables, stamps and
// outputs equal the host step's bit for bit. Device pointers throughout
// (pool.n_slots >= k); counts go to counters (hits, misses, evictions).
cudaError_t launch_residency_step(const ResidencyState& state, const ResidencyPool& pool,
                                  int32_t layer, const int32_t* experts, int32_t k,
                                  int32_t* selected_keys, int32_t* slot_of_rank, uint8_t* missed,
                                  int32_t* evicted_keys, uint64_t* rank_cache,
                                  DeviceCounters* counters, cudaStream_t stream);

// hazard_step of residency/hazard_policy.h for one layer, in one block: a
// thread per expert observes the visit (atomicAdd on the cell counts, integer,
// so the order does not matter), the table is rebuilt in its four phases, and
// each miss takes the slot of least hazard_victim_rank (a block argmin; the
// ranks are computed once per step into rank_cache, pool.n_slots entries), so
// the state and outputs equal the host step's bit for bit. Device pointers
// throughout (pool.n_slots >= k); counts go to counters (hits, misses, evictions).
cudaError_t launch_hazard_step(const HazardState& state, const HazardPool& pool, int32_t layer,
                               const int32_t* experts, int32_t k, int32_t* selected_keys,
                               int32_t* slot_of_rank, uint8_t* missed, int32_t* evicted_keys,
                               uint64_t* rank_cache, DeviceCounters* counters,
                               cudaStream_t stream);

// The stage-every-token arm's slots (no policy): slot_of_rank[r] = scratch
// slot r, always missed. (The resident arm has no slot decision: ExpertRanks.)
cudaError_t launch_stage_all_slots(int32_t k, int32_t* slot_of_rank, uint8_t* missed,
                                   cudaStream_t stream);

// SM-driven copy of every missed expert's block from mapped pinned host memory
// (host_blocks: the device pointer of the layer's blocks, [n_expert][block_bytes])
// into its slot, 16-byte accesses; each missed rank's flag goes to kRankCopied
// (kernels/moe_math.h) once its block is all there, for the kReady pass.
// tickets: k, zero (left zero). Counts bytes_staged.
cudaError_t launch_stage_copy(const uint8_t* host_blocks, const DeviceBlockLayout& layout,
                              const int32_t* experts, const int32_t* slot_of_rank, uint8_t* missed,
                              int32_t k, uint8_t* slots, unsigned int* tickets,
                              DeviceCounters* counters, cudaStream_t stream);

// Where an expert pass finds the k ranks' experts: rank r's block is slot
// first_slot + slot_of_rank[r], with its miss flag missed[r]
// (kernels/moe_math.h): a cached arm's slot decision, first_slot 0. The
// resident arm, whose pool holds every expert of the layer in the slot its key
// names, has no decision and no flags: slot_of_rank is the layer's selection,
// first_slot the key of its expert 0, missed null (every rank a hit).
// With shared set, the passes have one more rank after the k routed ones, rank
// k: the layer's shared expert (qwen2moe, glm4moe, qwen35moe), its matrices of
// the slots' types and shapes (shared_expert_fits_slots), always a hit and
// never counted as an expert computed. Its gate/up and down then need no
// launches of their own, and act and expert_out hold k + 1 ranks.
struct SharedExpertMatrices {
  const DeviceMatrix* gate = nullptr;
  const DeviceMatrix* up = nullptr;
  const DeviceMatrix* down = nullptr;
};
struct ExpertRanks {
  int32_t k = 0;
  const int32_t* slot_of_rank = nullptr;
  const uint8_t* missed = nullptr;
  int32_t first_slot = 0;
  SharedExpertMatrices shared;
};

// Whether the shared expert's matrices can ride the expert passes as rank k:
// each of its projection's type, shape and row bytes in layout.
bool shared_expert_fits_slots(const DeviceBlockLayout& layout, const SharedExpertMatrices& shared);

// gpt-oss's expert biases, each null or [n_expert][n_ff] (down: [n_expert][n_embd]),
// rank r adding row experts[r] (the layer's selection): all null, or experts set.
struct ExpertBiases {
  const int32_t* experts = nullptr;
  const float* gate = nullptr;
  const float* up = nullptr;
  const float* down = nullptr;
};

// act[r][n_ff] = glu(act, gate_r x, up_r x) (kernels/nn_math.h; biases added
// to gate_r x and up_r x first) for each rank r of the pass, weights
// found through ranks (gate and up of one type; x and xq as
// launch_matvec reads them), and with act_q (n_ff a multiple of 32) act's q8_1
// blocks, [r][n_ff / 32] (tickets: k * n_ff / 32). Full grid: blocks of other
// passes exit. kReady: launched right after launch_stage_copy, its blocks start
// while the copy runs and a missed rank's wait for its flag (also in the down
// passes). Counts each expert computed once: pass_b_experts when it was
// computed after its copy (kMisses, a missed rank of kReady, which also counts
// copy_waits), else pass_a_experts.
cudaError_t launch_expert_gate_up(const uint8_t* slots, const DeviceBlockLayout& layout,
                                  const ExpertRanks& ranks, ExpertPass pass, const ExpertBiases& biases, GluAct glu_act,
                                  const float* x, const block_q8_1* xq, float* act,
                                  block_q8_1* act_q, DeviceCounters* counters,
                                  unsigned int* tickets, cudaStream_t stream);
// expert_out[r][n_embd] = down_r act[r] (+ its bias) for each rank r of the
// pass (act_q: its q8_1 blocks, for a quantized down).
cudaError_t launch_expert_down(const uint8_t* slots, const DeviceBlockLayout& layout,
                               const ExpertRanks& ranks, ExpertPass pass, const ExpertBiases& biases, const float* act,
                               const block_q8_1* act_q, float* expert_out, cudaStream_t stream);

// The end of the FFN, run by the last down pass: residual += sum over r in rank
// order of weights[r] * expert_out[r] (+ the shared expert's output: rank k's
// expert_out with ranks.shared set, whatever shexp_out says, else shexp_out
// when not null; times
// sigmoid(*shexp_logit) when that is not null: qwen2moe's gate), then norm of
// the residual where norm.weight is set (output_norm after the last layer; a
// layer's attn_norm is its projections' launch's: launch_qkv's input_norm).
struct CombineEpilogue {
  const float* weights = nullptr;
  const float* shexp_out = nullptr;
  const float* shexp_logit = nullptr;
  float* residual = nullptr;
  NormEpilogue norm;
};

// launch_expert_down, then the combine: the last block to finish each 32 rows
// combines them (one writer per row, ranks in order, so the bits do not depend
// on which pass computed each rank), and the last of those runs the norm (if any).
// tickets: n_embd / 32 (rounded up) + 1.
cudaError_t launch_expert_down_combine(const uint8_t* slots, const DeviceBlockLayout& layout,
                                       const ExpertRanks& ranks, ExpertPass pass, const ExpertBiases& biases,
                                       const float* act, const block_q8_1* act_q, float* expert_out,
                                       const CombineEpilogue& combine, unsigned int* tickets,
                                       cudaStream_t stream);

// launch_expert_gate_up then launch_expert_down_combine of one pass over
// every rank (kAll, or kReady right after launch_stage_copy), the same bits, in
// one launch (one kernel node fewer a layer): the blocks take the pair's rows
// first, rank by rank, then down's, a down block of rank r starting its rows
// once every gate/up block of rank r is done (chained_matvec_kernel,
// kernels/matvec.cu). tickets: step_tickets's count (the combine's, the pair's
// q8_1 groups', the chain's counts).
cudaError_t launch_expert_ffn(const uint8_t* slots, const DeviceBlockLayout& layout,
                              const ExpertRanks& ranks, ExpertPass pass,
                              const ExpertBiases& biases, GluAct glu_act, const float* x,
                              const block_q8_1* xq, float* act, block_q8_1* act_q,
                              float* expert_out, const CombineEpilogue& combine,
                              DeviceCounters* counters, unsigned int* tickets,
                              cudaStream_t stream);

// Tickets every launcher above needs, for a model of n_embd, n_head and
// n_head_kv whose gate/up pairs have at most pair_rows rows over all ranks
// (n_ff of an expert times k, a dense or shared expert's n_ff).
int32_t step_tickets(int32_t n_embd, int32_t n_head, int32_t n_head_kv, int32_t pair_rows);

// ---- tokens ----

// Sampling: top-k, top-p, min-p, temperature and a Philox-4x32-10 draw keyed by
// params->seed with counter *step (the position whose logits these are), so a
// replay with the same seed draws the same tokens. The decision is
// sample_token of kernels/sample_math.h, bit for bit; temperature 0 is the
// argmax (ties to the lowest id). *params is device memory read when the
// kernel runs, so a captured graph samples with whatever was written there
// last; it must satisfy sampling_params_valid (checked by whoever writes it).
// One block per 4096 logits (n at most 2^22); the last to finish decides.
// scratch: sample_scratch_bytes(n) of device memory, 16-byte aligned, whose
// first int32 is the SamplePath the last decision took; tickets: 1.
// With end.step set (to step) the launch also ends the decode step once the
// token is chosen: out_tokens[*step] = token, ++*step, ++counters->steps.
enum class SamplePath : int32_t {
  kArgmax = 0,      // greedy
  kCandidates = 1,  // over the blocks' top-k candidates
  kVocabulary = 2,  // over every logit (top-k off, past 256, or too many ties in a block)
};
struct StepEnd {
  int32_t* step = nullptr;
  int32_t* out_tokens = nullptr;
  DeviceCounters* counters = nullptr;
};
size_t sample_scratch_bytes(int32_t n);
cudaError_t launch_sample(const float* logits, int32_t n, const SamplingParams* params,
                          const int32_t* step, void* scratch, unsigned int* tickets,
                          int32_t* token_out, const StepEnd& end, cudaStream_t stream);

// The step's logits kept for later: record[*step * n .. + n) = logits while
// *step < record_steps (a gate reads every step's logits in one readback).
cudaError_t launch_record_logits(const float* logits, int32_t n, const int32_t* step,
                                 int32_t record_steps, float* record, cudaStream_t stream);

}  // namespace moegraph
