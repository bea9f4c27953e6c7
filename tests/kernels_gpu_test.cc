// Every decode-step kernel against the CPU: the oracle's ops (reference/ops.h),
// the quant code and the residency policy run on the host with the same inputs.
// Inputs are random, never zeros. Without a CUDA device every test skips.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/moe_math.h"
#include "kernels/nn_math.h"
#include "kernels/sample_math.h"
#include "loader/ggml_type.h"
#include "loader/model_config.h"
#include "loader/quant.h"
#include "loader/quantize.h"
#include "reference/ops.h"
#include "residency/hazard_cache.h"
#include "residency/policy.h"
#include "tests/cuda_test_util.h"

namespace moegraph {
namespace {

const GgmlType kTypes[] = {GgmlType::kF32,  GgmlType::kF16,    GgmlType::kBF16,   GgmlType::kQ8_0,
                           GgmlType::kQ4_0, GgmlType::kQ4_K,   GgmlType::kQ5_K,   GgmlType::kQ6_K,
                           GgmlType::kQ4_1, GgmlType::kQ5_0,   GgmlType::kQ5_1,   GgmlType::kQ2_K,
                           GgmlType::kQ3_K, GgmlType::kIQ4_NL, GgmlType::kIQ4_XS, GgmlType::kMXFP4};

std::string TypeName(GgmlType type) { return ggml_type_name(static_cast<uint32_t>(type)); }

// A device array that frees itself; copies are synchronous (the tests sync the
// kernels' stream before reading back).
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&ptr_), std::max<size_t>(n, 1) * sizeof(T)),
              cudaSuccess);
  }
  explicit DeviceArray(const std::vector<T>& values) : DeviceArray(values.size()) {
    Upload(values);
  }
  ~DeviceArray() { cudaFree(ptr_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  void Upload(const std::vector<T>& values) {
    ASSERT_EQ(values.size(), n_);
    EXPECT_EQ(cudaMemcpy(ptr_, values.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<T> Download() const {
    std::vector<T> values(n_);
    EXPECT_EQ(cudaMemcpy(values.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return values;
  }
  T* get() const { return ptr_; }

 private:
  T* ptr_ = nullptr;
  size_t n_;
};

std::vector<float> Gaussian(std::mt19937& rng, size_t n, float sd = 1.0f) {
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// The device buffers of a StepStart at step 0 of a one-token prompt: the
// step's embed reads `token`.
struct OneTokenStart {
  explicit OneTokenStart(int32_t token)
      : prompt(std::vector<int32_t>{token}), n_prompt(std::vector<int32_t>{1}),
        sampled(std::vector<int32_t>{-1}), step(std::vector<int32_t>{0}), pos(1) {}
  StepStart get() { return {prompt.get(), n_prompt.get(), sampled.get(), step.get(), pos.get()}; }
  DeviceArray<int32_t> prompt, n_prompt, sampled, step, pos;
};

// launch_sample with its own scratch and ticket; path() is the SamplePath the
// last launch took.
class Sampler {
 public:
  explicit Sampler(int32_t n)
      : n_(n), scratch_(sample_scratch_bytes(n)), tickets_(std::vector<unsigned int>{0}) {}
  cudaError_t Launch(const float* logits, const SamplingParams* params, const int32_t* step,
                     int32_t* token_out, cudaStream_t stream, const StepEnd& end = {}) {
    return launch_sample(logits, n_, params, step, scratch_.get(), tickets_.get(), token_out, end,
                         stream);
  }
  SamplePath path() const {
    int32_t path = -1;
    EXPECT_EQ(cudaMemcpy(&path, scratch_.get(), sizeof(path), cudaMemcpyDeviceToHost), cudaSuccess);
    return static_cast<SamplePath>(path);
  }
  unsigned int ticket() const { return tickets_.Download()[0]; }

 private:
  int32_t n_;
  DeviceArray<uint8_t> scratch_;
  DeviceArray<unsigned int> tickets_;
};

// Normalised mean squared error of actual against expected (test-backend-ops' NMSE).
double Nmse(const std::vector<float>& actual, const std::vector<float>& expected) {
  EXPECT_EQ(actual.size(), expected.size());
  double err = 0.0, norm = 0.0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double d = static_cast<double>(actual[i]) - expected[i];
    err += d * d;
    norm += static_cast<double>(expected[i]) * expected[i];
  }
  return err / norm;
}

// rows x cols of type, quantized from Gaussian values.
std::vector<uint8_t> RandomMatrix(std::mt19937& rng, GgmlType type, int64_t rows, int64_t cols) {
  const size_t row_bytes = ggml_row_size(type, cols);
  std::vector<uint8_t> bytes(rows * row_bytes);
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<float> values = Gaussian(rng, cols, 0.5f);
    quantize_row(type, values.data(), bytes.data() + r * row_bytes, cols);
  }
  return bytes;
}

WeightView HostView(const uint8_t* data, GgmlType type, int64_t rows, int64_t cols) {
  return WeightView{data, type, cols, rows, ggml_row_size(type, cols)};
}

DeviceMatrix DeviceView(const uint8_t* data, GgmlType type, int32_t rows, int32_t cols) {
  return DeviceMatrix{data, type, cols, rows, ggml_row_size(type, cols)};
}

// x's q8_1 blocks as the host quantizes them (kernels/mmvq_math.h).
std::vector<block_q8_1> Q8_1(const std::vector<float>& x) {
  std::vector<block_q8_1> blocks(x.size() / QK8_1);
  for (size_t b = 0; b < blocks.size(); ++b) quantize_q8_1_block(x.data() + b * QK8_1, &blocks[b]);
  return blocks;
}

bool SameBlocks(const std::vector<block_q8_1>& a, const std::vector<block_q8_1>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(block_q8_1)) == 0;
}

// W x for every row, as the grouped matvec computes it.
std::vector<float> GroupedMatvec(GgmlType type, const uint8_t* w, int64_t rows, int64_t cols,
                                 const std::vector<float>& x,
                                 const std::vector<block_q8_1>& xq) {
  std::vector<float> out(rows);
  const size_t row_bytes = ggml_row_size(type, cols);
  for (int64_t r = 0; r < rows; ++r) {
    out[r] = matvec_row_reference(type, w + r * row_bytes, x.data(), xq.data(), cols);
  }
  return out;
}

// The f32 bound of a type against the dequantized f32 product. Where the
// activations go through q8_1: twice test-backend-ops' 5e-4, since a product of
// 7 rows is a noisy estimate and q4_0's offset goes through the f16 block sums
// (q4_0 at 7x2048 measured 6.1e-4 on one seed; 300 rows stay under 5e-4).
double F32Bound(GgmlType type) { return mmvq_type(type) ? 1e-3 : 1e-7; }

// RoPE's table (fill_rope_table) of positions + 1 rows with only row `pos`
// made, the others NaN: a kernel reading any other row writes NaNs.
std::vector<float> RopeTableRow(int32_t n_rot, float freq_base, const RopeYarn& yarn,
                                 int32_t pos) {
  std::vector<float> table(rope_table_floats(n_rot, pos + 1), std::nanf(""));
  for (int32_t i = 0; i < n_rot / 2; ++i) {
    float* at = table.data() + 2 * (static_cast<size_t>(pos) * (n_rot / 2) + i);
    rope_cos_sin(pos, i, n_rot, freq_base, yarn, at, at + 1);
  }
  return table;
}

// launch_qkv's rope of heads at *pos, by the table's cosines and sines
// (NEOX, no QK-norm, no outputs yet).
QkvRope HeadsRope(const int32_t* pos, int32_t n_head, int32_t n_head_kv, int32_t head_dim,
                  const float* cos_sin) {
  QkvRope rope;
  rope.pos = pos;
  rope.n_head = n_head;
  rope.n_head_kv = n_head_kv;
  rope.head_dim = head_dim;
  rope.cos_sin = cos_sin;
  rope.rope_type = kRopeNeox;
  return rope;
}

using KernelsGpuTest = testing_util::CudaStreamTest;

TEST_F(KernelsGpuTest, EmbedEqualsDequantizedRowBitForBit) {
  std::mt19937 rng(1);
  const int32_t rows = 7, cols = 512;
  for (GgmlType type : kTypes) {
    SCOPED_TRACE(TypeName(type));
    const std::vector<uint8_t> table = RandomMatrix(rng, type, rows, cols);
    DeviceArray<uint8_t> d_table(table);
    for (int32_t token : {0, 5, rows - 1}) {
      OneTokenStart start(token);
      DeviceArray<float> d_out(cols);
      ASSERT_EQ(launch_embed_step(DeviceView(d_table.get(), type, rows, cols), start.get(),
                                  d_out.get(), stream_),
                cudaSuccess);
      Sync();
      std::vector<float> expected(cols);
      DequantizeRow(HostView(table.data(), type, rows, cols), token, expected.data());
      const std::vector<float> out = d_out.Download();
      for (int32_t i = 0; i < cols; ++i) {
        ASSERT_EQ(f32_to_bits(out[i]), f32_to_bits(expected[i])) << "token " << token << " i " << i;
      }
    }
  }
}

// Every type at row lengths from one block to many, against the host's run of
// the same per-thread arithmetic and butterflies (bit for bit on the emulator; a
// GPU may fuse multiply-adds: 1e-10) and against the f32 product of the
// dequantized rows (q8_1 rounding: F32Bound).
TEST_F(KernelsGpuTest, MatvecMatchesReferenceForEveryType) {
  std::mt19937 rng(3);
  struct Shape {
    int32_t rows, cols;
  };
  for (GgmlType type : kTypes) {
    for (Shape shape : {Shape{300, 512}, Shape{7, 2048}, Shape{1000, 256}, Shape{33, 64},
                        Shape{5, 8192}}) {
      if (!matvec_supports_type(type, shape.cols)) continue;
      SCOPED_TRACE(TypeName(type) + " " + std::to_string(shape.rows) + "x" +
                   std::to_string(shape.cols));
      const std::vector<uint8_t> w = RandomMatrix(rng, type, shape.rows, shape.cols);
      const std::vector<float> x = Gaussian(rng, shape.cols);
      const std::vector<block_q8_1> xq = Q8_1(x);
      const std::vector<float> bias = Gaussian(rng, shape.rows);
      std::vector<float> f32(shape.rows);
      MatMul(HostView(w.data(), type, shape.rows, shape.cols), x, absl::MakeSpan(f32));
      std::vector<float> grouped = GroupedMatvec(type, w.data(), shape.rows, shape.cols, x, xq);
      DeviceArray<uint8_t> d_w(w);
      DeviceArray<float> d_x(x), d_bias(bias), d_out(shape.rows);
      DeviceArray<block_q8_1> d_xq(xq);
      const DeviceMatrix view = DeviceView(d_w.get(), type, shape.rows, shape.cols);
      // Each type reads only its own input: the other is null.
      const float* x_in = mmvq_type(type) ? nullptr : d_x.get();
      const block_q8_1* xq_in = mmvq_type(type) ? d_xq.get() : nullptr;
      ASSERT_EQ(launch_matvec(view, x_in, xq_in, nullptr, d_out.get(), stream_), cudaSuccess);
      Sync();
      const std::vector<float> out = d_out.Download();
      EXPECT_LT(Nmse(out, grouped), 1e-10);
      EXPECT_LT(Nmse(out, f32), F32Bound(type));
      AddBias(bias, absl::MakeSpan(grouped));
      ASSERT_EQ(launch_matvec(view, x_in, xq_in, d_bias.get(), d_out.get(), stream_), cudaSuccess);
      Sync();
      EXPECT_LT(Nmse(d_out.Download(), grouped), 1e-10);
    }
  }
}

// silu(gate x) * (up x) in one launch, and the q8_1 blocks of that (made by
// the last block of each 32 rows where a block holds fewer: its tickets are
// left at zero).
TEST_F(KernelsGpuTest, MatvecSwigluPairsGateAndUpAndQuantizesTheProduct) {
  std::mt19937 rng(31);
  for (GgmlType type : {GgmlType::kQ4_K, GgmlType::kQ8_0, GgmlType::kF16}) {
    SCOPED_TRACE(TypeName(type));
    const int32_t rows = 96, cols = 512;
    const std::vector<uint8_t> gate = RandomMatrix(rng, type, rows, cols);
    const std::vector<uint8_t> up = RandomMatrix(rng, type, rows, cols);
    const std::vector<float> x = Gaussian(rng, cols);
    const std::vector<block_q8_1> xq = Q8_1(x);
    const std::vector<float> g = GroupedMatvec(type, gate.data(), rows, cols, x, xq);
    const std::vector<float> u = GroupedMatvec(type, up.data(), rows, cols, x, xq);
    std::vector<float> expected(rows);
    for (int32_t i = 0; i < rows; ++i) expected[i] = silu(g[i]) * u[i];
    DeviceArray<uint8_t> d_gate(gate), d_up(up);
    DeviceArray<float> d_x(x), d_out(rows);
    DeviceArray<block_q8_1> d_xq(xq), d_q(rows / QK8_1);
    const std::vector<unsigned int> zero_tickets(rows / QK8_1, 0);
    DeviceArray<unsigned int> d_tickets(zero_tickets);
    ASSERT_LT(matvec_geometry(type, cols).rows_per_block, kMaxRowsPerBlock);
    ASSERT_EQ(launch_matvec_swiglu(DeviceView(d_gate.get(), type, rows, cols),
                                   DeviceView(d_up.get(), type, rows, cols), d_x.get(), d_xq.get(),
                                   d_out.get(), d_q.get(), d_tickets.get(), stream_),
              cudaSuccess);
    Sync();
    const std::vector<float> out = d_out.Download();
    EXPECT_LT(Nmse(out, expected), 1e-10);
    EXPECT_TRUE(SameBlocks(d_q.Download(), Q8_1(out)));
    EXPECT_EQ(d_tickets.Download(), zero_tickets);
    // Without tickets the q8_1 output is refused where blocks hold fewer than 32 rows.
    EXPECT_EQ(launch_matvec_swiglu(DeviceView(d_gate.get(), type, rows, cols),
                                   DeviceView(d_up.get(), type, rows, cols), d_x.get(), d_xq.get(),
                                   d_out.get(), d_q.get(), nullptr, stream_),
              cudaErrorInvalidValue);
  }
}

// residual += W x, then the norm of the residual in the last block (whichever
// block that is: the emulator runs them in a random order), every launch
// leaving its ticket at zero.
TEST_F(KernelsGpuTest, MatvecResidualAddsIntoTheResidualThenRunsTheNorm) {
  std::mt19937 rng(32);
  for (GgmlType type : {GgmlType::kQ4_K, GgmlType::kQ8_0, GgmlType::kF32}) {
    SCOPED_TRACE(TypeName(type));
    const int32_t rows = 1024, cols = 512;
    const std::vector<uint8_t> w = RandomMatrix(rng, type, rows, cols);
    const std::vector<float> x = Gaussian(rng, cols);
    const std::vector<block_q8_1> xq = Q8_1(x);
    const std::vector<float> residual = Gaussian(rng, rows, 4.0f);
    const std::vector<float> weight = Gaussian(rng, rows);
    // gpt-oss's output bias, added to the product before the residual.
    const std::vector<float> bias = Gaussian(rng, rows);
    std::vector<float> expected = GroupedMatvec(type, w.data(), rows, cols, x, xq);
    for (int32_t i = 0; i < rows; ++i) expected[i] = residual[i] + (expected[i] + bias[i]);
    std::vector<float> h_expected(rows);
    RmsNorm(expected, weight, 1e-6f, absl::MakeSpan(h_expected));
    DeviceArray<uint8_t> d_w(w);
    DeviceArray<float> d_x(x), d_bias(bias), d_residual(residual), d_weight(weight), d_h(rows);
    DeviceArray<block_q8_1> d_xq(xq), d_h_q(rows / QK8_1);
    DeviceArray<unsigned int> d_tickets(std::vector<unsigned int>{0});
    NormEpilogue norm;
    norm.weight = d_weight.get();
    norm.eps = 1e-6f;
    norm.out = d_h.get();
    norm.out_q = d_h_q.get();
    ASSERT_EQ(launch_matvec_residual(DeviceView(d_w.get(), type, rows, cols),
                                     mmvq_type(type) ? nullptr : d_x.get(),
                                     mmvq_type(type) ? d_xq.get() : nullptr, d_bias.get(),
                                     d_residual.get(), norm, d_tickets.get(), stream_),
              cudaSuccess);
    Sync();
    EXPECT_LT(Nmse(d_residual.Download(), expected), 1e-12);
    const std::vector<float> h = d_h.Download();
    EXPECT_LT(Nmse(h, h_expected), 1e-7);
    EXPECT_TRUE(SameBlocks(d_h_q.Download(), Q8_1(h)));
    EXPECT_EQ(d_tickets.Download()[0], 0u);
  }
}

// attn_out's residual add and norm chained to the router in one launch
// (launch_matvec_residual_router) gives the two launches' bits: the residual,
// the norm's output and q8_1 blocks, the logits (the shared gate's row too),
// the top-k; its tickets back to zero, twice in a row. The f32 and f16
// routers normalize the residual themselves as they read it (router block 0
// writing the norm's output); the q8_0 router reads the q8_1 blocks that
// attn_out's last block makes.
TEST_F(KernelsGpuTest, TheResidualChainedToTheRouterGivesTheTwoLaunchesBits) {
  std::mt19937 rng(33);
  for (auto [type, router_type] : {std::pair{GgmlType::kQ4_K, GgmlType::kF32},
                                   std::pair{GgmlType::kQ8_0, GgmlType::kQ8_0},
                                   std::pair{GgmlType::kF32, GgmlType::kF16}}) {
    SCOPED_TRACE(TypeName(type) + "/" + TypeName(router_type));
    const int32_t n_embd = 512, cols = 1024, n_expert = 60, k = 4;
    const DeviceArray<uint8_t> d_w(RandomMatrix(rng, type, n_embd, cols));
    const DeviceArray<uint8_t> d_router_w(RandomMatrix(rng, router_type, n_expert + 1, n_embd));
    const DeviceMatrix w = DeviceView(d_w.get(), type, n_embd, cols);
    const DeviceMatrix router_w = DeviceView(d_router_w.get(), router_type, n_expert + 1, n_embd);
    const std::vector<float> x = Gaussian(rng, cols), bias = Gaussian(rng, n_embd),
                             residual = Gaussian(rng, n_embd, 4.0f),
                             weight = Gaussian(rng, n_embd);
    const DeviceArray<float> d_x(x), d_bias(bias), d_weight(weight);
    const DeviceArray<block_q8_1> d_xq(Q8_1(x));
    const std::vector<unsigned int> zero_tickets(step_tickets(n_embd, 1, 1, 32), 0);
    DeviceArray<unsigned int> d_tickets(zero_tickets);
    DeviceArray<DeviceCounters> d_counters(std::vector<DeviceCounters>{DeviceCounters{}});
    // One run's outputs.
    struct Out {
      Out(const std::vector<float>& residual, int32_t n_embd, int32_t n_logits, int32_t k)
          : residual(residual), h(n_embd), logits(n_logits), weights(k), h_q(n_embd / QK8_1),
            experts(k) {}
      DeviceArray<float> residual, h, logits, weights;
      DeviceArray<block_q8_1> h_q;
      DeviceArray<int32_t> experts;
    };
    const auto norm_of = [&](Out& o) {
      NormEpilogue norm;
      norm.weight = d_weight.get();
      norm.eps = 1e-6f;
      norm.out = o.h.get();
      norm.out_q = o.h_q.get();
      return norm;
    };
    const auto router_of = [&](Out& o) {
      RouterEpilogue router;
      router.k = k;
      router.norm_topk = true;
      router.experts = o.experts.get();
      router.weights = o.weights.get();
      router.shared_gate_row = true;
      return router;
    };
    const float* in_x = mmvq_type(type) ? nullptr : d_x.get();
    const block_q8_1* in_xq = mmvq_type(type) ? d_xq.get() : nullptr;
    Out two(residual, n_embd, n_expert + 1, k);
    ASSERT_EQ(launch_matvec_residual(w, in_x, in_xq, d_bias.get(), two.residual.get(),
                                     norm_of(two), d_tickets.get(), stream_),
              cudaSuccess);
    ASSERT_EQ(launch_router(router_w, two.h.get(), two.h_q.get(), two.logits.get(),
                            router_of(two), d_tickets.get(), stream_),
              cudaSuccess);
    for (int run = 0; run < 2; ++run) {
      Out one(residual, n_embd, n_expert + 1, k);
      ASSERT_EQ(launch_matvec_residual_router(w, in_x, in_xq, d_bias.get(), one.residual.get(),
                                              norm_of(one), router_w, one.logits.get(),
                                              router_of(one), d_counters.get(), d_tickets.get(),
                                              stream_),
                cudaSuccess);
      Sync();
      EXPECT_EQ(d_tickets.Download(), zero_tickets);
      EXPECT_EQ(d_counters.Download()[0].chained_launches, static_cast<uint64_t>(run + 1));
      EXPECT_EQ(one.residual.Download(), two.residual.Download());
      EXPECT_EQ(one.h.Download(), two.h.Download());
      EXPECT_TRUE(SameBlocks(one.h_q.Download(), two.h_q.Download()));
      EXPECT_EQ(one.logits.Download(), two.logits.Download());
      EXPECT_EQ(one.experts.Download(), two.experts.Download());
      EXPECT_EQ(one.weights.Download(), two.weights.Download());
    }
    // The router reads the norm's output: without one there is nothing to chain.
    Out bad(residual, n_embd, n_expert + 1, k);
    NormEpilogue no_norm;
    EXPECT_EQ(launch_matvec_residual_router(w, in_x, in_xq, d_bias.get(), bad.residual.get(),
                                            no_norm, router_w, bad.logits.get(), router_of(bad),
                                            d_counters.get(), d_tickets.get(), stream_),
              cudaErrorInvalidValue);
  }
}

// q, k and v of different types in one launch equal three launches of each,
// for every type the launch takes; mxfp4 it refuses.
TEST_F(KernelsGpuTest, QkvIsThreeMatvecsInOneLaunch) {
  std::mt19937 rng(33);
  const int32_t cols = 512;
  const int32_t rows[3] = {512, 128, 128};
  using Types = std::array<GgmlType, 3>;
  for (const Types& types : {Types{GgmlType::kQ4_K, GgmlType::kQ8_0, GgmlType::kQ6_K},
                             Types{GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1},
                             Types{GgmlType::kQ2_K, GgmlType::kQ3_K, GgmlType::kIQ4_NL},
                             Types{GgmlType::kIQ4_XS, GgmlType::kF16, GgmlType::kQ4_0},
                             Types{GgmlType::kQ5_K, GgmlType::kBF16, GgmlType::kF32}}) {
    SCOPED_TRACE(TypeName(types[0]) + " " + TypeName(types[1]) + " " + TypeName(types[2]));
    std::vector<std::vector<uint8_t>> w;
    std::vector<std::vector<float>> bias;
    for (int j = 0; j < 3; ++j) {
      w.push_back(RandomMatrix(rng, types[j], rows[j], cols));
      bias.push_back(Gaussian(rng, rows[j]));
    }
    const std::vector<float> x = Gaussian(rng, cols);
    DeviceArray<uint8_t> d_wq(w[0]), d_wk(w[1]), d_wv(w[2]);
    DeviceArray<float> d_bq(bias[0]), d_bk(bias[1]), d_bv(bias[2]);
    DeviceArray<float> d_x(x), d_q(rows[0]), d_k(rows[1]), d_v(rows[2]);
    DeviceArray<block_q8_1> d_xq(Q8_1(x));
    const DeviceMatrix wq = DeviceView(d_wq.get(), types[0], rows[0], cols);
    const DeviceMatrix wk = DeviceView(d_wk.get(), types[1], rows[1], cols);
    const DeviceMatrix wv = DeviceView(d_wv.get(), types[2], rows[2], cols);
    ASSERT_EQ(launch_qkv(wq, wk, wv, d_x.get(), d_xq.get(), d_bq.get(), d_bk.get(), d_bv.get(),
                         d_q.get(), d_k.get(), d_v.get(), nullptr, NormEpilogue{}, nullptr,
                         stream_),
              cudaSuccess);
    Sync();
    const std::vector<float> fused[3] = {d_q.Download(), d_k.Download(), d_v.Download()};
    const DeviceMatrix* views[3] = {&wq, &wk, &wv};
    const float* biases[3] = {d_bq.get(), d_bk.get(), d_bv.get()};
    for (int j = 0; j < 3; ++j) {
      DeviceArray<float> d_out(rows[j]);
      ASSERT_EQ(launch_matvec(*views[j], d_x.get(), d_xq.get(), biases[j], d_out.get(), stream_),
                cudaSuccess);
      Sync();
      EXPECT_EQ(fused[j], d_out.Download()) << "matrix " << j;
    }
    // A matrix of other columns than q's.
    const DeviceMatrix narrow = DeviceView(d_wk.get(), types[1], rows[1] * 2, cols / 2);
    EXPECT_EQ(launch_qkv(wq, narrow, wv, d_x.get(), d_xq.get(), nullptr, nullptr, nullptr,
                         d_q.get(), d_k.get(), d_v.get(), nullptr, NormEpilogue{}, nullptr,
                         stream_),
              cudaErrorInvalidValue);
  }
  const std::vector<uint8_t> w4 = RandomMatrix(rng, GgmlType::kMXFP4, 128, cols);
  DeviceArray<uint8_t> d_w4(w4);
  DeviceArray<float> d_x(Gaussian(rng, cols)), d_out(512);
  DeviceArray<block_q8_1> d_xq(cols / QK8_1);
  const DeviceMatrix mxfp4 = DeviceView(d_w4.get(), GgmlType::kMXFP4, 128, cols);
  EXPECT_TRUE(matvec_supports_type(GgmlType::kMXFP4, cols));
  EXPECT_FALSE(qkv_supports_type(GgmlType::kMXFP4, cols));
  EXPECT_EQ(launch_qkv(mxfp4, mxfp4, mxfp4, d_x.get(), d_xq.get(), nullptr, nullptr, nullptr,
                       d_out.get(), d_out.get(), d_out.get(), nullptr, NormEpilogue{}, nullptr,
                       stream_),
            cudaErrorInvalidValue);
}

// A Gated DeltaNet's four projections (qkv, z, alpha, beta: Qwen3.5's rows
// but narrower) in one launch are four matvecs bit for bit, whatever their
// types; a job list of none, or of more than kMaxProjections, is refused.
TEST_F(KernelsGpuTest, ProjectionsAreUpToFourMatvecsInOneLaunch) {
  std::mt19937 rng(34);
  const int32_t cols = 256;
  const int32_t rows[4] = {384, 128, 4, 4};
  using Types = std::array<GgmlType, 4>;
  for (const Types& types :
       {Types{GgmlType::kQ8_0, GgmlType::kQ4_K, GgmlType::kF32, GgmlType::kF16},
        Types{GgmlType::kQ6_K, GgmlType::kQ5_K, GgmlType::kQ8_0, GgmlType::kBF16}}) {
    SCOPED_TRACE(TypeName(types[0]) + " " + TypeName(types[1]) + " " + TypeName(types[2]) + " " +
                 TypeName(types[3]));
    std::vector<std::unique_ptr<DeviceArray<uint8_t>>> w;
    std::vector<std::unique_ptr<DeviceArray<float>>> out;
    std::vector<DeviceMatrix> views;
    for (int j = 0; j < 4; ++j) {
      w.push_back(std::make_unique<DeviceArray<uint8_t>>(RandomMatrix(rng, types[j], rows[j], cols)));
      out.push_back(std::make_unique<DeviceArray<float>>(rows[j]));
      views.push_back(DeviceView(w[j]->get(), types[j], rows[j], cols));
    }
    const std::vector<float> x = Gaussian(rng, cols);
    DeviceArray<float> d_x(x);
    DeviceArray<block_q8_1> d_xq(Q8_1(x));
    Projection jobs[kMaxProjections + 1];
    for (int j = 0; j < 4; ++j) jobs[j] = {&views[j], nullptr, out[j]->get()};
    ASSERT_EQ(launch_projections(jobs, 4, d_x.get(), d_xq.get(), NormEpilogue{}, nullptr, stream_),
              cudaSuccess);
    Sync();
    for (int j = 0; j < 4; ++j) {
      DeviceArray<float> d_one(rows[j]);
      ASSERT_EQ(launch_matvec(views[j], d_x.get(), d_xq.get(), nullptr, d_one.get(), stream_),
                cudaSuccess);
      Sync();
      EXPECT_EQ(out[j]->Download(), d_one.Download()) << "matrix " << j;
    }
    jobs[4] = jobs[0];
    EXPECT_EQ(launch_projections(jobs, 5, d_x.get(), d_xq.get(), NormEpilogue{}, nullptr, stream_),
              cudaErrorInvalidValue);
    EXPECT_EQ(launch_projections(jobs, 0, d_x.get(), d_xq.get(), NormEpilogue{}, nullptr, stream_),
              cudaErrorInvalidValue);
  }
}

// The layer's attn_norm run by the projections' own launch (input_norm: its
// first blocks write the norm, the others wait for them) gives the bits of a
// single-block norm (launch_rmsnorm_row, the combine's) and then the launch on
// its output: the norm's out and q8_1 blocks, q, k, q_out after the QK-norm and
// RoPE, the k and v cache rows; quant and element types, the last norm block
// a partial one (cols 640: 5 blocks of 128); twice in a row, its counts and the
// rope's left zero. The DeltaNet's four projections likewise. Refused: a norm
// without tickets, or one written over the residual it reads.
TEST_F(KernelsGpuTest, TheProjectionsLaunchNormalizesItsInputFirst) {
  std::mt19937 rng(41);
  const int32_t n_head = 4, n_head_kv = 2, head_dim = 64, pos = 2;
  const int32_t q_len = n_head * head_dim, kv_len = n_head_kv * head_dim;
  const float eps = 1e-6f;
  using Types = std::array<GgmlType, 3>;
  for (const Types& types : {Types{GgmlType::kQ4_0, GgmlType::kQ8_0, GgmlType::kQ5_1},
                             Types{GgmlType::kF32, GgmlType::kF16, GgmlType::kBF16},
                             Types{GgmlType::kQ4_K, GgmlType::kF32, GgmlType::kQ6_K}}) {
    SCOPED_TRACE(TypeName(types[0]) + " " + TypeName(types[1]) + " " + TypeName(types[2]));
    const int32_t cols = types[0] == GgmlType::kQ4_K ? 768 : 640;
    DeviceArray<uint8_t> d_wq(RandomMatrix(rng, types[0], q_len, cols));
    DeviceArray<uint8_t> d_wk(RandomMatrix(rng, types[1], kv_len, cols));
    DeviceArray<uint8_t> d_wv(RandomMatrix(rng, types[2], kv_len, cols));
    const DeviceMatrix wq = DeviceView(d_wq.get(), types[0], q_len, cols);
    const DeviceMatrix wk = DeviceView(d_wk.get(), types[1], kv_len, cols);
    const DeviceMatrix wv = DeviceView(d_wv.get(), types[2], kv_len, cols);
    DeviceArray<float> d_residual(Gaussian(rng, cols)), d_norm_w(Gaussian(rng, cols));
    DeviceArray<float> d_q_norm(Gaussian(rng, head_dim)), d_k_norm(Gaussian(rng, head_dim));
    DeviceArray<float> d_cos_sin(RopeTableRow(head_dim, 1e6f, RopeYarn{}, pos));
    DeviceArray<int32_t> d_pos(std::vector<int32_t>{pos});
    const std::vector<unsigned int> zero_tickets(n_head + n_head_kv + 3, 0);
    DeviceArray<unsigned int> d_tickets(zero_tickets);
    const std::vector<float> cache((pos + 1) * kv_len, 7.0f);
    struct Run {
      Run(int32_t cols, int32_t q_len, int32_t kv_len, const std::vector<float>& cache)
          : h(cols), q(q_len), k(kv_len), q_out(q_len), k_cache(cache),
            v_cache(cache), h_q(cols / QK8_1) {}
      DeviceArray<float> h, q, k, q_out, k_cache, v_cache;
      DeviceArray<block_q8_1> h_q;
    };
    auto norm_of = [&](Run& r) {
      NormEpilogue norm;
      norm.weight = d_norm_w.get();
      norm.eps = eps;
      norm.out = r.h.get();
      norm.out_q = r.h_q.get();
      return norm;
    };
    auto rope_of = [&](Run& r) {
      QkvRope rope = HeadsRope(d_pos.get(), n_head, n_head_kv, head_dim, d_cos_sin.get());
      rope.use_norm = true;
      rope.norm.q_weight = d_q_norm.get();
      rope.norm.k_weight = d_k_norm.get();
      rope.norm.eps = eps;
      rope.q_out = r.q_out.get();
      rope.k_cache = r.k_cache.get();
      rope.v_cache = r.v_cache.get();
      return rope;
    };
    Run two(cols, q_len, kv_len, cache);
    ASSERT_EQ(launch_rmsnorm_row(d_residual.get(), cols, norm_of(two), stream_), cudaSuccess);
    const QkvRope two_rope = rope_of(two);
    ASSERT_EQ(launch_qkv(wq, wk, wv, two.h.get(), two.h_q.get(), nullptr, nullptr, nullptr,
                         two.q.get(), two.k.get(), nullptr, &two_rope, NormEpilogue{},
                         d_tickets.get(), stream_),
              cudaSuccess);
    for (int run = 0; run < 2; ++run) {
      Run one(cols, q_len, kv_len, cache);
      const QkvRope one_rope = rope_of(one);
      ASSERT_EQ(launch_qkv(wq, wk, wv, d_residual.get(), nullptr, nullptr, nullptr, nullptr,
                           one.q.get(), one.k.get(), nullptr, &one_rope, norm_of(one),
                           d_tickets.get(), stream_),
                cudaSuccess);
      Sync();
      EXPECT_EQ(d_tickets.Download(), zero_tickets);
      EXPECT_EQ(one.h.Download(), two.h.Download());
      EXPECT_TRUE(SameBlocks(one.h_q.Download(), two.h_q.Download()));
      EXPECT_EQ(one.q.Download(), two.q.Download());
      EXPECT_EQ(one.k.Download(), two.k.Download());
      EXPECT_EQ(one.q_out.Download(), two.q_out.Download());
      EXPECT_EQ(one.k_cache.Download(), two.k_cache.Download());
      EXPECT_EQ(one.v_cache.Download(), two.v_cache.Download());
    }
    Run bad(cols, q_len, kv_len, cache);
    const QkvRope bad_rope = rope_of(bad);
    EXPECT_EQ(launch_qkv(wq, wk, wv, d_residual.get(), nullptr, nullptr, nullptr, nullptr,
                         bad.q.get(), bad.k.get(), nullptr, &bad_rope, norm_of(bad), nullptr,
                         stream_),
              cudaErrorInvalidValue);
    NormEpilogue over_residual = norm_of(bad);
    over_residual.out = d_residual.get();
    EXPECT_EQ(launch_qkv(wq, wk, wv, d_residual.get(), nullptr, nullptr, nullptr, nullptr,
                         bad.q.get(), bad.k.get(), nullptr, &bad_rope, over_residual,
                         d_tickets.get(), stream_),
              cudaErrorInvalidValue);

    // The DeltaNet's projections: q's, k's and v's matrices and a fourth.
    std::vector<std::unique_ptr<DeviceArray<float>>> outs[2];
    Run norms[2] = {Run(cols, q_len, kv_len, cache), Run(cols, q_len, kv_len, cache)};
    const DeviceMatrix* views[4] = {&wq, &wk, &wv, &wk};
    Projection jobs[2][4];
    for (int r = 0; r < 2; ++r) {
      for (int j = 0; j < 4; ++j) {
        outs[r].push_back(std::make_unique<DeviceArray<float>>(views[j]->rows));
        jobs[r][j] = {views[j], nullptr, outs[r][j]->get()};
      }
    }
    ASSERT_EQ(launch_rmsnorm_row(d_residual.get(), cols, norm_of(norms[1]), stream_), cudaSuccess);
    ASSERT_EQ(launch_projections(jobs[1], 4, norms[1].h.get(), norms[1].h_q.get(), NormEpilogue{},
                                 nullptr, stream_),
              cudaSuccess);
    ASSERT_EQ(launch_projections(jobs[0], 4, d_residual.get(), nullptr, norm_of(norms[0]),
                                 d_tickets.get(), stream_),
              cudaSuccess);
    Sync();
    EXPECT_EQ(d_tickets.Download(), zero_tickets);
    EXPECT_EQ(norms[0].h.Download(), norms[1].h.Download());
    for (int j = 0; j < 4; ++j) {
      EXPECT_EQ(outs[0][j]->Download(), outs[1][j]->Download()) << "matrix " << j;
    }
    EXPECT_EQ(launch_projections(jobs[0], 4, d_residual.get(), nullptr, norm_of(norms[0]),
                                 nullptr, stream_),
              cudaErrorInvalidValue);
  }
}

// q, k and v with the epilogue of each head: without a QK-norm, per head
// (qwen3moe) and over all of q and k (olmoe), then RoPE, against the host's
// matvecs, RmsNorm and Rope; v lands in the cache row, every other row is left
// alone, and so are the q and k projections.
TEST_F(KernelsGpuTest, QkvRunsQkNormRopeAndTheKvAppendPerHead) {
  std::mt19937 rng(4);
  const int32_t n_head = 6, n_head_kv = 2, cols = 256;
  const GgmlType type = GgmlType::kQ8_0;
  enum class Norm { kNone, kPerHead, kFull };
  for (Norm norm_mode : {Norm::kNone, Norm::kPerHead, Norm::kFull}) {
    for (RopeType rope_type : {RopeType::kNorm, RopeType::kNeox}) {
      // f16 caches with the per-head norm: the rows written are the f32 ones rounded.
      const bool kv_f16 = norm_mode == Norm::kPerHead && rope_type == RopeType::kNeox;
      // 16 and 48: heads that share a block of 32 rows.
      for (int32_t head_dim : {16, 48, 64, 256}) {
        for (int32_t pos : {0, 3, 32767}) {
          SCOPED_TRACE("norm " + std::to_string(static_cast<int>(norm_mode)) + " head_dim " +
                       std::to_string(head_dim) + " pos " + std::to_string(pos));
          const int32_t q_len = n_head * head_dim, kv_len = n_head_kv * head_dim;
          const int64_t max_ctx = pos + 2;
          const std::vector<uint8_t> wq = RandomMatrix(rng, type, q_len, cols);
          const std::vector<uint8_t> wk = RandomMatrix(rng, type, kv_len, cols);
          const std::vector<uint8_t> wv = RandomMatrix(rng, type, kv_len, cols);
          const std::vector<float> x = Gaussian(rng, cols);
          const std::vector<block_q8_1> xq = Q8_1(x);
          const bool full = norm_mode == Norm::kFull;
          const std::vector<float> q_weight = Gaussian(rng, full ? q_len : head_dim);
          const std::vector<float> k_weight = Gaussian(rng, full ? kv_len : head_dim);
          std::vector<float> k_cache(max_ctx * kv_len, 7.0f), v_cache(max_ctx * kv_len, 8.0f);
          DeviceArray<uint8_t> d_wq(wq), d_wk(wk), d_wv(wv);
          DeviceArray<float> d_x(x), d_q(q_len), d_k(kv_len), d_q_out(q_len);
          DeviceArray<float> d_k_cache(k_cache), d_v_cache(v_cache);
          const std::vector<uint16_t> k_half(k_cache.size(), f32_to_f16(7.0f));
          const std::vector<uint16_t> v_half(v_cache.size(), f32_to_f16(8.0f));
          DeviceArray<uint16_t> d_k_half(k_half), d_v_half(v_half);
          DeviceArray<float> d_q_weight(q_weight), d_k_weight(k_weight);
          DeviceArray<block_q8_1> d_xq(xq);
          DeviceArray<int32_t> d_pos(std::vector<int32_t>{pos});
          const std::vector<unsigned int> zero_tickets(n_head + n_head_kv, 0);
          DeviceArray<unsigned int> d_tickets(zero_tickets);
          DeviceArray<float> d_cos_sin(RopeTableRow(head_dim, 1e6f, RopeYarn{}, pos));
          QkvRope rope = HeadsRope(d_pos.get(), n_head, n_head_kv, head_dim, d_cos_sin.get());
          rope.rope_type = rope_type == RopeType::kNorm ? kRopeNorm : kRopeNeox;
          rope.use_norm = norm_mode != Norm::kNone;
          rope.norm.q_weight = d_q_weight.get();
          rope.norm.k_weight = d_k_weight.get();
          rope.norm.eps = 1e-6f;
          rope.norm.full = full;
          rope.q_out = d_q_out.get();
          rope.kv_f16 = kv_f16;
          rope.k_cache = kv_f16 ? static_cast<void*>(d_k_half.get()) : d_k_cache.get();
          rope.v_cache = kv_f16 ? static_cast<void*>(d_v_half.get()) : d_v_cache.get();
          ASSERT_EQ(launch_qkv(DeviceView(d_wq.get(), type, q_len, cols),
                               DeviceView(d_wk.get(), type, kv_len, cols),
                               DeviceView(d_wv.get(), type, kv_len, cols), nullptr, d_xq.get(),
                               nullptr, nullptr, nullptr, d_q.get(), d_k.get(), nullptr, &rope,
                               NormEpilogue{}, d_tickets.get(), stream_),
                    cudaSuccess);
          Sync();
          EXPECT_EQ(d_tickets.Download(), zero_tickets);
          const std::vector<float> q0 = GroupedMatvec(type, wq.data(), q_len, cols, x, xq);
          const std::vector<float> k0 = GroupedMatvec(type, wk.data(), kv_len, cols, x, xq);
          const std::vector<float> v0 = GroupedMatvec(type, wv.data(), kv_len, cols, x, xq);
          std::vector<float> v0_expected = v0;
          EXPECT_LT(Nmse(d_q.Download(), q0), 1e-10);  // the projections stay
          EXPECT_LT(Nmse(d_k.Download(), k0), 1e-10);
          std::vector<float> q = q0, k = k0;
          if (norm_mode != Norm::kNone) {
            RmsNorm(q0, q_weight, 1e-6f, absl::MakeSpan(q));
            RmsNorm(k0, k_weight, 1e-6f, absl::MakeSpan(k));
          }
          const int32_t positions[] = {pos};
          Rope(absl::MakeSpan(q), n_head, head_dim, positions, 1e6f, rope_type);
          Rope(absl::MakeSpan(k), n_head_kv, head_dim, positions, 1e6f, rope_type);
          EXPECT_LT(Nmse(d_q_out.Download(), q), 1e-10);
          // The caches as f32 (the f16 ones widened), and the reference rows rounded
          // to f16 and back.
          std::vector<float> k_out = d_k_cache.Download(), v_out = d_v_cache.Download();
          if (kv_f16) {
            const std::vector<uint16_t> k_bits = d_k_half.Download(), v_bits = d_v_half.Download();
            for (size_t i = 0; i < k_out.size(); ++i) {
              k_out[i] = f16_to_f32(k_bits[i]);
              v_out[i] = f16_to_f32(v_bits[i]);
            }
            for (float& value : k) value = f16_to_f32(f32_to_f16(value));
            std::vector<float> v_rounded = v0;
            for (float& value : v_rounded) value = f16_to_f32(f32_to_f16(value));
            v0_expected = v_rounded;
          }
          const std::vector<float> k_row(k_out.begin() + pos * kv_len,
                                         k_out.begin() + (pos + 1) * kv_len);
          const std::vector<float> v_row(v_out.begin() + pos * kv_len,
                                         v_out.begin() + (pos + 1) * kv_len);
          // f16: a value next to a rounding boundary may round the other way.
          const double cache_bound = kv_f16 ? 1e-6 : 1e-10;
          EXPECT_LT(Nmse(k_row, k), cache_bound);
          EXPECT_LT(Nmse(v_row, v0_expected), cache_bound);
          std::copy(k_row.begin(), k_row.end(), k_cache.begin() + pos * kv_len);
          std::copy(v_row.begin(), v_row.end(), v_cache.begin() + pos * kv_len);
          EXPECT_EQ(k_out, k_cache);  // every other row as it was
          EXPECT_EQ(v_out, v_cache);
        }
      }
    }
  }
}

std::vector<uint32_t> Bits(const std::vector<float>& values) {
  std::vector<uint32_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) bits[i] = f32_to_bits(values[i]);
  return bits;
}

// A random KV cache of n elements a side on the device, f16 bits (kv_f16) or
// f32; k and v hold the values the reference reads (the f16 ones widened).
struct RandomKvCache {
  RandomKvCache(std::mt19937& rng, size_t n, bool kv_f16)
      : k(Gaussian(rng, n)), v(Gaussian(rng, n)), f16(kv_f16) {
    std::vector<uint16_t> k_half(n), v_half(n);
    for (size_t i = 0; i < n; ++i) {
      k_half[i] = f32_to_f16(k[i]);
      v_half[i] = f32_to_f16(v[i]);
      if (kv_f16) {
        k[i] = f16_to_f32(k_half[i]);
        v[i] = f16_to_f32(v_half[i]);
      }
    }
    if (kv_f16) {
      k_f16 = std::make_unique<DeviceArray<uint16_t>>(k_half);
      v_f16 = std::make_unique<DeviceArray<uint16_t>>(v_half);
    } else {
      k_f32 = std::make_unique<DeviceArray<float>>(k);
      v_f32 = std::make_unique<DeviceArray<float>>(v);
    }
  }
  const void* k_in() const { return f16 ? static_cast<const void*>(k_f16->get()) : k_f32->get(); }
  const void* v_in() const { return f16 ? static_cast<const void*>(v_f16->get()) : v_f32->get(); }

  std::vector<float> k, v;
  bool f16;
  std::unique_ptr<DeviceArray<float>> k_f32, v_f32;
  std::unique_ptr<DeviceArray<uint16_t>> k_f16, v_f16;
};

// An attention test's shape: head_dim, query heads, KV heads.
struct AttentionHeads {
  int32_t head_dim, n_head, n_head_kv;
};

// f32 and f16 caches (the reference reads the f16 values widened back), every
// length's splits and merge; on 64-wide heads also gpt-oss's masks: a window of
// 100 (from length 200 its first split starts mid-split and the one before it
// does not run) with sinks, and a window of 5 alone.
TEST_F(KernelsGpuTest, AttentionMatchesReferenceAtEveryLength) {
  std::mt19937 rng(6);
  // 16: heads narrower than a q8_1 block, quantized by the last column merged;
  // 24: f16 values in 3-lane groups, 128 threads not a multiple of them; 256:
  // the widest head, a full warp of 8-dimension lanes per group, and 8 of them
  // in one block (every element a thread holds). GQA groups of 4 (one block a
  // KV head), 8 (the most one block serves), 9 (two blocks of 5 and 4 heads),
  // 1 (no sharing).
  for (const AttentionHeads& hc : std::vector<AttentionHeads>{
           {64, 8, 2}, {64, 16, 2}, {64, 9, 1}, {64, 3, 3}, {16, 8, 2}, {24, 4, 2}, {256, 8, 2},
           {256, 8, 1}}) {
    for (bool kv_f16 : {false, true}) {
      const int32_t head_dim = hc.head_dim, n_head = hc.n_head, n_head_kv = hc.n_head_kv;
      SCOPED_TRACE("head_dim " + std::to_string(head_dim) + " heads " + std::to_string(n_head) +
                   "/" + std::to_string(n_head_kv) + (kv_f16 ? " f16" : " f32"));
      const int32_t max_ctx = 300;
      const int32_t kv_len = n_head_kv * head_dim;
      const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
      const RandomKvCache cache(rng, max_ctx * kv_len, kv_f16);
      const std::vector<float>& k_cache = cache.k;
      const std::vector<float>& v_cache = cache.v;
      const void* k_in = cache.k_in();
      const void* v_in = cache.v_in();
      DeviceArray<float> d_partial(attention_partial_floats(n_head, head_dim, max_ctx));
      DeviceArray<float> d_out(n_head * head_dim);
      const std::vector<unsigned int> zero_tickets(n_head + 1, 0);
      DeviceArray<unsigned int> d_tickets(zero_tickets);
      const std::vector<float> sinks = Gaussian(rng, n_head, 2.0f);
      DeviceArray<float> d_sinks(sinks);
      struct MaskCase {
        int32_t window;
        bool sinks;
      };
      std::vector<MaskCase> masks = {{0, false}};
      if (head_dim == 64 && n_head == 8) masks.insert(masks.end(), {{100, true}, {5, false}});
      if (head_dim == 64 && n_head == 9) masks.push_back({100, true});
      for (const MaskCase& m : masks) {
        AttentionMask mask;
        mask.window = m.window;
        mask.sinks = m.sinks ? d_sinks.get() : nullptr;
        // 1, a split boundary and one past it, the middle of a split, and max_ctx.
        for (int32_t length : {1, 2, 128, 129, 200, max_ctx}) {
          SCOPED_TRACE("length " + std::to_string(length) + " window " + std::to_string(m.window) +
                       (m.sinks ? " sinks" : ""));
          const std::vector<float> q = Gaussian(rng, n_head * head_dim, 2.0f);
          DeviceArray<float> d_q(q);
          DeviceArray<int32_t> d_pos(std::vector<int32_t>{length - 1});
          DeviceArray<block_q8_1> d_out_q(n_head * head_dim / QK8_1);
          ASSERT_EQ(
              launch_attention_decode(d_q.get(), k_in, v_in, kv_f16, d_pos.get(), n_head, n_head_kv,
                                      head_dim, max_ctx, scale, mask, d_partial.get(),
                                      d_tickets.get(), d_out.get(), d_out_q.get(), stream_),
              cudaSuccess);
          Sync();
          EXPECT_EQ(d_tickets.Download(), zero_tickets);  // each epilogue ran once, reset
          std::vector<float> expected(q.size());
          const int32_t q_pos[] = {length - 1};
          Attention(q, q_pos, k_cache, v_cache, n_head, n_head_kv, head_dim, scale,
                    absl::MakeSpan(expected), m.window,
                    m.sinks ? absl::MakeConstSpan(sinks) : absl::Span<const float>());
          const std::vector<float> out = d_out.Download();
          EXPECT_LT(Nmse(out, expected), 1e-7);
          EXPECT_TRUE(SameBlocks(d_out_q.Download(), Q8_1(out)));
        }
      }
    }
  }
}

// A ubatch's row ops: 5 rows at positions 3..7 QK-normed (per head and
// full-width), rotated (with gpt-oss's YaRN where normed per head) and appended
// to f32 and f16 caches as the reference does it row by row; rows normed into
// f16 for the GEMMs.
TEST_F(KernelsGpuTest, PrefillRowsAreNormedRotatedAndAppendedAsTheReference) {
  std::mt19937 rng(8);
  const int32_t n_head = 4, n_head_kv = 2, head_dim = 32, tokens = 5, pos0 = 3, max_ctx = 16;
  const int32_t q_len = n_head * head_dim, kv_len = n_head_kv * head_dim;
  enum class Norm { kNone, kPerHead, kFull };
  for (Norm norm_mode : {Norm::kNone, Norm::kPerHead, Norm::kFull}) {
    for (bool kv_f16 : {false, true}) {
      SCOPED_TRACE("norm " + std::to_string(static_cast<int>(norm_mode)) +
                   (kv_f16 ? " f16" : " f32"));
      const bool full = norm_mode == Norm::kFull;
      const std::vector<float> q = Gaussian(rng, tokens * q_len),
                               k = Gaussian(rng, tokens * kv_len),
                               v = Gaussian(rng, tokens * kv_len);
      const std::vector<float> q_weight = Gaussian(rng, full ? q_len : head_dim);
      const std::vector<float> k_weight = Gaussian(rng, full ? kv_len : head_dim);
      DeviceArray<float> d_q(q), d_k(k), d_v(v), d_q_out(tokens * q_len);
      DeviceArray<float> d_q_weight(q_weight), d_k_weight(k_weight);
      DeviceArray<float> d_k_cache(std::vector<float>(max_ctx * kv_len, 7.0f)),
          d_v_cache(std::vector<float>(max_ctx * kv_len, 8.0f));
      DeviceArray<uint16_t> d_k_half(max_ctx * kv_len), d_v_half(max_ctx * kv_len);
      DeviceArray<int32_t> d_pos(std::vector<int32_t>{pos0});
      QkvRope rope;
      rope.pos = d_pos.get();
      rope.n_head = n_head;
      rope.n_head_kv = n_head_kv;
      rope.head_dim = head_dim;
      RopeScaling scaling;
      if (norm_mode == Norm::kPerHead) {
        scaling.freq_scale = 1.0f / 32.0f;
        scaling.ext_factor = 1.0f;
        scaling.n_ctx_orig = 4096;
      }
      std::vector<float> cos_sin(rope_table_floats(head_dim, max_ctx));
      fill_rope_table(head_dim, 1e6f, YarnOf(scaling, head_dim, 1e6f), max_ctx, cos_sin.data());
      DeviceArray<float> d_cos_sin(cos_sin);
      rope.cos_sin = d_cos_sin.get();
      rope.rope_type = kRopeNeox;
      rope.use_norm = norm_mode != Norm::kNone;
      rope.norm.q_weight = d_q_weight.get();
      rope.norm.k_weight = d_k_weight.get();
      rope.norm.eps = 1e-6f;
      rope.norm.full = full;
      rope.q_out = d_q_out.get();
      rope.kv_f16 = kv_f16;
      rope.k_cache = kv_f16 ? static_cast<void*>(d_k_half.get()) : d_k_cache.get();
      rope.v_cache = kv_f16 ? static_cast<void*>(d_v_half.get()) : d_v_cache.get();
      ASSERT_EQ(launch_rope_append_rows(d_q.get(), d_k.get(), d_v.get(), tokens, rope, stream_),
                cudaSuccess);
      Sync();

      std::vector<float> q_expected = q, k_expected = k;
      std::vector<int32_t> positions(tokens);
      for (int32_t t = 0; t < tokens; ++t) {
        positions[t] = pos0 + t;
        if (norm_mode == Norm::kNone) continue;
        const auto q_row = absl::MakeConstSpan(q).subspan(t * q_len, q_len);
        const auto k_row = absl::MakeConstSpan(k).subspan(t * kv_len, kv_len);
        RmsNorm(q_row, q_weight, 1e-6f, absl::MakeSpan(q_expected).subspan(t * q_len, q_len));
        RmsNorm(k_row, k_weight, 1e-6f, absl::MakeSpan(k_expected).subspan(t * kv_len, kv_len));
      }
      Rope(absl::MakeSpan(q_expected), n_head, head_dim, positions, 1e6f, RopeType::kNeox, scaling);
      Rope(absl::MakeSpan(k_expected), n_head_kv, head_dim, positions, 1e6f, RopeType::kNeox,
           scaling);
      EXPECT_LT(Nmse(d_q_out.Download(), q_expected), 1e-10);
      std::vector<float> k_rows(tokens * kv_len), v_rows(tokens * kv_len);
      if (kv_f16) {
        const std::vector<uint16_t> kh = d_k_half.Download(), vh = d_v_half.Download();
        for (int32_t i = 0; i < tokens * kv_len; ++i) {
          k_rows[i] = f16_to_f32(kh[pos0 * kv_len + i]);
          v_rows[i] = f16_to_f32(vh[pos0 * kv_len + i]);
          EXPECT_EQ(vh[pos0 * kv_len + i], f32_to_f16(v[i]));
        }
        EXPECT_LT(Nmse(k_rows, k_expected), 1e-6);
      } else {
        const std::vector<float> kc = d_k_cache.Download(), vc = d_v_cache.Download();
        for (int32_t i = 0; i < tokens * kv_len; ++i) {
          k_rows[i] = kc[pos0 * kv_len + i];
          v_rows[i] = vc[pos0 * kv_len + i];
        }
        EXPECT_LT(Nmse(k_rows, k_expected), 1e-10);
        EXPECT_EQ(v_rows, v);
        EXPECT_EQ(kc[0], 7.0f);                         // rows before the ubatch untouched
        EXPECT_EQ(kc[(pos0 + tokens) * kv_len], 7.0f);  // and after it
      }
    }
  }

  // Rows normed into f32 and f16: the f16 bits are the f32 values rounded.
  const int32_t n = 96;
  const std::vector<float> x = Gaussian(rng, tokens * n), weight = Gaussian(rng, n);
  DeviceArray<float> d_x(x), d_weight(weight), d_out(tokens * n);
  DeviceArray<uint16_t> d_half(tokens * n);
  ASSERT_EQ(launch_rmsnorm_rows(d_x.get(), d_weight.get(), n, tokens, 1e-6f, d_out.get(),
                                d_half.get(), stream_),
            cudaSuccess);
  Sync();
  std::vector<float> expected(x.size());
  RmsNorm(x, weight, 1e-6f, absl::MakeSpan(expected));
  const std::vector<float> got = d_out.Download();
  EXPECT_LT(Nmse(got, expected), 1e-10);
  const std::vector<uint16_t> half = d_half.Download();
  for (size_t i = 0; i < half.size(); ++i) EXPECT_EQ(half[i], f32_to_f16(got[i])) << i;
  EXPECT_EQ(
      launch_rmsnorm_rows(d_x.get(), d_weight.get(), n, 0, 1e-6f, d_out.get(), nullptr, stream_),
      cudaErrorInvalidValue);
  EXPECT_EQ(
      launch_rmsnorm_rows(d_x.get(), d_weight.get(), n, tokens, 1e-6f, nullptr, nullptr, stream_),
      cudaErrorInvalidValue);
}

// A prompt's ubatch of 9 rows at positions 124..132 (across a split boundary):
// each row has the decode step's bits at its position, on f32 and f16 caches,
// and the reference's values; 64-wide heads with gpt-oss's window (7: each
// row's keys start inside split 0) and sinks, in GQA groups of 2 and of 9 (two
// blocks of heads a KV head).
TEST_F(KernelsGpuTest, PrefillAttentionRowsHaveTheDecodeStepsBits) {
  std::mt19937 rng(7);
  for (const AttentionHeads& hc :
       std::vector<AttentionHeads>{{64, 4, 2}, {64, 18, 2}, {24, 4, 2}}) {
    for (bool kv_f16 : {false, true}) {
      const int32_t head_dim = hc.head_dim, n_head = hc.n_head, n_head_kv = hc.n_head_kv;
      SCOPED_TRACE("head_dim " + std::to_string(head_dim) + " heads " + std::to_string(n_head) +
                   "/" + std::to_string(n_head_kv) + (kv_f16 ? " f16" : " f32"));
      const std::vector<float> sinks = Gaussian(rng, n_head, 2.0f);
      DeviceArray<float> d_sinks(sinks);
      AttentionMask mask;
      if (head_dim == 64) {
        mask.window = 7;
        mask.sinks = d_sinks.get();
      }
      const int32_t max_ctx = 300, tokens = 9, pos0 = 124;
      const int32_t q_len = n_head * head_dim, kv_len = n_head_kv * head_dim;
      const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
      const RandomKvCache cache(rng, max_ctx * kv_len, kv_f16);
      const std::vector<float>& k_cache = cache.k;
      const std::vector<float>& v_cache = cache.v;
      const void* k_in = cache.k_in();
      const void* v_in = cache.v_in();
      const std::vector<float> q = Gaussian(rng, tokens * q_len, 2.0f);
      DeviceArray<float> d_q(q), d_out(tokens * q_len);
      DeviceArray<int32_t> d_pos0(std::vector<int32_t>{pos0});
      ASSERT_EQ(
          launch_attention_prefill(d_q.get(), k_in, v_in, kv_f16, d_pos0.get(), tokens, n_head,
                                   n_head_kv, head_dim, scale, mask, d_out.get(), stream_),
          cudaSuccess);
      Sync();
      const std::vector<float> prefill = d_out.Download();

      DeviceArray<float> d_partial(attention_partial_floats(n_head, head_dim, max_ctx));
      DeviceArray<unsigned int> d_tickets(std::vector<unsigned int>(n_head + 1, 0));
      DeviceArray<float> d_row_q(q_len), d_row_out(q_len);
      std::vector<int32_t> positions(tokens);
      for (int32_t t = 0; t < tokens; ++t) {
        positions[t] = pos0 + t;
        d_row_q.Upload(std::vector<float>(q.begin() + t * q_len, q.begin() + (t + 1) * q_len));
        DeviceArray<int32_t> d_pos(std::vector<int32_t>{pos0 + t});
        ASSERT_EQ(
            launch_attention_decode(d_row_q.get(), k_in, v_in, kv_f16, d_pos.get(), n_head,
                                    n_head_kv, head_dim, max_ctx, scale, mask, d_partial.get(),
                                    d_tickets.get(), d_row_out.get(), nullptr, stream_),
            cudaSuccess);
        Sync();
        const std::vector<float> decode = d_row_out.Download();
        for (int32_t i = 0; i < q_len; ++i) {
          ASSERT_EQ(f32_to_bits(prefill[t * q_len + i]), f32_to_bits(decode[i]))
              << "row " << t << " element " << i;
        }
      }
      std::vector<float> expected(q.size());
      Attention(q, positions, k_cache, v_cache, n_head, n_head_kv, head_dim, scale,
                absl::MakeSpan(expected), mask.window,
                mask.sinks != nullptr ? absl::MakeConstSpan(sinks) : absl::Span<const float>());
      EXPECT_LT(Nmse(prefill, expected), 1e-7);
    }
  }
}

// A windowed layer's ring cache (AttentionMask::kv_rows): with the rows of
// positions [0, end) written at p mod rows, decode at lengths past the ring
// and a prefill ubatch give the full cache's bits; rings too small for the
// window (or the ubatch) and rings without a window are refused.
TEST_F(KernelsGpuTest, RingCachesGiveTheFullCachesBits) {
  std::mt19937 rng(9);
  const int32_t n_head = 4, n_head_kv = 2, head_dim = 64, max_ctx = 300, window = 100;
  const int32_t tokens = 9, pos0 = 250, rows = window + tokens - 1;
  const int32_t q_len = n_head * head_dim, kv_len = n_head_kv * head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const std::vector<float> sinks = Gaussian(rng, n_head, 2.0f);
  DeviceArray<float> d_sinks(sinks);
  for (bool kv_f16 : {false, true}) {
    SCOPED_TRACE(kv_f16 ? "f16" : "f32");
    const RandomKvCache cache(rng, max_ctx * kv_len, kv_f16);
    // The ring after positions [0, end) were written: row r holds the last p
    // below end with p mod rows == r.
    auto ring = [&](int32_t end) {
      std::vector<float> k(static_cast<size_t>(rows) * kv_len), v(k.size());
      for (int32_t p = std::max(0, end - rows); p < end; ++p) {
        std::copy_n(cache.k.begin() + p * kv_len, kv_len, k.begin() + (p % rows) * kv_len);
        std::copy_n(cache.v.begin() + p * kv_len, kv_len, v.begin() + (p % rows) * kv_len);
      }
      return std::make_pair(k, v);
    };
    auto upload = [&](const std::vector<float>& values) {
      std::vector<uint16_t> half(values.size());
      for (size_t i = 0; i < values.size(); ++i) half[i] = f32_to_f16(values[i]);
      return std::make_pair(std::make_unique<DeviceArray<float>>(values),
                            std::make_unique<DeviceArray<uint16_t>>(half));
    };
    auto ptr = [&](const std::pair<std::unique_ptr<DeviceArray<float>>,
                                   std::unique_ptr<DeviceArray<uint16_t>>>& a) -> const void* {
      return kv_f16 ? static_cast<const void*>(a.second->get()) : a.first->get();
    };
    AttentionMask full;
    full.window = window;
    full.sinks = d_sinks.get();
    AttentionMask ringed = full;
    ringed.kv_rows = rows;
    DeviceArray<float> d_partial(attention_partial_floats(n_head, head_dim, max_ctx));
    DeviceArray<unsigned int> d_tickets(std::vector<unsigned int>(n_head + 1, 0));
    DeviceArray<float> d_out(n_head * head_dim), d_ring_out(n_head * head_dim);
    for (int32_t length : {1, 108, 129, 200, max_ctx}) {
      SCOPED_TRACE("length " + std::to_string(length));
      const auto [ring_k, ring_v] = ring(length);
      const auto k_ring = upload(ring_k), v_ring = upload(ring_v);
      DeviceArray<float> d_q(Gaussian(rng, q_len, 2.0f));
      DeviceArray<int32_t> d_pos(std::vector<int32_t>{length - 1});
      ASSERT_EQ(
          launch_attention_decode(d_q.get(), cache.k_in(), cache.v_in(), kv_f16, d_pos.get(),
                                  n_head, n_head_kv, head_dim, max_ctx, scale, full,
                                  d_partial.get(), d_tickets.get(), d_out.get(), nullptr, stream_),
          cudaSuccess);
      ASSERT_EQ(
          launch_attention_decode(d_q.get(), ptr(k_ring), ptr(v_ring), kv_f16, d_pos.get(), n_head,
                                  n_head_kv, head_dim, max_ctx, scale, ringed, d_partial.get(),
                                  d_tickets.get(), d_ring_out.get(), nullptr, stream_),
          cudaSuccess);
      Sync();
      EXPECT_EQ(Bits(d_ring_out.Download()), Bits(d_out.Download()));
    }
    // A ubatch of 9 rows at positions 250..258, all of them in the ring.
    const auto [ring_k, ring_v] = ring(pos0 + tokens);
    const auto k_ring = upload(ring_k), v_ring = upload(ring_v);
    DeviceArray<float> d_q(Gaussian(rng, tokens * q_len, 2.0f));
    DeviceArray<float> d_rows(tokens * q_len), d_ring_rows(tokens * q_len);
    DeviceArray<int32_t> d_pos0(std::vector<int32_t>{pos0});
    ASSERT_EQ(launch_attention_prefill(d_q.get(), cache.k_in(), cache.v_in(), kv_f16, d_pos0.get(),
                                       tokens, n_head, n_head_kv, head_dim, scale, full,
                                       d_rows.get(), stream_),
              cudaSuccess);
    ASSERT_EQ(launch_attention_prefill(d_q.get(), ptr(k_ring), ptr(v_ring), kv_f16, d_pos0.get(),
                                       tokens, n_head, n_head_kv, head_dim, scale, ringed,
                                       d_ring_rows.get(), stream_),
              cudaSuccess);
    Sync();
    EXPECT_EQ(Bits(d_ring_rows.Download()), Bits(d_rows.Download()));

    AttentionMask small = ringed;
    small.kv_rows = rows - 1;  // one row short of the ubatch's window
    EXPECT_EQ(launch_attention_prefill(d_q.get(), ptr(k_ring), ptr(v_ring), kv_f16, d_pos0.get(),
                                       tokens, n_head, n_head_kv, head_dim, scale, small,
                                       d_ring_rows.get(), stream_),
              cudaErrorInvalidValue);
    small.kv_rows = window - 1;  // short of the window
    EXPECT_EQ(
        launch_attention_decode(d_q.get(), ptr(k_ring), ptr(v_ring), kv_f16, d_pos0.get(), n_head,
                                n_head_kv, head_dim, max_ctx, scale, small, d_partial.get(),
                                d_tickets.get(), d_out.get(), nullptr, stream_),
        cudaErrorInvalidValue);
    AttentionMask unwindowed;
    unwindowed.kv_rows = rows;
    EXPECT_EQ(
        launch_attention_decode(d_q.get(), ptr(k_ring), ptr(v_ring), kv_f16, d_pos0.get(), n_head,
                                n_head_kv, head_dim, max_ctx, scale, unwindowed, d_partial.get(),
                                d_tickets.get(), d_out.get(), nullptr, stream_),
        cudaErrorInvalidValue);
  }
}

// launch_router with logits given: an f32 identity router (row e has 1 at
// column e and 0 elsewhere) over x = logits gives logits exactly, except that a
// NaN in x is moved into the diagonal so it spoils its own logit only.
class RouterTest : public KernelsGpuTest {
 protected:
  void Route(const std::vector<float>& logits, int32_t k, bool norm_topk,
             DeviceArray<int32_t>& experts, DeviceArray<float>& weights) {
    const int32_t n = static_cast<int32_t>(logits.size());
    std::vector<float> identity(static_cast<size_t>(n) * n, 0.0f), x = logits;
    for (int32_t e = 0; e < n; ++e) {
      identity[static_cast<size_t>(e) * n + e] = std::isnan(x[e]) ? NAN : 1.0f;
      if (std::isnan(x[e])) x[e] = 1.0f;
    }
    DeviceArray<float> d_w(identity), d_x(x), d_logits(n);
    DeviceArray<unsigned int> d_tickets(std::vector<unsigned int>{0});
    RouterEpilogue router;
    router.k = k;
    router.norm_topk = norm_topk;
    router.experts = experts.get();
    router.weights = weights.get();
    ASSERT_EQ(
        launch_router(DeviceView(reinterpret_cast<const uint8_t*>(d_w.get()), GgmlType::kF32, n, n),
                      d_x.get(), nullptr, d_logits.get(), router, d_tickets.get(), stream_),
        cudaSuccess);
    Sync();
    EXPECT_EQ(d_tickets.Download()[0], 0u);
  }
};

TEST_F(RouterTest, TopKMatchesReference) {
  std::mt19937 rng(8);
  struct Case {
    int32_t n_expert, k;
    bool norm;
  };
  for (Case c : {Case{128, 8, true}, Case{128, 8, false}, Case{60, 4, true}, Case{8, 2, true},
                 Case{160, 8, true}, Case{512, 10, true}}) {
    for (int trial = 0; trial < 20; ++trial) {
      SCOPED_TRACE("n_expert " + std::to_string(c.n_expert) + " trial " + std::to_string(trial));
      std::vector<float> logits = Gaussian(rng, c.n_expert, 2.0f);
      if (trial % 4 == 3) logits[c.n_expert / 2] = logits[1];  // a tie in the logits
      DeviceArray<int32_t> d_experts(c.k);
      DeviceArray<float> d_weights(c.k);
      ASSERT_NO_FATAL_FAILURE(Route(logits, c.k, c.norm, d_experts, d_weights));
      std::vector<float> probs = logits;
      Softmax(c.n_expert, absl::MakeSpan(probs));
      const std::vector<int32_t> expected = TopK(probs, c.k);
      EXPECT_EQ(d_experts.Download(), expected);
      // The same bits as the oracle's weights (router_softmax, topk_weights).
      std::vector<double> want(c.k);
      ChosenWeights(probs, expected, c.norm, ExpertGating::kSoftmax, 1.0f, absl::MakeSpan(want));
      const std::vector<float> weights = d_weights.Download();
      for (int32_t r = 0; r < c.k; ++r) {
        EXPECT_EQ(f32_to_bits(weights[r]), f32_to_bits(static_cast<float>(want[r])))
            << "rank " << r;
      }
    }
  }
}

// block_router_topk (launch_router_topk_rows runs it on rows of given logits)
// at sizes of one expert a thread and of two to eight, where the k-th of the
// threads' bests bounds the experts ranked, for every gating and bias: the
// host's choice (GateProbs, then SelectExperts), its weights and the
// probabilities written over the logits, bit for bit (a NaN as any NaN). Rows:
// Gaussian; five values only (ties across the k-th); NaNs; the best experts
// packed into k threads (about k a thread pass the bound); every logit equal;
// -infs and large logits.
TEST_F(RouterTest, TheBlocksTopKIsTheHostsAtEverySizeAndGating) {
  std::mt19937 rng(21);
  struct Case {
    int32_t n, k;
    ExpertGating gating;
    bool logit_bias, score_bias, norm;
    float scale;
  };
  constexpr auto kSoftmax = ExpertGating::kSoftmax, kSigmoid = ExpertGating::kSigmoid,
                 kSoftmaxWeight = ExpertGating::kSoftmaxWeight;
  const Case cases[] = {
      {8, 2, kSoftmax, false, false, true, 1.0f},
      {60, 4, kSigmoid, false, true, true, 2.5f},
      {128, 8, kSoftmax, false, false, true, 1.0f},
      {128, 64, kSoftmax, false, false, false, 1.0f},
      {129, 4, kSoftmaxWeight, true, false, false, 1.0f},
      {160, 8, kSigmoid, false, true, true, 2.5f},
      {256, 64, kSoftmax, false, false, true, 1.0f},
      {257, 42, kSigmoid, true, true, false, 1.5f},
      {512, 10, kSoftmax, false, false, true, 1.0f},
      {1024, 16, kSoftmax, true, true, true, 1.5f},
  };
  constexpr int32_t kRows = 6;
  const auto same = [](float a, float b) {
    return (std::isnan(a) && std::isnan(b)) || f32_to_bits(a) == f32_to_bits(b);
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("n_expert " + std::to_string(c.n) + " k " + std::to_string(c.k) + " gating " +
                 std::to_string(static_cast<int>(c.gating)));
    ASSERT_TRUE(router_topk_fits(c.n, c.k));
    const int32_t held = (c.n + kRouterThreads - 1) / kRouterThreads;
    std::vector<float> logits;
    for (int32_t row = 0; row < kRows; ++row) {
      std::vector<float> x = Gaussian(rng, c.n, 2.0f);
      if (row == 1) {
        for (float& v : x) v = static_cast<float>(static_cast<int>(rng() % 5)) * 0.5f;
      } else if (row == 2) {
        x[c.n / 3] = NAN;
        x[c.n - 1] = NAN;
      } else if (row == 3) {
        // Threads t < k hold values above 10; thread k - 1's best is 10, the
        // k-th of the bests, and its other experts fall below it.
        for (int32_t t = 0; t < c.k && t < kRouterThreads; ++t) {
          for (int32_t s = 0; s < held && t + s * kRouterThreads < c.n; ++s) {
            x[t + s * kRouterThreads] =
                t == c.k - 1 ? (s == 0 ? 10.0f : 9.0f - s) : 10.5f + 0.01f * (t * held + s);
          }
        }
      } else if (row == 4) {
        std::fill(x.begin(), x.end(), 0.75f);
      } else if (row == 5) {
        x[0] = -INFINITY;
        x[c.n / 2] = -INFINITY;
        x[c.n / 4] = 60.0f;
        x[c.n - 1] = 85.0f;
      }
      logits.insert(logits.end(), x.begin(), x.end());
    }
    const std::vector<float> logit_bias = Gaussian(rng, c.n, 0.5f);
    const std::vector<float> score_bias = Gaussian(rng, c.n, 0.25f);
    DeviceArray<float> d_logits(logits), d_logit_bias(logit_bias), d_score_bias(score_bias),
        d_weights(kRows * c.k);
    DeviceArray<int32_t> d_experts(kRows * c.k);
    RouterEpilogue router;
    router.k = c.k;
    router.norm_topk = c.norm;
    router.gating = RouterGatingOf(c.gating);
    router.logit_bias = c.logit_bias ? d_logit_bias.get() : nullptr;
    router.score_bias = c.score_bias ? d_score_bias.get() : nullptr;
    router.scale = c.scale;
    router.experts = d_experts.get();
    router.weights = d_weights.get();
    ASSERT_EQ(launch_router_topk_rows(d_logits.get(), c.n, kRows, router, stream_), cudaSuccess);
    Sync();
    const std::vector<float> probs_out = d_logits.Download(), weights = d_weights.Download();
    const std::vector<int32_t> experts = d_experts.Download();
    for (int32_t row = 0; row < kRows; ++row) {
      SCOPED_TRACE("row " + std::to_string(row));
      std::vector<float> probs(logits.begin() + row * c.n, logits.begin() + (row + 1) * c.n);
      if (c.logit_bias) {
        for (int32_t e = 0; e < c.n; ++e) probs[e] += logit_bias[e];
      }
      GateProbs(c.gating, c.n, absl::MakeSpan(probs));
      std::vector<int32_t> want;
      std::vector<double> want_w;
      SelectExperts(probs, c.n, c.k, c.norm, &want, &want_w, c.gating,
                    c.score_bias ? absl::MakeConstSpan(score_bias) : absl::Span<const float>(),
                    c.scale);
      EXPECT_EQ(std::vector<int32_t>(experts.begin() + row * c.k,
                                     experts.begin() + (row + 1) * c.k),
                want);
      for (int32_t r = 0; r < c.k; ++r) {
        EXPECT_TRUE(same(weights[row * c.k + r], static_cast<float>(want_w[r])))
            << "rank " << r << ": " << weights[row * c.k + r] << " against " << want_w[r];
      }
      for (int32_t e = 0; e < c.n; ++e) {
        ASSERT_TRUE(same(probs_out[row * c.n + e], probs[e]))
            << "expert " << e << ": " << probs_out[row * c.n + e] << " against " << probs[e];
      }
    }
  }
  // More than kRouterThreads candidates could pass the bound: refused.
  DeviceArray<float> d_logits(1025);
  DeviceArray<int32_t> d_experts(64);
  DeviceArray<float> d_weights(64);
  RouterEpilogue router;
  router.experts = d_experts.get();
  router.weights = d_weights.get();
  for (auto [n, k] : {std::pair{1024, 17}, std::pair{257, 43}, std::pair{1025, 1},
                      std::pair{8, 9}, std::pair{128, 65}}) {
    router.k = k;
    EXPECT_EQ(launch_router_topk_rows(d_logits.get(), n, 1, router, stream_),
              cudaErrorInvalidValue)
        << n << " experts, top-" << k;
  }
}

// The shared expert's gate as the router's last row (shared_gate_row): its
// logit is the one launch_matvec gives, left in logits[n_expert] and kept out
// of the top-k (here it is the largest logit), whose experts and weights are
// those of the router alone.
TEST_F(RouterTest, ASharedGateRowGivesItsLogitAndLeavesTheTopKAlone) {
  std::mt19937 rng(14);
  const int32_t n_expert = 60, n_embd = 256, k = 4;
  std::vector<float> w = Gaussian(rng, (n_expert + 1) * n_embd);
  const std::vector<float> x = Gaussian(rng, n_embd);
  for (int32_t i = 0; i < n_embd; ++i) w[n_expert * n_embd + i] = 8.0f * x[i];
  DeviceArray<float> d_w(w), d_x(x), d_gate_logit(1), d_logits_alone(n_expert),
      d_logits(n_expert + 1), d_weights_alone(k), d_weights(k);
  DeviceArray<int32_t> d_experts_alone(k), d_experts(k);
  DeviceArray<unsigned int> d_tickets(std::vector<unsigned int>{0});
  const auto* bytes = reinterpret_cast<const uint8_t*>(d_w.get());
  const auto route = [&](int32_t rows, bool shared_gate_row, DeviceArray<float>& logits,
                         DeviceArray<int32_t>& experts, DeviceArray<float>& weights) {
    RouterEpilogue router;
    router.k = k;
    router.norm_topk = true;
    router.experts = experts.get();
    router.weights = weights.get();
    router.shared_gate_row = shared_gate_row;
    return launch_router(DeviceView(bytes, GgmlType::kF32, rows, n_embd), d_x.get(), nullptr,
                         logits.get(), router, d_tickets.get(), stream_);
  };
  ASSERT_EQ(route(n_expert, false, d_logits_alone, d_experts_alone, d_weights_alone), cudaSuccess);
  ASSERT_EQ(launch_matvec(DeviceView(bytes + n_expert * n_embd * sizeof(float), GgmlType::kF32, 1,
                                     n_embd),
                          d_x.get(), nullptr, nullptr, d_gate_logit.get(), stream_),
            cudaSuccess);
  ASSERT_EQ(route(n_expert + 1, true, d_logits, d_experts, d_weights), cudaSuccess);
  Sync();
  const std::vector<float> logits = d_logits.Download();
  EXPECT_EQ(f32_to_bits(logits[n_expert]), f32_to_bits(d_gate_logit.Download()[0]));
  EXPECT_GT(logits[n_expert], 10.0f);  // it would have been chosen first
  EXPECT_EQ(std::vector<float>(logits.begin(), logits.end() - 1), d_logits_alone.Download());
  EXPECT_EQ(d_experts.Download(), d_experts_alone.Download());
  EXPECT_EQ(d_weights.Download(), d_weights_alone.Download());
  EXPECT_EQ(d_tickets.Download()[0], 0u);
  // Without the flag the same rows route over n_expert + 1.
  ASSERT_EQ(route(n_expert + 1, false, d_logits, d_experts, d_weights), cudaSuccess);
  Sync();
  EXPECT_EQ(d_experts.Download()[0], n_expert);
}

// A NaN logit makes every probability NaN (the sum is NaN). The router must
// still pick k distinct valid experts, as select_topk does, and sampling must
// give sample_token's token (the argmax, 0) instead of leaving a stale one.
TEST_F(RouterTest, NaNLogitsGiveTheHostDecision) {
  std::mt19937 rng(13);
  const int32_t n_expert = 60, k = 4;
  std::vector<float> logits = Gaussian(rng, n_expert);
  logits[17] = NAN;
  DeviceArray<float> d_weights(k);
  DeviceArray<int32_t> d_experts(k);
  ASSERT_NO_FATAL_FAILURE(Route(logits, k, true, d_experts, d_weights));
  std::vector<float> probs(n_expert);
  router_softmax(logits.data(), n_expert, probs.data());
  std::vector<int32_t> expected(k);
  select_topk(probs.data(), n_expert, k, expected.data());
  EXPECT_EQ(d_experts.Download(), expected);

  const std::vector<float> nan_logits(1000, NAN);
  DeviceArray<float> d_nan_logits(nan_logits);
  DeviceArray<int32_t> d_step(std::vector<int32_t>{0}), d_token(std::vector<int32_t>{7});
  SamplingParams params;
  params.temperature = 0.7f;
  params.top_p = 0.9f;
  params.top_k = 40;
  params.seed = 1;
  DeviceArray<SamplingParams> d_params(std::vector<SamplingParams>{params});
  Sampler sampler(1000);
  ASSERT_EQ(
      sampler.Launch(d_nan_logits.get(), d_params.get(), d_step.get(), d_token.get(), stream_),
      cudaSuccess);
  Sync();
  EXPECT_EQ(sampler.path(), SamplePath::kCandidates);
  EXPECT_EQ(d_token.Download()[0], sample_token(nan_logits.data(), 1000, params, 0.5f));
  EXPECT_EQ(d_token.Download()[0], 0);
}

// Residency state on the host (for residency_step) and its copy on the device.
struct ResidencyFixture {
  ResidencyFixture(int n_layer, int n_expert, int n_slots)
      : table(n_layer * n_expert, kNoSlot),
        owner(n_slots, kNoKey),
        stamp(n_slots, 0),
        seg(n_slots, kProbation),
        d_table(table),
        d_owner(owner),
        d_stamp(stamp),
        d_seg(seg) {
    host = {table.data(), owner.data(), stamp.data(), seg.data(), n_expert};
    device = {d_table.get(), d_owner.get(), d_stamp.get(), d_seg.get(), n_expert};
  }
  std::vector<int32_t> table, owner;
  std::vector<uint64_t> stamp;
  std::vector<uint8_t> seg;
  DeviceArray<int32_t> d_table, d_owner;
  DeviceArray<uint64_t> d_stamp;
  DeviceArray<uint8_t> d_seg;
  ResidencyState host, device;
};

// Pools: one global pool over every slot, or one pool per layer (each with its
// own protected count and clock). The kernel must leave every array, count and
// clock as the host's residency_step does, step by step.
TEST_F(KernelsGpuTest, ResidencyStepEqualsHostStepBitForBit) {
  const int32_t n_layer = 4, n_expert = 32, k = 4;
  for (bool per_layer : {false, true}) {
    for (double protected_frac : {0.0, 0.5}) {
      SCOPED_TRACE(std::string(per_layer ? "per-layer" : "global") + " pools, frac " +
                   std::to_string(protected_frac));
      const int32_t slots_per_pool = per_layer ? 9 : 40;
      const int32_t n_pools = per_layer ? n_layer : 1;
      const int32_t n_slots = slots_per_pool * n_pools;
      ResidencyFixture fx(n_layer, n_expert, n_slots);
      std::vector<int32_t> n_protected(n_pools, 0);
      std::vector<uint64_t> clock(n_pools, 0);
      DeviceArray<int32_t> d_n_protected(n_protected);
      DeviceArray<uint64_t> d_clock(clock);
      DeviceArray<int32_t> d_experts(k), d_keys(k), d_slots(k), d_evicted(k);
      DeviceArray<uint8_t> d_missed(k);
      DeviceArray<uint64_t> d_rank_cache(slots_per_pool);
      DeviceArray<DeviceCounters> d_counters(std::vector<DeviceCounters>{DeviceCounters{}});
      const int32_t cap = static_cast<int32_t>(slots_per_pool * protected_frac);
      std::mt19937 rng(per_layer * 10 + static_cast<int>(protected_frac * 4));
      std::geometric_distribution<int> skew(0.12);
      StepOutcome total = {0, 0, 0};
      for (int step = 0; step < 300; ++step) {
        const int32_t layer = step % n_layer;
        const int32_t p = per_layer ? layer : 0;
        std::vector<int32_t> experts;
        while (static_cast<int32_t>(experts.size()) < k) {
          const int32_t e = std::min(skew(rng), n_expert - 1);
          if (std::find(experts.begin(), experts.end(), e) == experts.end()) experts.push_back(e);
        }
        const ResidencyPool host_pool = {p * slots_per_pool, slots_per_pool, cap, &n_protected[p],
                                         &clock[p]};
        const ResidencyPool device_pool = {p * slots_per_pool, slots_per_pool, cap,
                                           d_n_protected.get() + p, d_clock.get() + p};
        int32_t keys[k], slots[k], evicted[k];
        uint8_t missed[k];
        const StepOutcome out = residency_step(fx.host, host_pool, layer, experts.data(), k, keys,
                                               slots, missed, evicted);
        total.n_hits += out.n_hits;
        total.n_misses += out.n_misses;
        total.n_evictions += out.n_evictions;
        d_experts.Upload(experts);
        ASSERT_EQ(launch_residency_step(fx.device, device_pool, layer, d_experts.get(), k,
                                        d_keys.get(), d_slots.get(), d_missed.get(),
                                        d_evicted.get(), d_rank_cache.get(), d_counters.get(),
                                        stream_),
                  cudaSuccess);
        Sync();
        ASSERT_EQ(fx.d_table.Download(), fx.table) << "step " << step;
        ASSERT_EQ(fx.d_owner.Download(), fx.owner) << "step " << step;
        ASSERT_EQ(fx.d_stamp.Download(), fx.stamp) << "step " << step;
        ASSERT_EQ(fx.d_seg.Download(), fx.seg) << "step " << step;
        ASSERT_EQ(d_n_protected.Download(), n_protected) << "step " << step;
        ASSERT_EQ(d_clock.Download(), clock) << "step " << step;
        ASSERT_EQ(d_keys.Download(), std::vector<int32_t>(keys, keys + k));
        ASSERT_EQ(d_slots.Download(), std::vector<int32_t>(slots, slots + k));
        ASSERT_EQ(d_missed.Download(), std::vector<uint8_t>(missed, missed + k));
        const std::vector<int32_t> d_evicted_keys = d_evicted.Download();
        for (int32_t e = 0; e < out.n_evictions; ++e) ASSERT_EQ(d_evicted_keys[e], evicted[e]);
      }
      const DeviceCounters counters = d_counters.Download()[0];
      EXPECT_EQ(counters.hits, static_cast<unsigned long long>(total.n_hits));
      EXPECT_EQ(counters.misses, static_cast<unsigned long long>(total.n_misses));
      EXPECT_EQ(counters.evictions, static_cast<unsigned long long>(total.n_evictions));
      // The sequence exercised every branch the kernel has.
      EXPECT_GT(total.n_hits, 0);
      EXPECT_GT(total.n_evictions, 0);
    }
  }
}

// The hazard kernel against the host cache, step by step, global and per-layer
// pools, 1000 experts per layer so the observation strides over the block: the
// table, owners, every per-key and per-cell array, the costs and the outputs.
// 90 slots: about 100 experts of each layer recur, so both pool modes evict.
TEST_F(KernelsGpuTest, HazardStepEqualsHostStepBitForBit) {
  const int32_t n_layer = 3, n_expert = 1000, k = 6;
  for (const PoolMode pool_mode : {PoolMode::kGlobal, PoolMode::kPerLayer}) {
    SCOPED_TRACE(pool_mode == PoolMode::kGlobal ? "global pool" : "per-layer pools");
    CacheConfig config;
    config.n_layer = n_layer;
    config.n_expert = n_expert;
    config.k = k;
    config.n_slots = 90;
    config.pool_mode = pool_mode;
    absl::StatusOr<HazardCache> cache = HazardCache::Create(config);
    ASSERT_TRUE(cache.ok()) << cache.status();
    DeviceArray<int32_t> d_table(cache->table()), d_owner(cache->owner()),
        d_last_visit(cache->last_visit()), d_visits(cache->visits());
    DeviceArray<uint32_t> d_frequency(cache->frequency()),
        d_long_frequency(cache->long_frequency()), d_cell_hits(cache->cell_hits()),
        d_cell_trials(cache->cell_trials());
    DeviceArray<float> d_cell_cost(cache->cell_cost());
    const HazardState device = {.table = d_table.get(),
                                .owner = d_owner.get(),
                                .last_visit = d_last_visit.get(),
                                .frequency = d_frequency.get(),
                                .long_frequency = d_long_frequency.get(),
                                .visits = d_visits.get(),
                                .cell_hits = d_cell_hits.get(),
                                .cell_trials = d_cell_trials.get(),
                                .cell_cost = d_cell_cost.get(),
                                .n_layer = n_layer,
                                .n_expert = n_expert,
                                .k = k};
    DeviceArray<int32_t> d_experts(k), d_keys(k), d_slots(k), d_evicted(k);
    DeviceArray<uint8_t> d_missed(k);
    DeviceArray<uint64_t> d_rank_cache(config.n_slots);
    DeviceArray<DeviceCounters> d_counters(std::vector<DeviceCounters>{DeviceCounters{}});
    std::mt19937 rng(pool_mode == PoolMode::kGlobal ? 3 : 4);
    std::geometric_distribution<int> skew(0.05);
    StepOutcome total = {0, 0, 0};
    for (int step = 0; step < 240; ++step) {
      const int32_t layer = step % n_layer;
      std::vector<int32_t> experts;
      while (static_cast<int32_t>(experts.size()) < k) {
        const int32_t e = std::min(skew(rng), n_expert - 1);
        if (std::find(experts.begin(), experts.end(), e) == experts.end()) experts.push_back(e);
      }
      const LayerStep& want = cache->Step(layer, experts.data());
      total.n_hits += want.outcome.n_hits;
      total.n_misses += want.outcome.n_misses;
      total.n_evictions += want.outcome.n_evictions;
      d_experts.Upload(experts);
      ASSERT_EQ(launch_hazard_step(device, cache->pools()[cache->pool_of_layer(layer)], layer,
                                   d_experts.get(), k, d_keys.get(), d_slots.get(),
                                   d_missed.get(), d_evicted.get(), d_rank_cache.get(),
                                   d_counters.get(), stream_),
                cudaSuccess);
      Sync();
      ASSERT_EQ(d_table.Download(), cache->table()) << "step " << step;
      ASSERT_EQ(d_owner.Download(), cache->owner()) << "step " << step;
      ASSERT_EQ(d_last_visit.Download(), cache->last_visit()) << "step " << step;
      ASSERT_EQ(d_frequency.Download(), cache->frequency()) << "step " << step;
      ASSERT_EQ(d_long_frequency.Download(), cache->long_frequency()) << "step " << step;
      ASSERT_EQ(d_visits.Download(), cache->visits()) << "step " << step;
      ASSERT_EQ(d_cell_hits.Download(), cache->cell_hits()) << "step " << step;
      ASSERT_EQ(d_cell_trials.Download(), cache->cell_trials()) << "step " << step;
      const std::vector<float> cost = d_cell_cost.Download();
      ASSERT_EQ(std::memcmp(cost.data(), cache->cell_cost().data(), cost.size() * sizeof(float)),
                0)
          << "step " << step;
      ASSERT_EQ(d_slots.Download(), want.slot_of_rank) << "step " << step;
      ASSERT_EQ(d_missed.Download(), want.missed) << "step " << step;
      const std::vector<int32_t> d_evicted_keys = d_evicted.Download();
      ASSERT_EQ(std::vector<int32_t>(d_evicted_keys.begin(),
                                     d_evicted_keys.begin() + want.outcome.n_evictions),
                want.evicted_keys)
          << "step " << step;
    }
    const DeviceCounters counters = d_counters.Download()[0];
    EXPECT_EQ(counters.hits, static_cast<unsigned long long>(total.n_hits));
    EXPECT_EQ(counters.misses, static_cast<unsigned long long>(total.n_misses));
    EXPECT_EQ(counters.evictions, static_cast<unsigned long long>(total.n_evictions));
    EXPECT_GT(total.n_hits, 0);
    EXPECT_GT(total.n_evictions, 0);
  }
}

TEST_F(KernelsGpuTest, StageAllSlots) {
  const int32_t k = 3;
  DeviceArray<int32_t> d_slots(k);
  DeviceArray<uint8_t> d_missed(std::vector<uint8_t>{9, 9, 9});
  ASSERT_EQ(launch_stage_all_slots(k, d_slots.get(), d_missed.get(), stream_), cudaSuccess);
  Sync();
  EXPECT_EQ(d_slots.Download(), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(d_missed.Download(), (std::vector<uint8_t>{1, 1, 1}));
}

TEST_F(KernelsGpuTest, StageCopyCopiesExactlyTheMissedBlocks) {
  std::mt19937 rng(9);
  const int32_t n_expert = 6, n_slots = 5, k = 3;
  DeviceBlockLayout layout{};
  layout.block_bytes = 300 * 1024 + 256;  // not a multiple of the grid's stride
  uint8_t* host_blocks = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&host_blocks), n_expert * layout.block_bytes,
                          cudaHostAllocMapped),
            cudaSuccess);
  std::uniform_int_distribution<int> byte(0, 255);
  for (size_t i = 0; i < n_expert * layout.block_bytes; ++i) host_blocks[i] = byte(rng);
  uint8_t* device_view = nullptr;
  ASSERT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_view), host_blocks, 0),
            cudaSuccess);
  const std::vector<uint8_t> sentinel(n_slots * layout.block_bytes, 0xab);
  DeviceArray<uint8_t> d_slots(sentinel);
  DeviceArray<int32_t> d_experts(std::vector<int32_t>{4, 1, 5});
  DeviceArray<int32_t> d_slot_of_rank(std::vector<int32_t>{2, 0, 4});
  DeviceArray<uint8_t> d_missed(std::vector<uint8_t>{1, 0, 1});
  DeviceArray<unsigned int> d_tickets(std::vector<unsigned int>(k, 0));
  DeviceArray<DeviceCounters> d_counters(std::vector<DeviceCounters>{DeviceCounters{}});
  ASSERT_EQ(launch_stage_copy(device_view, layout, d_experts.get(), d_slot_of_rank.get(),
                              d_missed.get(), k, d_slots.get(), d_tickets.get(), d_counters.get(),
                              stream_),
            cudaSuccess);
  Sync();
  // The missed ranks marked copied for the kReady pass, the tickets left zero.
  EXPECT_EQ(d_missed.Download(), (std::vector<uint8_t>{kRankCopied, kRankHit, kRankCopied}));
  EXPECT_EQ(d_tickets.Download(), std::vector<unsigned int>(k, 0));
  std::vector<uint8_t> expected = sentinel;
  std::memcpy(expected.data() + 2 * layout.block_bytes, host_blocks + 4 * layout.block_bytes,
              layout.block_bytes);
  std::memcpy(expected.data() + 4 * layout.block_bytes, host_blocks + 5 * layout.block_bytes,
              layout.block_bytes);
  EXPECT_TRUE(d_slots.Download() == expected);
  EXPECT_EQ(d_counters.Download()[0].bytes_staged, 2 * layout.block_bytes);
  cudaFreeHost(host_blocks);
}

