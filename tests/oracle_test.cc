// The CPU oracle: each op against values worked out by hand, batch independence
// of every op, a hand-built MoE layer, and whole forwards of every architecture
// on synthetic fixtures (KV-cache decode equals one prefill, errors, quant types).
#include "reference/oracle.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "loader/fixture.h"
#include "loader/gguf.h"
#include "loader/gguf_writer.h"
#include "loader/model_config.h"
#include "loader/quant.h"
#include "loader/quantize.h"
#include "reference/ops.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::BitEqual;
using testing_util::LoadedModel;
using testing_util::LoadFixture;
using testing_util::MessageHas;

WeightView F32View(const std::vector<float>& w, int64_t cols) {
  WeightView v;
  v.data = reinterpret_cast<const uint8_t*>(w.data());
  v.type = GgmlType::kF32;
  v.cols = cols;
  v.rows = static_cast<int64_t>(w.size()) / cols;
  v.row_bytes = static_cast<size_t>(cols) * sizeof(float);
  return v;
}

std::vector<float> RandomVector(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// ---- ops against hand-computed values ----

TEST(OpsTest, RmsNormScalesByRootMeanSquareThenWeight) {
  // mean(3^2, 4^2) = 12.5, sqrt(12.5) = 3.5355339; y = (3, 4) / 3.5355339 * (1, 2).
  const std::vector<float> x = {3, 4};
  const std::vector<float> w = {1, 2};
  std::vector<float> y(2);
  RmsNorm(x, w, 0.0f, absl::MakeSpan(y));
  EXPECT_NEAR(y[0], 0.8485281f, 1e-6);
  EXPECT_NEAR(y[1], 2.2627417f, 1e-6);
  // eps joins the mean: sqrt(12.5 + 3.5) = 4.
  RmsNorm(x, w, 3.5f, absl::MakeSpan(y));
  EXPECT_FLOAT_EQ(y[0], 0.75f);
  EXPECT_FLOAT_EQ(y[1], 2.0f);
}

TEST(OpsTest, MatMulDotsEachWeightRowWithEachInputRow) {
  // w rows (1,2,3), (4,5,6); x rows (1,0,-1), (0.5,0.5,0.5).
  // Row 0: 1-3 = -2, 4-6 = -2. Row 1: 0.5*6 = 3, 0.5*15 = 7.5.
  const std::vector<float> w = {1, 2, 3, 4, 5, 6};
  const std::vector<float> x = {1, 0, -1, 0.5f, 0.5f, 0.5f};
  std::vector<float> y(4);
  MatMul(F32View(w, 3), x, absl::MakeSpan(y));
  EXPECT_EQ(y, (std::vector<float>{-2, -2, 3, 7.5f}));
}

TEST(OpsTest, MatMulDequantizesQ8_0Rows) {
  // One q8_0 block: d = 0.5 (f16 0x3800), quants 1..32. Against all-ones x the
  // dot is 0.5 * (1 + ... + 32) = 0.5 * 528 = 264.
  block_q8_0 block;
  block.d = 0x3800;
  for (int i = 0; i < QK8_0; ++i) block.qs[i] = static_cast<int8_t>(i + 1);
  WeightView v;
  v.data = reinterpret_cast<const uint8_t*>(&block);
  v.type = GgmlType::kQ8_0;
  v.cols = QK8_0;
  v.rows = 1;
  v.row_bytes = sizeof(block);
  const std::vector<float> x(QK8_0, 1.0f);
  std::vector<float> y(1);
  MatMul(v, x, absl::MakeSpan(y));
  EXPECT_EQ(y[0], 264.0f);
}

TEST(OpsTest, AddBiasAddsToEveryRow) {
  std::vector<float> x = {1, 2, 3, 4};
  AddBias(std::vector<float>{10, 20}, absl::MakeSpan(x));
  EXPECT_EQ(x, (std::vector<float>{11, 22, 13, 24}));
}

TEST(OpsTest, RopeNormRotatesAdjacentPairs) {
  // head_dim 4, base 10000: pair 0 turns by pos * 1, pair 1 by pos * 10000^(-2/4) = pos * 0.01.
  // At position 1, (1, 0) becomes (cos t, sin t).
  std::vector<float> x = {1, 0, 1, 0};
  const std::vector<int32_t> pos = {1};
  Rope(absl::MakeSpan(x), 1, 4, pos, 10000.0f, RopeType::kNorm);
  EXPECT_NEAR(x[0], std::cos(1.0), 1e-7);
  EXPECT_NEAR(x[1], std::sin(1.0), 1e-7);
  EXPECT_NEAR(x[2], std::cos(0.01), 1e-7);
  EXPECT_NEAR(x[3], std::sin(0.01), 1e-7);
}

TEST(OpsTest, RopeNeoxRotatesHalvesAgainstEachOther) {
  // NEOX pairs (x[0], x[2]) by 1 rad and (x[1], x[3]) by 0.01 rad at position 1.
  std::vector<float> x = {1, 1, 0, 0};
  const std::vector<int32_t> pos = {1};
  Rope(absl::MakeSpan(x), 1, 4, pos, 10000.0f, RopeType::kNeox);
  EXPECT_NEAR(x[0], std::cos(1.0), 1e-7);
  EXPECT_NEAR(x[2], std::sin(1.0), 1e-7);
  EXPECT_NEAR(x[1], std::cos(0.01), 1e-7);
  EXPECT_NEAR(x[3], std::sin(0.01), 1e-7);
}

TEST(OpsTest, RopeAtPositionZeroIsIdentityAndRowsUseTheirOwnPosition) {
  // Two heads, two rows: row 0 at position 0 stays; row 1 at position 2 turns
  // pair 0 of each head by 2 rad: (0, 1) -> (-sin 2, cos 2).
  std::vector<float> x = {0.5f, -2, 0, 1, 0, 1, 0, 1};
  const std::vector<int32_t> pos = {0, 2};
  Rope(absl::MakeSpan(x), 2, 2, pos, 10000.0f, RopeType::kNorm);
  EXPECT_EQ(x[0], 0.5f);
  EXPECT_EQ(x[1], -2.0f);
  EXPECT_EQ(x[2], 0.0f);
  EXPECT_EQ(x[3], 1.0f);
  for (int h = 0; h < 2; ++h) {
    EXPECT_NEAR(x[4 + 2 * h], -std::sin(2.0), 1e-7);
    EXPECT_NEAR(x[5 + 2 * h], std::cos(2.0), 1e-7);
  }
}

TEST(OpsTest, SoftmaxNormalisesExponentials) {
  // exp(0), exp(ln 2), exp(ln 3) = 1, 2, 3; sum 6. The second row is the first
  // shifted by 1000: same result, because the max is subtracted first.
  std::vector<float> x = {0,    std::log(2.0f),        std::log(3.0f),
                          1000, 1000 + std::log(2.0f), 1000 + std::log(3.0f)};
  Softmax(3, absl::MakeSpan(x));
  for (int r = 0; r < 2; ++r) {
    // The second row's logits carry float rounding at 1000 (spacing 6e-5), hence 1e-4.
    EXPECT_NEAR(x[3 * r + 0], 1.0 / 6, 1e-4);
    EXPECT_NEAR(x[3 * r + 1], 2.0 / 6, 1e-4);
    EXPECT_NEAR(x[3 * r + 2], 3.0 / 6, 1e-4);
  }
}

TEST(OpsTest, TopKIsAStableDescendingArgsort) {
  const std::vector<float> row = {0.1f, 0.5f, 0.5f, 0.2f, 0.5f};
  EXPECT_EQ(TopK(row, 2), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(TopK(row, 4), (std::vector<int32_t>{1, 2, 4, 3}));
  EXPECT_EQ(TopK(row, 0), (std::vector<int32_t>{}));
}

TEST(OpsTest, ArgMaxTiesGoToTheLowestIndex) {
  EXPECT_EQ(ArgMax(std::vector<float>{1, 3, 3, 2}), 1);
  EXPECT_EQ(ArgMax(std::vector<float>{-1, -5}), 0);
  EXPECT_EQ(ArgMax(std::vector<float>{0, 0, 7}), 2);
}

TEST(OpsTest, SiluSigmoidSwiglu) {
  // sigmoid(1) = 1 / (1 + e^-1) = 0.7310586; silu(x) = x sigmoid(x).
  EXPECT_EQ(Sigmoid(0), 0.5f);
  EXPECT_NEAR(Sigmoid(1), 0.7310586f, 1e-7);
  EXPECT_EQ(Silu(0), 0.0f);
  EXPECT_NEAR(Silu(1), 0.7310586f, 1e-7);
  EXPECT_NEAR(Silu(-2), -2 * 0.1192029f, 1e-7);
  // swiglu(gate, up) = silu(gate) * up: (0 * 5, 0.7310586 * 2).
  std::vector<float> out(2);
  Swiglu(std::vector<float>{0, 1}, std::vector<float>{5, 2}, absl::MakeSpan(out));
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_NEAR(out[1], 1.4621172f, 1e-6);
}

TEST(OpsTest, AttentionIsCausalAndSharesKvHeadsAcrossTheGroup) {
  // Two query heads share one KV head (head_dim 2). Cache: k0 = (1, 0), k1 = (0, 1),
  // v0 = (1, 2), v1 = (3, 4).
  const std::vector<float> k = {1, 0, 0, 1};
  const std::vector<float> v = {1, 2, 3, 4};
  // Row 0 at position 0 sees only k0: every head returns v0.
  // Row 1 at position 1, scale 1: head 0 q = (1, 0) scores (1, 0) ->
  // weights (e, 1) / (e + 1); head 1 q = (0, 0) scores (0, 0) -> mean of v0, v1 = (2, 3).
  const std::vector<float> q = {5, -3, 2, 2, 1, 0, 0, 0};
  const std::vector<int32_t> pos = {0, 1};
  std::vector<float> out(q.size());
  Attention(q, pos, k, v, 2, 1, 2, 1.0f, absl::MakeSpan(out));
  const double e = std::exp(1.0);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], 2.0f);
  EXPECT_EQ(out[2], 1.0f);
  EXPECT_EQ(out[3], 2.0f);
  EXPECT_NEAR(out[4], (e * 1 + 3) / (e + 1), 1e-6);
  EXPECT_NEAR(out[5], (e * 2 + 4) / (e + 1), 1e-6);
  EXPECT_NEAR(out[6], 2.0, 1e-6);
  EXPECT_NEAR(out[7], 3.0, 1e-6);
}

