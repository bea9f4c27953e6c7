// The decode step's matrix-vector products: the dense projections, lm_head and
// the experts through the slot table, one kernel template per weight type (no
// type switch in the loop), ggml-cuda's mmvq scheme for the quant types
// (kernels/mmvq_math.h: q8_1 activations, aligned 32-bit weight words, dp4a)
// and aligned 32-bit words for the element types.
//
// Geometry (mul_mat_vec_q's, mmvq.cu): a block of kMatvecThreads threads on one
// row (or a few: matvec_geometry), K split across its threads, each thread
// loading a whole trip of units before its first dp4a; a row's parts meet in a
// butterfly within a warp and, past a warp, through shared memory in warp
// order. The grid is (row blocks) x (ranks): thousands of blocks at a real
// model's shape. A gate/up pair computes glu(gate . x, up . x) per row and,
// when asked, quantizes each 32 rows of that to q8_1 for the down projection:
// the last block of each 32 rows does it.
//
// The weights are the kernel's first parameter and nothing else is
// (tests/kernel_shape_test.py traces weight loads to it); every parameter is
// __grid_constant__, so an epilogue reads it in place instead of a copy on
// the stack.
//
// Epilogues (kernels/epilogue.cuh): the residual projection's last block runs
// the RMSNorm after it (unless the router chained to it normalizes its own
// input: MatvecArgs::input_norm), the router's its top-k; the last down
// pass's last block of each 32 rows combines the ranks into the residual, and
// after the last layer the last of those runs the output norm. q, k and v are
// one launch whose blocks each take one matrix's rows (a block-uniform switch
// on its type, outside the loops), the last block of each head running its
// QK-norm, RoPE and KV append; its first blocks write the layer's attn_norm
// that the others read (NormPrologue), so no single block normalizes between
// the layer before and the projections.
#include "kernels/copy_ready.cuh"
#include "kernels/epilogue.cuh"
#include "kernels/kernels.h"
#include "kernels/launch.cuh"
#include "kernels/launch_geometry.h"
#include "kernels/mmvq_math.h"
#include "kernels/nn_math.h"
#include "kernels/q8_1.cuh"
#include "kernels/reduce.cuh"
#include "loader/quant.h"

#include <algorithm>