// Expert blocks in slots, passes A (hits) + B (misses) against one kAll pass and
// against the reference SwiGLU FFN of each expert; the last down pass combines
// the ranks into the residual and runs the norm after it.
// An expert block of gate and up of gate_up rows and down of down rows, each
// projection 256-byte aligned, as the pools lay them out.
DeviceBlockLayout SlotLayout(GgmlType gate_up, GgmlType down, int32_t n_embd, int32_t n_ff) {
  DeviceBlockLayout layout{};
  layout.type[0] = layout.type[1] = gate_up;
  layout.type[2] = down;
  layout.row_bytes[0] = layout.row_bytes[1] = ggml_row_size(gate_up, n_embd);
  layout.row_bytes[2] = ggml_row_size(down, n_ff);
  layout.n_embd = n_embd;
  layout.n_ff = n_ff;
  size_t offset = 0;
  for (int p = 0; p < 3; ++p) {
    layout.offset[p] = offset;
    const size_t bytes = layout.row_bytes[p] * (p < 2 ? n_ff : n_embd);
    offset += (bytes + 255) / 256 * 256;
  }
  layout.block_bytes = offset;
  return layout;
}

// n_slots blocks of layout, each projection random.
std::vector<uint8_t> RandomSlots(std::mt19937& rng, const DeviceBlockLayout& layout,
                                 int32_t n_slots) {
  std::vector<uint8_t> slots(n_slots * layout.block_bytes, 0);
  for (int32_t s = 0; s < n_slots; ++s) {
    for (int p = 0; p < 3; ++p) {
      const std::vector<uint8_t> w =
          RandomMatrix(rng, layout.type[p], p < 2 ? layout.n_ff : layout.n_embd,
                       p < 2 ? layout.n_embd : layout.n_ff);
      std::copy(w.begin(), w.end(), slots.begin() + s * layout.block_bytes + layout.offset[p]);
    }
  }
  return slots;
}