TEST(OpsTest, AttentionHeadsReadTheirOwnKvHeadWithoutGrouping) {
  // n_head = n_head_kv = 2, one cached position: each head returns its own v.
  const std::vector<float> k = {1, 0, 0, 1};
  const std::vector<float> v = {1, 2, 7, 8};
  const std::vector<float> q = {1, 1, 1, 1};
  std::vector<float> out(4);
  Attention(q, std::vector<int32_t>{0}, k, v, 2, 2, 2, 0.5f, absl::MakeSpan(out));
  EXPECT_EQ(out, (std::vector<float>{1, 2, 7, 8}));
}

// ---- rows of a batch are independent, bit for bit ----

TEST(OpsBatchTest, EveryOpOverABatchEqualsTheOpRowByRow) {
  constexpr int kRows = 5;
  constexpr int kLen = 256;  // one q4_K super-block per weight row
  const std::vector<float> x = RandomVector(kRows * kLen, 1);
  const std::vector<float> norm_w = RandomVector(kLen, 2);

  // A quantized weight: 3 rows of q4_K.
  const std::vector<float> w_f32 = RandomVector(3 * kLen, 3);
  std::vector<uint8_t> w_q(3 * ggml_row_size(GgmlType::kQ4_K, kLen));
  for (int r = 0; r < 3; ++r) {
    quantize_row(GgmlType::kQ4_K, w_f32.data() + r * kLen,
                 w_q.data() + r * ggml_row_size(GgmlType::kQ4_K, kLen), kLen);
  }
  WeightView wq;
  wq.data = w_q.data();
  wq.type = GgmlType::kQ4_K;
  wq.cols = kLen;
  wq.rows = 3;
  wq.row_bytes = ggml_row_size(GgmlType::kQ4_K, kLen);

  std::vector<float> batch_norm(x.size()), batch_mm(kRows * 3);
  RmsNorm(x, norm_w, 1e-6f, absl::MakeSpan(batch_norm));
  MatMul(wq, x, absl::MakeSpan(batch_mm));
  std::vector<float> batch_soft = x;
  Softmax(kLen, absl::MakeSpan(batch_soft));
  std::vector<int32_t> positions(kRows);
  for (int t = 0; t < kRows; ++t) positions[t] = 3 * t + 1;
  std::vector<float> batch_rope = x;
  Rope(absl::MakeSpan(batch_rope), 4, kLen / 4, positions, 1e6f, RopeType::kNeox);

  for (int t = 0; t < kRows; ++t) {
    const std::vector<float> row(x.begin() + t * kLen, x.begin() + (t + 1) * kLen);
    std::vector<float> norm(kLen), mm(3);
    RmsNorm(row, norm_w, 1e-6f, absl::MakeSpan(norm));
    MatMul(wq, row, absl::MakeSpan(mm));
    std::vector<float> soft = row;
    Softmax(kLen, absl::MakeSpan(soft));
    std::vector<float> rope = row;
    Rope(absl::MakeSpan(rope), 4, kLen / 4, std::vector<int32_t>{positions[t]}, 1e6f,
         RopeType::kNeox);
    auto slice = [&](const std::vector<float>& v, int len) {
      return std::vector<float>(v.begin() + t * len, v.begin() + (t + 1) * len);
    };
    EXPECT_TRUE(BitEqual(norm, slice(batch_norm, kLen))) << "rms_norm row " << t;
    EXPECT_TRUE(BitEqual(mm, slice(batch_mm, 3))) << "matmul row " << t;
    EXPECT_TRUE(BitEqual(soft, slice(batch_soft, kLen))) << "softmax row " << t;
    EXPECT_TRUE(BitEqual(rope, slice(batch_rope, kLen))) << "rope row " << t;
  }
}

