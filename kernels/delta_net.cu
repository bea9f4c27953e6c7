// The Gated DeltaNet mixer (launch_delta_net_mix, kernels/kernels.h): the
// indexing and the movement; the per-element math is kernels/delta_net_math.h,
// the CPU backend's too.
#include "kernels/delta_net_math.h"
#include "kernels/epilogue.cuh"
#include "kernels/kernels.h"
#include "kernels/launch.cuh"
#include "kernels/launch_geometry.h"
#include "kernels/nn_math.h"
#include "kernels/q8_1.cuh"
#include "kernels/reduce.cuh"

namespace moegraph {
namespace {

constexpr int kMaxHeadDim = kDeltaNetMaxHeadDim;
constexpr int kWarps = kDeltaNetThreads / 32;
// Keys a lane holds of a state row, and the rows a warp loads at once: a
// block's warps take kDeltaNetRowsPerBlock rows, one group each.
constexpr int kKeysPerLane = kMaxHeadDim / 32;
constexpr int kRowsAtOnce = kDeltaNetRowsPerBlock / kWarps;
static_assert(kRowsAtOnce * kWarps == kDeltaNetRowsPerBlock);
// The channels a block convolves: the head's q and k, and its rows' v.
constexpr int kMaxChannels = 2 * kMaxHeadDim + kDeltaNetRowsPerBlock;

// The model's channel of block channel j (of channels = 2 d + the rows'): q,
// k (both of key head g), then v rows first_row.. (of value head h).
__device__ inline int32_t model_channel(int32_t j, int32_t d, int32_t g, int32_t h,
                                        int32_t first_row, int32_t key_dim) {
  if (j < d) return g * d + j;
  if (j < 2 * d) return key_dim + g * d + (j - d);
  return 2 * key_dim + h * d + first_row + (j - 2 * d);
}

// The delta state, the stream the kernel reads and writes at every token, is
// its first parameter and nothing else is (tests/kernel_shape_test.py traces
// its loads to it, as the matvecs' weights).
//
// Block (h, s) owns value head h's state rows [32 s, + 32): the delta rule
// updates each row from that row alone, so the head's rows split across
// blocks with no exchange. Each block convolves the head's q and k channels
// itself and keeps its own copy of their conv state (no block overwrites a
// word another reads). The gated norm needs all of a head's rows: each block
// leaves its rows of o in out, and the head's last block to finish
// (a.tickets[h]) norms every token's row of the head in place. One block an
// SM is asked for: without it ptxas held the kernel to 128 registers and
// spilled the rows kept across tokens (184 bytes).
__global__ void __launch_bounds__(kDeltaNetThreads, 1)
    delta_net_mix_kernel(float* __restrict__ delta_state, const DeltaNetMixArgs a,
                         int32_t tokens) {
  wait_for_prior_grids();
  __shared__ float y[kMaxChannels];  // the conv's outputs: q, k, the rows' v
  __shared__ float scratch[kWarps];
  __shared__ EpilogueShared epilogue;
  const int32_t h = blockIdx.x, s = blockIdx.y, tid = threadIdx.x, lane = tid % 32,
                warp = tid / 32;
  const int32_t d = a.head_dim, g = h % a.n_k_heads, held = a.d_conv - 1;
  const int32_t key_dim = a.n_k_heads * d, value_dim = a.n_v_heads * d;
  const int32_t conv_dim = 2 * key_dim + value_dim;
  const int32_t first_row = s * kDeltaNetRowsPerBlock;
  const int32_t channels = 2 * d + kDeltaNetRowsPerBlock;
  float* const conv_state =
      a.conv_state + (static_cast<int64_t>(h) * gridDim.y + s) * channels * held;
  float* const m = delta_state + static_cast<int64_t>(h) * d * d;
  const float scale = 1.0f / sqrtf(static_cast<float>(d));

  // The warp's kRowsAtOnce state rows (first_row + 4 warp .. + 3), a lane
  // every 32nd key, held in registers across the tokens: all their loads
  // first, so a lane has 4 x head_dim / 32 in flight; stored after the last.
  const int32_t j0 = first_row + warp * kRowsAtOnce;
  float r[kRowsAtOnce][kKeysPerLane];
#pragma unroll
  for (int32_t i = 0; i < kRowsAtOnce; ++i) {
    const float* row = m + static_cast<int64_t>(j0 + i) * d;
#pragma unroll
    for (int32_t u = 0; u < kKeysPerLane; ++u) r[i][u] = u < d / 32 ? row[lane + 32 * u] : 0.0f;
  }

  for (int32_t t = 0; t < tokens; ++t) {
    // 1. The conv and silu of the block's channels at token t.
    for (int32_t j = tid; j < channels; j += kDeltaNetThreads) {
      const int32_t c = model_channel(j, d, g, h, first_row, key_dim);
      const float* kept = conv_state + j * held;
      const float* const qkv = a.qkv;
      const int32_t first = t - held;
      const auto input_at = [=](int32_t i) {
        const int32_t tau = first + i;
        return tau < 0 ? kept[held + tau] : qkv[static_cast<int64_t>(tau) * conv_dim + c];
      };
      y[j] = silu(delta_net_conv_tap_sum(input_at, a.conv_taps + c * a.d_conv, a.d_conv));
    }
    __syncthreads();

    // 2. q and k l2-normalised, and k.q for the output.
    float q_sq = 0.0f, k_sq = 0.0f;
    for (int32_t i = tid; i < d; i += kDeltaNetThreads) {
      q_sq += y[i] * y[i];
      k_sq += y[d + i] * y[d + i];
    }
    const float q_scale = delta_net_l2_scale(block_sum(q_sq, scratch), d, a.eps);
    const float k_scale = delta_net_l2_scale(block_sum(k_sq, scratch), d, a.eps);
    // Held in registers: every index below is a constant once unrolled.
    float q[kKeysPerLane], k[kKeysPerLane];
    float kq_part = 0.0f;
#pragma unroll
    for (int32_t u = 0; u < kKeysPerLane; ++u) {
      q[u] = u < d / 32 ? y[lane + 32 * u] * q_scale : 0.0f;
      k[u] = u < d / 32 ? y[d + lane + 32 * u] * k_scale : 0.0f;
      kq_part += k[u] * q[u];
    }
    const float kq = warp_sum(kq_part);
    const int64_t at = static_cast<int64_t>(t) * a.n_v_heads + h;
    const float decay = delta_net_decay(a.alpha[at], a.dt_bias[h], a.ssm_a[h]);
    const float beta = sigmoid(a.beta_logit[at]);

    // 3. The delta rule on the warp's rows: each row's dots with k and q,
    // m_j = decay m_j + delta_j k, and its o (before the norm) into out.
    const int64_t row_at = static_cast<int64_t>(t) * value_dim + static_cast<int64_t>(h) * d;
#pragma unroll
    for (int32_t i = 0; i < kRowsAtOnce; ++i) {
      const int32_t j = j0 + i;
      float mk = 0.0f, mq = 0.0f;
#pragma unroll
      for (int32_t u = 0; u < kKeysPerLane; ++u) {
        mk += r[i][u] * k[u];
        mq += r[i][u] * q[u];
      }
      mk = warp_sum(mk);
      mq = warp_sum(mq);
      const float delta = (y[2 * d + j - first_row] - decay * mk) * beta;
#pragma unroll
      for (int32_t u = 0; u < kKeysPerLane; ++u) r[i][u] = fmaf(delta, k[u], decay * r[i][u]);
      if (lane == 0) a.out[row_at + j] = (decay * mq + delta * kq) * scale;
    }
    __syncthreads();
  }

#pragma unroll
  for (int32_t i = 0; i < kRowsAtOnce; ++i) {
    float* row = m + static_cast<int64_t>(j0 + i) * d;
#pragma unroll
    for (int32_t u = 0; u < kKeysPerLane; ++u) {
      if (u < d / 32) row[lane + 32 * u] = r[i][u];
    }
  }

  // 4. Each channel's last d_conv - 1 inputs become its state, oldest first
  // (entry i takes the input tokens + i entries later, read before written).
  for (int32_t j = tid; j < channels; j += kDeltaNetThreads) {
    const int32_t c = model_channel(j, d, g, h, first_row, key_dim);
    float* kept = conv_state + j * held;
    for (int32_t i = 0; i < held; ++i) {
      const int32_t tau = tokens - held + i;
      kept[i] = tau < 0 ? kept[tokens + i] : a.qkv[static_cast<int64_t>(tau) * conv_dim + c];
    }
  }

  // 5. In the head's last block: rms_norm(o) * norm * silu(z) of each token's
  // row, in place, and its q8_1 blocks (the other blocks' rows read through L2).
  if (!last_block_done(a.tickets + h, gridDim.y, &epilogue)) return;
  for (int32_t t = 0; t < tokens; ++t) {
    const int64_t row_at = static_cast<int64_t>(t) * value_dim + static_cast<int64_t>(h) * d;
    float* const o = a.out + row_at;
    float o_sq = 0.0f;
    for (int32_t j = tid; j < d; j += kDeltaNetThreads) {
      const float v = __ldcg(o + j);
      o_sq += v * v;
    }
    const float rms = rms_scale(block_sum(o_sq, scratch), d, a.eps);
    for (int32_t base = warp * 32; base < d; base += kDeltaNetThreads) {
      const int32_t j = base + lane;
      const float v = __ldcg(o + j) * rms * a.norm[j] * silu(a.z[row_at + j]);
      o[j] = v;
      if (a.out_q != nullptr) warp_quantize_q8_1(v, a.out_q + (row_at + base) / 32);
    }
    __syncthreads();
  }
}

}  // namespace

int64_t delta_net_conv_state_floats(int32_t n_v_heads, int32_t head_dim, int32_t d_conv) {
  const int64_t blocks = int64_t{n_v_heads} * (head_dim / kDeltaNetRowsPerBlock);
  return blocks * (2 * head_dim + kDeltaNetRowsPerBlock) * (d_conv - 1);
}

cudaError_t launch_delta_net_mix(const DeltaNetMixArgs& args, int32_t tokens,
                                 cudaStream_t stream) {
  const bool shape_ok =
      delta_net_mix_supports(args.n_k_heads, args.n_v_heads, args.head_dim, args.d_conv);
  const bool buffers_ok = args.conv_taps != nullptr && args.dt_bias != nullptr &&
                          args.ssm_a != nullptr && args.norm != nullptr && args.qkv != nullptr &&
                          args.z != nullptr && args.alpha != nullptr &&
                          args.beta_logit != nullptr && args.conv_state != nullptr &&
                          args.delta_state != nullptr && args.out != nullptr &&
                          args.tickets != nullptr;
  if (!shape_ok || !buffers_ok || tokens < 1) return cudaErrorInvalidValue;
  const LaunchGeometry g = delta_net_mix_launch_geometry(args.n_v_heads, args.head_dim);
  return launch_kernel<delta_net_mix_kernel>(g.grid, g.block, stream, args.delta_state, args,
                                             tokens);
}

}  // namespace moegraph