TEST_F(KernelsGpuTest, ExpertPassesAndCombineMatchReferenceWhateverThePassSplit) {
  struct Types {
    GgmlType gate_up, down;
    bool oss = false;  // gpt-oss: the experts' biases and swiglu_oai
  };
  for (Types types :
       {Types{GgmlType::kQ4_K, GgmlType::kQ6_K}, Types{GgmlType::kQ8_0, GgmlType::kQ8_0},
        Types{GgmlType::kF32, GgmlType::kBF16}, Types{GgmlType::kMXFP4, GgmlType::kMXFP4, true}}) {
    SCOPED_TRACE(TypeName(types.gate_up) + "/" + TypeName(types.down) +
                 (types.oss ? " biases, swiglu_oai" : ""));
    std::mt19937 rng(10);
    const int32_t n_embd = 256, n_ff = 512, n_slots = 6, k = 4;
    const DeviceBlockLayout layout = SlotLayout(types.gate_up, types.down, n_embd, n_ff);
    const std::vector<uint8_t> slots = RandomSlots(rng, layout, n_slots);
    const std::vector<int32_t> slot_of_rank = {3, 1, 5, 2};
    const std::vector<uint8_t> missed = {0, 1, 1, 0};
    // The ranks' expert ids index the bias arrays of 8 experts; biases of sd 4
    // push gate and up past swiglu_oai's clamp at 7.
    const int32_t n_expert = 8;
    const std::vector<int32_t> experts = {5, 2, 7, 0};
    const std::vector<float> gate_b = Gaussian(rng, n_expert * n_ff, 4.0f),
                             up_b = Gaussian(rng, n_expert * n_ff, 4.0f),
                             down_b = Gaussian(rng, n_expert * n_embd);
    DeviceArray<int32_t> d_experts(experts);
    DeviceArray<float> d_gate_b(gate_b), d_up_b(up_b), d_down_b(down_b);
    ExpertBiases biases;
    if (types.oss) biases = {d_experts.get(), d_gate_b.get(), d_up_b.get(), d_down_b.get()};
    const GluAct glu_act = types.oss ? GluAct::kSwigluOai : GluAct::kSilu;
    const std::vector<float> x = Gaussian(rng, n_embd);
    const std::vector<float> weights = {0.4f, 0.3f, 0.2f, 0.1f};
    const std::vector<float> shexp = Gaussian(rng, n_embd);
    DeviceArray<uint8_t> d_slots(slots);
    DeviceArray<int32_t> d_slot_of_rank(slot_of_rank);
    DeviceArray<uint8_t> d_missed(missed);
    DeviceArray<float> d_x(x), d_weights(weights), d_shexp(shexp);
    DeviceArray<block_q8_1> d_xq(Q8_1(x));
    DeviceArray<block_q8_1> d_act_q_split(k * n_ff / QK8_1), d_act_q_all(k * n_ff / QK8_1);
    DeviceArray<float> d_logit(std::vector<float>{0.7f});
    DeviceArray<DeviceCounters> d_counters(std::vector<DeviceCounters>{DeviceCounters{}});
    const std::vector<float> unwritten(k * n_embd, -12345.0f);
    DeviceArray<float> d_act_split(k * n_ff), d_act_all(k * n_ff), d_act_ready(k * n_ff);
    DeviceArray<float> d_out_split(unwritten), d_out_all(k * n_embd), d_out_ready(k * n_embd);
    DeviceArray<block_q8_1> d_act_q_ready(k * n_ff / QK8_1);
    // The combine adds into the residual stream.
    const std::vector<float> residual = Gaussian(rng, n_embd);
    DeviceArray<float> d_sum_split(residual), d_sum_all(residual), d_sum_ready(residual);
    const std::vector<float> norm_weight = Gaussian(rng, n_embd);
    DeviceArray<float> d_norm_weight(norm_weight), d_h_split(n_embd), d_h_all(n_embd),
        d_h_ready(n_embd);
    DeviceArray<block_q8_1> d_h_q_split(n_embd / QK8_1), d_h_q_all(n_embd / QK8_1),
        d_h_q_ready(n_embd / QK8_1);
    const std::vector<unsigned int> zero_tickets(step_tickets(n_embd, 1, 1, k * n_ff), 0);
    DeviceArray<unsigned int> d_tickets(zero_tickets);

    // Pass A alone computes the hits and leaves the misses' outputs alone.
    ExpertRanks ranks;  // the slot decision's
    ranks.k = k;
    ranks.slot_of_rank = d_slot_of_rank.get();
    ranks.missed = d_missed.get();
    auto gate_up = [&](ExpertPass pass, DeviceArray<float>& act, DeviceArray<block_q8_1>& act_q) {
      return launch_expert_gate_up(d_slots.get(), layout, ranks, pass, biases, glu_act, d_x.get(),
                                   d_xq.get(), act.get(), act_q.get(), d_counters.get(),
                                   d_tickets.get(), stream_);
    };
    auto down = [&](ExpertPass pass, DeviceArray<float>& act, DeviceArray<block_q8_1>& act_q,
                    DeviceArray<float>& out) {
      return launch_expert_down(d_slots.get(), layout, ranks, pass, biases, act.get(), act_q.get(),
                                out.get(), stream_);
    };
    ASSERT_EQ(gate_up(ExpertPass::kHits, d_act_split, d_act_q_split), cudaSuccess);
    ASSERT_EQ(down(ExpertPass::kHits, d_act_split, d_act_q_split, d_out_split), cudaSuccess);
    Sync();
    const std::vector<float> after_a = d_out_split.Download();
    for (int32_t r = 0; r < k; ++r) {
      EXPECT_EQ(after_a[r * n_embd] == -12345.0f, missed[r] == 1) << "rank " << r;
    }
    auto combine_into = [&](DeviceArray<float>& sum, DeviceArray<float>& h,
                            DeviceArray<block_q8_1>& h_q) {
      CombineEpilogue combine;
      combine.weights = d_weights.get();
      combine.shexp_out = d_shexp.get();
      combine.shexp_logit = d_logit.get();
      combine.residual = sum.get();
      combine.norm.weight = d_norm_weight.get();
      combine.norm.eps = 1e-6f;
      combine.norm.out = h.get();
      combine.norm.out_q = h_q.get();
      return combine;
    };
    auto down_combine = [&](ExpertPass pass, DeviceArray<float>& act,
                            DeviceArray<block_q8_1>& act_q, DeviceArray<float>& out,
                            DeviceArray<float>& sum, DeviceArray<float>& h,
                            DeviceArray<block_q8_1>& h_q) {
      return launch_expert_down_combine(d_slots.get(), layout, ranks, pass, biases, act.get(),
                                        act_q.get(), out.get(), combine_into(sum, h, h_q),
                                        d_tickets.get(), stream_);
    };
    // The one pass's gate/up and down in one launch.
    DeviceArray<float> d_act_ffn(k * n_ff), d_out_ffn(k * n_embd), d_sum_ffn(residual),
        d_h_ffn(n_embd);
    DeviceArray<block_q8_1> d_act_q_ffn(k * n_ff / QK8_1), d_h_q_ffn(n_embd / QK8_1);
    auto ffn = [&](ExpertPass pass) {
      return launch_expert_ffn(d_slots.get(), layout, ranks, pass, biases, glu_act, d_x.get(),
                               d_xq.get(), d_act_ffn.get(), d_act_q_ffn.get(), d_out_ffn.get(),
                               combine_into(d_sum_ffn, d_h_ffn, d_h_q_ffn), d_counters.get(),
                               d_tickets.get(), stream_);
    };
    // The fused launch gave the one pass's bits, and set its tickets back to zero.
    auto expect_ffn_bits = [&] {
      EXPECT_EQ(d_tickets.Download(), zero_tickets);
      EXPECT_EQ(d_act_ffn.Download(), d_act_all.Download());
      EXPECT_EQ(d_out_ffn.Download(), d_out_all.Download());
      EXPECT_EQ(d_sum_ffn.Download(), d_sum_all.Download());
      EXPECT_EQ(d_h_ffn.Download(), d_h_all.Download());
      EXPECT_TRUE(SameBlocks(d_h_q_ffn.Download(), d_h_q_all.Download()));
    };
    ASSERT_EQ(gate_up(ExpertPass::kMisses, d_act_split, d_act_q_split), cudaSuccess);
    ASSERT_EQ(down_combine(ExpertPass::kMisses, d_act_split, d_act_q_split, d_out_split,
                           d_sum_split, d_h_split, d_h_q_split),
              cudaSuccess);
    ASSERT_EQ(gate_up(ExpertPass::kAll, d_act_all, d_act_q_all), cudaSuccess);
    ASSERT_EQ(down_combine(ExpertPass::kAll, d_act_all, d_act_q_all, d_out_all, d_sum_all, d_h_all,
                           d_h_q_all),
              cudaSuccess);
    Sync();
    const DeviceCounters before_ready = d_counters.Download()[0];
    // The one pass of the cached arms, once the stage copy has marked the
    // misses copied (the emulator traps on a rank still staging).
    std::vector<uint8_t> copied = missed;
    for (uint8_t& m : copied) m = m != kRankHit ? kRankCopied : kRankHit;
    d_missed.Upload(copied);
    ASSERT_EQ(gate_up(ExpertPass::kReady, d_act_ready, d_act_q_ready), cudaSuccess);
    ASSERT_EQ(down_combine(ExpertPass::kReady, d_act_ready, d_act_q_ready, d_out_ready,
                           d_sum_ready, d_h_ready, d_h_q_ready),
              cudaSuccess);
    Sync();
    EXPECT_EQ(d_tickets.Download(), zero_tickets);
    EXPECT_EQ(d_out_ready.Download(), d_out_all.Download());
    EXPECT_EQ(d_sum_ready.Download(), d_sum_all.Download());
    EXPECT_EQ(d_h_ready.Download(), d_h_all.Download());
    const DeviceCounters after_ready = d_counters.Download()[0];
    EXPECT_EQ(after_ready.pass_a_experts - before_ready.pass_a_experts, 2u);  // the hits
    EXPECT_EQ(after_ready.pass_b_experts - before_ready.pass_b_experts, 2u);  // the misses
    EXPECT_EQ(after_ready.copy_waits - before_ready.copy_waits, 2u);
    EXPECT_EQ(before_ready.copy_waits, 0u);  // no other pass waits
    // Fused, the same counts: each expert once, the misses after their copies.
    EXPECT_EQ(ffn(ExpertPass::kHits), cudaErrorInvalidValue);
    EXPECT_EQ(ffn(ExpertPass::kMisses), cudaErrorInvalidValue);
    ASSERT_EQ(ffn(ExpertPass::kReady), cudaSuccess);
    Sync();
    expect_ffn_bits();
    const DeviceCounters after_ffn = d_counters.Download()[0];
    EXPECT_EQ(after_ffn.pass_a_experts - after_ready.pass_a_experts, 2u);
    EXPECT_EQ(after_ffn.pass_b_experts - after_ready.pass_b_experts, 2u);
    EXPECT_EQ(after_ffn.copy_waits - after_ready.copy_waits, 2u);
    EXPECT_EQ(after_ffn.chained_launches - after_ready.chained_launches, 1u);
    EXPECT_EQ(after_ready.chained_launches, 0u);  // the two-launch passes are no chain

    // The resident arm's ranks: slot first_slot + selection[r], no flags.
    const DeviceArray<int32_t> d_resident_selection(std::vector<int32_t>{2, 0, 4, 1});
    ranks.slot_of_rank = d_resident_selection.get();
    ranks.missed = nullptr;
    ranks.first_slot = 1;
    EXPECT_EQ(gate_up(ExpertPass::kReady, d_act_ready, d_act_q_ready), cudaErrorInvalidValue);
    d_sum_ready.Upload(residual);
    ASSERT_EQ(gate_up(ExpertPass::kAll, d_act_ready, d_act_q_ready), cudaSuccess);
    ASSERT_EQ(down_combine(ExpertPass::kAll, d_act_ready, d_act_q_ready, d_out_ready, d_sum_ready,
                           d_h_ready, d_h_q_ready),
              cudaSuccess);
    Sync();
    EXPECT_EQ(d_tickets.Download(), zero_tickets);
    EXPECT_EQ(d_out_ready.Download(), d_out_all.Download());
    EXPECT_EQ(d_sum_ready.Download(), d_sum_all.Download());
    d_sum_ffn.Upload(residual);
    EXPECT_EQ(ffn(ExpertPass::kReady), cudaErrorInvalidValue);  // no flags to wait on
    ASSERT_EQ(ffn(ExpertPass::kAll), cudaSuccess);
    Sync();
    expect_ffn_bits();

    const std::vector<float> out_split = d_out_split.Download();
    const std::vector<float> sum_split = d_sum_split.Download();
    EXPECT_EQ(out_split, d_out_all.Download());
    EXPECT_EQ(sum_split, d_sum_all.Download());
    const std::vector<float> h_split = d_h_split.Download();
    EXPECT_EQ(h_split, d_h_all.Download());
    EXPECT_TRUE(SameBlocks(d_h_q_split.Download(), Q8_1(h_split)));
    EXPECT_TRUE(SameBlocks(d_h_q_all.Download(), Q8_1(h_split)));
    std::vector<float> h_expected(n_embd);
    RmsNorm(sum_split, norm_weight, 1e-6f, absl::MakeSpan(h_expected));
    EXPECT_LT(Nmse(h_split, h_expected), 1e-7);
    EXPECT_EQ(before_ready.pass_a_experts, 2u + 4u);  // two hits, then the kAll pass
    EXPECT_EQ(before_ready.pass_b_experts, 2u);

    // Each rank's output against the host's run of the grouped matvec (the
    // gate/up product quantized to q8_1 as the kernel does), and against the
    // reference FFN of its slot's weights in f32 (build_moe_ffn's: biases, then
    // the activation).
    std::vector<float> grouped(k * n_embd), expected(k * n_embd);
    const std::vector<block_q8_1> xq = Q8_1(x);
    for (int32_t r = 0; r < k; ++r) {
      const uint8_t* block = slots.data() + slot_of_rank[r] * layout.block_bytes;
      const auto bias_of = [&](const std::vector<float>& b, int32_t n) {
        return types.oss ? absl::MakeConstSpan(b).subspan(experts[r] * n, n)
                         : absl::Span<const float>();
      };
      std::vector<float> gq =
          GroupedMatvec(layout.type[0], block + layout.offset[0], n_ff, n_embd, x, xq);
      std::vector<float> uq =
          GroupedMatvec(layout.type[1], block + layout.offset[1], n_ff, n_embd, x, xq);
      if (types.oss) {
        AddBias(bias_of(gate_b, n_ff), absl::MakeSpan(gq));
        AddBias(bias_of(up_b, n_ff), absl::MakeSpan(uq));
      }
      std::vector<float> act(n_ff);
      for (int32_t i = 0; i < n_ff; ++i) act[i] = glu(glu_act, gq[i], uq[i]);
      std::vector<float> dq =
          GroupedMatvec(layout.type[2], block + layout.offset[2], n_embd, n_ff, act, Q8_1(act));
      if (types.oss) AddBias(bias_of(down_b, n_embd), absl::MakeSpan(dq));
      std::copy(dq.begin(), dq.end(), grouped.begin() + r * n_embd);
      std::vector<float> g(n_ff), u(n_ff);
      MatMul(HostView(block + layout.offset[0], layout.type[0], n_ff, n_embd), x,
             absl::MakeSpan(g));
      MatMul(HostView(block + layout.offset[1], layout.type[1], n_ff, n_embd), x,
             absl::MakeSpan(u));
      const absl::Span<float> y = absl::MakeSpan(expected).subspan(r * n_embd, n_embd);
      if (types.oss) {
        AddBias(bias_of(gate_b, n_ff), absl::MakeSpan(g));
        AddBias(bias_of(up_b, n_ff), absl::MakeSpan(u));
        SwigluOai(g, u, absl::MakeSpan(g));
      } else {
        Swiglu(g, u, absl::MakeSpan(g));
      }
      MatMul(HostView(block + layout.offset[2], layout.type[2], n_embd, n_ff), g, y);
      if (types.oss) AddBias(bias_of(down_b, n_embd), y);
    }
    EXPECT_LT(Nmse(out_split, grouped), 1e-10);
    EXPECT_LT(Nmse(out_split, expected), std::max(F32Bound(types.gate_up), F32Bound(types.down)));
    std::vector<float> expected_sum(n_embd);
    const double shared_scale = Sigmoid(0.7f);
    for (int32_t i = 0; i < n_embd; ++i) {
      double acc = residual[i] + shared_scale * shexp[i];
      for (int32_t r = 0; r < k; ++r)
        acc += static_cast<double>(weights[r]) * expected[r * n_embd + i];
      expected_sum[i] = static_cast<float>(acc);
    }
    EXPECT_LT(Nmse(sum_split, expected_sum),
              std::max(F32Bound(types.gate_up), F32Bound(types.down)));
  }
}

