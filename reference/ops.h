// The oracle's operations, one plain function each, over batches of rows.
//
// A batch is a row-major float array: n_rows rows of a fixed length, row r at
// [r * len, (r + 1) * len). Every op computes each output row from its own input
// row alone, in the same order whatever the batch, so an op over a batch equals
// the op applied row by row bit for bit; that is what makes a T-token forward
// equal T one-token forwards exactly. Arithmetic is f64 inside an op, rounded to
// f32 at its output (ggml keeps activations in f32 between ops too).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "kernels/moe_math.h"
#include "kernels/nn_math.h"
#include "loader/gguf.h"
#include "loader/model_config.h"

namespace moegraph {

// Row `row` of w dequantized to f32 (w.cols values written to dst).
void DequantizeRow(const WeightView& w, int64_t row, float* dst);

// All of a 1-D tensor (norm weights, biases, the shared-expert gate) as f32.
std::vector<float> TensorToFloat(const GgufTensor& t);

// ggml_rms_norm then ggml_mul by weight: y = x / sqrt(mean(x^2) + eps) * weight.
// Row length = weight.size().
void RmsNorm(absl::Span<const float> x, absl::Span<const float> weight, float eps,
             absl::Span<float> out);

// ggml_mul_mat(w, x): out[t][r] = dot(w row r, x row t). x has rows of w.cols,
// out rows of w.rows. Each weight row is dequantized once per call and dotted
// with every x row in f64.
void MatMul(const WeightView& w, absl::Span<const float> x, absl::Span<float> out);

// Adds bias to every row (row length = bias.size()).
void AddBias(absl::Span<const float> bias, absl::Span<float> x);

// Adds b to a element-wise (the residual connections).
void AddInPlace(absl::Span<const float> b, absl::Span<float> a);

// ggml_rope_ext on rows of [n_head][head_dim], row t at position positions[t];
// the first n_rot dimensions of each head rotate (0: all; glm4moe rotates half),
// the rest pass through. Pair i turns by theta = pos * freq_base^(-2i / n_rot),
// scaled as ggml's rope_yarn does (scaling's freq_scale, and with ext_factor its
// per-dimension ramp between the scaled and unscaled angles and the magnitude
// factor). kNorm pairs (x[2i], x[2i+1]), kNeox pairs (x[i], x[i + n_rot/2]).
void Rope(absl::Span<float> x, int n_head, int head_dim, absl::Span<const int32_t> positions,
          float freq_base, RopeType type, const RopeScaling& scaling = RopeScaling(),
          int n_rot = 0);

// The YaRN constants of scaling for heads of n_rot rotated dimensions, as the
// oracle, the CPU backend and the CUDA kernels apply them (kernels/nn_math.h).
RopeYarn YarnOf(const RopeScaling& scaling, int n_rot, float freq_base);

// Rope's rotation of pair i (of n_rot / 2) at pos, magnitude factor included:
// cos and sin for pairs 0 .. n_rot / 2 - 1 into cos_out, sin_out.
void RopeCosSin(int32_t pos, int n_rot, float freq_base, const RopeScaling& scaling,
                float* cos_out, float* sin_out);

// Softmax of each row of length row_len, in place (max subtracted first), as
// the router kernel computes it (router_softmax, kernels/moe_math.h): f32, the
// same bits on every backend.
void Softmax(int64_t row_len, absl::Span<float> x);

// Indices of the k largest values, largest first; equal values keep the lower
// index first (a stable descending argsort, then its first k). A NaN ranks as
// -inf (topk_precedes, kernels/moe_math.h, as the router kernels rank).
std::vector<int32_t> TopK(absl::Span<const float> row, int k);

// The index of the largest value; ties go to the lowest index.
int32_t ArgMax(absl::Span<const float> row);

// x * sigmoid(x).
float Silu(float x);
// 1 / (1 + exp(-x)).
float Sigmoid(float x);

// ggml_swiglu_split(gate, up): silu(gate) * up, element-wise.
void Swiglu(absl::Span<const float> gate, absl::Span<const float> up, absl::Span<float> out);
// ggml_swiglu_oai(gate, up, 1.702, 7): x = min(gate, 7), y = clamp(up, -7, 7),
// x * sigmoid(1.702 x) * (y + 1).
void SwigluOai(absl::Span<const float> gate, absl::Span<const float> up, absl::Span<float> out);

// Causal multi-head attention for the rows of q against a KV cache.
// q: rows of [n_head][head_dim], row t at position q_pos[t]. k_cache, v_cache:
// rows of [n_head_kv][head_dim] for positions 0, 1, ...; query t sees the cache
// rows 0..q_pos[t]. Head h reads KV head h / (n_head / n_head_kv) (ggml's
// broadcast in mul_mat). out: rows of [n_head][head_dim] =
// softmax(kq_scale * q.k) . v per head.
// With window > 0 a query at p1 sees only keys at p0 > p1 - window
// (llama_hparams::is_masked_swa, LLAMA_SWA_TYPE_STANDARD); with sinks (one logit
// per head) each head's softmax also counts exp(sink), a column that adds to the
// denominator and no value (ggml_soft_max_ext's sinks).
void Attention(absl::Span<const float> q, absl::Span<const int32_t> q_pos,
               absl::Span<const float> k_cache, absl::Span<const float> v_cache, int n_head,
               int n_head_kv, int head_dim, float kq_scale, absl::Span<float> out, int window = 0,
               absl::Span<const float> sinks = {});

// One routed expert's matrices.
struct ExpertWeights {
  WeightView gate, up, down;
};

// Where MoeFfn finds the routed experts' weights: the model file itself, or a
// cache of copies (the CPU backend's slots). Provide is called once per (row,
// layer), rows in order, with the row's k selected ids in router rank order, and
// fills weights[r] for rank r; the views need only stay valid until the next call.
class ExpertProvider {
 public:
  virtual ~ExpertProvider() = default;
  virtual void Provide(int layer, absl::Span<const int32_t> experts,
                       absl::Span<ExpertWeights> weights) = 0;
  // Provide, but returning before the views of ranks whose weights are
  // still on their way (a disk tier's reads) are ready: Pending(r) says
  // which, and Arrive hands them over as they come. The default provides
  // every rank at once.
  virtual void ProvideStart(int layer, absl::Span<const int32_t> experts,
                            absl::Span<ExpertWeights> weights) {
    Provide(layer, experts, weights);
  }
  virtual bool Pending(int /*rank*/) const { return false; }
  // Waits until at least one pending rank's view is ready and appends the
  // ranks ready since the last call (no longer pending) to ranks.
  virtual void Arrive(std::vector<int>* /*ranks*/) {}
  // Routing replay: called once per (row, layer) after the router and before
  // Provide, with the row's gate values (GateProbs' output, n_expert), its
  // selection (k ids, rank order) and combine weights; an override rewrites
  // the last two. The default keeps the router's choice.
  virtual void Route(int /*layer*/, absl::Span<const float> /*probs*/,
                     absl::Span<int32_t> /*experts*/, absl::Span<double> /*weights*/) {}
  // Whether the views Provide fills stay valid through later calls (until the
  // next Forward), so a batch's experts can run after all its rows are asked;
  // a cache that may evict says no.
  virtual bool ViewsOutliveCalls() const { return true; }
};

// The model's own slices (Model::expert).
class ModelExpertProvider final : public ExpertProvider {
 public:
  explicit ModelExpertProvider(const Model& model) : model_(model) {}
  void Provide(int layer, absl::Span<const int32_t> experts,
               absl::Span<ExpertWeights> weights) override;

