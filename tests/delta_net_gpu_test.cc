// The device's Gated DeltaNet mixer (launch_delta_net_mix) against the CPU
// backend's (CpuDeltaNetMix), call after call from a zero state: its outputs
// and its delta state within float rounding of the CPU's (the two sum in
// other orders), its q8_1 blocks the host's quantization of its outputs.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/delta_net.h"
#include "cpu/thread_pool.h"
#include "kernels/kernels.h"
#include "kernels/mmvq_math.h"
#include "tests/cuda_test_util.h"

namespace moegraph {
namespace {

template <typename T>
T* DeviceCopy(const std::vector<T>& host) {
  T* ptr = nullptr;
  EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<size_t>(host.size(), 1) * sizeof(T)),
            cudaSuccess);
  EXPECT_EQ(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return ptr;
}

template <typename T>
std::vector<T> HostCopy(const T* ptr, size_t n) {
  std::vector<T> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

std::vector<float> Gaussian(std::mt19937& rng, size_t n, float mean, float sd) {
  std::normal_distribution<float> dist(mean, sd);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Worst |got - want| / max(1, |want|).
double WorstRelative(const std::vector<float>& got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size());
  double worst = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, std::fabs(double{got[i]} - want[i]) / std::max(1.0, std::fabs(double{want[i]})));
  }
  return worst;
}

class DeltaNetGpuTest : public testing_util::CudaStreamTest,
                        public ::testing::WithParamInterface<DeltaNetShape> {};

TEST_P(DeltaNetGpuTest, CallsFromAZeroStateFollowTheCpuBackend) {
  const DeltaNetShape shape = GetParam();
  const int64_t conv_dim = shape.conv_dim(), value_dim = shape.value_dim();
  const int hv = shape.n_v_heads, d = shape.head_dim;
  std::mt19937 rng(41);
  // The fixture's distributions (loader/fixture.cc): taps summing to about 1,
  // ssm_a = -exp(A_log), norm weights near 1.
  const std::vector<float> taps = Gaussian(rng, conv_dim * shape.d_conv, 0.0f, 0.5f);
  const std::vector<float> dt_bias = Gaussian(rng, hv, 0.0f, 1.0f);
  std::vector<float> ssm_a = Gaussian(rng, hv, 0.0f, 0.5f);
  for (float& x : ssm_a) x = -std::exp(x);
  const std::vector<float> norm = Gaussian(rng, d, 1.0f, 0.1f);
  constexpr float kEps = 1e-6f;
  const DeltaNetWeights weights{taps, dt_bias, ssm_a, norm};

  CpuDeltaNetState cpu_state(shape);
  ThreadPool pool(1);
  DeltaNetMixArgs args;
  args.n_k_heads = shape.n_k_heads;
  args.n_v_heads = hv;
  args.head_dim = d;
  args.d_conv = shape.d_conv;
  args.eps = kEps;
  args.conv_taps = DeviceCopy(taps);
  args.dt_bias = DeviceCopy(dt_bias);
  args.ssm_a = DeviceCopy(ssm_a);
  args.norm = DeviceCopy(norm);
  args.conv_state = DeviceCopy(std::vector<float>(
      delta_net_conv_state_floats(hv, d, shape.d_conv), 0.0f));
  args.delta_state = DeviceCopy(std::vector<float>(shape.delta_state_floats(), 0.0f));
  const std::vector<unsigned int> zero_tickets(hv, 0);
  args.tickets = DeviceCopy(zero_tickets);

  // A prompt of 5 tokens (longer than the conv's window), a decode step, 3 more.
  for (const int tokens : {5, 1, 3}) {
    SCOPED_TRACE(tokens);
    std::vector<float> qkv = Gaussian(rng, tokens * conv_dim, 0.0f, 1.0f);
    const std::vector<float> z = Gaussian(rng, tokens * value_dim, 0.0f, 1.0f);
    const std::vector<float> alpha = Gaussian(rng, tokens * hv, 0.0f, 1.0f);
    const std::vector<float> beta = Gaussian(rng, tokens * hv, 0.0f, 1.0f);
    DeltaNetMixArgs call = args;
    call.qkv = DeviceCopy(qkv);
    call.z = DeviceCopy(z);
    call.alpha = DeviceCopy(alpha);
    call.beta_logit = DeviceCopy(beta);
    call.out = DeviceCopy(std::vector<float>(tokens * value_dim, 0.0f));
    call.out_q = DeviceCopy(std::vector<block_q8_1>(tokens * value_dim / QK8_1));
    ASSERT_EQ(launch_delta_net_mix(call, tokens, stream_), cudaSuccess);
    Sync();
    const std::vector<float> got = HostCopy(call.out, tokens * value_dim);

    std::vector<float> want(tokens * value_dim);
    CpuDeltaNetMix(shape, weights, kEps, tokens, qkv.data(), z.data(), alpha.data(), beta.data(),
                   pool, &cpu_state, want.data());
    EXPECT_LT(WorstRelative(got, want), 1e-4);
    EXPECT_EQ(HostCopy(args.tickets, zero_tickets.size()), zero_tickets);
    const std::vector<block_q8_1> got_q = HostCopy(call.out_q, got.size() / QK8_1);
    for (size_t b = 0; b < got_q.size(); ++b) {
      block_q8_1 want_q;
      quantize_q8_1_block(got.data() + b * QK8_1, &want_q);
      EXPECT_EQ(std::memcmp(&got_q[b], &want_q, sizeof(want_q)), 0) << "q8_1 block " << b;
    }
    for (const void* p : {static_cast<const void*>(call.qkv), static_cast<const void*>(call.z),
                          static_cast<const void*>(call.alpha),
                          static_cast<const void*>(call.beta_logit),
                          static_cast<const void*>(call.out), static_cast<const void*>(call.out_q)}) {
      cudaFree(const_cast<void*>(p));
    }
  }
  EXPECT_LT(WorstRelative(HostCopy(args.delta_state, cpu_state.delta.size()), cpu_state.delta),
            1e-4);
  for (const void* p :
       {static_cast<const void*>(args.conv_taps), static_cast<const void*>(args.dt_bias),
        static_cast<const void*>(args.ssm_a), static_cast<const void*>(args.norm),
        static_cast<const void*>(args.conv_state), static_cast<const void*>(args.delta_state),
        static_cast<const void*>(args.tickets)}) {
    cudaFree(const_cast<void*>(p));
  }
}

// A small shape, and Qwen3.5-35B-A3B's (16 key and 32 value heads of 128).
INSTANTIATE_TEST_SUITE_P(Shapes, DeltaNetGpuTest,
                         ::testing::Values(DeltaNetShape{4, 32, 2, 4},
                                           DeltaNetShape{4, 128, 16, 32}),
                         [](const ::testing::TestParamInfo<DeltaNetShape>& info) {
                           return "k" + std::to_string(info.param.n_k_heads) + "_v" +
                                  std::to_string(info.param.n_v_heads) + "_d" +
                                  std::to_string(info.param.head_dim);
                         });

TEST(DeltaNetGpuArgsTest, BadShapesAndMissingBuffersAreRefused) {
  DeltaNetMixArgs args;
  EXPECT_EQ(launch_delta_net_mix(args, 1, nullptr), cudaErrorInvalidValue);
  args.n_k_heads = 2;
  args.n_v_heads = 3;  // not a multiple of the key heads
  args.head_dim = 32;
  args.d_conv = 4;
  EXPECT_EQ(launch_delta_net_mix(args, 1, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace moegraph