TEST(OpsBatchTest, AttentionOverABatchEqualsOneQueryAtATime) {
  constexpr int kHead = 4, kHeadKv = 2, kDim = 8, kCache = 6;
  const std::vector<float> k = RandomVector(kCache * kHeadKv * kDim, 4);
  const std::vector<float> v = RandomVector(kCache * kHeadKv * kDim, 5);
  const std::vector<float> q = RandomVector(3 * kHead * kDim, 6);
  const std::vector<int32_t> pos = {3, 4, 5};
  std::vector<float> batch(q.size());
  Attention(q, pos, k, v, kHead, kHeadKv, kDim, 0.35f, absl::MakeSpan(batch));
  for (int t = 0; t < 3; ++t) {
    const std::vector<float> qt(q.begin() + t * kHead * kDim, q.begin() + (t + 1) * kHead * kDim);
    // Only the cache rows the query may see: nothing later can leak in.
    const size_t seen = static_cast<size_t>(pos[t] + 1) * kHeadKv * kDim;
    const std::vector<float> kt(k.begin(), k.begin() + seen), vt(v.begin(), v.begin() + seen);
    std::vector<float> one(qt.size());
    Attention(qt, std::vector<int32_t>{pos[t]}, kt, vt, kHead, kHeadKv, kDim, 0.35f,
              absl::MakeSpan(one));
    EXPECT_TRUE(BitEqual(one, std::vector<float>(batch.begin() + t * kHead * kDim,
                                                 batch.begin() + (t + 1) * kHead * kDim)))
        << "row " << t;
  }
}

