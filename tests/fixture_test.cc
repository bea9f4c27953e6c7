// The synthetic fixture generator: determinism, the metadata and tokenizer that
// llama.cpp reads, router skew, and the spec's validation messages.
#include "loader/fixture.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "loader/gguf.h"
#include "loader/model_config.h"
#include "loader/quant.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::FixtureFileOrFail;
using testing_util::ReadFileToString;
using testing_util::TempPath;

std::vector<float> Dequantize(const WeightView& w, int64_t row) {
  std::vector<float> out(w.cols);
  EXPECT_TRUE(dequantize_row(w.type, w.data + row * w.row_bytes, out.data(), w.cols));
  return out;
}

TEST(Fixture, SameSeedSameBytesOtherSeedOtherBytes) {
  FixtureSpec spec;
  spec.dense_type = GgmlType::kQ8_0;
  spec.expert_type = GgmlType::kQ4_K;
  spec.n_embd = 256;
  spec.n_ff_exp = 256;
  spec.router_skew = 2.0f;
  spec.seed = 42;
  absl::StatusOr<std::vector<uint8_t>> a = FixtureBytes(spec);
  absl::StatusOr<std::vector<uint8_t>> b = FixtureBytes(spec);
  spec.seed = 43;
  absl::StatusOr<std::vector<uint8_t>> c = FixtureBytes(spec);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(*a, *b);
  ASSERT_EQ(a->size(), c->size());
  EXPECT_NE(*a, *c);

  // Streaming to disk writes the same bytes.
  spec.seed = 42;
  const std::string path = TempPath("fixture.gguf");
  ASSERT_TRUE(WriteFixture(spec, path).ok());
  const std::string on_disk_bytes = ReadFileToString(path);
  const std::vector<uint8_t> on_disk(on_disk_bytes.begin(), on_disk_bytes.end());
  std::remove(path.c_str());
  EXPECT_EQ(on_disk, *a);
}

TEST(Fixture, WritesTheHyperParameterKeysLlamaCppReads) {
  struct Case {
    Arch arch;
    std::vector<std::string> keys;
  };
  const std::vector<std::string> common = {"context_length",
                                           "embedding_length",
                                           "block_count",
                                           "feed_forward_length",
                                           "attention.head_count",
                                           "attention.head_count_kv",
                                           "attention.layer_norm_rms_epsilon",
                                           "rope.freq_base",
                                           "expert_count",
                                           "expert_used_count"};
  const Case cases[] = {
      {Arch::kQwen3Moe, {"expert_feed_forward_length"}},
      {Arch::kOlmoe, {}},
      {Arch::kQwen2Moe, {"expert_feed_forward_length", "expert_shared_feed_forward_length"}},
      {Arch::kMixtral, {}},
  };
  for (const Case& c : cases) {
    FixtureSpec spec;
    spec.arch = c.arch;
    spec.n_head_kv = spec.n_head;
    std::unique_ptr<GgufFile> file = FixtureFileOrFail(spec);
    ASSERT_NE(file, nullptr);
    const std::string arch(arch_gguf_name(c.arch));
    EXPECT_EQ(*file->GetString("general.architecture"), arch);
    std::vector<std::string> keys = common;
    keys.insert(keys.end(), c.keys.begin(), c.keys.end());
    for (const std::string& key : keys) {
      EXPECT_NE(file->FindKey(arch + "." + key), nullptr) << arch << "." << key;
    }
    EXPECT_EQ(*file->GetUint(arch + ".expert_count"), 8u);
    EXPECT_EQ(*file->GetUint(arch + ".expert_used_count"), 2u);
  }
}