namespace moegraph {
namespace {

__host__ __device__ int32_t ceil_div(int64_t a, int64_t b) {
  return static_cast<int32_t>((a + b - 1) / b);
}

size_t packed_row_bytes(GgmlType type, int64_t cols) {
  return static_cast<size_t>(cols / quant_block_elems(type) * quant_block_bytes(type));
}

// A launch's weights: fixed (dense: w[0], and w[1] for a pair) or, with slots
// set, found per rank: slots + (its slot: MatvecArgs) * block_bytes + offset[p];
// with shared set too, the last rank's are shared[p] (the shared expert's).
struct MatvecWeights {
  const uint8_t* w[2] = {nullptr, nullptr};
  const uint8_t* slots = nullptr;
  const uint8_t* shared[2] = {nullptr, nullptr};
};

// The rest of a launch: shapes, activations, outputs, epilogues.
struct MatvecArgs {
  size_t row_bytes[2] = {0, 0};
  size_t block_bytes = 0;
  size_t offset[2] = {0, 0};
  // Rank r's slot: first_slot + slot_of_rank[r], its flag missed[r] (kRank*,
  // kernels/moe_math.h; null: a hit).
  const int32_t* slot_of_rank = nullptr;
  const uint8_t* missed = nullptr;
  int32_t first_slot = 0;
  ExpertPass pass = ExpertPass::kAll;  // with slots: the ranks computed
  // The launch right after the stage copy: its blocks start without waiting
  // for it (a missed rank's wait for its flag is the only order it needs).
  bool overlaps_copy = false;
  int32_t rows = 0, cols = 0;
  MatvecGeometry geometry;
  bool pair = false;  // out = glu(w[0] x, w[1] x)
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
  // Rank r's output: out + r * out_stride, and with out_q its q8_1 blocks
  // (out_q_tickets: rows / 32 per rank, where a block holds fewer than 32
  // rows); with out_f16 set, rows go there as f16 instead (the v cache row).
  float* out = nullptr;
  uint16_t* out_f16 = nullptr;
  block_q8_1* out_q = nullptr;
  unsigned int* out_q_tickets = nullptr;
  int64_t out_stride = 0;
  DeviceCounters* counters = nullptr;  // the experts computed, once per rank
  // Epilogues, with tickets set: the norm of out (ranks 1), the router's
  // top-k over out (experts set), or the combine of the ranks' outputs into
  // combine.residual and its norm.
  unsigned int* tickets = nullptr;
  NormEpilogue norm;
  RouterEpilogue router;
  CombineEpilogue combine;
  // With weight set (the router chained to attn_out, an element type): x is
  // the residual and the rows read its RMSNorm, which each block computes as
  // it reads (NormedInput: the scale from x, then the products); the blocks
  // also write the norm's out and out_q for the expert pass, 32 elements a warp.
  NormEpilogue input_norm;
};

// Where a block's rows are: row block x of rank r in a grid of blocks_x x
// ranks (grouped_matvec_kernel's blockIdx and gridDim; one phase of
// expert_ffn_kernel's logical blocks).
struct BlockPlace {
  int32_t x, r, blocks_x, ranks;
};
__device__ __forceinline__ BlockPlace grid_place() {
  return {static_cast<int32_t>(blockIdx.x), static_cast<int32_t>(blockIdx.y),
          static_cast<int32_t>(gridDim.x), static_cast<int32_t>(gridDim.y)};
}

// The router's last block runs its top-k (block_router_topk) on the launch's threads.
static_assert(kMatvecThreads == kRouterThreads);

struct MatvecShared {
  float parts[2][kMatvecThreads];  // the later warps' parts of a row, per matrix
  float results[kMaxRowsPerBlock];
  EpilogueShared epilogue;
};

// The sum of a row's threads' parts v, as row_sum_of_parts adds them: every
// thread of the block calls it; the row's first thread gets the sum.
__device__ __forceinline__ float row_reduce(float v, int threads, float* parts) {
  if (threads <= 32) return group_sum(v, threads);
  const int warp_in_row = threadIdx.x % threads / 32;
  if (warp_in_row > 0) parts[threadIdx.x] = v;
  __syncthreads();
  if (warp_in_row == 0) {
    for (int w = 1; w < threads / 32; ++w) v += parts[threadIdx.x + 32 * w];
  }
  return warp_sum(v);
}

// The q8_1 block of rows [32 g, + 32) of rank r's out, once every block
// holding them is done (the last of them quantizes, warp 0, reading through L2).
__device__ void quantize_out_group(const MatvecArgs& a, int32_t r, int32_t row0,
                                   EpilogueShared* shared) {
  const int32_t g = row0 / QK8_1;
  const int blocks = QK8_1 / a.geometry.rows_per_block;
  unsigned int* ticket = a.out_q_tickets + r * (a.rows / QK8_1) + g;
  if (!last_block_done(ticket, blocks, shared) || threadIdx.x >= 32) return;
  const float* out = a.out + r * a.out_stride + g * QK8_1;
  warp_quantize_q8_1(__ldcg(out + threadIdx.x), a.out_q + (r * a.out_stride) / QK8_1 + g);
}

// Rank r's f32 input (null where the launch reads q8_1).
__device__ __forceinline__ const float* rank_input(const MatvecArgs& a, int32_t r) {
  return a.x != nullptr ? a.x + r * a.x_stride : nullptr;
}

// Rows [rows_per_block place.x, + rows_per_block) of rank place.r by the whole
// block, M matrices (a pair: 2), into out (or out_f16); x: the rank's f32 input
// (rank_input, or a NormedInput); flag: the rank's miss flag (kRank*), for the
// count of the rank's first block; shared_rank: the rank is the shared
// expert's (weights.shared, not a slot).
template <GgmlType T, int M, typename X>
__device__ __forceinline__ void matvec_block(const MatvecWeights& weights, const MatvecArgs& a,
                                             BlockPlace place, const X& x, uint8_t flag,
                                             bool shared_rank, float* out_base, uint16_t* out_f16,
                                             MatvecShared* shared) {
  const int32_t r = place.r;
  const int32_t bx = place.x;
  const int threads = a.geometry.threads_per_row;
  const int rows_per_block = a.geometry.rows_per_block;
  const int i = threadIdx.x / threads;
  const int t = threadIdx.x % threads;
  const int32_t row0 = bx * rows_per_block;
  const int32_t row = row0 + i;
  const bool live = row < a.rows;
  const uint8_t* base[2] = {shared_rank ? weights.shared[0] : weights.w[0],
                            shared_rank ? weights.shared[1] : weights.w[1]};
  if (weights.slots != nullptr && !shared_rank) {
    const uint8_t* block =
        weights.slots + static_cast<size_t>(a.first_slot + a.slot_of_rank[r]) * a.block_bytes;
    base[0] = block + a.offset[0];
    base[1] = block + a.offset[1];
    if (a.counters != nullptr && bx == 0 && threadIdx.x == 0) {
      atomicAdd(rank_computed_after_copy(a.pass, flag) ? &a.counters->pass_b_experts
                                                       : &a.counters->pass_a_experts,
                1ull);
      if (rank_waits_for_copy(a.pass, flag)) atomicAdd(&a.counters->copy_waits, 1ull);
    }
  }
  // Only the input the type reads is there; the other may be null.
  const block_q8_1* xq = a.xq != nullptr ? a.xq + r * a.x_stride / QK8_1 : nullptr;
  float sums[M];
#pragma unroll
  for (int m = 0; m < M; ++m) sums[m] = 0.0f;
  if (live) {
    const uint8_t* rows[M];
#pragma unroll
    for (int m = 0; m < M; ++m) rows[m] = base[m] + static_cast<size_t>(row) * a.row_bytes[m];
    thread_partials<T, M>(rows, x, xq, a.cols, t, threads, sums);
  }
  float v = row_reduce(sums[0], threads, shared->parts[0]);
  float u = M == 2 ? row_reduce(sums[M - 1], threads, shared->parts[M - 1]) : 0.0f;
  if (t == 0) {
    const int64_t bias_at = a.experts != nullptr ? static_cast<int64_t>(a.experts[r]) * a.rows : 0;
    if (live && a.bias[0] != nullptr) v += a.bias[0][bias_at + row];
    if (M == 2) {
      if (live && a.bias[1] != nullptr) u += a.bias[1][bias_at + row];
      v = glu(a.act, v, u);
    }
    shared->results[i] = live ? v : 0.0f;
  }
  __syncthreads();
  if (out_f16 != nullptr) {
    for (int k = threadIdx.x; k < rows_per_block && row0 + k < a.rows; k += kMatvecThreads) {
      out_f16[row0 + k] = f32_to_f16(shared->results[k]);
    }
    return;
  }
  float* out = out_base + r * a.out_stride;
  for (int k = threadIdx.x; k < rows_per_block && row0 + k < a.rows; k += kMatvecThreads) {
    out[row0 + k] = a.accumulate ? out[row0 + k] + shared->results[k] : shared->results[k];
  }
  if (a.out_q == nullptr) return;
  if (rows_per_block == kMaxRowsPerBlock) {
    if (threadIdx.x < 32) {
      warp_quantize_q8_1(shared->results[threadIdx.x],
                         a.out_q + (r * a.out_stride + row0) / QK8_1);
    }
  } else {
    quantize_out_group(a, r, row0, &shared->epilogue);
  }
}

// The 32-row group of block bx and how many blocks hold its rows.
struct RowGroup {
  int32_t index, blocks;
};
__device__ RowGroup row_group_of(const MatvecArgs& a, BlockPlace place) {
  const int32_t per_group = kMaxRowsPerBlock / a.geometry.rows_per_block;
  const int32_t index = place.x / per_group;
  return {index, min(per_group, place.blocks_x - index * per_group)};
}

inline constexpr int kCombineRanks = 4;

// Rows [32 g, + 32) of the ranks' outputs into the residual, ranks in order
// (every rank's blocks of these rows are done), the shared expert's last
// (c.shexp_out: with has_shared_rank, the last rank's output, which is not also a
// routed one), then, in the last block to get here, the norm of the whole
// residual.
__device__ void combine_epilogue(const MatvecArgs& a, BlockPlace place, bool has_shared_rank,
                                 EpilogueShared* shared) {
  const CombineEpilogue& c = a.combine;
  const RowGroup group = row_group_of(a, place);
  const int32_t row0 = group.index * kMaxRowsPerBlock;
  if (!last_block_done(a.tickets + 1 + group.index, group.blocks * place.ranks, shared)) return;
  const int32_t routed = place.ranks - (has_shared_rank ? 1 : 0);
  for (int32_t i = threadIdx.x; i < kMaxRowsPerBlock && row0 + i < a.rows; i += kMatvecThreads) {
    const int32_t row = row0 + i;
    const float shexp = c.shexp_out != nullptr ? __ldcg(c.shexp_out + row) : 0.0f;
    // kCombineRanks ranks' loads in flight at once (one at a time, each waited
    // for the one before: a top-8 group spent 8 L2 round trips), added in rank
    // order all the same.
    float acc = 0.0f;
    for (int32_t r0 = 0; r0 < routed; r0 += kCombineRanks) {
      float part[kCombineRanks], weight[kCombineRanks];
#pragma unroll
      for (int j = 0; j < kCombineRanks; ++j) {
        const int32_t r = min(r0 + j, routed - 1);
        part[j] = __ldcg(a.out + r * a.out_stride + row);
        weight[j] = c.weights[r];
      }
#pragma unroll
      for (int j = 0; j < kCombineRanks; ++j) {
        if (r0 + j < routed) acc += weight[j] * part[j];
      }
    }
    if (c.shexp_out != nullptr) {
      acc += (c.shexp_logit != nullptr ? sigmoid(*c.shexp_logit) : 1.0f) * shexp;
    }
    c.residual[row] += acc;
  }
  if (c.norm.weight == nullptr ||
      !last_block_done(a.tickets, ceil_div(a.rows, kMaxRowsPerBlock), shared)) {
    return;
  }
  run_norm_epilogue(c.norm, c.residual, a.rows, shared);
}

// The launch's epilogue (its tickets are set): the combine, or the router's
// top-k or the norm of out in the last block. Inlined: a call's saved
// registers spilled to the stack (ptxas: 4-8 bytes, 8 more registers).
__device__ __forceinline__ void matvec_epilogue(const MatvecArgs& a, BlockPlace place,
                                                bool has_shared_rank, EpilogueShared* shared) {
  if (a.combine.residual != nullptr) {
    combine_epilogue(a, place, has_shared_rank, shared);
    return;
  }
  if (!last_block_done(a.tickets, place.blocks_x * place.ranks, shared)) return;
  if (a.router.experts != nullptr) {
    block_router_topk(a.out, a.rows - (a.router.shared_gate_row ? 1 : 0), a.router,
                      a.router.experts, a.router.weights, shared);
  } else {
    run_norm_epilogue(a.norm, a.out, a.rows, shared);
  }
}

template <GgmlType T>
__global__ void __launch_bounds__(kMatvecThreads)
    grouped_matvec_kernel(const __grid_constant__ MatvecWeights weights,
                          const __grid_constant__ MatvecArgs a) {
  wait_for_prior_grids_unless(a.overlaps_copy);
  __shared__ MatvecShared shared;
  const BlockPlace place = grid_place();
  // The shared expert's rank, the last where the launch has one: a hit, in no slot.
  const bool shared_rank = weights.shared[0] != nullptr && place.r + 1 == place.ranks;
  // The rank's flag, read once (the resident arm's and dense launches': a hit).
  const uint8_t flag = a.missed != nullptr && !shared_rank ? a.missed[place.r] : kRankHit;
  if (rank_in_pass(a.pass, flag)) {
    // Here, not in matvec_block: there the poll loop cost q3_K's instance a
    // spill (ptxas: 8-byte frame), as the count did iq4_nl's here.
    if (rank_waits_for_copy(a.pass, flag)) wait_for_rank_copy(a.missed + place.r);
    if (a.pair) {
      matvec_block<T, 2>(weights, a, place, rank_input(a, place.r), flag, shared_rank, a.out,
                         a.out_f16, &shared);
    } else {
      matvec_block<T, 1>(weights, a, place, rank_input(a, place.r), flag, shared_rank, a.out,
                         a.out_f16, &shared);
    }
  }
  // Read again here, not kept across the loop: kept, it cost mxfp4's and
  // iq4_nl's instances a spill (ptxas: 4 bytes).
  if (a.tickets != nullptr) {
    matvec_epilogue(a, place, weights.shared[0] != nullptr, &shared.epilogue);
  }
}

// Two matvec launches in one, the second reading what the first writes
// (ChainArgs): the blocks take logical indices in the order they start
// (take_block_index), the first first_blocks x ranks running the first
// launch's row blocks, rank by rank, each adding itself to its rank's ready
// count once its rows and epilogue are done; the rest run the second's, a
// block of rank r starting its rows once ready[r] counts every first-launch
// block of rank r. Those started before it, so a waiting block never holds an
// SM a block it waits for needs. The last second-launch block to finish resets
// the counts for the next launch. An expert pass's gate/up then down and
// combine (launch_expert_ffn); attn_out's residual add and norm, then the
// router (launch_matvec_residual_router): one kernel node each instead of two.
struct ChainWeights {
  MatvecWeights first, second;
};
struct ChainArgs {
  MatvecArgs first, second;
  GgmlType type[2];  // the first's weight type (a pair's gate and up), the second's
  int32_t first_blocks = 0, second_blocks = 0, ranks = 0;  // row blocks per rank; ranks
  unsigned int* order = nullptr;  // 1: logical indices handed out
  unsigned int* ready = nullptr;  // [ranks]: first-launch blocks done per rank
  unsigned int* done = nullptr;   // 1: second-launch blocks done
  DeviceCounters* counters = nullptr;  // chained_launches: one a launch
};

// The block's logical index, by thread 0: blocks get them in the order they
// start, and the last to get one resets the counter for the next launch.
__device__ __forceinline__ uint32_t take_block_index(unsigned int* order, uint32_t blocks) {
  const uint32_t index = atomicAdd(order, 1u);
  if (index + 1 == blocks) *order = 0;
  return index;
}

// By every thread of a second-launch block of rank r: acquires the rank's
// first-launch blocks' writes for its own loads (as wait_for_rank_copy does
// the copy's).
__device__ __forceinline__ void wait_for_first_launch(const unsigned int* ready,
                                                      uint32_t blocks) {
#if defined(__CUDA_ARCH__)
  constexpr uint32_t kMaxPolls = 1u << 25;  // at least 100 ns each: over 3 s
  for (uint32_t poll = 0;; ++poll) {
    unsigned int count;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(count) : "l"(ready) : "memory");
    if (count == blocks) break;
    if (poll == kMaxPolls) __trap();
    __nanosleep(100);
  }
#else
  // The emulator runs a launch's blocks one after another, so every block
  // with a lower logical index has finished: a count short of blocks is a bug.
  if (*ready != blocks) __trap();
#endif
}

// A second-launch block's weight rows into L2 before it waits: they do not
// depend on the first launch, so their DRAM round trip overlaps its tail (the
// router's rows while attn_out drains, a rank's down rows while its gate/up
// runs). L2 is coherent: a missed rank's slot still being copied is only
// fetched early, never read stale.
__device__ __forceinline__ void prefetch_rows_to_l2([[maybe_unused]] const MatvecWeights& weights,
                                                    [[maybe_unused]] const MatvecArgs& a,
                                                    [[maybe_unused]] BlockPlace place) {
#if defined(__CUDA_ARCH__)
  constexpr int kLine = 128;
  const bool shared_rank = weights.shared[0] != nullptr && place.r + 1 == place.ranks;
  const uint8_t* base = shared_rank ? weights.shared[0] : weights.w[0];
  if (weights.slots != nullptr && !shared_rank) {
    base = weights.slots +
           static_cast<size_t>(a.first_slot + a.slot_of_rank[place.r]) * a.block_bytes +
           a.offset[0];
  }
  const int32_t row0 = place.x * a.geometry.rows_per_block;
  const int32_t rows = min(a.geometry.rows_per_block, a.rows - row0);
  const uint8_t* start = base + static_cast<size_t>(row0) * a.row_bytes[0];
  const size_t bytes = static_cast<size_t>(rows) * a.row_bytes[0];
  for (size_t at = threadIdx.x * size_t{kLine}; at < bytes; at += kMatvecThreads * size_t{kLine}) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(start + at));
  }
  // A router that normalizes its input reads the norm's weight too.
  if (a.input_norm.weight != nullptr) {
    const size_t norm_bytes = static_cast<size_t>(a.cols) * sizeof(float);
    for (size_t at = threadIdx.x * size_t{kLine}; at < norm_bytes;
         at += kMatvecThreads * size_t{kLine}) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(
          reinterpret_cast<const uint8_t*>(a.input_norm.weight) + at));
    }
  }