// The shared expert as rank k of the expert passes (ExpertRanks::shared) gives
// the bits of its own launches (launch_matvec_swiglu, launch_matvec, the
// combine reading shexp_out), on every pass split and on the resident arm's
// ranks, and is never counted as an expert computed.
TEST_F(KernelsGpuTest, ASharedExpertRidingTheExpertPassesGivesItsOwnLaunchesBits) {
  for (auto [gate_up_type, down_type] :
       {std::pair{GgmlType::kQ4_K, GgmlType::kQ6_K}, std::pair{GgmlType::kQ8_0, GgmlType::kQ8_0},
        std::pair{GgmlType::kF32, GgmlType::kBF16}}) {
    SCOPED_TRACE(TypeName(gate_up_type) + "/" + TypeName(down_type));
    std::mt19937 rng(12);
    const int32_t n_embd = 256, n_ff = 512, n_slots = 6, k = 4;
    const DeviceBlockLayout layout = SlotLayout(gate_up_type, down_type, n_embd, n_ff);
    DeviceArray<uint8_t> d_slots(RandomSlots(rng, layout, n_slots));
    DeviceArray<uint8_t> d_gate(RandomMatrix(rng, gate_up_type, n_ff, n_embd)),
        d_up(RandomMatrix(rng, gate_up_type, n_ff, n_embd)),
        d_down(RandomMatrix(rng, down_type, n_embd, n_ff));
    const DeviceMatrix gate = DeviceView(d_gate.get(), gate_up_type, n_ff, n_embd);
    const DeviceMatrix up = DeviceView(d_up.get(), gate_up_type, n_ff, n_embd);
    const DeviceMatrix down = DeviceView(d_down.get(), down_type, n_embd, n_ff);
    const std::vector<float> x = Gaussian(rng, n_embd), residual = Gaussian(rng, n_embd),
                             norm_weight = Gaussian(rng, n_embd);
    DeviceArray<float> d_x(x), d_weights(std::vector<float>{0.4f, 0.3f, 0.2f, 0.1f}),
        d_logit(std::vector<float>{0.7f}), d_norm_weight(norm_weight);
    DeviceArray<block_q8_1> d_xq(Q8_1(x));
    DeviceArray<int32_t> d_slot_of_rank(std::vector<int32_t>{3, 1, 5, 2});
    const std::vector<uint8_t> missed = {0, 1, 1, 0};
    DeviceArray<uint8_t> d_missed(missed);
    DeviceArray<DeviceCounters> d_counters(std::vector<DeviceCounters>{DeviceCounters{}});
    const std::vector<unsigned int> zero_tickets(step_tickets(n_embd, 1, 1, (k + 1) * n_ff), 0);
    DeviceArray<unsigned int> d_tickets(zero_tickets);
    ExpertRanks ranks;
    ranks.k = k;
    ranks.slot_of_rank = d_slot_of_rank.get();
    ranks.missed = d_missed.get();

    // One FFN: its residual, next norm and the outputs of every rank.
    struct Ffn {
      explicit Ffn(int32_t ranks, int32_t n_embd, int32_t n_ff, const std::vector<float>& residual)
          : act(ranks * n_ff), out(ranks * n_embd), sum(residual), h(n_embd),
            act_q(ranks * n_ff / QK8_1), h_q(n_embd / QK8_1) {}
      DeviceArray<float> act, out, sum, h;
      DeviceArray<block_q8_1> act_q, h_q;
    };
    // Its combine into f's residual and norm (shexp_out: the shared expert's
    // own output, where it does not ride the passes).
    const auto combine_into = [&](Ffn& f, const float* shexp_out) {
      CombineEpilogue combine;
      combine.weights = d_weights.get();
      combine.shexp_out = shexp_out;
      combine.shexp_logit = d_logit.get();
      combine.residual = f.sum.get();
      combine.norm.weight = d_norm_weight.get();
      combine.norm.eps = 1e-6f;
      combine.norm.out = f.h.get();
      combine.norm.out_q = f.h_q.get();
      return combine;
    };
    const auto run = [&](const std::vector<ExpertPass>& passes, Ffn& f,
                         const float* shexp_out) {
      for (size_t i = 0; i < passes.size(); ++i) {
        ASSERT_EQ(launch_expert_gate_up(d_slots.get(), layout, ranks, passes[i], ExpertBiases{},
                                        GluAct::kSilu, d_x.get(), d_xq.get(), f.act.get(),
                                        f.act_q.get(), d_counters.get(), d_tickets.get(), stream_),
                  cudaSuccess);
        if (i + 1 < passes.size()) {
          ASSERT_EQ(launch_expert_down(d_slots.get(), layout, ranks, passes[i], ExpertBiases{},
                                       f.act.get(), f.act_q.get(), f.out.get(), stream_),
                    cudaSuccess);
          continue;
        }
        ASSERT_EQ(launch_expert_down_combine(d_slots.get(), layout, ranks, passes[i],
                                             ExpertBiases{}, f.act.get(), f.act_q.get(),
                                             f.out.get(), combine_into(f, shexp_out),
                                             d_tickets.get(), stream_),
                  cudaSuccess);
      }
    };

    // The same one pass in one launch (launch_expert_ffn).
    const auto run_fused = [&](ExpertPass pass, Ffn& f) {
      ASSERT_EQ(launch_expert_ffn(d_slots.get(), layout, ranks, pass, ExpertBiases{},
                                  GluAct::kSilu, d_x.get(), d_xq.get(), f.act.get(),
                                  f.act_q.get(), f.out.get(), combine_into(f, nullptr),
                                  d_counters.get(), d_tickets.get(), stream_),
                cudaSuccess);
    };

    // The shared expert's own launches, then the routed ranks' one pass.
    DeviceArray<float> d_shexp_act(n_ff), d_shexp_out(n_embd);
    DeviceArray<block_q8_1> d_shexp_act_q(n_ff / QK8_1);
    ASSERT_EQ(launch_matvec_swiglu(gate, up, d_x.get(), d_xq.get(), d_shexp_act.get(),
                                   d_shexp_act_q.get(), d_tickets.get(), stream_),
              cudaSuccess);
    ASSERT_EQ(launch_matvec(down, d_shexp_act.get(), d_shexp_act_q.get(), nullptr,
                            d_shexp_out.get(), stream_),
              cudaSuccess);
    Ffn own(k, n_embd, n_ff, residual);
    run({ExpertPass::kAll}, own, d_shexp_out.get());
    Sync();
    const std::vector<float> shexp_act = d_shexp_act.Download();
    const std::vector<float> shexp_out = d_shexp_out.Download();
    const std::vector<float> own_out = own.out.Download();

    // Rank k: a hits pass and a misses pass, the one kAll pass, the kReady
    // pass, and the resident arm's ranks.
    ranks.shared = {&gate, &up, &down};
    const auto expect_own_bits = [&](Ffn& f, const std::vector<float>& routed_out) {
      const std::vector<float> act = f.act.Download(), out = f.out.Download();
      EXPECT_EQ(std::vector<float>(act.begin() + k * n_ff, act.end()), shexp_act);
      EXPECT_EQ(std::vector<float>(out.begin() + k * n_embd, out.end()), shexp_out);
      EXPECT_EQ(std::vector<float>(out.begin(), out.begin() + k * n_embd), routed_out);
      EXPECT_EQ(f.sum.Download(), own.sum.Download());
      EXPECT_EQ(f.h.Download(), own.h.Download());
      EXPECT_TRUE(SameBlocks(f.h_q.Download(), own.h_q.Download()));
      EXPECT_EQ(d_tickets.Download(), zero_tickets);
    };
    const DeviceCounters before = d_counters.Download()[0];
    Ffn split(k + 1, n_embd, n_ff, residual);
    run({ExpertPass::kHits, ExpertPass::kMisses}, split, nullptr);
    Ffn all(k + 1, n_embd, n_ff, residual);
    run({ExpertPass::kAll}, all, nullptr);
    Sync();
    expect_own_bits(split, own_out);
    expect_own_bits(all, own_out);
    const DeviceCounters after = d_counters.Download()[0];
    EXPECT_EQ(after.pass_a_experts - before.pass_a_experts, 2u + 4u);  // the hits, then kAll
    EXPECT_EQ(after.pass_b_experts - before.pass_b_experts, 2u);       // the misses

    std::vector<uint8_t> copied = missed;
    for (uint8_t& m : copied) m = m != kRankHit ? kRankCopied : kRankHit;
    d_missed.Upload(copied);
    Ffn ready(k + 1, n_embd, n_ff, residual);
    run({ExpertPass::kReady}, ready, nullptr);
    Ffn ready_fused(k + 1, n_embd, n_ff, residual);
    run_fused(ExpertPass::kReady, ready_fused);
    Sync();
    expect_own_bits(ready, own_out);
    expect_own_bits(ready_fused, own_out);

    // The resident arm: slots first_slot + selection[r], no flags.
    const DeviceArray<int32_t> d_selection(std::vector<int32_t>{2, 0, 4, 1});
    ranks.slot_of_rank = d_selection.get();
    ranks.missed = nullptr;
    ranks.first_slot = 1;
    Ffn resident(k + 1, n_embd, n_ff, residual);
    run({ExpertPass::kAll}, resident, nullptr);
    Ffn resident_fused(k + 1, n_embd, n_ff, residual);
    run_fused(ExpertPass::kAll, resident_fused);
    Sync();
    expect_own_bits(resident, own_out);  // slot 1 + {2, 0, 4, 1}: the same slots
    expect_own_bits(resident_fused, own_out);

    // A shared expert not of the slots' types, or beside expert biases, is refused.
    const DeviceMatrix down_as_gate = DeviceView(d_down.get(), down_type, n_ff, n_embd);
    ranks.shared = {&gate, &up, &down_as_gate};
    EXPECT_EQ(launch_expert_down(d_slots.get(), layout, ranks, ExpertPass::kAll, ExpertBiases{},
                                 resident.act.get(), resident.act_q.get(), resident.out.get(),
                                 stream_),
              cudaErrorInvalidValue);
    ranks.shared = {&gate, &up, &down};
    const DeviceArray<float> d_bias(std::vector<float>(8 * n_embd, 0.5f));
    EXPECT_EQ(launch_expert_down(d_slots.get(), layout, ranks, ExpertPass::kAll,
                                 ExpertBiases{d_selection.get(), nullptr, nullptr, d_bias.get()},
                                 resident.act.get(), resident.act_q.get(), resident.out.get(),
                                 stream_),
              cudaErrorInvalidValue);
  }
}