// What llama.cpp's vocabulary loader needs: a model name, distinct tokens with
// one type each, merges for gpt2 (whose halves and results are tokens), scores
// for llama, and special ids inside the vocabulary.
TEST(Fixture, TokenizerIsCompleteForEachFamily) {
  struct Case {
    Arch arch;
    int n_vocab;
    const char* model;
    const char* pre;
  };
  const Case cases[] = {
      {Arch::kQwen3Moe, 600, "gpt2", "qwen2"}, {Arch::kQwen2Moe, 300, "gpt2", "qwen2"},
      {Arch::kOlmoe, 600, "gpt2", "olmo"},     {Arch::kMixtral, 600, "llama", nullptr},
      {Arch::kQwen3Moe, 8, "gpt2", "qwen2"},   {Arch::kMixtral, 8, "llama", nullptr},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat(std::string(arch_gguf_name(c.arch)), " vocab ", c.n_vocab));
    FixtureSpec spec;
    spec.arch = c.arch;
    spec.n_vocab = c.n_vocab;
    spec.n_head_kv = spec.n_head;
    std::unique_ptr<GgufFile> file = FixtureFileOrFail(spec);
    ASSERT_NE(file, nullptr);
    EXPECT_EQ(*file->GetString("tokenizer.ggml.model"), c.model);
    if (c.pre != nullptr) {
      EXPECT_EQ(*file->GetString("tokenizer.ggml.pre"), c.pre);
    }
    const std::vector<std::string_view> tokens = *file->GetStringArray("tokenizer.ggml.tokens");
    ASSERT_EQ(tokens.size(), static_cast<size_t>(c.n_vocab));
    const std::set<std::string_view> distinct(tokens.begin(), tokens.end());
    EXPECT_EQ(distinct.size(), tokens.size());
    const std::vector<int64_t> types = *file->GetIntArray("tokenizer.ggml.token_type");
    EXPECT_EQ(types.size(), tokens.size());
    for (const char* id_key : {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"}) {
      absl::StatusOr<uint64_t> id = file->GetUint(id_key);
      ASSERT_TRUE(id.ok()) << id.status();
      EXPECT_LT(*id, tokens.size());
      EXPECT_EQ(types[*id], 3) << id_key << " is not a control token";
    }
    if (std::string(c.model) == "llama") {
      EXPECT_EQ(file->GetFloatArray("tokenizer.ggml.scores")->size(), tokens.size());
      if (c.n_vocab >= 3 + 256) {
        EXPECT_NE(distinct.count("<0x0A>"), 0u);
      }
      continue;
    }
    const std::vector<std::string_view> merges = *file->GetStringArray("tokenizer.ggml.merges");
    if (c.n_vocab >= 300) {
      EXPECT_FALSE(merges.empty());
      EXPECT_NE(distinct.count("\xc4\x8a"), 0u);  // '\n' as GPT-2's byte-level 'Ċ'
    }
    for (std::string_view merge : merges) {
      const size_t space = merge.find(' ');
      ASSERT_NE(space, std::string_view::npos) << merge;
      const std::string left(merge.substr(0, space));
      const std::string right(merge.substr(space + 1));
      EXPECT_NE(distinct.count(left), 0u) << merge;
      EXPECT_NE(distinct.count(right), 0u) << merge;
      EXPECT_NE(distinct.count(left + right), 0u) << merge;
    }
  }
}

// Weights follow the documented scales: norms near 1, input projections with
// standard deviation 1/sqrt(fan_in).
TEST(Fixture, WeightsHaveTheirScales) {
  FixtureSpec spec;
  spec.n_embd = 128;
  std::unique_ptr<GgufFile> file = FixtureFileOrFail(spec);
  ASSERT_NE(file, nullptr);
  absl::StatusOr<Model> m = LoadModel(*file);
  ASSERT_TRUE(m.ok()) << m.status();
  const WeightView gate = m->expert(1, ExpertProj::kGate, 3);
  double sum2 = 0;
  for (int64_t r = 0; r < gate.rows; ++r) {
    for (float v : Dequantize(gate, r)) sum2 += double{v} * v;
  }
  const double stddev = std::sqrt(sum2 / (gate.rows * gate.cols));
  EXPECT_NEAR(stddev, 1.0 / std::sqrt(128.0), 0.1 / std::sqrt(128.0));
  const std::vector<float> norm = Dequantize(weight_view(*m->layers[0].ffn_norm), 0);
  double mean = 0;
  for (float v : norm) mean += v;
  EXPECT_NEAR(mean / norm.size(), 1.0, 0.05);
}

