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
#include "kernels/kernels.h"
#include "kernels/launch.cuh"
#include "kernels/mmvq_math.h"
#include "kernels/nn_math.h"
#include "kernels/q8_1.cuh"
#include "kernels/reduce.cuh"
#include "loader/quant.h"

namespace moegraph {
namespace {

constexpr int kThreads = 128;
constexpr int kRows = 32;  // rows per block: a q8_1 block of the pair's output

int32_t ceil_div(int64_t a, int64_t b) { return static_cast<int32_t>((a + b - 1) / b); }

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
  const float* bias = nullptr;
  bool accumulate = false;  // out += W x (the residual add)
  // Rank r's output: out + r * out_stride, and with out_q its q8_1 blocks.
  float* out = nullptr;
  block_q8_1* out_q = nullptr;
  int64_t out_stride = 0;
  unsigned long long* count = nullptr;  // once per rank computed
};

template <GgmlType T>
__global__ void __launch_bounds__(kThreads) grouped_matvec_kernel(MatvecArgs a) {
  __shared__ float results[kRows];
  const int32_t r = blockIdx.y;
  const uint8_t* w0 = a.w[0];
  const uint8_t* w1 = a.w[1];
  if (a.slots != nullptr) {
    if (!rank_in_pass(a.pass, a.missed[r])) return;
    const uint8_t* block = a.slots + static_cast<size_t>(a.slot_of_rank[r]) * a.block_bytes;
    w0 = block + a.offset[0];
    w1 = block + a.offset[1];
  }
  if (a.count != nullptr && blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(a.count, 1ull);
  // Only the input the type reads is there; the other may be null.
  const float* x = a.x != nullptr ? a.x + r * a.x_stride : nullptr;
  const block_q8_1* xq = a.xq != nullptr ? a.xq + r * a.x_stride / QK8_1 : nullptr;
  const int g = a.group;
  const int t = threadIdx.x % g;
  const int n_groups = kThreads / g;
  const int32_t row0 = blockIdx.x * kRows;
  // Every thread runs the same rounds (the groups' butterflies need whole warps).
  for (int i = threadIdx.x / g; i < kRows; i += n_groups) {
    const int32_t row = row0 + i;
    const bool live = row < a.rows;
    float v = live ? row_partial<T>(w0 + row * a.row_bytes[0], x, xq, a.cols, t, g) : 0.0f;
    v = group_sum(v, g);
    if (a.pair) {
      float u = live ? row_partial<T>(w1 + row * a.row_bytes[1], x, xq, a.cols, t, g) : 0.0f;
      u = group_sum(u, g);
      v = silu(v) * u;
    } else if (a.bias != nullptr && live) {
      v += a.bias[row];
    }
    if (t == 0) results[i] = live ? v : 0.0f;
  }
  __syncthreads();
  float* out = a.out + r * a.out_stride;
  for (int i = threadIdx.x; i < kRows && row0 + i < a.rows; i += kThreads) {
    out[row0 + i] = a.accumulate ? out[row0 + i] + results[i] : results[i];
  }
  if (a.out_q != nullptr && threadIdx.x < 32) {
    warp_quantize_q8_1(results[threadIdx.x], a.out_q + (r * a.out_stride + row0) / QK8_1);
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

cudaError_t launch_matvec(const DeviceMatrix& w, const float* x, const block_q8_1* xq,
                          const float* bias, float* out, cudaStream_t stream) {
  if (!matrix_ok(w) || !input_ok(w.type, x, xq) || out == nullptr) return cudaErrorInvalidValue;
  MatvecArgs a = DenseArgs(w, x, xq);
  a.bias = bias;
  a.out = out;
  return launch_grouped(w.type, a, 1, stream);
}

cudaError_t launch_matvec_residual(const DeviceMatrix& w, const float* x, const block_q8_1* xq,
                                   float* residual, cudaStream_t stream) {
  if (!matrix_ok(w) || !input_ok(w.type, x, xq) || residual == nullptr) {
    return cudaErrorInvalidValue;
  }
  MatvecArgs a = DenseArgs(w, x, xq);
  a.accumulate = true;
  a.out = residual;
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
                                  ExpertPass pass, const float* x, const block_q8_1* xq,
                                  float* act, block_q8_1* act_q, DeviceCounters* counters,
                                  cudaStream_t stream) {
  if (slots == nullptr || !layout_ok(layout) || layout.type[0] != layout.type[1] ||
      slot_of_rank == nullptr || missed == nullptr || k <= 0 || k > kMaxTopK ||
      !input_ok(layout.type[0], x, xq) || act == nullptr || counters == nullptr ||
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
                               ExpertPass pass, const float* act, const block_q8_1* act_q,
                               float* expert_out, cudaStream_t stream) {
  if (slots == nullptr || !layout_ok(layout) || slot_of_rank == nullptr || missed == nullptr ||
      k <= 0 || k > kMaxTopK || !input_ok(layout.type[2], act, act_q) || expert_out == nullptr) {
    return cudaErrorInvalidValue;
  }
  MatvecArgs a = ExpertArgs(slots, layout, slot_of_rank, missed, pass);
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
  return launch_grouped(layout.type[2], a, k, stream);
}

}  // namespace moegraph