// Greedy: the argmax over 38 blocks, ties to the lowest id within a block and
// across blocks.
TEST_F(KernelsGpuTest, ArgmaxTiesGoToTheLowestId) {
  std::mt19937 rng(11);
  const int32_t n = 151936;
  std::vector<float> logits = Gaussian(rng, n);
  for (int32_t i : {90000, 70003, 70001, 151935}) logits[i] = 9.0f;
  DeviceArray<float> d_logits(logits);
  DeviceArray<int32_t> d_token(1), d_step(std::vector<int32_t>{0});
  DeviceArray<SamplingParams> d_params(std::vector<SamplingParams>{SamplingParams{}});
  Sampler sampler(n);
  ASSERT_EQ(sampler.Launch(d_logits.get(), d_params.get(), d_step.get(), d_token.get(), stream_),
            cudaSuccess);
  Sync();
  EXPECT_EQ(d_token.Download()[0], 70001);
  EXPECT_EQ(ArgMax(logits), 70001);
  EXPECT_EQ(sampler.path(), SamplePath::kArgmax);
  EXPECT_EQ(sampler.ticket(), 0u);
}

// The kernel computes sample_token's floats bit for bit (kernels/sample_math.h),
// so every setting and draw gives the host's token, even flat logits where many
// draws land near a boundary; a top-k of at most 256 decides over the blocks'
// candidates, any other setting over the vocabulary.
TEST_F(KernelsGpuTest, SamplingEqualsTheHostDecisionForEverySetting) {
  std::mt19937 rng(12);
  const uint64_t seed = 0x1234567887654321ull;
  DeviceArray<int32_t> d_step(1), d_token(1);
  DeviceArray<SamplingParams> d_params(1);
  struct Setting {
    float temperature, top_p;
    int32_t top_k;
    float min_p;
  };
  const Setting settings[] = {
      {0.0f, 1.0f, 0, 0.0f},    {0.7f, 1.0f, 0, 0.0f},      {0.7f, 0.9f, 0, 0.0f},
      {0.8f, 0.95f, 40, 0.05f}, {1.5f, 0.3f, 0, 0.0f},      {1.0f, 1.0f, 5, 0.0f},
      {1.0f, 1.0f, 0, 0.2f},    {0.2f, 0.99f, 1000, 0.01f}, {2.0f, 0.98f, 256, 0.0f}};
  for (int32_t step = 0; step < 8; ++step) {
    const int32_t n = step % 2 == 0 ? 1000 : 151936;
    SCOPED_TRACE("step " + std::to_string(step) + " n " + std::to_string(n));
    const std::vector<float> logits = Gaussian(rng, n, step < 4 ? 4.0f : 0.5f);
    DeviceArray<float> d_logits(logits);
    Sampler sampler(n);
    d_step.Upload({step});
    for (const Setting& s : settings) {
      SamplingParams params;
      params.temperature = s.temperature;
      params.top_p = s.top_p;
      params.top_k = s.top_k;
      params.min_p = s.min_p;
      params.seed = seed;
      d_params.Upload({params});
      ASSERT_EQ(
          sampler.Launch(d_logits.get(), d_params.get(), d_step.get(), d_token.get(), stream_),
          cudaSuccess);
      Sync();
      const int32_t token = d_token.Download()[0];
      EXPECT_EQ(token, sample_token(logits.data(), n, params, sample_uniform(seed, step)))
          << "temperature " << s.temperature << " top_p " << s.top_p << " top_k " << s.top_k
          << " min_p " << s.min_p;
      const SamplePath path = s.temperature == 0.0f ? SamplePath::kArgmax
                              : s.top_k > 0 && s.top_k <= 256 && s.top_k < n
                                  ? SamplePath::kCandidates
                                  : SamplePath::kVocabulary;
      EXPECT_EQ(sampler.path(), path) << "top_k " << s.top_k;
      if (s.temperature == 0.0f) {
        EXPECT_EQ(token, ArgMax(logits));
      }
      EXPECT_EQ(sampler.ticket(), 0u);
    }
  }
}