// ---- a hand-built MoE layer ----

std::vector<uint8_t> FloatBytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(float));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// 4 experts, top-2, n_embd 2, n_ff 2, all f32. Expert e: gate rows (1, 0), (1, 1);
// up = (e + 1) * identity; down rows (1, 1), (0, 1). The router rows give the
// logits (0, x0, x1, 0.5 x0). Optionally a qwen2moe shared expert: gate, up,
// down = identity, ffn_gate_inp_shexp = (0.5, -1).
class HandMoeTest : public ::testing::Test {
 protected:
  void Build(bool norm_topk, bool shared) {
    GgufWriter w;
    w.AddTensor("router", GgmlType::kF32, {2, 4}, FloatBytes({0, 0, 1, 0, 0, 1, 0.5f, 0}));
    std::vector<float> gate, up, down;
    for (int e = 0; e < 4; ++e) {
      const float c = static_cast<float>(e + 1);
      gate.insert(gate.end(), {1, 0, 1, 1});
      up.insert(up.end(), {c, 0, 0, c});
      down.insert(down.end(), {1, 1, 0, 1});
    }
    w.AddTensor("gate_exps", GgmlType::kF32, {2, 2, 4}, FloatBytes(gate));
    w.AddTensor("up_exps", GgmlType::kF32, {2, 2, 4}, FloatBytes(up));
    w.AddTensor("down_exps", GgmlType::kF32, {2, 2, 4}, FloatBytes(down));
    if (shared) {
      w.AddTensor("shexp_gate_inp", GgmlType::kF32, {2}, FloatBytes({0.5f, -1}));
      for (const char* name : {"shexp_gate", "shexp_up", "shexp_down"}) {
        w.AddTensor(name, GgmlType::kF32, {2, 2}, FloatBytes({1, 0, 0, 1}));
      }
    }
    const std::vector<uint8_t> bytes = w.Serialize();
    absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes("hand_moe", bytes);
    ASSERT_TRUE(file.ok()) << file.status();
    file_ = std::move(*file);

    model_.file = file_.get();
    model_.config.n_layer = 1;
    model_.config.n_embd = 2;
    model_.config.n_expert = 4;
    model_.config.n_expert_used = 2;
    model_.config.n_ff_exp = 2;
    model_.config.n_ff_shexp = shared ? 2 : 0;
    model_.config.norm_topk_prob = norm_topk;
    model_.layers.resize(1);
    LayerTensors& lt = model_.layers[0];
    lt.router = file_->FindTensor("router");
    lt.gate_exps = file_->FindTensor("gate_exps");
    lt.up_exps = file_->FindTensor("up_exps");
    lt.down_exps = file_->FindTensor("down_exps");
    if (shared) {
      lt.shexp_gate_inp = file_->FindTensor("shexp_gate_inp");
      lt.shexp_gate = file_->FindTensor("shexp_gate");
      lt.shexp_up = file_->FindTensor("shexp_up");
      lt.shexp_down = file_->FindTensor("shexp_down");
    }
  }

  // Expert e on x = (1, 2): gate (1, 3), up (e+1) (1, 2),
  // h = (silu(1) (e+1), silu(3) 2 (e+1)), down (h0 + h1, h1).
  static std::vector<double> ExpertOut(int e) {
    const double h0 = Silu(1) * (e + 1.0);
    const double h1 = Silu(3) * 2.0 * (e + 1.0);
    return {h0 + h1, h1};
  }

  std::unique_ptr<GgufFile> file_;
  Model model_;
};

TEST_F(HandMoeTest, SoftmaxTopTwoWithoutRenormalisation) {
  ASSERT_NO_FATAL_FAILURE(Build(false, false));
  // x = (1, 2): logits (0, 1, 2, 0.5), so experts 2 then 1 with softmax weights
  // e^2 / Z and e^1 / Z, Z = 1 + e + e^2 + e^0.5 (olmoe, qwen2moe: norm_w false).
  const std::vector<float> x = {1, 2};
  std::vector<float> out(2);
  std::vector<int32_t> selected;
  MoeFfn(model_, 0, x, absl::MakeSpan(out), &selected);
  EXPECT_EQ(selected, (std::vector<int32_t>{2, 1}));
  const double z = 1 + std::exp(1.0) + std::exp(2.0) + std::exp(0.5);
  const double w2 = std::exp(2.0) / z, w1 = std::exp(1.0) / z;
  for (int i = 0; i < 2; ++i) {
    EXPECT_NEAR(out[i], w2 * ExpertOut(2)[i] + w1 * ExpertOut(1)[i], 1e-5) << i;
  }
}