// Share of router picks that go to the two most picked experts of layer 0, for
// hidden states x = rmsnorm(h) * ffn_norm with h taken from `inputs`.
double TopTwoShare(const Model& m, const std::vector<std::vector<float>>& inputs) {
  const ModelConfig& c = m.config;
  const WeightView router = weight_view(*m.layers[0].router);
  const std::vector<float> norm = Dequantize(weight_view(*m.layers[0].ffn_norm), 0);
  std::vector<std::vector<float>> rows;
  for (int e = 0; e < c.n_expert; ++e) rows.push_back(Dequantize(router, e));
  std::vector<int> picks(c.n_expert, 0);
  for (const std::vector<float>& h : inputs) {
    double ss = 0;
    for (float v : h) ss += double{v} * v;
    const double inv_rms = 1.0 / std::sqrt(ss / h.size() + c.rms_eps);
    std::vector<std::pair<double, int>> logits;
    for (int e = 0; e < c.n_expert; ++e) {
      double dot = 0;
      for (int i = 0; i < c.n_embd; ++i) dot += rows[e][i] * h[i] * inv_rms * norm[i];
      logits.push_back({-dot, e});
    }
    std::sort(logits.begin(), logits.end());
    for (int k = 0; k < c.n_expert_used; ++k) ++picks[logits[k].second];
  }
  std::sort(picks.rbegin(), picks.rend());
  return static_cast<double>(picks[0] + picks[1]) / (inputs.size() * c.n_expert_used);
}

TEST(Fixture, RouterSkewConcentratesRouting) {
  FixtureSpec spec;  // 8 experts, top-2: an even router gives the top two 1/4 of picks
  spec.n_vocab = 400;
  spec.seed = 11;
  double share[2] = {0, 0};
  double random_share[2] = {0, 0};
  const float skews[2] = {0.0f, 4.0f};
  for (int i = 0; i < 2; ++i) {
    spec.router_skew = skews[i];
    std::unique_ptr<GgufFile> file = FixtureFileOrFail(spec);
    ASSERT_NE(file, nullptr);
    absl::StatusOr<Model> m = LoadModel(*file);
    ASSERT_TRUE(m.ok()) << m.status();
    // The model's own inputs: every token's embedding.
    const WeightView embd = weight_view(*m->token_embd);
    std::vector<std::vector<float>> tokens;
    for (int64_t t = 0; t < embd.rows; ++t) tokens.push_back(Dequantize(embd, t));
    share[i] = TopTwoShare(*m, tokens);
    // Random unit vectors, with the embeddings' mean added: the common
    // component every hidden state of the model carries.
    std::vector<float> mean(spec.n_embd, 0.0f);
    for (const auto& t : tokens) {
      for (int j = 0; j < spec.n_embd; ++j) mean[j] += t[j] / tokens.size();
    }
    uint64_t state = 7;
    std::vector<std::vector<float>> randoms;
    for (int n = 0; n < 400; ++n) {
      std::vector<float> v(spec.n_embd);
      double ss = 0;
      for (float& x : v) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        x = static_cast<float>(static_cast<int64_t>(state >> 11) % 2001 - 1000) / 1000.0f;
        ss += double{x} * x;
      }
      for (int j = 0; j < spec.n_embd; ++j) {
        v[j] = static_cast<float>(v[j] / std::sqrt(ss) * std::sqrt(spec.n_embd)) + mean[j];
      }
      randoms.push_back(std::move(v));
    }
    random_share[i] = TopTwoShare(*m, randoms);
  }
  EXPECT_LT(share[0], 0.40) << "skew 0 should route near evenly";
  EXPECT_GT(share[1], 0.70) << "skew 4 should concentrate routing";
  EXPECT_LT(random_share[0], 0.40);
  EXPECT_GT(random_share[1], 0.70);
}