// Ties, NaN and -inf among the candidates: a block whose top-40 boundary is a
// logit 300 tokens share holds too many, and the decision falls back to the
// vocabulary; NaN never survives, -inf survives top-k only as a tie. Either
// way the host's token.
TEST_F(KernelsGpuTest, SamplingWithTiesNansAndInfinitiesEqualsTheHostDecision) {
  std::mt19937 rng(13);
  const int32_t n = 20000;
  DeviceArray<int32_t> d_step(std::vector<int32_t>{3}), d_token(1);
  SamplingParams params;
  params.temperature = 0.9f;
  params.top_k = 40;
  params.top_p = 0.95f;
  params.seed = 5;
  DeviceArray<SamplingParams> d_params(std::vector<SamplingParams>{params});
  Sampler sampler(n);
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE("variant " + std::to_string(variant));
    std::vector<float> logits = Gaussian(rng, n, 2.0f);
    if (variant == 0) {
      // Block 1 (tokens 4096..8191): 300 tokens share its largest logit.
      for (int32_t i = 5000; i < 5300; ++i) logits[i] = 12.0f;
    } else if (variant == 1) {
      for (int32_t i = 0; i < n; i += 3) logits[i] = NAN;
      for (int32_t i = 1; i < n; i += 7) logits[i] = -INFINITY;
    } else {
      // Fewer logits that are not NaN than k in the first four blocks: each
      // keeps all of its own.
      for (int32_t i = 0; i < 16384; ++i) logits[i] = i % 200 == 0 ? 1.0f : NAN;
    }
    DeviceArray<float> d_logits(logits);
    ASSERT_EQ(sampler.Launch(d_logits.get(), d_params.get(), d_step.get(), d_token.get(), stream_),
              cudaSuccess);
    Sync();
    EXPECT_EQ(d_token.Download()[0], sample_token(logits.data(), n, params, sample_uniform(5, 3)));
    EXPECT_EQ(sampler.path(), variant == 0 ? SamplePath::kVocabulary : SamplePath::kCandidates);
  }
}