#endif
}

// matvec_block of a type known at run time (block-uniform: a launch's phase).
template <int M>
__device__ __forceinline__ void typed_matvec_block(GgmlType type, const MatvecWeights& weights,
                                                   const MatvecArgs& a, BlockPlace place,
                                                   uint8_t flag, bool shared_rank,
                                                   MatvecShared* shared) {
  switch (type) {
#define MG_CHAIN_TYPE(T)                                                                   \
  case GgmlType::T:                                                                       \
    return matvec_block<GgmlType::T, M>(weights, a, place, rank_input(a, place.r), flag,  \
                                        shared_rank, a.out, nullptr, shared);
    MG_CHAIN_TYPE(kQ8_0)
    MG_CHAIN_TYPE(kQ4_0)
    MG_CHAIN_TYPE(kQ4_K)
    MG_CHAIN_TYPE(kQ5_K)
    MG_CHAIN_TYPE(kQ6_K)
    MG_CHAIN_TYPE(kQ4_1)
    MG_CHAIN_TYPE(kQ5_0)
    MG_CHAIN_TYPE(kQ5_1)
    MG_CHAIN_TYPE(kQ2_K)
    MG_CHAIN_TYPE(kQ3_K)
    MG_CHAIN_TYPE(kIQ4_NL)
    MG_CHAIN_TYPE(kIQ4_XS)
    MG_CHAIN_TYPE(kMXFP4)
    MG_CHAIN_TYPE(kF32)
    MG_CHAIN_TYPE(kF16)
    MG_CHAIN_TYPE(kBF16)
#undef MG_CHAIN_TYPE
    default:
      return;
  }
}

// The norm's output for the expert pass (norm.out, and its q8_1 blocks where
// norm.out_q is set), 32 elements a warp, the warps of every router block
// taking the groups in turn (2048: 64 groups, on 16 blocks of 4 warps): each
// block writes at most a round trip's worth, so none is the norm's tail. The
// same bits as block_rmsnorm's (its products, warp_quantize_q8_1's butterflies).
__device__ __forceinline__ void write_norm_groups(const NormedInput& x, const NormEpilogue& norm,
                                                  int32_t n, BlockPlace place) {
  constexpr int32_t kWarps = kMatvecThreads / 32;
  const int32_t lane = static_cast<int32_t>(threadIdx.x % 32);
  for (int32_t g = place.x * kWarps + static_cast<int32_t>(threadIdx.x / 32); g * QK8_1 < n;
       g += place.blocks_x * kWarps) {
    const int32_t i = g * QK8_1 + lane;
    const float v = i < n ? x[i] : 0.0f;
    if (i < n) norm.out[i] = v;
    if (norm.out_q != nullptr) warp_quantize_q8_1(v, norm.out_q + g);
  }
}

// A router block of the chain that normalizes its own input (args.input_norm,
// an element-type router): the RMSNorm's scale from the residual by the whole
// block (one L2 round trip of its 8 KB at 2048), then its rows reading the
// norm's products as they go, then its share of the norm's output
// (write_norm_groups). attn_out's blocks only add their rows: no single block
// normalizes between them and the router, or after it.
__device__ __forceinline__ void normed_router_block(GgmlType type, const MatvecWeights& weights,
                                                    const MatvecArgs& a, BlockPlace place,
                                                    MatvecShared* shared) {
  const NormEpilogue& norm = a.input_norm;
  const NormedInput x{a.x, norm.weight,
                      block_rms_scale(a.x, a.cols, norm.eps, &shared->epilogue)};
  switch (type) {
    case GgmlType::kF32:
      matvec_block<GgmlType::kF32, 1>(weights, a, place, x, kRankHit, false, a.out, nullptr,
                                      shared);
      break;
    case GgmlType::kF16:
      matvec_block<GgmlType::kF16, 1>(weights, a, place, x, kRankHit, false, a.out, nullptr,
                                      shared);
      break;
    case GgmlType::kBF16:
      matvec_block<GgmlType::kBF16, 1>(weights, a, place, x, kRankHit, false, a.out, nullptr,
                                       shared);
      break;
    default:
      return;
  }
  write_norm_groups(x, norm, a.cols, place);
}

