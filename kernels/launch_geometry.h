// The grid and block of every decode-step launcher, one function each: the
// launchers in kernels/*.cu launch with them and `moegraph inspect --walk`
// (capture/walk_shape.h) prints them, so both give the same numbers (launch_qkv
// sums matvec_row_blocks into its jobs' first blocks, as qkv_launch_geometry
// does). tests/walk_shape_test.cc holds the emulated engine's launches to
// walk_shape.h's rows. Light: .cu and .cc files include it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/mmvq_math.h"
#include "kernels/moe_math.h"
#include "kernels/sample_math.h"
#include "loader/ggml_type.h"

namespace moegraph {

struct LaunchGeometry {
  dim3 grid;
  dim3 block;
};

// launch_embed: one block, a thread per ggml block of the row (strided).
inline constexpr int kEmbedThreads = 256;
// launch_attention_decode: a block per (column of at most kAttentionGroupHeads
// query heads of one KV head, split of kAttentionSplitPositions positions).
inline constexpr int kAttentionThreads = 128;
inline constexpr int kAttentionSplitPositions = 128;
inline constexpr int kAttentionGroupHeads = 8;
// launch_delta_net_mix: a block per (value head, kDeltaNetRowsPerBlock of its
// state rows), eight warps of four rows each, a lane every 32nd key of a row
// (the four rows' loads in flight together: 16 KiB a block at head_dim 128;
// the rows held in registers across a call's tokens: 190 registers, one block
// an SM). Qwen3.5-35B-A3B's 32 value heads of 128 make 128 blocks, about one
// an SM: 2 MiB of state in flight.
inline constexpr int kDeltaNetThreads = 256;
inline constexpr int32_t kDeltaNetRowsPerBlock = 32;
// The shapes it takes: a head's state rows of head_dim (a multiple of 32, at
// most kDeltaNetMaxHeadDim: a lane holds head_dim / 32 keys in registers),
// conv kernels of 2..kDeltaNetMaxConv taps, whole groups of value heads.
inline constexpr int32_t kDeltaNetMaxHeadDim = 256;
inline constexpr int32_t kDeltaNetMaxConv = 8;
inline bool delta_net_mix_supports(int32_t n_k_heads, int32_t n_v_heads, int32_t head_dim,
                                   int32_t d_conv) {
  return n_k_heads > 0 && n_v_heads > 0 && n_v_heads % n_k_heads == 0 && head_dim > 0 &&
         head_dim % 32 == 0 && head_dim <= kDeltaNetMaxHeadDim && d_conv >= 2 &&
         d_conv <= kDeltaNetMaxConv;
}
// launch_residency_step and launch_hazard_step: one block each (the hazard
// step's victim pass reads several dependent arrays per slot: more warps hide
// more of that latency).
inline constexpr int kResidencyStepThreads = 256;
inline constexpr int kHazardStepThreads = 1024;
// launch_stage_copy: kStageCopyBlocksPerExpert blocks per rank, enough loads
// in flight to fill PCIe.
inline constexpr int kStageCopyBlocksPerExpert = 32;
inline constexpr int kStageCopyThreads = 256;
// launch_routing_step_end and launch_record_logits.
inline constexpr int kRoutingStepEndThreads = 256;
inline constexpr int kRecordLogitsThreads = 256;
// launch_sample: blocks of kSampleRuns threads, 4 logits a thread.
inline constexpr int kSampleBlockLogits = 4 * kSampleRuns;

inline int32_t ceil_blocks(int64_t n, int64_t per_block) {
  return static_cast<int32_t>((n + per_block - 1) / per_block);
}

// Every grouped_matvec_kernel launch (launch_matvec, _residual, _swiglu,
// launch_router, the expert passes): the matrix's row blocks x ranks.
inline LaunchGeometry matvec_launch_geometry(GgmlType type, int64_t rows, int64_t cols,
                                             int32_t ranks) {
  return {dim3(static_cast<unsigned>(matvec_row_blocks(type, rows, cols)),
               static_cast<unsigned>(ranks)),
          dim3(kMatvecThreads)};
}

// launch_expert_ffn and launch_matvec_residual_router (chained_matvec_kernel):
// the first matvec's row blocks, rank by rank, then the second's, along x.
inline LaunchGeometry chained_matvec_launch_geometry(GgmlType first_type, int64_t first_rows,
                                                     int64_t first_cols, GgmlType second_type,
                                                     int64_t second_rows, int64_t second_cols,
                                                     int32_t ranks) {
  const int64_t per_rank = matvec_row_blocks(first_type, first_rows, first_cols) +
                           matvec_row_blocks(second_type, second_rows, second_cols);
  return {dim3(static_cast<unsigned>(per_rank * ranks)), dim3(kMatvecThreads)};
}

// The blocks of launch_qkv's input norm (kernels/kernels.h): a warp writes
// each 32 elements.
inline int32_t norm_prologue_blocks(int64_t cols) { return ceil_blocks(cols, kMatvecThreads); }

// launch_qkv and launch_projections: the n matrices' row blocks one after
// another along x (q's, k's and v's), after the input norm's blocks where the
// launch has one.
inline LaunchGeometry qkv_launch_geometry(const GgmlType* type, const int64_t* rows, int n,
                                          int64_t cols, bool input_norm) {
  int64_t blocks = input_norm ? norm_prologue_blocks(cols) : 0;
  for (int j = 0; j < n; ++j) blocks += matvec_row_blocks(type[j], rows[j], cols);
  return {dim3(static_cast<unsigned>(blocks)), dim3(kMatvecThreads)};
}

inline LaunchGeometry embed_launch_geometry() { return {dim3(1), dim3(kEmbedThreads)}; }
inline LaunchGeometry delta_net_mix_launch_geometry(int32_t n_v_heads, int32_t head_dim) {
  return {dim3(static_cast<unsigned>(n_v_heads),
               static_cast<unsigned>(head_dim / kDeltaNetRowsPerBlock)),
          dim3(kDeltaNetThreads)};
}

// The attention's splits of a context of max_ctx positions.
inline int32_t attention_splits(int32_t max_ctx) {
  return ceil_blocks(max_ctx, kAttentionSplitPositions);
}

// The attention's block columns (dense.cu's HeadGroup): ceil(group /
// kAttentionGroupHeads) per KV head (the prefill's grid has them too).
inline int32_t attention_columns(int32_t n_head, int32_t n_head_kv) {
  return n_head_kv * ceil_blocks(n_head / n_head_kv, kAttentionGroupHeads);
}

// Columns x splits, fixed by max_ctx (splits past the live keys exit at once).
inline LaunchGeometry attention_decode_launch_geometry(int32_t n_head, int32_t n_head_kv,
                                                       int32_t max_ctx) {
  return {dim3(static_cast<unsigned>(attention_columns(n_head, n_head_kv)),
               static_cast<unsigned>(attention_splits(max_ctx))),
          dim3(kAttentionThreads)};
}

inline LaunchGeometry residency_step_launch_geometry() {
  return {dim3(1), dim3(kResidencyStepThreads)};
}
inline LaunchGeometry hazard_step_launch_geometry() { return {dim3(1), dim3(kHazardStepThreads)}; }

// launch_stage_all_slots: a thread per rank, as many
// as any k.
inline LaunchGeometry rank_threads_launch_geometry() { return {dim3(1), dim3(kMaxTopK)}; }

inline LaunchGeometry stage_copy_launch_geometry(int32_t k) {
  return {dim3(kStageCopyBlocksPerExpert, static_cast<unsigned>(k)), dim3(kStageCopyThreads)};
}

inline LaunchGeometry routing_step_end_launch_geometry() {
  return {dim3(1), dim3(kRoutingStepEndThreads)};
}

inline LaunchGeometry record_logits_launch_geometry(int32_t n) {
  return {dim3(static_cast<unsigned>(ceil_blocks(n, kRecordLogitsThreads))),
          dim3(kRecordLogitsThreads)};
}

inline LaunchGeometry sample_launch_geometry(int32_t n) {
  return {dim3(static_cast<unsigned>(ceil_blocks(n, kSampleBlockLogits))), dim3(kSampleRuns)};
}

}  // namespace moegraph