// A step starts in its embed and ends in its sample: the embedded row is the
// prompt's token while the step is inside the prompt, then the last sample;
// the sample's last block writes out_tokens[step], advances the step and
// counts it. Table row r is r everywhere, so the output names the token.
TEST_F(KernelsGpuTest, StepBookkeepingTeacherForcesThePromptThenFeedsSamples) {
  const int32_t rows = 200, cols = 32;
  std::vector<float> table(static_cast<size_t>(rows) * cols);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<float>(i / cols);
  const std::vector<int32_t> prompt = {11, 22, 33};
  DeviceArray<float> d_table(table), d_out(cols), d_logits(rows);
  DeviceArray<int32_t> d_prompt(prompt), d_n_prompt(std::vector<int32_t>{3}), d_sampled(1),
      d_step(std::vector<int32_t>{0}), d_pos(1), d_out_tokens(6);
  DeviceArray<DeviceCounters> d_counters(std::vector<DeviceCounters>{DeviceCounters{}});
  DeviceArray<SamplingParams> d_params(std::vector<SamplingParams>{SamplingParams{}});  // greedy
  const StepStart start{d_prompt.get(), d_n_prompt.get(), d_sampled.get(), d_step.get(),
                        d_pos.get()};
  const StepEnd end{d_step.get(), d_out_tokens.get(), d_counters.get()};
  Sampler sampler(rows);
  int32_t fed = -1;
  for (int32_t s = 0; s < 6; ++s) {
    ASSERT_EQ(launch_embed_step(DeviceView(reinterpret_cast<const uint8_t*>(d_table.get()),
                                           GgmlType::kF32, rows, cols),
                                start, d_out.get(), stream_),
              cudaSuccess);
    Sync();
    const float embedded = d_out.Download()[0];
    EXPECT_EQ(embedded, static_cast<float>(s < 3 ? prompt[s] : fed)) << s;
    EXPECT_EQ(d_pos.Download()[0], s);
    // Logits whose argmax is 100 + s.
    std::vector<float> logits(rows, 0.0f);
    logits[100 + s] = 1.0f;
    d_logits.Upload(logits);
    ASSERT_EQ(sampler.Launch(d_logits.get(), d_params.get(), d_step.get(), d_sampled.get(),
                             stream_, end),
              cudaSuccess);
    Sync();
    fed = 100 + s;
    EXPECT_EQ(d_sampled.Download()[0], fed);
    EXPECT_EQ(d_step.Download()[0], s + 1);
  }
  EXPECT_EQ(d_out_tokens.Download(), (std::vector<int32_t>{100, 101, 102, 103, 104, 105}));
  EXPECT_EQ(d_counters.Download()[0].steps, 6u);
  // An end whose step is not the step the sample reads is refused.
  DeviceArray<int32_t> d_other_step(std::vector<int32_t>{0});
  EXPECT_EQ(sampler.Launch(d_logits.get(), d_params.get(), d_other_step.get(), d_sampled.get(),
                           stream_, end),
            cudaErrorInvalidValue);
}