// The two chains, each its own kernel: one kernel for both spilled (ptxas:
// 8-byte frame at 64 registers).
enum class Chain {
  kExpertFfn,       // a gate/up pair, then down and the combine
  kResidualRouter,  // a residual add and its norm, then the router and its top-k
};

// One block of a chain's first launch (kFirst) or second at place: its rows,
// then its epilogue.
template <Chain C, bool kFirst>
__device__ __forceinline__ void chain_block(const MatvecWeights& weights, const MatvecArgs& args,
                                            GgmlType type, BlockPlace place,
                                            MatvecShared* shared) {
  const bool shared_rank = weights.shared[0] != nullptr && place.r + 1 == place.ranks;
  const uint8_t flag = args.missed != nullptr && !shared_rank ? args.missed[place.r] : kRankHit;
  if (rank_in_pass(args.pass, flag)) {
    if (kFirst && rank_waits_for_copy(args.pass, flag)) wait_for_rank_copy(args.missed + place.r);
    if (C == Chain::kExpertFfn && kFirst) {
      typed_matvec_block<2>(type, weights, args, place, flag, shared_rank, shared);
    } else if (C == Chain::kResidualRouter && !kFirst && args.input_norm.weight != nullptr) {
      normed_router_block(type, weights, args, place, shared);
    } else {
      typed_matvec_block<1>(type, weights, args, place, flag, shared_rank, shared);
    }
  }
  // The pair's q8_1 groups are matvec_block's; the others' epilogues are here
  // (none for a residual add whose router normalizes: input_norm).
  if ((C == Chain::kExpertFfn && kFirst) || args.tickets == nullptr) return;
  matvec_epilogue(args, place, weights.shared[0] != nullptr, &shared->epilogue);
}

template <Chain C>
__global__ void __launch_bounds__(kMatvecThreads)
    chained_matvec_kernel(const __grid_constant__ ChainWeights w,
                          const __grid_constant__ ChainArgs a) {
  wait_for_prior_grids_unless(a.first.overlaps_copy);
  __shared__ MatvecShared shared;
  __shared__ uint32_t logical;
  const uint32_t first_total = static_cast<uint32_t>(a.first_blocks * a.ranks);
  const uint32_t second_total = static_cast<uint32_t>(a.second_blocks * a.ranks);
  if (threadIdx.x == 0) logical = take_block_index(a.order, first_total + second_total);
  __syncthreads();
  if (logical < first_total) {
    const int32_t index = static_cast<int32_t>(logical);
    const BlockPlace place{index % a.first_blocks, index / a.first_blocks, a.first_blocks,
                           a.ranks};
    chain_block<C, true>(w.first, a.first, a.type[0], place, &shared);
    // Its rows, q8_1 groups and epilogue visible before the count says so.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(a.ready + place.r, 1u);
    return;
  }
  const int32_t index = static_cast<int32_t>(logical - first_total);
  const BlockPlace place{index % a.second_blocks, index / a.second_blocks, a.second_blocks,
                         a.ranks};
  prefetch_rows_to_l2(w.second, a.second, place);
  wait_for_first_launch(a.ready + place.r, static_cast<uint32_t>(a.first_blocks));
  chain_block<C, false>(w.second, a.second, a.type[1], place, &shared);
  if (last_block_done(a.done, second_total, &shared.epilogue)) {
    // The launch has run to its end: its counts back to zero, and counted.
    if (static_cast<int32_t>(threadIdx.x) < a.ranks) a.ready[threadIdx.x] = 0;
    if (threadIdx.x == 0) atomicAdd(&a.counters->chained_launches, 1ull);
  }
}

// Matrices of one input (q, k and v; or launch_projections' up to four):
// blocks [first_block[j], first_block[j + 1]) compute job j of n_jobs; with
// tickets (q, k and v's rope), v's rows go straight to the cache row *pos.
struct QkvWeights {
  const uint8_t* w[kMaxProjections];
};
// The launch's input norm (launch_qkv's input_norm, with norm.weight set): its
// blocks, the residual it reads, and its counts.
struct NormPrologue {
  const float* residual = nullptr;
  NormEpilogue norm;
  int32_t blocks = 0;
  unsigned int* order = nullptr;  // logical indices handed out
  unsigned int* ready = nullptr;  // norm blocks done
  unsigned int* done = nullptr;   // matrix blocks done
};
inline constexpr int32_t kNormPrologueTickets = 3;  // order, ready, done
struct QkvArgs {
  MatvecArgs job[kMaxProjections];
  GgmlType type[kMaxProjections];
  int32_t first_block[kMaxProjections + 1];
  int32_t n_jobs = 0;
  QkvRope rope;
  unsigned int* tickets = nullptr;
  NormPrologue input;
};

// Each head of q (j 0) or k (j 1) that block bx's rows hold, once the last
// block holding rows of it is done: QK-norm and RoPE into q_out or the cache
// row. With a full-width norm (olmoe) the last block of all of q (or k) does
// every head.
__device__ void qkv_rope_epilogue(const QkvArgs& a, int j, int32_t bx, EpilogueShared* shared) {
  const QkvRope& rope = a.rope;
  const int32_t d = rope.head_dim;
  const int32_t n_heads = j == 0 ? rope.n_head : rope.n_head_kv;
  // A head's rows start every `stride` rows (a gated q's: 2 d), its query the first d.
  const int32_t stride = static_cast<int32_t>(rope_source_head(rope, j, 1));
  const int32_t rows = n_heads * stride;
  const int32_t per_block = a.job[j].geometry.rows_per_block;
  unsigned int* tickets = a.tickets + (j == 0 ? 0 : rope.n_head);
  const float* src = a.job[j].out;
  const int32_t p = *rope.pos;
  if (rope.use_norm && rope.norm.full) {
    if (!last_block_done(tickets, ceil_div(rows, per_block), shared)) return;
    const float scale = block_rms_scale(src, rows, rope.norm.eps, shared);
    for (int32_t h = 0; h < n_heads; ++h) rope_qk_head(rope, j, src, scale, h, p, rope.q_out);
    return;
  }
  const int32_t row0 = bx * per_block;
  const int32_t row_end = min(row0 + per_block, rows);
  for (int32_t h = row0 / stride; h * stride < row_end; ++h) {
    if (h * stride + d <= row0) continue;  // the block holds only its gate's rows
    const int32_t blocks = (h * stride + d - 1) / per_block - h * stride / per_block + 1;
    if (!last_block_done(tickets + h, blocks, shared)) continue;
    const float scale =
        rope.use_norm ? block_rms_scale(src + h * stride, d, rope.norm.eps, shared) : 1.0f;
    rope_qk_head(rope, j, src, scale, h, p, rope.q_out);
  }
}

template <GgmlType T>
__device__ __forceinline__ void qkv_job(const QkvWeights& w, const QkvArgs& a, int j, int32_t bx,
                                        MatvecShared* shared) {
  const MatvecArgs& job = a.job[j];
  MatvecWeights weights;
  weights.w[0] = w.w[j];
  float* out = job.out;
  uint16_t* out_f16 = nullptr;
  if (a.tickets != nullptr && j == 2) {
    const int64_t row =
        kv_cache_row(*a.rope.pos, a.rope.kv_rows) * a.rope.n_head_kv * a.rope.head_dim;
    if (a.rope.kv_f16) {
      out_f16 = static_cast<uint16_t*>(a.rope.v_cache) + row;
    } else {
      out = static_cast<float*>(a.rope.v_cache) + row;
    }
  }
  const BlockPlace place{bx, 0, a.first_block[j + 1] - a.first_block[j], 1};
  matvec_block<T, 1>(weights, job, place, job.x, kRankHit, false, out, out_f16, shared);
  if (a.tickets != nullptr && j < 2) qkv_rope_epilogue(a, j, bx, &shared->epilogue);
}