TEST(Fixture, ValidationNamesTheFlag) {
  struct Case {
    void (*edit)(FixtureSpec*);
    const char* expect;
  };
  const Case cases[] = {
      {[](FixtureSpec* s) {
         s->n_embd = 100;
         s->dense_type = GgmlType::kQ4_K;
       },
       "--embd 100 is not a multiple of 256 (q4_K block size)"},
      {[](FixtureSpec* s) { s->n_expert_used = 9; }, "--top-k 9 exceeds --experts 8"},
      {[](FixtureSpec* s) { s->n_expert_used = 0; }, "--top-k 0"},
      {[](FixtureSpec* s) { s->n_layer = 0; }, "--layers 0"},
      {[](FixtureSpec* s) {
         s->n_head = 6;
         s->n_head_kv = 4;
         s->n_embd = 96;
       },
       "--heads 6 is not a multiple of --kv-heads 4"},
      {[](FixtureSpec* s) {
         s->n_ff_exp = 48;
         s->expert_type = GgmlType::kQ8_0;
       },
       "--ff 48 is not a multiple of 32 (q8_0 block size)"},
      {[](FixtureSpec* s) { s->dense_type = GgmlType::kIQ2_XXS; }, "--quant iq2_xxs"},
      {[](FixtureSpec* s) { s->expert_type = GgmlType::kTQ1_0; }, "--quant expert=tq1_0"},
      {[](FixtureSpec* s) { s->legacy_experts = true; }, "--legacy-experts"},
      {[](FixtureSpec* s) { s->router_skew = -1.0f; }, "--router-skew"},
      {[](FixtureSpec* s) { s->n_vocab = 2; }, "--vocab 2"},
      {[](FixtureSpec* s) { s->head_dim = 7; }, "--head-dim 7"},
      {[](FixtureSpec* s) { s->n_ff_shexp = 64; }, "--shared-ff"},
      {[](FixtureSpec* s) {
         s->arch = Arch::kOlmoe;
         s->n_head_kv = 2;
       },
       "--kv-heads 2 must equal --heads 4"},
      {[](FixtureSpec* s) {
         s->arch = Arch::kQwen2Moe;
         s->tied_output = true;
       },
       "--tied-output"},
  };
  for (const Case& c : cases) {
    FixtureSpec spec;
    c.edit(&spec);
    absl::StatusOr<std::vector<uint8_t>> bytes = FixtureBytes(spec);
    ASSERT_FALSE(bytes.ok()) << c.expect;
    EXPECT_NE(bytes.status().message().find(c.expect), absl::string_view::npos) << bytes.status();
  }
}

TEST(Fixture, WriteFixtureNamesAnUnwritablePath) {
  const absl::Status s = WriteFixture(FixtureSpec{}, "/nonexistent-dir/x.gguf");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("/nonexistent-dir/x.gguf"), absl::string_view::npos) << s;
}

// FNV-1a 64 of the bytes: the hashes below were printed from the generator
// before expert_variants existed.
uint64_t Fnv1a(const std::vector<uint8_t>& bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (uint8_t b : bytes) h = (h ^ b) * 0x100000001b3ull;
  return h;
}