TEST_F(HandMoeTest, RenormalisedTopTwoWeightsSumToOne) {
  ASSERT_NO_FATAL_FAILURE(Build(true, false));
  // norm_w (qwen3moe, mixtral): w2 = e^2 / (e + e^2) = e / (1 + e), w1 = 1 / (1 + e).
  const std::vector<float> x = {1, 2};
  std::vector<float> out(2);
  MoeFfn(model_, 0, x, absl::MakeSpan(out));
  const double e = std::exp(1.0);
  for (int i = 0; i < 2; ++i) {
    EXPECT_NEAR(out[i], e / (1 + e) * ExpertOut(2)[i] + 1 / (1 + e) * ExpertOut(1)[i], 1e-5);
  }
}

TEST_F(HandMoeTest, SharedExpertAddsWithASigmoidGate) {
  ASSERT_NO_FATAL_FAILURE(Build(false, true));
  // Shared logit 0.5 * 1 - 1 * 2 = -1.5; shared expert = silu(x) * x = (silu(1), 2 silu(2)).
  const std::vector<float> x = {1, 2};
  std::vector<float> out(2);
  MoeFfn(model_, 0, x, absl::MakeSpan(out));
  const double z = 1 + std::exp(1.0) + std::exp(2.0) + std::exp(0.5);
  const double w2 = std::exp(2.0) / z, w1 = std::exp(1.0) / z;
  const double gate = 1 / (1 + std::exp(1.5));
  const double shared[2] = {Silu(1), 2.0 * Silu(2)};
  for (int i = 0; i < 2; ++i) {
    EXPECT_NEAR(out[i], w2 * ExpertOut(2)[i] + w1 * ExpertOut(1)[i] + gate * shared[i], 1e-5);
  }
}

TEST_F(HandMoeTest, RoutingFollowsTheInput) {
  ASSERT_NO_FATAL_FAILURE(Build(true, false));
  // x = (2, -1): logits (0, 2, -1, 1): experts 1 then 3; batch of both rows.
  const std::vector<float> x = {1, 2, 2, -1};
  std::vector<float> out(4);
  std::vector<int32_t> selected;
  MoeFfn(model_, 0, x, absl::MakeSpan(out), &selected);
  EXPECT_EQ(selected, (std::vector<int32_t>{2, 1, 1, 3}));
}

// ---- whole forwards on fixtures ----

struct ArchCase {
  const char* name;
  Arch arch;
  bool legacy_experts;
  int n_head_kv;  // olmoe has no GQA: its k_norm spans n_embd
};

void PrintTo(const ArchCase& c, std::ostream* os) { *os << c.name; }

class OracleArchTest : public ::testing::TestWithParam<ArchCase> {
 protected:
  void SetUp() override {
    FixtureSpec spec;
    spec.arch = GetParam().arch;
    spec.legacy_experts = GetParam().legacy_experts;
    spec.n_head_kv = GetParam().n_head_kv;
    spec.n_vocab = 128;
    spec.router_skew = 1.0f;
    spec.seed = 7;
    spec.full_attention_interval = 2;  // qwen35moe: a Gated DeltaNet, then gated attention
    absl::StatusOr<std::unique_ptr<LoadedModel>> loaded = LoadFixture(spec);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    loaded_ = std::move(*loaded);
  }

  std::unique_ptr<Oracle> NewOracle(int max_ctx) {
    absl::StatusOr<std::unique_ptr<Oracle>> oracle = Oracle::Create(loaded_->model, max_ctx);
    EXPECT_TRUE(oracle.ok()) << oracle.status();
    return oracle.ok() ? std::move(*oracle) : nullptr;
  }

  std::unique_ptr<LoadedModel> loaded_;
};

const std::vector<int32_t> kPrompt = {3, 17, 101, 42, 42, 0, 127, 64};

TEST_P(OracleArchTest, DecodingTokenByTokenEqualsOnePrefillExactly) {
  std::unique_ptr<Oracle> prefill = NewOracle(16);
  std::unique_ptr<Oracle> decode = NewOracle(16);
  ASSERT_TRUE(prefill && decode);
  absl::StatusOr<std::vector<float>> all = prefill->Forward(kPrompt);
  ASSERT_TRUE(all.ok()) << all.status();
  const size_t n_vocab = loaded_->model.config.n_vocab;
  ASSERT_EQ(all->size(), kPrompt.size() * n_vocab);
  EXPECT_EQ(prefill->n_past(), static_cast<int>(kPrompt.size()));

  // f64 accumulation and row-independent ops make the two paths bit-identical.
  std::vector<float> stepped;
  for (int32_t token : kPrompt) {
    absl::StatusOr<std::vector<float>> one = decode->Forward({token});
    ASSERT_TRUE(one.ok()) << one.status();
    stepped.insert(stepped.end(), one->begin(), one->end());
  }
  EXPECT_TRUE(BitEqual(*all, stepped));

  // Chunks of 3 + 5 too.
  decode->Reset();
  absl::StatusOr<std::vector<float>> first = decode->Forward(absl::MakeSpan(kPrompt).subspan(0, 3));
  absl::StatusOr<std::vector<float>> rest = decode->Forward(absl::MakeSpan(kPrompt).subspan(3));
  ASSERT_TRUE(first.ok() && rest.ok());
  first->insert(first->end(), rest->begin(), rest->end());
  EXPECT_TRUE(BitEqual(*all, *first));
}