// Job j's block bx, of the type the launch gives it.
__device__ __forceinline__ void typed_qkv_job(const QkvWeights& w, const QkvArgs& a, int j,
                                              int32_t bx, MatvecShared* shared) {
  switch (a.type[j]) {
    case GgmlType::kQ8_0: return qkv_job<GgmlType::kQ8_0>(w, a, j, bx, shared);
    case GgmlType::kQ4_0: return qkv_job<GgmlType::kQ4_0>(w, a, j, bx, shared);
    case GgmlType::kQ4_K: return qkv_job<GgmlType::kQ4_K>(w, a, j, bx, shared);
    case GgmlType::kQ5_K: return qkv_job<GgmlType::kQ5_K>(w, a, j, bx, shared);
    case GgmlType::kQ6_K: return qkv_job<GgmlType::kQ6_K>(w, a, j, bx, shared);
    case GgmlType::kQ4_1: return qkv_job<GgmlType::kQ4_1>(w, a, j, bx, shared);
    case GgmlType::kQ5_0: return qkv_job<GgmlType::kQ5_0>(w, a, j, bx, shared);
    case GgmlType::kQ5_1: return qkv_job<GgmlType::kQ5_1>(w, a, j, bx, shared);
    case GgmlType::kQ2_K: return qkv_job<GgmlType::kQ2_K>(w, a, j, bx, shared);
    case GgmlType::kQ3_K: return qkv_job<GgmlType::kQ3_K>(w, a, j, bx, shared);
    case GgmlType::kIQ4_NL: return qkv_job<GgmlType::kIQ4_NL>(w, a, j, bx, shared);
    case GgmlType::kIQ4_XS: return qkv_job<GgmlType::kIQ4_XS>(w, a, j, bx, shared);
    case GgmlType::kF32: return qkv_job<GgmlType::kF32>(w, a, j, bx, shared);
    case GgmlType::kF16: return qkv_job<GgmlType::kF16>(w, a, j, bx, shared);
    case GgmlType::kBF16: return qkv_job<GgmlType::kBF16>(w, a, j, bx, shared);
    default: return;
  }
}

// The job a matrix block belongs to.
__device__ __forceinline__ int qkv_job_of(const QkvArgs& a, int32_t block) {
  int j = 0;
  while (j + 1 < a.n_jobs && block >= a.first_block[j + 1]) ++j;
  return j;
}

// A block of the input norm (logical index b of in.blocks): the scale from the
// whole residual (one L2 round trip of its 8 KB at 2048), then its warps' 32
// elements each of norm.out and its q8_1 blocks (write_norm_groups, the bits
// of block_rmsnorm's), then its count.
__device__ __forceinline__ void norm_prologue_block(const NormPrologue& in, int32_t cols,
                                                    int32_t b, MatvecShared* shared) {
  const NormedInput x{in.residual, in.norm.weight,
                      block_rms_scale(in.residual, cols, in.norm.eps, &shared->epilogue)};
  write_norm_groups(x, in.norm, cols, BlockPlace{b, 0, in.blocks, 1});
  // Its groups visible before the count says so.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(in.ready, 1u);
}

// With an input norm the blocks take logical indices in the order they start
// (take_block_index): the first in.blocks run the norm, the rest the matrices'
// row blocks, each asking L2 for its rows before it waits for the norm (those
// blocks started before it: a waiting block never holds an SM one it waits for
// needs). The last matrix block resets the ready count for the next launch.
__global__ void __launch_bounds__(kMatvecThreads)
    qkv_kernel(const __grid_constant__ QkvWeights w, const __grid_constant__ QkvArgs a) {
  wait_for_prior_grids();
  __shared__ MatvecShared shared;
  __shared__ uint32_t logical;
  const NormPrologue& in = a.input;
  const bool normed = in.norm.weight != nullptr;
  const int32_t matrix_blocks = a.first_block[a.n_jobs];
  int32_t block = blockIdx.x;
  if (normed) {
    if (threadIdx.x == 0) {
      logical = take_block_index(in.order, static_cast<uint32_t>(in.blocks + matrix_blocks));
    }
    __syncthreads();
    if (logical < static_cast<uint32_t>(in.blocks)) {
      norm_prologue_block(in, a.job[0].cols, static_cast<int32_t>(logical), &shared);
      return;
    }
    block = static_cast<int32_t>(logical) - in.blocks;
  }
  const int j = qkv_job_of(a, block);
  const int32_t bx = block - a.first_block[j];
  if (normed) {
    MatvecWeights rows;
    rows.w[0] = w.w[j];
    prefetch_rows_to_l2(rows, a.job[j],
                        BlockPlace{bx, 0, a.first_block[j + 1] - a.first_block[j], 1});
    wait_for_first_launch(in.ready, static_cast<uint32_t>(in.blocks));
  }
  typed_qkv_job(w, a, j, bx, &shared);
  if (normed && last_block_done(in.done, static_cast<uint32_t>(matrix_blocks), &shared.epilogue) &&
      threadIdx.x == 0) {
    *in.ready = 0;
  }
}

bool supported(GgmlType type, int64_t cols) { return grouped_matvec_supports(type, cols); }

// One launch's two parameters.
struct MatvecLaunch {
  MatvecWeights weights;
  MatvecArgs args;
};

// The kernel of the launch's weight type, over ranks blocks of y.
cudaError_t launch_grouped(GgmlType type, const MatvecLaunch& l, int32_t ranks,
                           cudaStream_t stream) {
  const LaunchGeometry g = matvec_launch_geometry(type, l.args.rows, l.args.cols, ranks);
  const MatvecWeights& w = l.weights;
  const MatvecArgs& a = l.args;
  switch (type) {
    case GgmlType::kQ8_0:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kQ8_0>>(g.grid, g.block, stream, w, a);
    case GgmlType::kQ4_0:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kQ4_0>>(g.grid, g.block, stream, w, a);
    case GgmlType::kQ4_K:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kQ4_K>>(g.grid, g.block, stream, w, a);
    case GgmlType::kQ5_K:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kQ5_K>>(g.grid, g.block, stream, w, a);
    case GgmlType::kQ6_K:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kQ6_K>>(g.grid, g.block, stream, w, a);
    case GgmlType::kQ4_1:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kQ4_1>>(g.grid, g.block, stream, w, a);
    case GgmlType::kQ5_0:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kQ5_0>>(g.grid, g.block, stream, w, a);
    case GgmlType::kQ5_1:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kQ5_1>>(g.grid, g.block, stream, w, a);
    case GgmlType::kQ2_K:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kQ2_K>>(g.grid, g.block, stream, w, a);
    case GgmlType::kQ3_K:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kQ3_K>>(g.grid, g.block, stream, w, a);
    case GgmlType::kIQ4_NL:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kIQ4_NL>>(g.grid, g.block, stream, w, a);
    case GgmlType::kIQ4_XS:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kIQ4_XS>>(g.grid, g.block, stream, w, a);
    case GgmlType::kMXFP4:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kMXFP4>>(g.grid, g.block, stream, w, a);
    case GgmlType::kF32:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kF32>>(g.grid, g.block, stream, w, a);
    case GgmlType::kF16:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kF16>>(g.grid, g.block, stream, w, a);
    case GgmlType::kBF16:
      return launch_kernel<grouped_matvec_kernel<GgmlType::kBF16>>(g.grid, g.block, stream, w, a);
    default:
      return cudaErrorInvalidValue;
  }
}

// The alignment every row of type starts at: the kernels load a type whose
// blocks are whole words with plain 32-bit loads, 16-bit fields with the
// aligned word that holds them, and the rest (mxfp4) at any byte.
bool rows_aligned(GgmlType type, const void* p, size_t row_bytes) {
  const size_t unit = mmvq_type(type) ? quant_block_bytes(type) : 4;
  const size_t align = unit % 4 == 0 ? 4 : unit % 2 == 0 ? 2 : 1;
  return reinterpret_cast<uintptr_t>(p) % align == 0 && row_bytes % align == 0;
}

bool matrix_ok(const DeviceMatrix& m) {
  return m.data != nullptr && m.rows > 0 && supported(m.type, m.cols) &&
         m.row_bytes >= packed_row_bytes(m.type, m.cols) &&
         rows_aligned(m.type, m.data, m.row_bytes);
}

// The input a type reads is there: q8_1 for the quant types, f32 for the others.
bool input_ok(GgmlType type, const float* x, const block_q8_1* xq) {
  return mmvq_type(type) ? xq != nullptr : x != nullptr;
}

// One dense matrix against x (and its q8_1 blocks xq).
MatvecArgs DenseArgs(const DeviceMatrix& w, const float* x, const block_q8_1* xq) {
  MatvecArgs a;
  a.row_bytes[0] = w.row_bytes;
  a.rows = w.rows;
  a.cols = w.cols;
  a.geometry = matvec_geometry(w.type, w.cols);
  a.x = x;
  a.xq = xq;
  return a;
}

