// The decode step's matrix-vector products: the dense projections, lm_head and
// the experts through the slot table, one kernel template per weight type (no
// type switch in the loop), ggml-cuda's mmvq scheme for the quant types
// (kernels/mmvq_math.h: q8_1 activations, whole-word weight loads, dp4a) and
// 16-byte loads for the element types.
//
// A block of kThreads threads owns kRows consecutive output rows of one rank
// (blockIdx.y); a row goes to a group of G threads (row_group: G covers the
// row's work units, up to a warp), so short rows keep every lane busy. A group
// reduces its row with a butterfly. A gate/up pair computes silu(gate . x) *
// (up . x) per row and, when asked, quantizes each 32 rows of that to q8_1 for
// the down projection: the block holds them all.
//
// Epilogues (kernels/epilogue.cuh): the residual projection's last block runs
// the RMSNorm after it, the router's its top-k; the last down pass's last block
// of each 32 rows combines the ranks into the residual, and the last of those
// runs the next norm. q, k and v are one launch whose blocks each take one
// matrix's rows (a block-uniform switch on its type, outside the loops), the
// last block of each head running its QK-norm, RoPE and KV append.
#include "kernels/epilogue.cuh"
#include "kernels/kernels.h"
#include "kernels/launch.cuh"
#include "kernels/mmvq_math.h"
#include "kernels/nn_math.h"
#include "kernels/q8_1.cuh"
#include "kernels/reduce.cuh"
#include "loader/quant.h"

#include <algorithm>