// Truncate back into the sequence and feed its rest again: the rows equal the
// first pass's, bit for bit (a Gated DeltaNet's state, which holds every
// position, is rebuilt from the kept tokens).
TEST_P(OracleArchTest, TruncatingAndFeedingTheRestAgainGivesTheSameLogits) {
  std::unique_ptr<Oracle> oracle = NewOracle(16);
  ASSERT_TRUE(oracle);
  absl::StatusOr<std::vector<float>> all = oracle->Forward(kPrompt);
  ASSERT_TRUE(all.ok()) << all.status();
  oracle->Truncate(5);
  EXPECT_EQ(oracle->n_past(), 5);
  absl::StatusOr<std::vector<float>> rest = oracle->Forward(absl::MakeSpan(kPrompt).subspan(5));
  ASSERT_TRUE(rest.ok()) << rest.status();
  const size_t n_vocab = loaded_->model.config.n_vocab;
  EXPECT_TRUE(BitEqual(*rest, std::vector<float>(all->begin() + 5 * n_vocab, all->end())));
}

TEST_P(OracleArchTest, LogitsAreFiniteAndVary) {
  std::unique_ptr<Oracle> oracle = NewOracle(16);
  ASSERT_TRUE(oracle);
  absl::StatusOr<std::vector<float>> logits = oracle->Forward(kPrompt);
  ASSERT_TRUE(logits.ok()) << logits.status();
  for (float v : *logits) ASSERT_TRUE(std::isfinite(v));
  const size_t n_vocab = loaded_->model.config.n_vocab;
  for (size_t t = 0; t < kPrompt.size(); ++t) {
    const auto row = absl::MakeConstSpan(*logits).subspan(t * n_vocab, n_vocab);
    EXPECT_NE(*std::min_element(row.begin(), row.end()), *std::max_element(row.begin(), row.end()))
        << "row " << t;
  }
  // The context matters: the same token at different positions after different
  // prefixes gives different logits (42 at index 3 and 4).
  EXPECT_FALSE(std::equal(logits->begin() + 3 * n_vocab, logits->begin() + 4 * n_vocab,
                          logits->begin() + 4 * n_vocab));
}

// A sink sees each token as it is picked, and stopping it stops the decode there.
TEST_P(OracleArchTest, ASinkSeesEachTokenAndCanStopTheDecode) {
  std::unique_ptr<Oracle> a = NewOracle(32);
  ASSERT_TRUE(a);
  absl::StatusOr<std::vector<int32_t>> full = a->Generate(kPrompt, 6);
  ASSERT_TRUE(full.ok()) << full.status();
  a->Reset();
  std::vector<int32_t> seen;
  absl::StatusOr<std::vector<int32_t>> stopped =
      a->Generate(kPrompt, 6, nullptr, [&](int32_t token) {
        seen.push_back(token);
        return seen.size() < 3;
      });
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  EXPECT_EQ(*stopped, std::vector<int32_t>(full->begin(), full->begin() + 3));
  EXPECT_EQ(seen, *stopped);
  // Nothing was run past the stopping token: two of the three were fed back.
  EXPECT_EQ(a->n_past(), static_cast<int>(kPrompt.size()) + 2);
}

// kPrompt, then n tokens, each pick(the last Forward's logits, the position of
// its last row), fed back but the last: Generate written out.
std::vector<int32_t> DecodeByHand(
    Oracle& oracle, int n, const std::function<int32_t(absl::Span<const float>, int)>& pick) {
  std::vector<int32_t> out;
  absl::StatusOr<std::vector<float>> logits = oracle.Forward(kPrompt);
  while (logits.ok()) {
    out.push_back(pick(*logits, oracle.n_past() - 1));
    if (static_cast<int>(out.size()) == n) return out;
    logits = oracle.Forward({out.back()});
  }
  ADD_FAILURE() << logits.status();
  return out;
}

TEST_P(OracleArchTest, GenerateIsDeterministicAndMatchesArgmaxDecoding) {
  std::unique_ptr<Oracle> a = NewOracle(32);
  std::unique_ptr<Oracle> b = NewOracle(32);
  ASSERT_TRUE(a && b);
  absl::StatusOr<std::vector<int32_t>> first = a->Generate(kPrompt, 6);
  absl::StatusOr<std::vector<int32_t>> second = b->Generate(kPrompt, 6);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(*first, *second);
  ASSERT_EQ(first->size(), 6u);
  // The last generated token is not fed back.
  EXPECT_EQ(a->n_past(), static_cast<int>(kPrompt.size()) + 5);
  a->Reset();
  EXPECT_EQ(a->n_past(), 0);
  absl::StatusOr<std::vector<int32_t>> again = a->Generate(kPrompt, 6);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *first);

  // By hand: argmax of the last row, fed back.
  b->Reset();
  const size_t n_vocab = loaded_->model.config.n_vocab;
  EXPECT_EQ(DecodeByHand(*b, 6,
                         [&](absl::Span<const float> last, int) {
                           return ArgMax(last.subspan(last.size() - n_vocab));
                         }),
            *first);
}