MatvecLaunch Dense(const DeviceMatrix& w, const float* x, const block_q8_1* xq) {
  MatvecLaunch l;
  l.weights.w[0] = static_cast<const uint8_t*>(w.data);
  l.args = DenseArgs(w, x, xq);
  return l;
}

// An expert pass over the ranks of pass: weights through the slot table, and
// the shared expert's (when it rides the pass) from shared_0 and shared_1.
MatvecLaunch Experts(const uint8_t* slots, const DeviceBlockLayout& layout,
                     const ExpertRanks& ranks, ExpertPass pass, const DeviceMatrix* shared_0,
                     const DeviceMatrix* shared_1) {
  MatvecLaunch l;
  l.weights.slots = slots;
  if (shared_0 != nullptr) l.weights.shared[0] = static_cast<const uint8_t*>(shared_0->data);
  if (shared_1 != nullptr) l.weights.shared[1] = static_cast<const uint8_t*>(shared_1->data);
  l.args.block_bytes = layout.block_bytes;
  l.args.slot_of_rank = ranks.slot_of_rank;
  l.args.missed = ranks.missed;
  l.args.first_slot = ranks.first_slot;
  l.args.pass = pass;
  return l;
}

// The down projection of the ranks of pass.
MatvecLaunch Down(const uint8_t* slots, const DeviceBlockLayout& layout, const ExpertRanks& ranks,
                  ExpertPass pass, const ExpertBiases& biases, const float* act,
                  const block_q8_1* act_q, float* expert_out) {
  MatvecLaunch l = Experts(slots, layout, ranks, pass, ranks.shared.down, nullptr);
  MatvecArgs& a = l.args;
  a.bias[0] = biases.down;
  a.experts = biases.experts;
  a.offset[0] = layout.offset[2];
  a.row_bytes[0] = layout.row_bytes[2];
  a.rows = layout.n_embd;
  a.cols = layout.n_ff;
  a.geometry = matvec_geometry(layout.type[2], layout.n_ff);
  a.x = act;
  a.xq = act_q;
  a.x_stride = layout.n_ff;
  a.out = expert_out;
  a.out_stride = layout.n_embd;
  return l;
}

bool same_shape(const DeviceMatrix& m, GgmlType type, int64_t rows, int64_t cols,
                size_t row_bytes) {
  return m.data != nullptr && m.type == type && m.rows == rows && m.cols == cols &&
         m.row_bytes == row_bytes;
}

// The ranks' slots: a slot decision's, or the resident arm's (only its one
// pass over every rank: nothing is missed); a shared expert that fits them.
bool ranks_ok(const ExpertRanks& r, ExpertPass pass, const DeviceBlockLayout& layout) {
  const SharedExpertMatrices& s = r.shared;
  const bool no_shared = s.gate == nullptr && s.up == nullptr && s.down == nullptr;
  return r.k > 0 && r.k <= kMaxTopK && r.slot_of_rank != nullptr && r.first_slot >= 0 &&
         (r.missed != nullptr || pass == ExpertPass::kAll) &&
         (no_shared || shared_expert_fits_slots(layout, s));
}

// The ranks a pass's grid covers: k, and the shared expert's.
int32_t grid_ranks(const ExpertRanks& r) { return r.k + (r.shared.gate != nullptr ? 1 : 0); }

// No replay, or a trace with its step and a row for the layer.
bool replay_ok(const RoutingReplay& t) {
  return t.ids == nullptr ||
         (t.step != nullptr && t.n_layer > 0 && t.layer >= 0 && t.layer < t.n_layer);
}

// Biases, where set, come with the ranks' expert ids (none with a shared
// expert's rank, which has no expert id).
bool biases_ok(const ExpertBiases& b, const ExpertRanks& r) {
  const bool none = b.gate == nullptr && b.up == nullptr && b.down == nullptr;
  return r.shared.gate != nullptr ? none && b.experts == nullptr : b.experts != nullptr || none;
}

bool layout_ok(const uint8_t* slots, const DeviceBlockLayout& layout) {
  if (layout.n_embd <= 0 || layout.n_ff <= 0 || layout.block_bytes % 16 != 0) return false;
  for (int p = 0; p < 3; ++p) {
    const int64_t cols = p < 2 ? layout.n_embd : layout.n_ff;
    const int64_t rows = p < 2 ? layout.n_ff : layout.n_embd;
    if (!supported(layout.type[p], cols) ||
        layout.row_bytes[p] < packed_row_bytes(layout.type[p], cols) ||
        layout.offset[p] + rows * layout.row_bytes[p] > layout.block_bytes ||
        !rows_aligned(layout.type[p], slots + layout.offset[p], layout.row_bytes[p])) {
      return false;
    }
  }
  return true;
}

// A pair's q8_1 output of rows per rank: rows a multiple of 32, and tickets
// where a block holds fewer than 32 rows.
bool pair_output_ok(GgmlType type, int64_t cols, int64_t rows, const block_q8_1* out_q,
                    const unsigned int* tickets) {
  return out_q == nullptr ||
         (rows % QK8_1 == 0 &&
          (tickets != nullptr || matvec_geometry(type, cols).rows_per_block == kMaxRowsPerBlock));
}

// Jobs of one input into a (its first n_jobs of job), their weights into
// weights, and the input norm where input_norm.weight is set (x the residual,
// the jobs reading its out and out_q; counts: its 3 tickets): false where one
// is not computable.
bool SetJobs(const Projection* jobs, int32_t n, const float* x, const block_q8_1* xq,
             const NormEpilogue& input_norm, unsigned int* counts, QkvWeights* weights,
             QkvArgs* a) {
  if (n < 1 || n > kMaxProjections || jobs[0].w == nullptr) return false;
  if (input_norm.weight != nullptr) {
    const int32_t cols = jobs[0].w->cols;
    if (x == nullptr || counts == nullptr || !norm_epilogue_ok(input_norm, cols) ||
        input_norm.out == x) {
      return false;
    }
    a->input.residual = x;
    a->input.norm = input_norm;
    a->input.blocks = norm_prologue_blocks(cols);
    a->input.order = counts;
    a->input.ready = counts + 1;
    a->input.done = counts + 2;
    x = input_norm.out;
    xq = input_norm.out_q;
  }
  a->n_jobs = n;
  a->first_block[0] = 0;
  for (int32_t j = 0; j < n; ++j) {
    if (jobs[j].w == nullptr) return false;
    const DeviceMatrix& w = *jobs[j].w;
    if (!matrix_ok(w) || !qkv_supports_type(w.type, w.cols) || w.cols != jobs[0].w->cols ||
        !input_ok(w.type, x, xq) || jobs[j].out == nullptr) {
      return false;
    }
    weights->w[j] = static_cast<const uint8_t*>(w.data);
    a->job[j] = DenseArgs(w, x, xq);
    a->job[j].bias[0] = jobs[j].bias;
    a->job[j].out = jobs[j].out;
    a->type[j] = w.type;
    a->first_block[j + 1] = a->first_block[j] + matvec_row_blocks(w.type, w.rows, w.cols);
  }
  return true;
}

// launch_matvec_residual's launch into l; false where it is not computable.
bool Residual(const DeviceMatrix& w, const float* x, const block_q8_1* xq, const float* bias,
              float* residual, const NormEpilogue& norm, unsigned int* tickets,
              MatvecLaunch* l) {
  if (!matrix_ok(w) || !input_ok(w.type, x, xq) || residual == nullptr ||
      !norm_epilogue_ok(norm, w.rows) || (norm.weight != nullptr && tickets == nullptr)) {
    return false;
  }
  *l = Dense(w, x, xq);
  MatvecArgs& a = l->args;
  a.bias[0] = bias;
  a.accumulate = true;
  a.out = residual;
  if (norm.weight != nullptr) {
    a.tickets = tickets;
    a.norm = norm;
  }
  return true;
}