TEST(Fixture, NoExpertVariantsKeepsTheBytesOfBefore) {
  struct Case {
    FixtureSpec spec;
    uint64_t fnv1a;
  };
  std::vector<Case> cases(4);
  cases[0].spec.dense_type = GgmlType::kQ8_0;   // make-fixture --quant q8_0,expert=q4_K
  cases[0].spec.expert_type = GgmlType::kQ4_K;  // --embd 256 --ff 256 --router-skew 2 --seed 42
  cases[0].spec.n_embd = 256;
  cases[0].spec.n_ff_exp = 256;
  cases[0].spec.router_skew = 2.0f;
  cases[0].spec.seed = 42;
  cases[0].fnv1a = 0x8843ed0cd4138c34ull;
  cases[1].spec.arch = Arch::kMixtral;  // --arch mixtral --legacy-experts --seed 5
  cases[1].spec.legacy_experts = true;
  cases[1].spec.seed = 5;
  cases[1].fnv1a = 0x41db45ad49ccd2f4ull;
  cases[2].fnv1a = 0xcadfef226872091dull;  // the defaults
  // Large enough that token_embd, output and the experts fill on several threads.
  cases[3].spec.dense_type = GgmlType::kQ8_0;
  cases[3].spec.expert_type = GgmlType::kQ8_0;
  cases[3].spec.n_vocab = 4096;
  cases[3].spec.n_embd = 256;
  cases[3].spec.n_ff_exp = 2048;
  cases[3].spec.n_expert = 4;
  cases[3].spec.router_skew = 1.0f;
  cases[3].spec.seed = 7;
  cases[3].fnv1a = 0x1878e7322041110full;
  for (const Case& c : cases) {
    absl::StatusOr<std::vector<uint8_t>> bytes = FixtureBytes(c.spec);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    EXPECT_EQ(Fnv1a(*bytes), c.fnv1a) << arch_gguf_name(c.spec.arch);
  }
}

bool SameExpertBytes(const Model& a, int expert_a, const Model& b, int expert_b, int layer,
                     ExpertProj proj) {
  const WeightView x = a.expert(layer, proj, expert_a);
  const WeightView y = b.expert(layer, proj, expert_b);
  const size_t n = x.row_bytes * x.rows;
  return n == y.row_bytes * y.rows && std::equal(x.data, x.data + n, y.data);
}

TEST(Fixture, ExpertVariantsRepeatTheFirstExperts) {
  for (const bool legacy : {false, true}) {
    FixtureSpec spec;
    spec.arch = legacy ? Arch::kMixtral : Arch::kQwen3Moe;
    spec.legacy_experts = legacy;
    spec.expert_type = GgmlType::kQ4_K;
    spec.n_embd = 256;
    spec.n_ff_exp = 256;
    spec.seed = 9;
    absl::StatusOr<std::unique_ptr<testing_util::LoadedModel>> distinct =
        testing_util::LoadFixture(spec);
    constexpr int kVariants = 3;
    spec.expert_variants = kVariants;
    absl::StatusOr<std::unique_ptr<testing_util::LoadedModel>> variants =
        testing_util::LoadFixture(spec);
    ASSERT_TRUE(distinct.ok()) << distinct.status();
    ASSERT_TRUE(variants.ok()) << variants.status();
    const Model& d = (*distinct)->model;
    const Model& v = (*variants)->model;
    for (int layer = 0; layer < spec.n_layer; ++layer) {
      for (const ExpertProj proj : {ExpertProj::kGate, ExpertProj::kUp, ExpertProj::kDown}) {
        SCOPED_TRACE(
            absl::StrCat("legacy ", legacy, " layer ", layer, " proj ", static_cast<int>(proj)));
        for (int e = 0; e < spec.n_expert; ++e) {
          // Expert e copies variant e % V, and the variants are the experts of V = 0.
          EXPECT_TRUE(SameExpertBytes(v, e, d, e % kVariants, layer, proj)) << "expert " << e;
          if (e + kVariants < spec.n_expert) {
            EXPECT_TRUE(SameExpertBytes(v, e, v, e + kVariants, layer, proj)) << "expert " << e;
          }
        }
        EXPECT_FALSE(SameExpertBytes(v, 0, v, 1, layer, proj));
        EXPECT_FALSE(SameExpertBytes(d, 0, d, kVariants, layer, proj));
      }
    }
  }
  FixtureSpec bad;
  bad.expert_variants = 9;  // 8 experts
  absl::StatusOr<std::vector<uint8_t>> bytes = FixtureBytes(bad);
  ASSERT_FALSE(bytes.ok());
  EXPECT_TRUE(testing_util::MessageHas(bytes.status(), "--expert-variants 9")) << bytes.status();
}

}  // namespace
}  // namespace moegraph