// Sampling: each token is sample_token of its row with the draw counted by the
// row's position; the same seed gives the same tokens, and the settings are
// checked.
TEST_P(OracleArchTest, SampledGenerateDrawsByPositionAndSeed) {
  std::unique_ptr<Oracle> a = NewOracle(32);
  ASSERT_TRUE(a);
  SamplingParams sampling;
  sampling.temperature = 1.5f;
  sampling.top_k = 50;
  sampling.top_p = 0.98f;
  sampling.min_p = 0.001f;
  sampling.seed = 12345;
  absl::StatusOr<std::vector<int32_t>> first = a->Generate(kPrompt, 8, nullptr, nullptr, sampling);
  ASSERT_TRUE(first.ok()) << first.status();
  a->Reset();
  absl::StatusOr<std::vector<int32_t>> again = a->Generate(kPrompt, 8, nullptr, nullptr, sampling);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *first);

  a->Reset();
  const int32_t n_vocab = loaded_->model.config.n_vocab;
  EXPECT_EQ(DecodeByHand(*a, 8,
                         [&](absl::Span<const float> rows, int position) {
                           return sample_token(rows.data() + rows.size() - n_vocab, n_vocab,
                                               sampling, sample_uniform(sampling.seed, position));
                         }),
            *first);

  sampling.top_p = 0.0f;
  a->Reset();
  absl::StatusOr<std::vector<int32_t>> bad = a->Generate(kPrompt, 2, nullptr, nullptr, sampling);
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(MessageHas(bad.status(), "top-p 0")) << bad.status();
}

TEST_P(OracleArchTest, MoeLayerOverABatchEqualsRowByRow) {
  const ModelConfig& cfg = loaded_->model.config;
  const std::vector<float> x = RandomVector(6 * cfg.n_embd, 11);
  std::vector<float> batch(x.size());
  std::vector<int32_t> batch_selected;
  MoeFfn(loaded_->model, 1, x, absl::MakeSpan(batch), &batch_selected);
  ASSERT_EQ(batch_selected.size(), 6u * cfg.n_expert_used);
  for (int t = 0; t < 6; ++t) {
    const std::vector<float> row(x.begin() + t * cfg.n_embd, x.begin() + (t + 1) * cfg.n_embd);
    std::vector<float> one(row.size());
    std::vector<int32_t> selected;
    MoeFfn(loaded_->model, 1, row, absl::MakeSpan(one), &selected);
    EXPECT_TRUE(BitEqual(one, std::vector<float>(batch.begin() + t * cfg.n_embd,
                                                 batch.begin() + (t + 1) * cfg.n_embd)));
    EXPECT_EQ(selected, std::vector<int32_t>(batch_selected.begin() + t * cfg.n_expert_used,
                                             batch_selected.begin() + (t + 1) * cfg.n_expert_used));
  }
}