// launch_router's launch into l; false where it is not computable.
bool Router(const DeviceMatrix& w, const float* x, const block_q8_1* xq, float* logits,
            const RouterEpilogue& router, unsigned int* tickets, MatvecLaunch* l) {
  const int32_t n_expert = w.rows - (router.shared_gate_row ? 1 : 0);
  if (!matrix_ok(w) || !input_ok(w.type, x, xq) || logits == nullptr ||
      !router_topk_fits(n_expert, router.k) || router.experts == nullptr ||
      router.weights == nullptr || tickets == nullptr || !replay_ok(router.replay)) {
    return false;
  }
  *l = Dense(w, x, xq);
  l->args.out = logits;
  l->args.tickets = tickets;
  l->args.router = router;
  return true;
}

// launch_expert_ffn's tickets: the combine's, the pair's q8_1 groups', the
// chain's counts.
int32_t expert_ffn_tickets(int32_t n_embd, int32_t pair_rows, int32_t ranks) {
  return ceil_div(n_embd, kMaxRowsPerBlock) + 1 + ceil_div(pair_rows, QK8_1) + ranks + 2;
}

// first then second (its input first's output) over ranks in one
// chained_matvec_kernel launch; counts: ranks + 2 zeroed tickets of its own.
template <Chain C>
cudaError_t launch_chain(const MatvecLaunch& first, GgmlType first_type,
                         const MatvecLaunch& second, GgmlType second_type, int32_t ranks,
                         unsigned int* counts, DeviceCounters* counters, cudaStream_t stream) {
  if (counters == nullptr) return cudaErrorInvalidValue;
  ChainWeights w;
  ChainArgs a;
  w.first = first.weights;
  w.second = second.weights;
  a.first = first.args;
  a.second = second.args;
  a.type[0] = first_type;
  a.type[1] = second_type;
  a.first_blocks = matvec_row_blocks(first_type, first.args.rows, first.args.cols);
  a.second_blocks = matvec_row_blocks(second_type, second.args.rows, second.args.cols);
  a.ranks = ranks;
  a.ready = counts;
  a.order = counts + ranks;
  a.done = counts + ranks + 1;
  a.counters = counters;
  const LaunchGeometry g =
      chained_matvec_launch_geometry(first_type, first.args.rows, first.args.cols, second_type,
                                     second.args.rows, second.args.cols, ranks);
  return launch_kernel<chained_matvec_kernel<C>>(g.grid, g.block, stream, w, a);
}

}  // namespace

bool matvec_supports_type(GgmlType type, int32_t cols) { return supported(type, cols); }

bool shared_expert_fits_slots(const DeviceBlockLayout& l, const SharedExpertMatrices& s) {
  return s.gate != nullptr && s.up != nullptr && s.down != nullptr &&
         same_shape(*s.gate, l.type[0], l.n_ff, l.n_embd, l.row_bytes[0]) &&
         same_shape(*s.up, l.type[1], l.n_ff, l.n_embd, l.row_bytes[1]) &&
         same_shape(*s.down, l.type[2], l.n_embd, l.n_ff, l.row_bytes[2]) &&
         rows_aligned(l.type[0], s.gate->data, l.row_bytes[0]) &&
         rows_aligned(l.type[1], s.up->data, l.row_bytes[1]) &&
         rows_aligned(l.type[2], s.down->data, l.row_bytes[2]);
}

bool qkv_supports_type(GgmlType type, int32_t cols) {
  return supported(type, cols) && type != GgmlType::kMXFP4;
}

cudaError_t launch_matvec(const DeviceMatrix& w, const float* x, const block_q8_1* xq,
                          const float* bias, float* out, cudaStream_t stream) {
  if (!matrix_ok(w) || !input_ok(w.type, x, xq) || out == nullptr) return cudaErrorInvalidValue;
  MatvecLaunch l = Dense(w, x, xq);
  l.args.bias[0] = bias;
  l.args.out = out;
  return launch_grouped(w.type, l, 1, stream);
}

cudaError_t launch_matvec_residual(const DeviceMatrix& w, const float* x, const block_q8_1* xq,
                                   const float* bias, float* residual, const NormEpilogue& norm,
                                   unsigned int* tickets, cudaStream_t stream) {
  MatvecLaunch l;
  if (!Residual(w, x, xq, bias, residual, norm, tickets, &l)) return cudaErrorInvalidValue;
  return launch_grouped(w.type, l, 1, stream);
}

cudaError_t launch_qkv(const DeviceMatrix& wq, const DeviceMatrix& wk, const DeviceMatrix& wv,
                       const float* x, const block_q8_1* xq, const float* bq, const float* bk,
                       const float* bv, float* q, float* k, float* v, const QkvRope* rope,
                       const NormEpilogue& input_norm, unsigned int* tickets,
                       cudaStream_t stream) {
  Projection jobs[3] = {{&wq, bq, q}, {&wk, bk, k}, {&wv, bv, v}};
  QkvWeights weights;
  QkvArgs a;
  if (rope != nullptr) {
    const int32_t d = rope->head_dim;
    const int32_t q_rows = rope->n_head * d * (rope->q_gated ? 2 : 1);
    if (rope->pos == nullptr || rope->cos_sin == nullptr || rope->n_head <= 0 ||
        rope->n_head_kv <= 0 || d <= 0 || d % 2 != 0 || wq.rows != q_rows ||
        wk.rows != rope->n_head_kv * d || wv.rows != wk.rows || rope->q_out == nullptr ||
        rope->q_out == q || rope->k_cache == nullptr || rope->v_cache == nullptr ||
        rope->kv_rows < 0 || (rope->rope_type != kRopeNorm && rope->rope_type != kRopeNeox) ||
        (rope->use_norm && (rope->norm.q_weight == nullptr || rope->norm.k_weight == nullptr)) ||
        (rope->q_gated && rope->use_norm && rope->norm.full) || tickets == nullptr) {
      return cudaErrorInvalidValue;
    }
    a.rope = *rope;
    a.tickets = tickets;
    jobs[2].out = static_cast<float*>(rope->v_cache);  // the row at *pos, found in the kernel
  }
  unsigned int* norm_counts =
      tickets != nullptr && rope != nullptr ? tickets + rope->n_head + rope->n_head_kv : tickets;
  if (!SetJobs(jobs, 3, x, xq, input_norm, norm_counts, &weights, &a)) {
    return cudaErrorInvalidValue;
  }
  return launch_kernel<qkv_kernel>(a.input.blocks + a.first_block[3], kMatvecThreads, stream,
                                   weights, a);
}

cudaError_t launch_projections(const Projection* projections, int32_t n, const float* x,
                               const block_q8_1* xq, const NormEpilogue& input_norm,
                               unsigned int* tickets, cudaStream_t stream) {
  QkvWeights weights;
  QkvArgs a;
  if (projections == nullptr ||
      !SetJobs(projections, n, x, xq, input_norm, tickets, &weights, &a)) {
    return cudaErrorInvalidValue;
  }
  return launch_kernel<qkv_kernel>(a.input.blocks + a.first_block[n], kMatvecThreads, stream,
                                   weights, a);
}

cudaError_t launch_router(const DeviceMatrix& w, const float* x, const block_q8_1* xq,
                          float* logits, const RouterEpilogue& router, unsigned int* tickets,
                          cudaStream_t stream) {
  MatvecLaunch l;
  if (!Router(w, x, xq, logits, router, tickets, &l)) return cudaErrorInvalidValue;
  return launch_grouped(w.type, l, 1, stream);
}

cudaError_t launch_matvec_swiglu(const DeviceMatrix& gate, const DeviceMatrix& up, const float* x,
                                 const block_q8_1* xq, float* out, block_q8_1* out_q,
                                 unsigned int* tickets, cudaStream_t stream) {
  if (!matrix_ok(gate) || !matrix_ok(up) || gate.type != up.type || gate.rows != up.rows ||
      gate.cols != up.cols || !input_ok(gate.type, x, xq) || out == nullptr ||
      !pair_output_ok(gate.type, gate.cols, gate.rows, out_q, tickets)) {
    return cudaErrorInvalidValue;
  }
  MatvecLaunch l = Dense(gate, x, xq);
  l.weights.w[1] = static_cast<const uint8_t*>(up.data);
  MatvecArgs& a = l.args;
  a.row_bytes[1] = up.row_bytes;
  a.pair = true;
  a.out = out;
  a.out_q = out_q;
  a.out_q_tickets = tickets;
  return launch_grouped(gate.type, l, 1, stream);
}