TEST_F(KernelsGpuTest, RecordLogitsWritesTheRowOfTheStepUntilTheRecordIsFull) {
  std::mt19937 rng(9);
  const int32_t n = 300, record_steps = 3;
  DeviceArray<float> d_record(static_cast<size_t>(n) * record_steps);
  DeviceArray<int32_t> d_step(1);
  std::vector<std::vector<float>> rows;
  for (int32_t step = 0; step < record_steps + 1; ++step) {
    rows.push_back(Gaussian(rng, n));
    DeviceArray<float> d_logits(rows.back());
    d_step.Upload({step});
    ASSERT_EQ(launch_record_logits(d_logits.get(), n, d_step.get(), record_steps, d_record.get(),
                                   stream_),
              cudaSuccess);
    Sync();
  }
  // The fourth step is past the record and wrote nothing.
  const std::vector<float> record = d_record.Download();
  for (int32_t step = 0; step < record_steps; ++step) {
    for (int32_t i = 0; i < n; ++i) {
      ASSERT_EQ(record[static_cast<size_t>(step * n + i)], rows[static_cast<size_t>(step)][static_cast<size_t>(i)])
          << "step " << step << " logit " << i;
    }
  }
  EXPECT_EQ(launch_record_logits(d_record.get(), n, d_step.get(), 0, d_record.get(), stream_),
            cudaErrorInvalidValue);
}

TEST_F(KernelsGpuTest, LaunchersRejectBadArguments) {
  DeviceArray<float> d_x(512);
  DeviceArray<int32_t> d_i(8);
  DeviceArray<block_q8_1> d_q(16);
  const DeviceMatrix iq2{d_x.get(), GgmlType::kIQ2_XXS, 256, 1, 66};
  EXPECT_EQ(launch_matvec(iq2, d_x.get(), d_q.get(), nullptr, d_x.get(), stream_),
            cudaErrorInvalidValue);
  // A quant type without its q8_1 input, an element type without its f32 one.
  const DeviceMatrix q8{d_x.get(), GgmlType::kQ8_0, 64, 2, 68};
  EXPECT_EQ(launch_matvec(q8, d_x.get(), nullptr, nullptr, d_x.get(), stream_),
            cudaErrorInvalidValue);
  const DeviceMatrix f32{d_x.get(), GgmlType::kF32, 64, 2, 256};
  EXPECT_EQ(launch_matvec(f32, nullptr, d_q.get(), nullptr, d_x.get(), stream_),
            cudaErrorInvalidValue);
  const DeviceMatrix f32_odd{d_x.get(), GgmlType::kF32, 62, 2, 248};  // not a multiple of 4
  EXPECT_EQ(launch_matvec(f32_odd, d_x.get(), nullptr, nullptr, d_x.get(), stream_),
            cudaErrorInvalidValue);
  // The hazard step: a layer past the state's, a pool past the rank's slot bits
  // or below k slots, a missing array.
  int32_t* i = d_i.get();
  uint32_t* u = reinterpret_cast<uint32_t*>(d_i.get());
  DeviceArray<DeviceCounters> d_counters(std::vector<DeviceCounters>{DeviceCounters{}});
  const HazardState hazard = {.table = i, .owner = i, .last_visit = i, .frequency = u,
                              .long_frequency = u, .visits = i, .cell_hits = u,
                              .cell_trials = u, .cell_cost = d_x.get(), .n_layer = 2,
                              .n_expert = 4, .k = 2};
  uint8_t* missed = reinterpret_cast<uint8_t*>(d_i.get());
  uint64_t* ranks = reinterpret_cast<uint64_t*>(d_x.get());
  auto hazard_step = [&](const HazardState& s, HazardPool pool, int32_t layer) {
    return launch_hazard_step(s, pool, layer, i, 2, i, i, missed, i, ranks, d_counters.get(),
                              stream_);
  };
  EXPECT_EQ(hazard_step(hazard, HazardPool{0, 4}, 2), cudaErrorInvalidValue);
  EXPECT_EQ(hazard_step(hazard, HazardPool{kHazardMaxSlots - 2, 4}, 0), cudaErrorInvalidValue);
  EXPECT_EQ(hazard_step(hazard, HazardPool{0, 1}, 0), cudaErrorInvalidValue);
  HazardState no_cost = hazard;
  no_cost.cell_cost = nullptr;
  EXPECT_EQ(hazard_step(no_cost, HazardPool{0, 4}, 0), cudaErrorInvalidValue);
  EXPECT_EQ(launch_hazard_step(hazard, HazardPool{0, 4}, 0, i, 2, i, i, missed, i, nullptr,
                               d_counters.get(), stream_),
            cudaErrorInvalidValue);
  const DeviceMatrix partial_block{d_x.get(), GgmlType::kQ4_K, 300, 1, 1000};
  EXPECT_EQ(launch_matvec(partial_block, d_x.get(), d_q.get(), nullptr, d_x.get(), stream_),
            cudaErrorInvalidValue);
  // The fused QK-norm and RoPE: an odd head_dim, no tickets, a QK-norm without
  // its weights, q rotated in place.
  unsigned int* tickets = reinterpret_cast<unsigned int*>(d_i.get());
  auto qkv = [&](int32_t head_dim, const QkvRope& rope, unsigned int* qkv_tickets) {
    const DeviceMatrix wq{d_x.get(), GgmlType::kF32, 64, 2 * head_dim, 256};
    const DeviceMatrix wkv{d_x.get(), GgmlType::kF32, 64, head_dim, 256};
    QkvRope r = rope;
    r.head_dim = head_dim;
    return launch_qkv(wq, wkv, wkv, d_x.get(), nullptr, nullptr, nullptr, nullptr, d_x.get(),
                      d_x.get(), d_x.get(), &r, NormEpilogue{}, qkv_tickets, stream_);
  };
  DeviceArray<float> d_cos_sin(rope_table_floats(64, 1));
  QkvRope rope;
  rope.pos = d_i.get();
  rope.n_head = 2;
  rope.n_head_kv = 1;
  rope.cos_sin = d_cos_sin.get();
  rope.q_out = d_x.get() + 256;
  rope.k_cache = rope.v_cache = d_x.get();
  EXPECT_EQ(qkv(63, rope, tickets), cudaErrorInvalidValue);
  EXPECT_EQ(qkv(64, rope, nullptr), cudaErrorInvalidValue);
  QkvRope bad = rope;
  bad.cos_sin = nullptr;  // RoPE's table
  EXPECT_EQ(qkv(64, bad, tickets), cudaErrorInvalidValue);
  bad = rope;
  bad.use_norm = true;
  EXPECT_EQ(qkv(64, bad, tickets), cudaErrorInvalidValue);
  bad = rope;
  bad.q_out = d_x.get();
  EXPECT_EQ(qkv(64, bad, tickets), cudaErrorInvalidValue);
  // Attention: KV heads not dividing the heads, 65536 splits of 128 positions
  // (past CUDA's gridDim.y limit), no tickets, q8_1 output blocks of an output
  // not a multiple of 32 long, an f16 cache not 16-byte aligned (keys or
  // values) or with heads not a multiple of 8 wide (its 16-byte loads).
  auto attention = [&](int32_t n_head, int32_t n_head_kv, int32_t head_dim, int32_t max_ctx,
                       unsigned int* attention_tickets, block_q8_1* out_q, const void* k,
                       const void* v = nullptr) {
    return launch_attention_decode(d_x.get(), k, v != nullptr ? v : d_x.get(), true, d_i.get(),
                                   n_head, n_head_kv, head_dim, max_ctx, 1.0f, AttentionMask{},
                                   d_x.get(), attention_tickets, d_x.get(), out_q, stream_);
  };
  EXPECT_EQ(attention(6, 4, 64, 16, tickets, nullptr, d_x.get()), cudaErrorInvalidValue);
  EXPECT_EQ(attention(4, 4, 64, 65536 * 128, tickets, nullptr, d_x.get()), cudaErrorInvalidValue);
  EXPECT_EQ(attention(4, 4, 64, 16, nullptr, nullptr, d_x.get()), cudaErrorInvalidValue);
  EXPECT_EQ(attention(4, 4, 10, 16, tickets, d_q.get(), d_x.get()), cudaErrorInvalidValue);
  EXPECT_EQ(attention(4, 4, 64, 16, tickets, nullptr, d_x.get() + 1), cudaErrorInvalidValue);
  EXPECT_EQ(attention(4, 4, 64, 16, tickets, nullptr, d_x.get(), d_x.get() + 1),
            cudaErrorInvalidValue);
  EXPECT_EQ(attention(4, 4, 12, 16, tickets, nullptr, d_x.get()), cudaErrorInvalidValue);
  // Prefill attention: no rows, rows past gridDim.y, an f16 head not a multiple
  // of 8, a negative window.
  EXPECT_EQ(launch_attention_prefill(d_x.get(), d_x.get(), d_x.get(), true, d_i.get(), 0, 4, 4, 64,
                                     1.0f, AttentionMask{}, d_x.get(), stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(launch_attention_prefill(d_x.get(), d_x.get(), d_x.get(), true, d_i.get(), 65536, 4, 4,
                                     64, 1.0f, AttentionMask{}, d_x.get(), stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(launch_attention_prefill(d_x.get(), d_x.get(), d_x.get(), true, d_i.get(), 1, 4, 4, 12,
                                     1.0f, AttentionMask{}, d_x.get(), stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(launch_attention_prefill(d_x.get(), d_x.get(), d_x.get(), true, d_i.get(), 1, 4, 4, 64,
                                     1.0f, AttentionMask{-1}, d_x.get(), stream_),
            cudaErrorInvalidValue);
  // A residual norm without tickets.
  NormEpilogue norm;
  norm.weight = d_x.get();
  norm.out = d_x.get();
  EXPECT_EQ(
      launch_matvec_residual(f32, d_x.get(), nullptr, nullptr, d_x.get(), norm, nullptr, stream_),
      cudaErrorInvalidValue);
  // A router's k past its experts.
  RouterEpilogue router;
  router.k = 3;
  router.experts = d_i.get();
  router.weights = d_x.get();
  EXPECT_EQ(launch_router(f32, d_x.get(), nullptr, d_x.get(), router, tickets, stream_),
            cudaErrorInvalidValue);
  // Sampling without settings, scratch or tickets, with scratch not 16-byte
  // aligned, and past 2^22 logits.
  DeviceArray<SamplingParams> d_params(1);
  DeviceArray<uint8_t> d_scratch(sample_scratch_bytes(10));
  auto sample = [&](const SamplingParams* params, void* scratch, unsigned int* sample_tickets,
                    int32_t n) {
    return launch_sample(d_x.get(), n, params, d_i.get(), scratch, sample_tickets, d_i.get(),
                         StepEnd{}, stream_);
  };
  EXPECT_EQ(sample(nullptr, d_scratch.get(), tickets, 10), cudaErrorInvalidValue);
  EXPECT_EQ(sample(d_params.get(), nullptr, tickets, 10), cudaErrorInvalidValue);
  EXPECT_EQ(sample(d_params.get(), d_scratch.get(), nullptr, 10), cudaErrorInvalidValue);
  EXPECT_EQ(sample(d_params.get(), d_scratch.get() + 4, tickets, 10), cudaErrorInvalidValue);
  EXPECT_EQ(sample(d_params.get(), d_scratch.get(), tickets, (1 << 22) + 1), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace moegraph