TEST_P(OracleArchTest, BadTokensAreErrorsNamingIndexAndValue) {
  std::unique_ptr<Oracle> oracle = NewOracle(16);
  ASSERT_TRUE(oracle);
  const int n_vocab = loaded_->model.config.n_vocab;
  absl::StatusOr<std::vector<float>> high = oracle->Forward({1, 2, n_vocab});
  ASSERT_FALSE(high.ok());
  EXPECT_EQ(high.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(MessageHas(high.status(), "token 128 at index 2")) << high.status();
  absl::StatusOr<std::vector<float>> negative = oracle->Forward({-5});
  ASSERT_FALSE(negative.ok());
  EXPECT_TRUE(MessageHas(negative.status(), "token -5 at index 0")) << negative.status();
  EXPECT_FALSE(oracle->Forward({}).ok());
  EXPECT_EQ(oracle->n_past(), 0);  // rejected calls leave the cache alone
}

TEST_P(OracleArchTest, AFullCacheIsAnErrorNamingTheContextSize) {
  std::unique_ptr<Oracle> oracle = NewOracle(4);
  ASSERT_TRUE(oracle);
  ASSERT_TRUE(oracle->Forward({1, 2, 3}).ok());
  absl::StatusOr<std::vector<float>> over = oracle->Forward({4, 5});
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(MessageHas(over.status(), "context size 4")) << over.status();
  EXPECT_EQ(oracle->n_past(), 3);
  EXPECT_TRUE(oracle->Forward({4}).ok());  // exactly full is fine
  EXPECT_FALSE(oracle->Forward({5}).ok());
  // Generate needs prompt + n_predict - 1 positions.
  oracle->Reset();
  EXPECT_TRUE(oracle->Generate({1, 2}, 3).ok());
  oracle->Reset();
  EXPECT_FALSE(oracle->Generate({1, 2}, 4).ok());
}

INSTANTIATE_TEST_SUITE_P(AllArchitectures, OracleArchTest,
                         ::testing::Values(ArchCase{"qwen3moe", Arch::kQwen3Moe, false, 2},
                                           ArchCase{"olmoe", Arch::kOlmoe, false, 4},
                                           ArchCase{"qwen2moe", Arch::kQwen2Moe, false, 2},
                                           ArchCase{"mixtral", Arch::kMixtral, false, 2},
                                           ArchCase{"mixtral_legacy", Arch::kMixtral, true, 2},
                                           ArchCase{"qwen35moe", Arch::kQwen35Moe, false, 2}),
                         [](const ::testing::TestParamInfo<ArchCase>& info) {
                           return std::string(info.param.name);
                         });

TEST(OracleTest, CreateRejectsANonPositiveContext) {
  FixtureSpec spec;
  spec.n_layer = 1;
  absl::StatusOr<std::unique_ptr<LoadedModel>> loaded = LoadFixture(spec);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  absl::StatusOr<std::unique_ptr<Oracle>> oracle = Oracle::Create((*loaded)->model, 0);
  ASSERT_FALSE(oracle.ok());
  EXPECT_TRUE(MessageHas(oracle.status(), "context size 0")) << oracle.status();
}

TEST(OracleTest, MergedAndLegacyMixtralExpertsGiveTheSameLogits) {
  // Same seed, same weights, two storage layouts of the experts.
  FixtureSpec spec;
  spec.arch = Arch::kMixtral;
  spec.seed = 5;
  absl::StatusOr<std::unique_ptr<LoadedModel>> merged = LoadFixture(spec);
  spec.legacy_experts = true;
  absl::StatusOr<std::unique_ptr<LoadedModel>> legacy = LoadFixture(spec);
  ASSERT_TRUE(merged.ok()) << merged.status();
  ASSERT_TRUE(legacy.ok()) << legacy.status();
  absl::StatusOr<std::unique_ptr<Oracle>> a = Oracle::Create((*merged)->model, 8);
  absl::StatusOr<std::unique_ptr<Oracle>> b = Oracle::Create((*legacy)->model, 8);
  ASSERT_TRUE(a.ok() && b.ok());
  absl::StatusOr<std::vector<float>> la = (*a)->Forward(kPrompt);
  absl::StatusOr<std::vector<float>> lb = (*b)->Forward(kPrompt);
  ASSERT_TRUE(la.ok() && lb.ok());
  EXPECT_TRUE(BitEqual(*la, *lb));
}

// ---- quant types ----

struct QuantCase {
  GgmlType type;
  double max_nmse;  // about 10x what the fixture shows, ordered by bits per weight
};

void PrintTo(const QuantCase& c, std::ostream* os) {
  *os << ggml_type_name(static_cast<uint32_t>(c.type));
}

class OracleQuantTest : public ::testing::TestWithParam<QuantCase> {};

TEST_P(OracleQuantTest, QuantizedExpertsRunAndStayNearTheF32Model) {
  // The fixture draws the same f32 weights for every type and quantizes after,
  // so the difference to the f32 model is quantization noise in the experts.
  FixtureSpec spec;
  spec.arch = Arch::kQwen3Moe;
  spec.n_layer = 1;
  spec.n_expert = 4;
  spec.n_embd = 256;  // the k-quants need rows of 256
  spec.n_ff_exp = 256;
  spec.n_head = 4;
  spec.n_head_kv = 2;
  spec.n_vocab = 64;
  spec.seed = 3;
  absl::StatusOr<std::unique_ptr<LoadedModel>> reference = LoadFixture(spec);
  spec.expert_type = GetParam().type;
  absl::StatusOr<std::unique_ptr<LoadedModel>> quantized = LoadFixture(spec);
  ASSERT_TRUE(reference.ok()) << reference.status();
  ASSERT_TRUE(quantized.ok()) << quantized.status();

  const std::vector<int32_t> prompt = {1, 5, 9, 33};
  auto run = [&](const Model& model) {
    absl::StatusOr<std::unique_ptr<Oracle>> oracle = Oracle::Create(model, 8);
    EXPECT_TRUE(oracle.ok()) << oracle.status();
    absl::StatusOr<std::vector<float>> logits = (*oracle)->Forward(prompt);
    EXPECT_TRUE(logits.ok()) << logits.status();
    return *logits;
  };
  const std::vector<float> want = run((*reference)->model);
  const std::vector<float> got = run((*quantized)->model);
  EXPECT_TRUE(BitEqual(got, run((*quantized)->model)));  // deterministic
  ASSERT_EQ(got.size(), want.size());
  // Normalised mean squared error, as llama.cpp's test-backend-ops compares.
  double err = 0, ref = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i]));
    err += (got[i] - want[i]) * static_cast<double>(got[i] - want[i]);
    ref += static_cast<double>(want[i]) * want[i];
  }
  EXPECT_LE(err / ref, GetParam().max_nmse);
  if (GetParam().type != GgmlType::kF32) {
    EXPECT_GT(err, 0.0);  // the experts really changed
  }
}

INSTANTIATE_TEST_SUITE_P(
    ExpertTypes, OracleQuantTest,
    ::testing::Values(QuantCase{GgmlType::kF32, 0.0}, QuantCase{GgmlType::kF16, 1e-7},
                      QuantCase{GgmlType::kBF16, 1e-5}, QuantCase{GgmlType::kQ8_0, 1e-4},
                      QuantCase{GgmlType::kQ6_K, 1e-3}, QuantCase{GgmlType::kQ5_K, 4e-3},
                      QuantCase{GgmlType::kQ4_K, 1.5e-2}, QuantCase{GgmlType::kQ4_0, 2e-2}),
    [](const ::testing::TestParamInfo<QuantCase>& info) {
      return ggml_type_name(static_cast<uint32_t>(info.param.type));
    });

}  // namespace
}  // namespace moegraph