namespace moegraph {
namespace {

constexpr int kThreads = 128;
constexpr int kRows = 32;  // rows per block: a q8_1 block of the pair's output

__host__ __device__ int32_t ceil_div(int64_t a, int64_t b) {
  return static_cast<int32_t>((a + b - 1) / b);
}

size_t packed_row_bytes(GgmlType type, int64_t cols) {
  return static_cast<size_t>(cols / quant_block_elems(type) * quant_block_bytes(type));
}

// One launch's operands. Weights are fixed (dense: w[0], and w[1] for a pair)
// or, with slots set, found per rank: slots + slot_of_rank[r] * block_bytes +
// offset[p], for the ranks of `pass` only.
struct MatvecArgs {
  const uint8_t* w[2] = {nullptr, nullptr};
  size_t row_bytes[2] = {0, 0};
  const uint8_t* slots = nullptr;
  size_t block_bytes = 0;
  size_t offset[2] = {0, 0};
  const int32_t* slot_of_rank = nullptr;
  const uint8_t* missed = nullptr;
  ExpertPass pass = ExpertPass::kAll;
  int32_t rows = 0, cols = 0;
  int32_t group = 0;
  bool pair = false;  // out = silu(w[0] x) * (w[1] x)
  // The input of rank r: x + r * x_stride (f32, element types) and its q8_1
  // blocks xq + r * x_stride / 32 (quant types).
  const float* x = nullptr;
  const block_q8_1* xq = nullptr;
  int64_t x_stride = 0;
  // Biases of w[0]'s and w[1]'s rows; with experts set, rank r's are rows
  // experts[r] of [n_expert][rows] arrays (gpt-oss's expert biases).
  const float* bias[2] = {nullptr, nullptr};
  const int32_t* experts = nullptr;
  GluAct act = GluAct::kSilu;  // a pair's activation
  bool accumulate = false;     // out += W x + bias (the residual add)
  // Rank r's output: out + r * out_stride, and with out_q its q8_1 blocks;
  // with out_f16 set, rows go there as f16 instead (the v cache row).
  float* out = nullptr;
  uint16_t* out_f16 = nullptr;
  block_q8_1* out_q = nullptr;
  int64_t out_stride = 0;
  unsigned long long* count = nullptr;  // once per rank computed
  // Epilogues, with tickets set: the norm of out (ranks 1), the router's
  // top-k over out (experts set), or the combine of the ranks' outputs into
  // combine.residual and its norm.
  unsigned int* tickets = nullptr;
  NormEpilogue norm;
  RouterEpilogue router;
  CombineEpilogue combine;
};

// Rows [32 bx, + 32) of rank blockIdx.y by the whole block.
template <GgmlType T>
__device__ __forceinline__ void matvec_rows(const MatvecArgs& a, int32_t bx) {
  __shared__ float results[kRows];
  const int32_t r = blockIdx.y;
  const uint8_t* w0 = a.w[0];
  const uint8_t* w1 = a.w[1];
  if (a.slots != nullptr) {
    const uint8_t* block = a.slots + static_cast<size_t>(a.slot_of_rank[r]) * a.block_bytes;
    w0 = block + a.offset[0];
    w1 = block + a.offset[1];
  }
  if (a.count != nullptr && bx == 0 && threadIdx.x == 0) atomicAdd(a.count, 1ull);
  // Only the input the type reads is there; the other may be null.
  const float* x = a.x != nullptr ? a.x + r * a.x_stride : nullptr;
  const block_q8_1* xq = a.xq != nullptr ? a.xq + r * a.x_stride / QK8_1 : nullptr;
  const int64_t bias_at = a.experts != nullptr ? static_cast<int64_t>(a.experts[r]) * a.rows : 0;
  const float* bias0 = a.bias[0] != nullptr ? a.bias[0] + bias_at : nullptr;
  const float* bias1 = a.bias[1] != nullptr ? a.bias[1] + bias_at : nullptr;
  const int g = a.group;
  const int t = threadIdx.x % g;
  const int n_groups = kThreads / g;
  const int32_t row0 = bx * kRows;
  // Every thread runs the same rounds (the groups' butterflies need whole warps).
  for (int i = threadIdx.x / g; i < kRows; i += n_groups) {
    const int32_t row = row0 + i;
    const bool live = row < a.rows;
    float v = live ? row_partial<T>(w0 + row * a.row_bytes[0], x, xq, a.cols, t, g) : 0.0f;
    v = group_sum(v, g);
    if (bias0 != nullptr && live) v += bias0[row];
    if (a.pair) {
      float u = live ? row_partial<T>(w1 + row * a.row_bytes[1], x, xq, a.cols, t, g) : 0.0f;
      u = group_sum(u, g);
      if (bias1 != nullptr && live) u += bias1[row];
      v = glu(a.act, v, u);
    }
    if (t == 0) results[i] = live ? v : 0.0f;
  }
  __syncthreads();
  if (a.out_f16 != nullptr) {
    for (int i = threadIdx.x; i < kRows && row0 + i < a.rows; i += kThreads) {
      a.out_f16[row0 + i] = f32_to_f16(results[i]);
    }
    return;
  }
  float* out = a.out + r * a.out_stride;
  for (int i = threadIdx.x; i < kRows && row0 + i < a.rows; i += kThreads) {
    out[row0 + i] = a.accumulate ? out[row0 + i] + results[i] : results[i];
  }
  if (a.out_q != nullptr && threadIdx.x < 32) {
    warp_quantize_q8_1(results[threadIdx.x], a.out_q + (r * a.out_stride + row0) / QK8_1);
  }
}

// Rows [32 blockIdx.x, + 32) of the ranks' outputs into the residual, ranks in
// order (every rank's block of these rows is done), then, in the last block to
// get here, the norm of the whole residual.
__device__ void combine_epilogue(const MatvecArgs& a, EpilogueShared* shared) {
  const CombineEpilogue& c = a.combine;
  const int32_t row0 = blockIdx.x * kRows;
  if (!last_block_done(a.tickets + 1 + blockIdx.x, gridDim.y, shared)) return;
  for (int32_t i = threadIdx.x; i < kRows && row0 + i < a.rows; i += kThreads) {
    const int32_t row = row0 + i;
    float acc = 0.0f;
    for (int32_t r = 0; r < static_cast<int32_t>(gridDim.y); ++r) {
      acc += c.weights[r] * __ldcg(a.out + r * a.out_stride + row);
    }
    if (c.shexp_out != nullptr) {
      acc += (c.shexp_logit != nullptr ? sigmoid(*c.shexp_logit) : 1.0f) * c.shexp_out[row];
    }
    c.residual[row] += acc;
  }
  if (c.norm.weight == nullptr || !last_block_done(a.tickets, gridDim.x, shared)) return;
  run_norm_epilogue(c.norm, c.residual, a.rows, shared);
}

// The launch's epilogue (its tickets are set): the combine, or the router's
// top-k or the norm of out in the last block. Out of line, so its registers do
// not count against the matvec loop's.
MG_NOINLINE __device__ void matvec_epilogue(MatvecArgs a, EpilogueShared* shared) {
  if (a.combine.residual != nullptr) {
    combine_epilogue(a, shared);
    return;
  }
  if (!last_block_done(a.tickets, gridDim.x * gridDim.y, shared)) return;
  if (a.router.experts != nullptr) {
    warp_router_topk(a.out, a.rows, a.router, a.router.experts, a.router.weights, shared);
  } else {
    run_norm_epilogue(a.norm, a.out, a.rows, shared);
  }
}

template <GgmlType T>
__global__ void __launch_bounds__(kThreads) grouped_matvec_kernel(MatvecArgs a) {
  wait_for_prior_grids();
  __shared__ EpilogueShared shared;
  if (a.slots == nullptr || rank_in_pass(a.pass, a.missed[blockIdx.y])) {
    matvec_rows<T>(a, blockIdx.x);
  }
  if (a.tickets != nullptr) matvec_epilogue(a, &shared);
}

// q, k and v: blocks [first_block[j], first_block[j + 1]) compute job j; v's
// rows go straight to the cache row *pos.
struct QkvArgs {
  MatvecArgs job[3];
  GgmlType type[3];
  int32_t first_block[4];
  QkvRope rope;
  unsigned int* tickets = nullptr;
};

// Each head of q (j 0) or k (j 1) that rows [32 bx, + 32) hold, once the last
// block holding rows of it is done: QK-norm and RoPE into q_out or the cache
// row. With a full-width norm (olmoe) the last block of all of q (or k) does
// every head.
__device__ void qkv_rope_epilogue(const QkvArgs& a, int j, int32_t bx, EpilogueShared* shared) {
  const QkvRope& rope = a.rope;
  const int32_t d = rope.head_dim;
  const int32_t n_heads = j == 0 ? rope.n_head : rope.n_head_kv;
  const int32_t rows = n_heads * d;
  unsigned int* tickets = a.tickets + (j == 0 ? 0 : rope.n_head);
  const float* src = a.job[j].out;
  const int32_t p = *rope.pos;
  if (rope.use_norm && rope.norm.full) {
    if (!last_block_done(tickets, ceil_div(rows, kRows), shared)) return;
    const float scale = block_rms_scale(src, rows, rope.norm.eps, shared);
    for (int32_t h = 0; h < n_heads; ++h) rope_qk_head(rope, j, src, scale, h, p, rope.q_out);
    return;
  }
  const int32_t row0 = bx * kRows;
  const int32_t row_end = min(row0 + kRows, rows);
  for (int32_t h = row0 / d; h * d < row_end; ++h) {
    const int32_t blocks = ((h + 1) * d - 1) / kRows - h * d / kRows + 1;
    if (!last_block_done(tickets + h, blocks, shared)) continue;
    const float scale =
        rope.use_norm ? block_rms_scale(src + h * d, d, rope.norm.eps, shared) : 1.0f;
    rope_qk_head(rope, j, src, scale, h, p, rope.q_out);
  }
}

template <GgmlType T>
__device__ __forceinline__ void qkv_job(const QkvArgs& a, int j, int32_t bx,
                                        EpilogueShared* shared) {
  MatvecArgs job = j == 0 ? a.job[0] : j == 1 ? a.job[1] : a.job[2];
  if (a.tickets != nullptr && j == 2) {
    const int64_t row =
        kv_cache_row(*a.rope.pos, a.rope.kv_rows) * a.rope.n_head_kv * a.rope.head_dim;
    if (a.rope.kv_f16) {
      job.out_f16 = static_cast<uint16_t*>(a.rope.v_cache) + row;
    } else {
      job.out = static_cast<float*>(a.rope.v_cache) + row;
    }
  }
  matvec_rows<T>(job, bx);
  if (a.tickets != nullptr && j < 2) qkv_rope_epilogue(a, j, bx, shared);
}

__global__ void __launch_bounds__(kThreads) qkv_kernel(QkvArgs a) {
  wait_for_prior_grids();
  __shared__ EpilogueShared shared;
  const int32_t block = blockIdx.x;
  const int j = block >= a.first_block[2] ? 2 : block >= a.first_block[1] ? 1 : 0;
  const int32_t bx = block - a.first_block[j];
  switch (a.type[j]) {
    case GgmlType::kQ8_0: return qkv_job<GgmlType::kQ8_0>(a, j, bx, &shared);
    case GgmlType::kQ4_0: return qkv_job<GgmlType::kQ4_0>(a, j, bx, &shared);
    case GgmlType::kQ4_K: return qkv_job<GgmlType::kQ4_K>(a, j, bx, &shared);
    case GgmlType::kQ5_K: return qkv_job<GgmlType::kQ5_K>(a, j, bx, &shared);
    case GgmlType::kQ6_K: return qkv_job<GgmlType::kQ6_K>(a, j, bx, &shared);
    case GgmlType::kQ4_1: return qkv_job<GgmlType::kQ4_1>(a, j, bx, &shared);
    case GgmlType::kQ5_0: return qkv_job<GgmlType::kQ5_0>(a, j, bx, &shared);
    case GgmlType::kQ5_1: return qkv_job<GgmlType::kQ5_1>(a, j, bx, &shared);
    case GgmlType::kQ2_K: return qkv_job<GgmlType::kQ2_K>(a, j, bx, &shared);
    case GgmlType::kQ3_K: return qkv_job<GgmlType::kQ3_K>(a, j, bx, &shared);
    case GgmlType::kIQ4_NL: return qkv_job<GgmlType::kIQ4_NL>(a, j, bx, &shared);
    case GgmlType::kIQ4_XS: return qkv_job<GgmlType::kIQ4_XS>(a, j, bx, &shared);
    case GgmlType::kF32: return qkv_job<GgmlType::kF32>(a, j, bx, &shared);
    case GgmlType::kF16: return qkv_job<GgmlType::kF16>(a, j, bx, &shared);
    case GgmlType::kBF16: return qkv_job<GgmlType::kBF16>(a, j, bx, &shared);
    default: return;
  }
}

bool supported(GgmlType type, int64_t cols) { return grouped_matvec_supports(type, cols); }

// The kernel of a's weight type, over ranks blocks of y.
cudaError_t launch_grouped(GgmlType type, const MatvecArgs& a, int32_t ranks,
                           cudaStream_t stream) {
  const dim3 grid(ceil_div(a.rows, kRows), ranks);
  switch (type) {
    case GgmlType::kQ8_0:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kQ8_0>>(grid, kThreads, stream, a);
    case GgmlType::kQ4_0:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kQ4_0>>(grid, kThreads, stream, a);
    case GgmlType::kQ4_K:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kQ4_K>>(grid, kThreads, stream, a);
    case GgmlType::kQ5_K:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kQ5_K>>(grid, kThreads, stream, a);
    case GgmlType::kQ6_K:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kQ6_K>>(grid, kThreads, stream, a);
    case GgmlType::kQ4_1:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kQ4_1>>(grid, kThreads, stream, a);
    case GgmlType::kQ5_0:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kQ5_0>>(grid, kThreads, stream, a);
    case GgmlType::kQ5_1:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kQ5_1>>(grid, kThreads, stream, a);
    case GgmlType::kQ2_K:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kQ2_K>>(grid, kThreads, stream, a);
    case GgmlType::kQ3_K:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kQ3_K>>(grid, kThreads, stream, a);
    case GgmlType::kIQ4_NL:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kIQ4_NL>>(grid, kThreads, stream, a);
    case GgmlType::kIQ4_XS:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kIQ4_XS>>(grid, kThreads, stream, a);
    case GgmlType::kMXFP4:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kMXFP4>>(grid, kThreads, stream, a);
    case GgmlType::kF32:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kF32>>(grid, kThreads, stream, a);
    case GgmlType::kF16:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kF16>>(grid, kThreads, stream, a);
    case GgmlType::kBF16:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kBF16>>(grid, kThreads, stream, a);
    default:
      return cudaErrorInvalidValue;
  }
}

bool matrix_ok(const DeviceMatrix& m) {
  return m.data != nullptr && m.rows > 0 && supported(m.type, m.cols) &&
         m.row_bytes >= packed_row_bytes(m.type, m.cols);
}

// The input a type reads is there: q8_1 for the quant types, f32 for the others.
bool input_ok(GgmlType type, const float* x, const block_q8_1* xq) {
  return mmvq_type(type) ? xq != nullptr : x != nullptr;
}

// One dense matrix against x (and its q8_1 blocks xq).
MatvecArgs DenseArgs(const DeviceMatrix& w, const float* x, const block_q8_1* xq) {
  MatvecArgs a;
  a.w[0] = static_cast<const uint8_t*>(w.data);
  a.row_bytes[0] = w.row_bytes;
  a.rows = w.rows;
  a.cols = w.cols;
  a.group = row_group(w.type, w.cols);
  a.x = x;
  a.xq = xq;
  return a;
}

// An expert pass over the ranks of pass: weights through the slot table.
MatvecArgs ExpertArgs(const uint8_t* slots, const DeviceBlockLayout& layout,
                      const int32_t* slot_of_rank, const uint8_t* missed, ExpertPass pass) {
  MatvecArgs a;
  a.slots = slots;
  a.block_bytes = layout.block_bytes;
  a.slot_of_rank = slot_of_rank;
  a.missed = missed;
  a.pass = pass;
  return a;
}

// The down projection of the ranks of pass.
MatvecArgs DownArgs(const uint8_t* slots, const DeviceBlockLayout& layout,
                    const int32_t* slot_of_rank, const uint8_t* missed, ExpertPass pass,
                    const ExpertBiases& biases, const float* act, const block_q8_1* act_q,
                    float* expert_out) {
  MatvecArgs a = ExpertArgs(slots, layout, slot_of_rank, missed, pass);
  a.bias[0] = biases.down;
  a.experts = biases.experts;
  a.offset[0] = layout.offset[2];
  a.row_bytes[0] = layout.row_bytes[2];
  a.rows = layout.n_embd;
  a.cols = layout.n_ff;
  a.group = row_group(layout.type[2], layout.n_ff);
  a.x = act;
  a.xq = act_q;
  a.x_stride = layout.n_ff;
  a.out = expert_out;
  a.out_stride = layout.n_embd;
  return a;
}

// Biases, where set, come with the ranks' expert ids.
bool biases_ok(const ExpertBiases& b) {
  return b.experts != nullptr || (b.gate == nullptr && b.up == nullptr && b.down == nullptr);
}

bool layout_ok(const DeviceBlockLayout& layout) {
  if (layout.n_embd <= 0 || layout.n_ff <= 0 || layout.block_bytes % 16 != 0) return false;
  for (int p = 0; p < 3; ++p) {
    const int64_t cols = p < 2 ? layout.n_embd : layout.n_ff;
    const int64_t rows = p < 2 ? layout.n_ff : layout.n_embd;
    if (!supported(layout.type[p], cols) ||
        layout.row_bytes[p] < packed_row_bytes(layout.type[p], cols) ||
        layout.offset[p] + rows * layout.row_bytes[p] > layout.block_bytes) {
      return false;
    }
  }
  return true;
}

}  // namespace

bool matvec_supports_type(GgmlType type, int32_t cols) { return supported(type, cols); }

bool qkv_supports_type(GgmlType type, int32_t cols) {
  return supported(type, cols) && type != GgmlType::kMXFP4;
}

cudaError_t launch_matvec(const DeviceMatrix& w, const float* x, const block_q8_1* xq,
                          const float* bias, float* out, cudaStream_t stream) {
  if (!matrix_ok(w) || !input_ok(w.type, x, xq) || out == nullptr) return cudaErrorInvalidValue;
  MatvecArgs a = DenseArgs(w, x, xq);
  a.bias[0] = bias;
  a.out = out;
  return launch_grouped(w.type, a, 1, stream);
}

cudaError_t launch_matvec_residual(const DeviceMatrix& w, const float* x, const block_q8_1* xq,
                                   const float* bias, float* residual, const NormEpilogue& norm,
                                   unsigned int* tickets, cudaStream_t stream) {
  if (!matrix_ok(w) || !input_ok(w.type, x, xq) || residual == nullptr ||
      !norm_epilogue_ok(norm, w.rows) || (norm.weight != nullptr && tickets == nullptr)) {
    return cudaErrorInvalidValue;
  }
  MatvecArgs a = DenseArgs(w, x, xq);
  a.bias[0] = bias;
  a.accumulate = true;
  a.out = residual;
  if (norm.weight != nullptr) {
    a.tickets = tickets;
    a.norm = norm;
  }
  return launch_grouped(w.type, a, 1, stream);
}

cudaError_t launch_qkv(const DeviceMatrix& wq, const DeviceMatrix& wk, const DeviceMatrix& wv,
                       const float* x, const block_q8_1* xq, const float* bq, const float* bk,
                       const float* bv, float* q, float* k, float* v, const QkvRope* rope,
                       unsigned int* tickets, cudaStream_t stream) {
  const DeviceMatrix* w[3] = {&wq, &wk, &wv};
  const float* bias[3] = {bq, bk, bv};
  float* out[3] = {q, k, v};
  QkvArgs a;
  if (rope != nullptr) {
    const int32_t d = rope->head_dim;
    if (rope->pos == nullptr || rope->n_head <= 0 || rope->n_head_kv <= 0 || d <= 0 || d % 2 != 0 ||
        wq.rows != rope->n_head * d || wk.rows != rope->n_head_kv * d || wv.rows != wk.rows ||
        rope->q_out == nullptr || rope->q_out == q || rope->k_cache == nullptr ||
        rope->v_cache == nullptr || rope->kv_rows < 0 ||
        (rope->rope_type != kRopeNorm && rope->rope_type != kRopeNeox) ||
        (rope->use_norm && (rope->norm.q_weight == nullptr || rope->norm.k_weight == nullptr)) ||
        tickets == nullptr) {
      return cudaErrorInvalidValue;
    }
    a.rope = *rope;
    a.tickets = tickets;
    out[2] = static_cast<float*>(rope->v_cache);  // the row at *pos, found in the kernel
  }
  a.first_block[0] = 0;
  for (int j = 0; j < 3; ++j) {
    if (!matrix_ok(*w[j]) || !qkv_supports_type(w[j]->type, w[j]->cols) ||
        w[j]->cols != wq.cols || !input_ok(w[j]->type, x, xq) || out[j] == nullptr) {
      return cudaErrorInvalidValue;
    }
    a.job[j] = DenseArgs(*w[j], x, xq);
    a.job[j].bias[0] = bias[j];
    a.job[j].out = out[j];
    a.type[j] = w[j]->type;
    a.first_block[j + 1] = a.first_block[j] + ceil_div(w[j]->rows, kRows);
  }
  return launch_kernel<qkv_kernel>(a.first_block[3], kThreads, stream, a);
}

cudaError_t launch_router(const DeviceMatrix& w, const float* x, const block_q8_1* xq,
                          float* logits, const RouterEpilogue& router, unsigned int* tickets,
                          cudaStream_t stream) {
  if (!matrix_ok(w) || !input_ok(w.type, x, xq) || logits == nullptr ||
      w.rows > kMaxRouterExperts || router.k <= 0 || router.k > kMaxTopK || router.k > w.rows ||
      router.experts == nullptr || router.weights == nullptr || tickets == nullptr) {
    return cudaErrorInvalidValue;
  }
  MatvecArgs a = DenseArgs(w, x, xq);
  a.out = logits;
  a.tickets = tickets;
  a.router = router;
  return launch_grouped(w.type, a, 1, stream);
}

cudaError_t launch_matvec_swiglu(const DeviceMatrix& gate, const DeviceMatrix& up, const float* x,
                                 const block_q8_1* xq, float* out, block_q8_1* out_q,
                                 cudaStream_t stream) {
  if (!matrix_ok(gate) || !matrix_ok(up) || gate.type != up.type || gate.rows != up.rows ||
      gate.cols != up.cols || !input_ok(gate.type, x, xq) || out == nullptr ||
      (out_q != nullptr && gate.rows % QK8_1 != 0)) {
    return cudaErrorInvalidValue;
  }
  MatvecArgs a;
  a.w[0] = static_cast<const uint8_t*>(gate.data);
  a.w[1] = static_cast<const uint8_t*>(up.data);
  a.row_bytes[0] = gate.row_bytes;
  a.row_bytes[1] = up.row_bytes;
  a.rows = gate.rows;
  a.cols = gate.cols;
  a.group = row_group(gate.type, gate.cols);
  a.pair = true;
  a.x = x;
  a.xq = xq;
  a.out = out;
  a.out_q = out_q;
  return launch_grouped(gate.type, a, 1, stream);
}

cudaError_t launch_expert_gate_up(const uint8_t* slots, const DeviceBlockLayout& layout,
                                  const int32_t* slot_of_rank, const uint8_t* missed, int32_t k,
                                  ExpertPass pass, const ExpertBiases& biases, GluAct glu_act,
                                  const float* x, const block_q8_1* xq, float* act,
                                  block_q8_1* act_q, DeviceCounters* counters,
                                  cudaStream_t stream) {
  if (slots == nullptr || !layout_ok(layout) || !biases_ok(biases) ||
      layout.type[0] != layout.type[1] || slot_of_rank == nullptr || missed == nullptr || k <= 0 ||
      k > kMaxTopK || !input_ok(layout.type[0], x, xq) || act == nullptr || counters == nullptr ||
      (act_q != nullptr && layout.n_ff % QK8_1 != 0)) {
    return cudaErrorInvalidValue;
  }
  MatvecArgs a = ExpertArgs(slots, layout, slot_of_rank, missed, pass);
  a.offset[0] = layout.offset[0];
  a.offset[1] = layout.offset[1];
  a.row_bytes[0] = layout.row_bytes[0];
  a.row_bytes[1] = layout.row_bytes[1];
  a.rows = layout.n_ff;
  a.cols = layout.n_embd;
  a.group = row_group(layout.type[0], layout.n_embd);
  a.pair = true;
  a.bias[0] = biases.gate;
  a.bias[1] = biases.up;
  a.experts = biases.experts;
  a.act = glu_act;
  a.x = x;
  a.xq = xq;
  a.out = act;
  a.out_q = act_q;
  a.out_stride = layout.n_ff;
  // kAll is the single pass of the unsplit walk, so it counts as pass A.
  a.count = pass == ExpertPass::kMisses ? &counters->pass_b_experts : &counters->pass_a_experts;
  return launch_grouped(layout.type[0], a, k, stream);
}

cudaError_t launch_expert_down(const uint8_t* slots, const DeviceBlockLayout& layout,
                               const int32_t* slot_of_rank, const uint8_t* missed, int32_t k,
                               ExpertPass pass, const ExpertBiases& biases, const float* act,
                               const block_q8_1* act_q, float* expert_out, cudaStream_t stream) {
  if (slots == nullptr || !layout_ok(layout) || !biases_ok(biases) || slot_of_rank == nullptr ||
      missed == nullptr || k <= 0 || k > kMaxTopK || !input_ok(layout.type[2], act, act_q) ||
      expert_out == nullptr) {
    return cudaErrorInvalidValue;
  }
  return launch_grouped(
      layout.type[2],
      DownArgs(slots, layout, slot_of_rank, missed, pass, biases, act, act_q, expert_out), k,
      stream);
}

cudaError_t launch_expert_down_combine(const uint8_t* slots, const DeviceBlockLayout& layout,
                                       const int32_t* slot_of_rank, const uint8_t* missed,
                                       int32_t k, ExpertPass pass, const ExpertBiases& biases,
                                       const float* act, const block_q8_1* act_q, float* expert_out,
                                       const CombineEpilogue& combine, unsigned int* tickets,
                                       cudaStream_t stream) {
  if (slots == nullptr || !layout_ok(layout) || !biases_ok(biases) || slot_of_rank == nullptr ||
      missed == nullptr || k <= 0 || k > kMaxTopK || !input_ok(layout.type[2], act, act_q) ||
      expert_out == nullptr || combine.weights == nullptr || combine.residual == nullptr ||
      !norm_epilogue_ok(combine.norm, layout.n_embd) || tickets == nullptr) {
    return cudaErrorInvalidValue;
  }
  MatvecArgs a =
      DownArgs(slots, layout, slot_of_rank, missed, pass, biases, act, act_q, expert_out);
  a.tickets = tickets;
  a.combine = combine;
  return launch_grouped(layout.type[2], a, k, stream);
}

int32_t step_tickets(int32_t n_embd, int32_t n_head, int32_t n_head_kv) {
  return std::max(ceil_div(n_embd, kRows) + 1, n_head + n_head_kv);
}

}  // namespace moegraph