 private:
  const Model& model_;
};

// The router's logits (rows of n_expert) turned into what SelectExperts reads,
// in place: softmaxed (kSoftmax), sigmoids (kSigmoid), or kept (kSoftmaxWeight).
void GateProbs(ExpertGating gating, int n_expert, absl::Span<float> logits);

// The router's choice for each row of probs (rows of n_expert, from GateProbs):
// the top k ids in rank order and their probabilities, divided by their sum when
// norm (norm_topk_prob), then times scale, at [row * k, row * k + k) of chosen
// and weight. With ExpertGating::kSoftmaxWeight, probs are the raw logits and
// the k weights their softmax. A score_bias (one per expert) is added to probs
// to choose; the weights are the unbiased probs.
void SelectExperts(absl::Span<const float> probs, int n_expert, int k, bool norm,
                   std::vector<int32_t>* chosen, std::vector<double>* weight,
                   ExpertGating gating = ExpertGating::kSoftmax,
                   absl::Span<const float> score_bias = {}, float scale = 1.0f);

// The kernels' name for a model's gating.
RouterGating RouterGatingOf(ExpertGating gating);

// The combine weights SelectExperts gives the experts ids (rank order) of one
// row of probs: their values (or, with kSoftmaxWeight, their softmax), norm
// and scale as SelectExperts documents, computed by topk_weights
// (kernels/moe_math.h) as the router kernel computes them.
void ChosenWeights(absl::Span<const float> probs, absl::Span<const int32_t> ids, bool norm,
                   ExpertGating gating, float scale, absl::Span<double> weights);

// The feed-forward block of one MoE layer (llm_graph_context::build_moe_ffn,
// plus the qwen2moe shared expert) on rows of n_embd that are already
// ffn-normed, with the routed experts' weights from experts. When selected is
// not null it receives n_expert_used expert ids per row, in router rank order.
void MoeFfn(const Model& model, int layer, ExpertProvider& experts, absl::Span<const float> x,
            absl::Span<float> out, std::vector<int32_t>* selected = nullptr);
// A leading dense layer's FFN (glm4moe): down(silu(gate x) * up x), rows of n_embd.
void DenseFfn(const Model& model, int layer, absl::Span<const float> x, absl::Span<float> out);
// The same with the model's own expert slices.
void MoeFfn(const Model& model, int layer, absl::Span<const float> x, absl::Span<float> out,
            std::vector<int32_t>* selected = nullptr);

}  // namespace moegraph