namespace {

// launch_expert_gate_up's launch into l; false where it is not computable.
bool GateUp(const uint8_t* slots, const DeviceBlockLayout& layout, const ExpertRanks& ranks,
            ExpertPass pass, const ExpertBiases& biases, GluAct glu_act, const float* x,
            const block_q8_1* xq, float* act, block_q8_1* act_q, DeviceCounters* counters,
            unsigned int* tickets, MatvecLaunch* l) {
  if (slots == nullptr || !layout_ok(slots, layout) || !biases_ok(biases, ranks) ||
      layout.type[0] != layout.type[1] || !ranks_ok(ranks, pass, layout) ||
      !input_ok(layout.type[0], x, xq) || act == nullptr || counters == nullptr ||
      !pair_output_ok(layout.type[0], layout.n_embd, layout.n_ff, act_q, tickets)) {
    return false;
  }
  *l = Experts(slots, layout, ranks, pass, ranks.shared.gate, ranks.shared.up);
  MatvecArgs& a = l->args;
  a.offset[0] = layout.offset[0];
  a.offset[1] = layout.offset[1];
  a.row_bytes[0] = layout.row_bytes[0];
  a.row_bytes[1] = layout.row_bytes[1];
  a.rows = layout.n_ff;
  a.cols = layout.n_embd;
  a.geometry = matvec_geometry(layout.type[0], layout.n_embd);
  a.pair = true;
  a.bias[0] = biases.gate;
  a.bias[1] = biases.up;
  a.experts = biases.experts;
  a.act = glu_act;
  a.x = x;
  a.xq = xq;
  a.out = act;
  a.out_q = act_q;
  a.out_q_tickets = tickets;
  a.out_stride = layout.n_ff;
  a.overlaps_copy = pass == ExpertPass::kReady;
  a.counters = counters;
  return true;
}

// launch_expert_down_combine's launch into l; false where it is not computable.
bool DownCombine(const uint8_t* slots, const DeviceBlockLayout& layout, const ExpertRanks& ranks,
                 ExpertPass pass, const ExpertBiases& biases, const float* act,
                 const block_q8_1* act_q, float* expert_out, const CombineEpilogue& combine,
                 unsigned int* tickets, MatvecLaunch* l) {
  if (slots == nullptr || !layout_ok(slots, layout) || !biases_ok(biases, ranks) ||
      !ranks_ok(ranks, pass, layout) || !input_ok(layout.type[2], act, act_q) ||
      expert_out == nullptr || combine.weights == nullptr || combine.residual == nullptr ||
      !norm_epilogue_ok(combine.norm, layout.n_embd) || tickets == nullptr) {
    return false;
  }
  *l = Down(slots, layout, ranks, pass, biases, act, act_q, expert_out);
  l->args.tickets = tickets;
  l->args.combine = combine;
  if (ranks.shared.down != nullptr) {
    l->args.combine.shexp_out = expert_out + static_cast<int64_t>(ranks.k) * layout.n_embd;
  }
  return true;
}

}  // namespace

cudaError_t launch_expert_gate_up(const uint8_t* slots, const DeviceBlockLayout& layout,
                                  const ExpertRanks& ranks, ExpertPass pass,
                                  const ExpertBiases& biases, GluAct glu_act, const float* x,
                                  const block_q8_1* xq, float* act, block_q8_1* act_q,
                                  DeviceCounters* counters, unsigned int* tickets,
                                  cudaStream_t stream) {
  MatvecLaunch l;
  if (!GateUp(slots, layout, ranks, pass, biases, glu_act, x, xq, act, act_q, counters, tickets,
              &l)) {
    return cudaErrorInvalidValue;
  }
  return launch_grouped(layout.type[0], l, grid_ranks(ranks), stream);
}

cudaError_t launch_expert_down(const uint8_t* slots, const DeviceBlockLayout& layout,
                               const ExpertRanks& ranks, ExpertPass pass, const ExpertBiases& biases, const float* act,
                               const block_q8_1* act_q, float* expert_out, cudaStream_t stream) {
  if (slots == nullptr || !layout_ok(slots, layout) || !biases_ok(biases, ranks) ||
      !ranks_ok(ranks, pass, layout) || !input_ok(layout.type[2], act, act_q) ||
      expert_out == nullptr) {
    return cudaErrorInvalidValue;
  }
  return launch_grouped(layout.type[2],
                        Down(slots, layout, ranks, pass, biases, act, act_q, expert_out),
                        grid_ranks(ranks), stream);
}

cudaError_t launch_expert_down_combine(const uint8_t* slots, const DeviceBlockLayout& layout,
                                       const ExpertRanks& ranks, ExpertPass pass,
                                       const ExpertBiases& biases, const float* act,
                                       const block_q8_1* act_q, float* expert_out,
                                       const CombineEpilogue& combine, unsigned int* tickets,
                                       cudaStream_t stream) {
  MatvecLaunch l;
  if (!DownCombine(slots, layout, ranks, pass, biases, act, act_q, expert_out, combine, tickets,
                   &l)) {
    return cudaErrorInvalidValue;
  }
  return launch_grouped(layout.type[2], l, grid_ranks(ranks), stream);
}

cudaError_t launch_expert_ffn(const uint8_t* slots, const DeviceBlockLayout& layout,
                              const ExpertRanks& ranks, ExpertPass pass,
                              const ExpertBiases& biases, GluAct glu_act, const float* x,
                              const block_q8_1* xq, float* act, block_q8_1* act_q,
                              float* expert_out, const CombineEpilogue& combine,
                              DeviceCounters* counters, unsigned int* tickets,
                              cudaStream_t stream) {
  if (tickets == nullptr || (pass != ExpertPass::kAll && pass != ExpertPass::kReady)) {
    return cudaErrorInvalidValue;
  }
  // The combine's tickets, then the pair's q8_1 groups', then the chain's
  // counts (expert_ffn_tickets).
  const int32_t n_ranks = grid_ranks(ranks);
  unsigned int* pair_tickets = tickets + ceil_div(layout.n_embd, kMaxRowsPerBlock) + 1;
  MatvecLaunch gate_up, down;
  if (!GateUp(slots, layout, ranks, pass, biases, glu_act, x, xq, act, act_q, counters,
              pair_tickets, &gate_up) ||
      !DownCombine(slots, layout, ranks, pass, biases, act, act_q, expert_out, combine, tickets,
                   &down)) {
    return cudaErrorInvalidValue;
  }
  return launch_chain<Chain::kExpertFfn>(
      gate_up, layout.type[0], down, layout.type[2], n_ranks,
      pair_tickets + ceil_div(int64_t{n_ranks} * layout.n_ff, QK8_1), counters, stream);
}

cudaError_t launch_matvec_residual_router(const DeviceMatrix& w, const float* x,
                                          const block_q8_1* xq, const float* bias,
                                          float* residual, const NormEpilogue& norm,
                                          const DeviceMatrix& router_w, float* logits,
                                          const RouterEpilogue& router, DeviceCounters* counters,
                                          unsigned int* tickets, cudaStream_t stream) {
  // The norm's ticket, the router's, then the chain's counts. An element-type
  // router (llama-quantize's files: it never quantizes ffn_gate_inp) normalizes
  // its own input (MatvecArgs::input_norm); a quant type's reads q8_1 blocks,
  // which attn_out's last block makes.
  MatvecLaunch first, second;
  const bool router_norms = !mmvq_type(router_w.type);
  if (tickets == nullptr || norm.weight == nullptr || !norm_epilogue_ok(norm, w.rows) ||
      !Residual(w, x, xq, bias, residual, router_norms ? NormEpilogue{} : norm, tickets,
                &first) ||
      !Router(router_w, router_norms ? residual : norm.out, norm.out_q, logits, router,
              tickets + 1, &second)) {
    return cudaErrorInvalidValue;
  }
  if (router_norms) second.args.input_norm = norm;
  return launch_chain<Chain::kResidualRouter>(first, w.type, second, router_w.type, 1,
                                              tickets + 2, counters, stream);
}

// launch_matvec_residual_router's: the norm's, the router's, one rank's chain counts.
constexpr int32_t kResidualRouterTickets = 2 + 1 + 2;

int32_t step_tickets(int32_t n_embd, int32_t n_head, int32_t n_head_kv, int32_t pair_rows) {
  return std::max({ceil_div(n_embd, kMaxRowsPerBlock) + 1,
                   n_head + n_head_kv + kNormPrologueTickets,
                   ceil_div(pair_rows, QK8_1),
                   expert_ffn_tickets(n_embd, pair_rows, kMaxTopK + 1),
                   kResidualRouterTickets});
}

}  // namespace moegraph
