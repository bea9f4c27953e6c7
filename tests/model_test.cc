// LoadConfig / LoadModel on in-memory fixtures of every architecture and weight
// type, and on fixtures edited to carry one or more mistakes.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "loader/fixture.h"
#include "loader/gguf.h"
#include "loader/gguf_writer.h"
#include "loader/model_config.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::FixtureFileOrFail;
using testing_util::MessageHas;
using testing_util::ParseOrFail;

// Edits to apply while copying a file: keys dropped or replaced, tensors dropped
// or given another shape (their bytes cut or zero-padded to fit).
struct Edits {
  std::set<std::string> drop_keys;
  std::map<std::string, uint32_t> set_u32;
  std::map<std::string, std::string> set_string;
  std::map<std::string, bool> set_bool;
  std::map<std::string, float> set_f32;
  std::map<std::string, std::vector<int32_t>> set_i32_array;
  std::set<std::string> drop_tensors;
  std::map<std::string, std::vector<int64_t>> reshape;
  std::map<std::string, GgmlType> retype;
  std::map<std::string, std::vector<int64_t>> add_f32;  // new zeroed f32 tensors by shape
};

std::unique_ptr<GgufFile> Edit(const GgufFile& in, const Edits& e) {
  GgufWriter w;
  for (const GgufKV& kv : in.kvs()) {
    if (e.drop_keys.count(kv.key) != 0 || e.set_u32.count(kv.key) != 0 ||
        e.set_string.count(kv.key) != 0 || e.set_bool.count(kv.key) != 0 ||
        e.set_f32.count(kv.key) != 0 || e.set_i32_array.count(kv.key) != 0) {
      continue;
    }
    w.SetValue(kv);
  }
  for (const auto& [key, v] : e.set_u32) w.SetUint32(key, v);
  for (const auto& [key, v] : e.set_string) w.SetString(key, v);
  for (const auto& [key, v] : e.set_bool) w.SetBool(key, v);
  for (const auto& [key, v] : e.set_f32) w.SetFloat32(key, v);
  for (const auto& [key, v] : e.set_i32_array) w.SetInt32Array(key, v);
  for (const GgufTensor& t : in.tensors()) {
    if (e.drop_tensors.count(t.name) != 0) continue;
    std::vector<int64_t> shape(t.ne, t.ne + t.n_dims);
    if (auto it = e.reshape.find(t.name); it != e.reshape.end()) shape = it->second;
    GgmlType type = t.ggml_type();
    if (auto it = e.retype.find(t.name); it != e.retype.end()) type = it->second;
    int64_t rows = 1;
    for (size_t i = 1; i < shape.size(); ++i) rows *= shape[i];
    std::vector<uint8_t> bytes(ggml_row_size(type, shape[0]) * rows);
    std::memcpy(bytes.data(), t.data, std::min<size_t>(bytes.size(), t.nbytes));
    w.AddTensor(t.name, type, shape, std::move(bytes));
  }
  for (const auto& [name, shape] : e.add_f32) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    w.AddTensor(name, GgmlType::kF32, shape, std::vector<uint8_t>(static_cast<size_t>(n) * 4));
  }
  return ParseOrFail(w.Serialize(), "edited.gguf");
}

std::string Name(Arch arch) {
  return arch == Arch::kMixtral ? "mixtral" : std::string(arch_gguf_name(arch));
}

using ArchType = std::tuple<Arch, GgmlType>;

class LoadEveryArchAndType : public ::testing::TestWithParam<ArchType> {};

TEST_P(LoadEveryArchAndType, ConfigAndTensorsMatchTheSpec) {
  const auto [arch, type] = GetParam();
  FixtureSpec spec;
  spec.arch = arch;
  spec.n_layer = 2;
  spec.n_expert = 4;
  spec.n_expert_used = 2;
  spec.n_embd = 256;  // one block of the k-quants
  spec.n_ff_exp = 256;
  spec.n_ff_shexp = arch == Arch::kQwen2Moe ? 512 : 0;
  spec.n_head = 4;
  spec.n_head_kv = arch == Arch::kOlmoe ? 4 : 2;
  spec.n_vocab = 300;
  spec.dense_type = type;
  spec.expert_type = type;
  spec.seed = 5;
  std::unique_ptr<GgufFile> file = FixtureFileOrFail(spec);
  ASSERT_NE(file, nullptr);
  absl::StatusOr<Model> model = LoadModel(*file);
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelConfig& c = model->config;

  EXPECT_EQ(c.arch, arch);
  EXPECT_EQ(c.n_layer, 2);
  EXPECT_EQ(c.n_embd, 256);
  EXPECT_EQ(c.n_head, 4);
  EXPECT_EQ(c.n_head_kv, spec.n_head_kv);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.n_vocab, 300);
  EXPECT_EQ(c.n_ctx_train, 4096);
  EXPECT_EQ(c.n_expert, 4);
  EXPECT_EQ(c.n_expert_used, 2);
  EXPECT_EQ(c.n_ff_exp, 256);
  EXPECT_EQ(c.n_ff_shexp, arch == Arch::kQwen2Moe ? 512 : 0);
  // llama_model_rope_type: LLM_ARCH_LLAMA is NORM, the other three NEOX.
  EXPECT_EQ(c.rope_type, arch == Arch::kMixtral ? RopeType::kNorm : RopeType::kNeox);
  // The norm_w argument of build_moe_ffn in src/models/*.cpp.
  EXPECT_EQ(c.norm_topk_prob, arch == Arch::kQwen3Moe || arch == Arch::kMixtral);
  EXPECT_EQ(c.qk_norm, arch == Arch::kQwen3Moe);
  EXPECT_EQ(c.qk_norm_full, arch == Arch::kOlmoe);
  EXPECT_EQ(c.qkv_bias, arch == Arch::kQwen2Moe);
  EXPECT_FALSE(c.tied_embeddings);
  EXPECT_GT(c.rms_eps, 0.0f);

  EXPECT_EQ(model->file, file.get());
  EXPECT_EQ(model->token_embd->ggml_type(), type);
  EXPECT_NE(model->output, model->token_embd);
  ASSERT_EQ(model->layers.size(), 2u);
  for (int il = 0; il < 2; ++il) {
    const LayerTensors& l = model->layers[il];
    EXPECT_EQ(l.wq->name, absl::StrCat("blk.", il, ".attn_q.weight"));
    EXPECT_EQ(l.wq->ggml_type(), type);
    EXPECT_EQ(l.attn_norm->ggml_type(), GgmlType::kF32);
    EXPECT_EQ(l.router->ggml_type(), GgmlType::kF32);
    EXPECT_EQ(l.bq != nullptr, arch == Arch::kQwen2Moe);
    EXPECT_EQ(l.q_norm != nullptr, arch == Arch::kQwen3Moe || arch == Arch::kOlmoe);
    EXPECT_EQ(l.shexp_down != nullptr, arch == Arch::kQwen2Moe);
    if (l.q_norm != nullptr) {
      EXPECT_EQ(l.q_norm->ne[0], arch == Arch::kOlmoe ? 256 : 64);
    }
    ASSERT_NE(l.gate_exps, nullptr);
    EXPECT_TRUE(l.gate_legacy.empty());
    for (int e = 0; e < 4; ++e) {
      for (ExpertProj proj : {ExpertProj::kGate, ExpertProj::kUp, ExpertProj::kDown}) {
        const GgufTensor* merged = proj == ExpertProj::kGate ? l.gate_exps
                                   : proj == ExpertProj::kUp ? l.up_exps
                                                             : l.down_exps;
        const WeightView v = model->expert(il, proj, e);
        EXPECT_EQ(v.type, type);
        EXPECT_EQ(v.cols, 256);
        EXPECT_EQ(v.rows, 256);
        EXPECT_EQ(v.row_bytes, ggml_row_size(type, 256));
        EXPECT_EQ(v.data, merged->data + e * merged->nbytes / 4);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, LoadEveryArchAndType,
                         ::testing::Combine(::testing::Values(Arch::kQwen3Moe, Arch::kOlmoe,
                                                              Arch::kQwen2Moe, Arch::kMixtral),
                                            ::testing::Values(GgmlType::kF32, GgmlType::kF16,
                                                              GgmlType::kBF16, GgmlType::kQ8_0,
                                                              GgmlType::kQ4_0, GgmlType::kQ4_K,
                                                              GgmlType::kQ5_K, GgmlType::kQ6_K)),
                         [](const ::testing::TestParamInfo<ArchType>& info) {
                           return Name(std::get<0>(info.param)) + "_" +
                                  ggml_type_name(static_cast<uint32_t>(std::get<1>(info.param)));
                         });

TEST(ArchName, RoundTripsAndAcceptsMixtral) {
  for (Arch arch : {Arch::kQwen3Moe, Arch::kOlmoe, Arch::kQwen2Moe, Arch::kMixtral}) {
    Arch parsed = Arch::kQwen3Moe;
    ASSERT_TRUE(arch_from_name(arch_gguf_name(arch), &parsed));
    EXPECT_EQ(parsed, arch);
  }
  Arch parsed = Arch::kQwen3Moe;
  ASSERT_TRUE(arch_from_name("mixtral", &parsed));
  EXPECT_EQ(parsed, Arch::kMixtral);
  EXPECT_EQ(arch_gguf_name(Arch::kMixtral), "llama");
  EXPECT_FALSE(arch_from_name("qwen3", &parsed));
}

TEST(LoadConfig, MissingKeyNamesTheKey) {
  std::unique_ptr<GgufFile> file = FixtureFileOrFail(FixtureSpec{});
  ASSERT_NE(file, nullptr);
  for (const char* key :
       {"qwen3moe.expert_count", "qwen3moe.expert_used_count", "qwen3moe.block_count",
        "qwen3moe.embedding_length", "qwen3moe.attention.head_count", "qwen3moe.context_length",
        "qwen3moe.attention.layer_norm_rms_epsilon", "general.architecture"}) {
    Edits e;
    e.drop_keys = {key};
    std::unique_ptr<GgufFile> edited = Edit(*file, e);
    ASSERT_NE(edited, nullptr);
    absl::StatusOr<ModelConfig> c = LoadConfig(*edited);
    ASSERT_FALSE(c.ok()) << key;
    EXPECT_NE(c.status().message().find(key), absl::string_view::npos) << c.status();
    EXPECT_NE(c.status().message().find("edited.gguf"), absl::string_view::npos) << c.status();
  }
}

TEST(LoadConfig, WronglyTypedKeyNamesTheKey) {
  std::unique_ptr<GgufFile> file = FixtureFileOrFail(FixtureSpec{});
  ASSERT_NE(file, nullptr);
  Edits e;
  e.set_string["qwen3moe.block_count"] = "two";
  absl::StatusOr<ModelConfig> c = LoadConfig(*Edit(*file, e));
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("qwen3moe.block_count"), absl::string_view::npos)
      << c.status();
}

TEST(LoadConfig, SanityChecksNameTheKeyAndValues) {
  std::unique_ptr<GgufFile> file = FixtureFileOrFail(FixtureSpec{});  // 8 experts, 4 heads of 16
  ASSERT_NE(file, nullptr);
  struct Case {
    std::map<std::string, uint32_t> set;
    std::vector<std::string> expect;
  };
  const Case cases[] = {
      {{{"qwen3moe.expert_used_count", 9}}, {"qwen3moe.expert_used_count", "9", "8"}},
      {{{"qwen3moe.expert_used_count", 0}}, {"qwen3moe.expert_used_count", "positive"}},
      {{{"qwen3moe.attention.head_count_kv", 3}}, {"qwen3moe.attention.head_count_kv", "3"}},
      {{{"qwen3moe.block_count", 0}}, {"qwen3moe.block_count"}},
      {{{"qwen3moe.attention.key_length", 15},
        {"qwen3moe.attention.value_length", 15},
        {"qwen3moe.rope.dimension_count", 15}},
       {"qwen3moe.attention.key_length", "15", "even"}},
      {{{"qwen3moe.attention.value_length", 8}}, {"qwen3moe.attention.value_length", "8"}},
      {{{"qwen3moe.rope.dimension_count", 8}},
       {"qwen3moe.rope.dimension_count", "partial RoPE (8 of 16", "llama.cpp asserts"}},
  };
  for (const Case& k : cases) {
    Edits e;
    e.set_u32 = k.set;
    absl::StatusOr<ModelConfig> c = LoadConfig(*Edit(*file, e));
    ASSERT_FALSE(c.ok()) << k.expect[0];
    for (const std::string& part : k.expect) {
      EXPECT_NE(c.status().message().find(part), absl::string_view::npos) << c.status();
    }
  }
}

TEST(LoadConfig, UnsupportedArchitectureNamesIt) {
  std::unique_ptr<GgufFile> file = FixtureFileOrFail(FixtureSpec{});
  ASSERT_NE(file, nullptr);
  Edits e;
  e.set_string["general.architecture"] = "gpt2";
  absl::StatusOr<ModelConfig> c = LoadConfig(*Edit(*file, e));
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("general.architecture"), absl::string_view::npos);
  EXPECT_NE(c.status().message().find("gpt2"), absl::string_view::npos);
}

// llama.cpp derives the expert size from feed_forward_length / top-k and the
// shared size from feed_forward_length when the expert keys are absent.
TEST(LoadConfig, ExpertSizesFallBackAsLlamaCppDoes) {
  FixtureSpec spec;
  spec.arch = Arch::kQwen2Moe;
  spec.n_ff_exp = 32;
  spec.n_ff_shexp = 96;
  spec.n_expert_used = 2;
  std::unique_ptr<GgufFile> file = FixtureFileOrFail(spec);
  ASSERT_NE(file, nullptr);
  Edits e;
  e.drop_keys = {"qwen2moe.expert_feed_forward_length",
                 "qwen2moe.expert_shared_feed_forward_length"};
  e.set_u32["qwen2moe.feed_forward_length"] = 128;
  absl::StatusOr<ModelConfig> c = LoadConfig(*Edit(*file, e));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->n_ff_exp, 64);
  EXPECT_EQ(c->n_ff_shexp, 128);
}

TEST(LoadConfig, VocabSizeFallsBackToTokensThenEmbeddings) {
  FixtureSpec spec;
  spec.n_vocab = 300;
  std::unique_ptr<GgufFile> file = FixtureFileOrFail(spec);
  ASSERT_NE(file, nullptr);
  Edits e;
  e.drop_keys = {"qwen3moe.vocab_size"};
  absl::StatusOr<ModelConfig> c = LoadConfig(*Edit(*file, e));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->n_vocab, 300);
  e.drop_keys.insert("tokenizer.ggml.tokens");
  c = LoadConfig(*Edit(*file, e));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->n_vocab, 300);
  e.drop_tensors = {"token_embd.weight"};
  c = LoadConfig(*Edit(*file, e));
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("qwen3moe.vocab_size"), absl::string_view::npos);
}

TEST(LoadConfig, ExpertWeightsNormKeyOverridesTheArchitecture) {
  FixtureSpec spec;
  spec.arch = Arch::kQwen2Moe;
  std::unique_ptr<GgufFile> file = FixtureFileOrFail(spec);
  ASSERT_NE(file, nullptr);
  Edits e;
  e.set_bool["qwen2moe.expert_weights_norm"] = true;
  absl::StatusOr<ModelConfig> c = LoadConfig(*Edit(*file, e));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->norm_topk_prob);
}

TEST(LoadModel, ReportsEveryBadTensorInOneStatus) {
  std::unique_ptr<GgufFile> file = FixtureFileOrFail(FixtureSpec{});  // embd 64, ff 32, 8 experts
  ASSERT_NE(file, nullptr);
  Edits e;
  e.reshape["blk.1.ffn_up_exps.weight"] = {64, 32, 4};
  e.drop_tensors = {"blk.0.attn_k.weight"};
  e.retype["blk.0.attn_q.weight"] = GgmlType::kQ8_1;
  absl::StatusOr<Model> m = LoadModel(*Edit(*file, e));
  ASSERT_FALSE(m.ok());
  const std::string message(m.status().message());
  const std::vector<std::string> lines = absl::StrSplit(message, '\n');
  ASSERT_EQ(lines.size(), 3u) << message;
  for (const std::string& line : lines) {
    EXPECT_EQ(line.rfind("edited.gguf: tensor '", 0), 0u) << line;
  }
  EXPECT_NE(message.find("tensor 'blk.0.attn_k.weight': missing"), std::string::npos) << message;
  EXPECT_NE(message.find("blk.1.ffn_up_exps.weight"), std::string::npos) << message;
  EXPECT_NE(message.find("expected shape [64, 32, 8], found [64, 32, 4]"), std::string::npos)
      << message;
  EXPECT_NE(message.find("blk.0.attn_q.weight"), std::string::npos) << message;
  EXPECT_NE(message.find("type q8_1 is not supported by moegraph (f32, f16"), std::string::npos)
      << message;
}

// gpt-oss as llama_model_openai_moe and llama_context read it: the window on the
// even layers, YaRN's arguments, the gating and activation, and every tensor.
TEST(LoadModel, GptOssReadsItsWindowYarnAndBiases) {
  FixtureSpec spec;
  spec.arch = Arch::kGptOss;
  spec.n_layer = 3;
  spec.n_swa = 6;
  std::unique_ptr<GgufFile> file = FixtureFileOrFail(spec);
  ASSERT_NE(file, nullptr);
  absl::StatusOr<Model> model = LoadModel(*file);
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelConfig& c = model->config;
  EXPECT_EQ(c.n_swa, 6);
  EXPECT_EQ(c.swa_pattern, 2);
  EXPECT_TRUE(c.swa_layer(0));
  EXPECT_FALSE(c.swa_layer(1));
  EXPECT_TRUE(c.swa_layer(2));
  // The rings: n_swa + slack rows on layers 0 and 2, where fewer.
  EXPECT_EQ(KvLayerRows(c, 0, 100), 100);
  EXPECT_EQ(KvLayerRows(c, 0, 100, 8), 14);
  EXPECT_EQ(KvLayerRows(c, 1, 100, 8), 100);
  EXPECT_EQ(KvLayerRows(c, 2, 10, 8), 10);
  const size_t row = 2 * static_cast<size_t>(c.n_head_kv) * c.head_dim * 2;  // K and V, f16
  EXPECT_EQ(KvCacheBytes(c, 100, KvCacheType::kF16), 300 * row);
  EXPECT_EQ(KvCacheBytes(c, 100, KvCacheType::kF16, 8), (14 + 100 + 14) * row);
  // Rings of 14 rows (window 6): after positions 0..39 they hold 26..39, so a
  // step at 31 finds its window's 26..30 and one at 30 misses 25.
  KvRingPositions rings(c, 100, 8);
  ASSERT_TRUE(rings.has_rings());
  rings.Wrote(0, 40);
  EXPECT_TRUE(rings.Holds(40));
  EXPECT_TRUE(rings.Holds(31));
  EXPECT_FALSE(rings.Holds(30));
  rings.Wrote(0, 23);  // a rewind to 20 fed again from 0, and 3 more: rows of 9..22
  EXPECT_TRUE(rings.Holds(23));
  EXPECT_FALSE(rings.Holds(40));  // 35..39's rows hold 21, 22, 9..11 now
  EXPECT_FALSE(KvRingPositions(c, 100, -1).has_rings());
  EXPECT_FALSE(KvRingPositions(c, 10, 8).has_rings());
  EXPECT_EQ(c.rope_type, RopeType::kNeox);
  EXPECT_EQ(c.rope_freq_base, 150000.0f);
  EXPECT_EQ(c.rope_scaling.freq_scale, 1.0f / 32.0f);
  EXPECT_EQ(c.rope_scaling.ext_factor, 1.0f);
  EXPECT_NEAR(c.rope_scaling.attn_factor, 1.0f, 1e-6f);  // get_mscale(32) / (1 + 0.1 ln 32)
  EXPECT_EQ(c.rope_scaling.n_ctx_orig, 4096);
  EXPECT_EQ(c.gating, ExpertGating::kSoftmaxWeight);
  EXPECT_EQ(c.expert_act, ExpertAct::kSwigluOai);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_TRUE(c.qkv_bias && c.attn_sinks && c.attn_out_bias && c.router_bias && c.expert_bias);
  for (const LayerTensors& l : model->layers) {
    ASSERT_NE(l.sinks, nullptr);
    EXPECT_EQ(l.sinks->ne[0], spec.n_head);
    EXPECT_NE(l.bq, nullptr);
    EXPECT_NE(l.bo, nullptr);
    EXPECT_NE(std::string(l.ffn_norm->name).find("post_attention_norm"), std::string::npos);
    ASSERT_NE(l.router_b, nullptr);
    ASSERT_NE(l.down_exps_b, nullptr);
    EXPECT_EQ(l.down_exps_b->ne[0], spec.n_embd);
    EXPECT_EQ(l.down_exps_b->ne[1], spec.n_expert);
  }
  // A missing window, a sink tensor and an unknown RoPE scaling, each named.
  Edits e;
  e.drop_keys = {"gpt-oss.attention.sliding_window"};
  absl::StatusOr<Model> bad = LoadModel(*Edit(*file, e));
  EXPECT_TRUE(MessageHas(bad.status(), "gpt-oss.attention.sliding_window")) << bad.status();
  e = Edits();
  e.drop_tensors = {"blk.1.attn_sinks.weight"};
  bad = LoadModel(*Edit(*file, e));
  EXPECT_TRUE(MessageHas(bad.status(), "tensor 'blk.1.attn_sinks.weight': missing"))
      << bad.status();
  e = Edits();
  e.set_string = {{"gpt-oss.rope.scaling.type", "longrope"}};
  bad = LoadModel(*Edit(*file, e));
  EXPECT_TRUE(MessageHas(bad.status(), "RoPE scaling 'longrope' is not supported")) << bad.status();
}

// glm4moe as llama_model_glm4_moe reads it: the NextN layers out of the decode
// layers, the leading dense layer, partial RoPE, sigmoid gating with its score
// bias, the weights' norm and scale, the ungated shared expert.
TEST(LoadModel, Glm4MoeReadsItsDenseLayersScoreBiasAndSharedExpert) {
  FixtureSpec spec;
  spec.arch = Arch::kGlm4Moe;
  spec.n_layer = 3;
  spec.n_dense_lead = 1;
  spec.n_nextn = 1;
  std::unique_ptr<GgufFile> file = FixtureFileOrFail(spec);
  ASSERT_NE(file, nullptr);
  ASSERT_NE(file->FindTensor("blk.3.nextn.eh_proj.weight"), nullptr);  // written, not read
  absl::StatusOr<Model> model = LoadModel(*file);
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelConfig& c = model->config;
  EXPECT_EQ(c.n_layer, 3);
  EXPECT_EQ(c.n_layer_nextn, 1);
  EXPECT_EQ(c.n_layer_dense_lead, 1);
  EXPECT_EQ(c.n_moe_layer(), 2);
  EXPECT_FALSE(c.moe_layer(0));
  EXPECT_TRUE(c.moe_layer(1));
  EXPECT_EQ(c.n_ff_dense, 2 * spec.n_ff_exp);
  EXPECT_EQ(c.n_ff_shexp, spec.n_ff_exp);
  EXPECT_EQ(c.n_rot, c.head_dim / 2);
  EXPECT_EQ(c.gating, ExpertGating::kSigmoid);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.expert_weights_scale, 2.5f);
  EXPECT_TRUE(c.expert_score_bias && c.qkv_bias);
  EXPECT_FALSE(c.shexp_gated || c.qk_norm);
  ASSERT_EQ(model->layers.size(), 3u);
  const LayerTensors& dense = model->layers[0];
  EXPECT_NE(dense.ffn_gate, nullptr);
  EXPECT_EQ(dense.router, nullptr);
  EXPECT_EQ(dense.gate_exps, nullptr);
  for (int il = 1; il < 3; ++il) {
    const LayerTensors& l = model->layers[il];
    EXPECT_EQ(l.ffn_gate, nullptr);
    ASSERT_NE(l.score_b, nullptr);
    EXPECT_EQ(l.score_b->ne[0], spec.n_expert);
    EXPECT_NE(l.shexp_gate, nullptr);
    EXPECT_EQ(l.shexp_gate_inp, nullptr);
    EXPECT_NE(std::string(l.ffn_norm->name).find("post_attention_norm"), std::string::npos);
  }
  // A fused gate/up expert tensor, which llama.cpp reads for other architectures only.
  Edits fused;
  fused.add_f32["blk.1.ffn_gate_up_exps.weight"] = {spec.n_embd, 2 * spec.n_ff_exp, spec.n_expert};
  absl::StatusOr<Model> refused_fused = LoadModel(*Edit(*file, fused));
  EXPECT_TRUE(MessageHas(refused_fused.status(), "blk.1.ffn_gate_up_exps.weight"))
      << refused_fused.status();
  EXPECT_TRUE(MessageHas(refused_fused.status(), "not part of glm4moe")) << refused_fused.status();
  // Per-layer arrays where llama.cpp reads them: equal values load, unequal are named.
  Edits e;
  e.set_i32_array = {{"glm4moe.expert_feed_forward_length", {32, 32, 32, 32}}};
  absl::StatusOr<Model> arrays = LoadModel(*Edit(*file, e));
  ASSERT_TRUE(arrays.ok()) << arrays.status();
  EXPECT_EQ(arrays->config.n_ff_exp, 32);
  e.set_i32_array = {{"glm4moe.expert_feed_forward_length", {32, 32, 64, 32}}};
  absl::StatusOr<Model> bad = LoadModel(*Edit(*file, e));
  EXPECT_TRUE(MessageHas(bad.status(), "glm4moe.expert_feed_forward_length")) << bad.status();
  EXPECT_TRUE(MessageHas(bad.status(), "layer 2 has 64 where layer 0 has 32")) << bad.status();
  // A missing score bias, an unknown gating function, NextN layers that leave
  // none to decode, each named.
  e = Edits();
  e.drop_tensors = {"blk.2.exp_probs_b.bias"};
  bad = LoadModel(*Edit(*file, e));
  EXPECT_TRUE(MessageHas(bad.status(), "tensor 'blk.2.exp_probs_b.bias': missing")) << bad.status();
  e = Edits();
  e.set_u32 = {{"glm4moe.expert_gating_func", 4}};
  bad = LoadModel(*Edit(*file, e));
  EXPECT_TRUE(MessageHas(bad.status(), "gating function 4 is not supported")) << bad.status();
  e = Edits();
  e.set_u32 = {{"glm4moe.nextn_predict_layers", 4}};
  bad = LoadModel(*Edit(*file, e));
  EXPECT_TRUE(MessageHas(bad.status(), "glm4moe.nextn_predict_layers")) << bad.status();
}

// Linear RoPE scaling on an original architecture is read (every backend scales).
// qwen35moe (docs/QWEN35MOE.md): the plan from attention.recurrent_layers, or
// without it every full_attention_interval-th layer gated attention; the Gated
// DeltaNet's tensors in place of q/k/v/o; no KV rows for its layers; the MTP
// block after them (block_count 5, nextn_predict_layers 1, its flag false) not a
// decode layer.
TEST(LoadModel, Qwen35MoeReadsItsLayerPlanDeltaNetAndGatedAttention) {
  FixtureSpec spec;
  spec.arch = Arch::kQwen35Moe;
  spec.n_layer = 4;
  spec.head_dim = 16;
  std::unique_ptr<GgufFile> file = FixtureFileOrFail(spec);
  ASSERT_NE(file, nullptr);
  absl::StatusOr<Model> model = LoadModel(*file);
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelConfig& c = model->config;
  using M = LayerMixer;
  EXPECT_EQ(c.n_layer, 4);
  EXPECT_EQ(c.n_layer_nextn, 1);
  EXPECT_EQ(model->layers.size(), 4u);
  EXPECT_NE(file->FindTensor("blk.4.nextn.eh_proj.weight"), nullptr);
  EXPECT_EQ(c.mixers, (std::vector<M>{M::kDeltaNet, M::kDeltaNet, M::kDeltaNet,
                                      M::kGatedAttention}));
  EXPECT_EQ(c.delta_net.d_conv, 4);
  EXPECT_EQ(c.delta_net.head_dim, 16);
  EXPECT_EQ(c.delta_net.n_k_heads, 2);
  EXPECT_EQ(c.delta_net.n_v_heads, 4);
  EXPECT_EQ(c.n_rot, 4);
  EXPECT_TRUE(c.qk_norm && c.shexp_gated && c.norm_topk_prob);
  EXPECT_EQ(c.n_ff_shexp, spec.n_ff_exp);
  const LayerTensors& delta = model->layers[0];
  EXPECT_EQ(delta.wq, nullptr);
  ASSERT_NE(delta.delta_net.qkv, nullptr);
  EXPECT_EQ(delta.delta_net.qkv->ne[1], c.delta_net.conv_dim());
  EXPECT_NE(delta.delta_net.a, nullptr);
  ASSERT_NE(model->layers[3].wq, nullptr);
  EXPECT_EQ(model->layers[3].wq->ne[1], 2 * c.n_head * c.head_dim);  // q and its gate
  EXPECT_EQ(model->layers[3].ffn_norm->name, "blk.3.post_attention_norm.weight");
  EXPECT_EQ(KvLayerRows(c, 0, 100), 0);
  EXPECT_EQ(KvLayerRows(c, 3, 100), 100);

  auto plan = [&](const Edits& e) -> absl::StatusOr<std::vector<M>> {
    std::unique_ptr<GgufFile> edited = Edit(*file, e);
    absl::StatusOr<ModelConfig> config = LoadConfig(*edited);
    if (!config.ok()) return config.status();
    return config->mixers;
  };
  Edits flags;
  flags.set_i32_array["qwen35moe.attention.recurrent_layers"] = {1, 0, 1, 0, 0};
  EXPECT_EQ(*plan(flags), (std::vector<M>{M::kDeltaNet, M::kGatedAttention, M::kDeltaNet,
                                          M::kGatedAttention}));
  Edits interval;
  interval.drop_keys = {"qwen35moe.attention.recurrent_layers"};
  interval.set_u32["qwen35moe.full_attention_interval"] = 2;
  EXPECT_EQ(*plan(interval), *plan(flags));
  Edits neither;
  neither.drop_keys = {"qwen35moe.attention.recurrent_layers", "qwen35moe.full_attention_interval"};
  EXPECT_EQ(*plan(neither), c.mixers);  // llama.cpp's default interval, 4

  auto refusal = [&](const Edits& e) { return plan(e).status(); };
  Edits inner;
  inner.set_u32["qwen35moe.ssm.inner_size"] = 60;
  EXPECT_TRUE(MessageHas(refusal(inner), "qwen35moe.ssm.inner_size"));
  Edits heads;
  heads.set_u32["qwen35moe.ssm.time_step_rank"] = 3;
  heads.set_u32["qwen35moe.ssm.inner_size"] = 48;
  EXPECT_TRUE(MessageHas(refusal(heads), "qwen35moe.ssm.time_step_rank"));
  Edits short_flags;
  short_flags.set_i32_array["qwen35moe.attention.recurrent_layers"] = {1, 0, 1, 0};
  EXPECT_TRUE(MessageHas(refusal(short_flags), "4 flags for 5 blocks"));
  Edits missing;
  missing.drop_keys = {"qwen35moe.ssm.conv_kernel"};
  EXPECT_TRUE(MessageHas(refusal(missing), "qwen35moe.ssm.conv_kernel"));
  Edits three_sections;
  three_sections.set_i32_array["qwen35moe.rope.dimension_sections"] = {1, 1, 0};
  EXPECT_TRUE(MessageHas(refusal(three_sections), "3 sections where llama.cpp reads 4"));
  // Two pairs of 4 rotated dims: a sum of 2 puts pair 1 in the h section, empty.
  Edits uncovered;
  uncovered.set_i32_array["qwen35moe.rope.dimension_sections"] = {2, 0, 0, 0};
  EXPECT_TRUE(MessageHas(refusal(uncovered), "qwen35moe.rope.dimension_sections"));
}

TEST(LoadModel, RopeScalingOnAnOriginalArchitectureIsRead) {
  std::unique_ptr<GgufFile> file = FixtureFileOrFail(FixtureSpec{});
  ASSERT_NE(file, nullptr);
  Edits e;
  e.set_string = {{"qwen3moe.rope.scaling.type", "linear"}};
  std::unique_ptr<GgufFile> edited = Edit(*file, e);
  absl::StatusOr<Model> plain = LoadModel(*edited);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE(plain->config.rope_scaling.scaled());  // no factor: nothing scales
  e.set_f32 = {{"qwen3moe.rope.scaling.factor", 4.0f}};
  edited = Edit(*file, e);
  absl::StatusOr<Model> scaled = LoadModel(*edited);
  ASSERT_TRUE(scaled.ok()) << scaled.status();
  EXPECT_EQ(scaled->config.rope_scaling.freq_scale, 0.25f);
  EXPECT_EQ(scaled->config.rope_scaling.ext_factor, 0.0f);
}

TEST(LoadModel, TiedOutputUsesTheEmbeddingWhereLlamaCppAllowsIt) {
  FixtureSpec spec;
  spec.tied_output = true;
  std::unique_ptr<GgufFile> file = FixtureFileOrFail(spec);
  ASSERT_NE(file, nullptr);
  absl::StatusOr<Model> m = LoadModel(*file);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(m->config.tied_embeddings);
  EXPECT_EQ(m->output, m->token_embd);

  // olmoe requires output.weight.
  spec.arch = Arch::kOlmoe;
  spec.tied_output = false;
  spec.n_head_kv = spec.n_head;
  file = FixtureFileOrFail(spec);
  ASSERT_NE(file, nullptr);
  Edits e;
  e.drop_tensors = {"output.weight"};
  m = LoadModel(*Edit(*file, e));
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("'output.weight': missing"), absl::string_view::npos)
      << m.status();
}

// The fixture draws each expert from the same stream whether it stores experts
// merged or per expert, so both layouts must expose the same expert bytes.
TEST(LoadModel, LegacyAndMergedMixtralExpertsAgree) {
  FixtureSpec spec;
  spec.arch = Arch::kMixtral;
  spec.n_expert = 4;
  spec.dense_type = GgmlType::kQ8_0;
  spec.expert_type = GgmlType::kQ4_0;
  std::unique_ptr<GgufFile> merged_file = FixtureFileOrFail(spec);
  spec.legacy_experts = true;
  std::unique_ptr<GgufFile> legacy_file = FixtureFileOrFail(spec);
  ASSERT_NE(merged_file, nullptr);
  ASSERT_NE(legacy_file, nullptr);
  absl::StatusOr<Model> merged = LoadModel(*merged_file);
  absl::StatusOr<Model> legacy = LoadModel(*legacy_file);
  ASSERT_TRUE(merged.ok()) << merged.status();
  ASSERT_TRUE(legacy.ok()) << legacy.status();
  ASSERT_EQ(legacy->layers[0].gate_legacy.size(), 4u);
  EXPECT_EQ(legacy->layers[0].gate_exps, nullptr);
  EXPECT_EQ(legacy->layers[1].down_legacy[3]->name, "blk.1.ffn_down.3.weight");
  for (int il = 0; il < spec.n_layer; ++il) {
    for (int e = 0; e < 4; ++e) {
      for (ExpertProj proj : {ExpertProj::kGate, ExpertProj::kUp, ExpertProj::kDown}) {
        const WeightView a = merged->expert(il, proj, e);
        const WeightView b = legacy->expert(il, proj, e);
        ASSERT_EQ(a.cols, b.cols);
        ASSERT_EQ(a.rows, b.rows);
        ASSERT_EQ(a.row_bytes, b.row_bytes);
        ASSERT_EQ(a.type, GgmlType::kQ4_0);
        EXPECT_EQ(std::memcmp(a.data, b.data, a.row_bytes * a.rows), 0)
            << "layer " << il << " expert " << e;
      }
    }
  }
  // Different experts hold different weights.
  const WeightView e0 = merged->expert(0, ExpertProj::kUp, 0);
  const WeightView e1 = merged->expert(0, ExpertProj::kUp, 1);
  EXPECT_NE(std::memcmp(e0.data, e1.data, e0.row_bytes * e0.rows), 0);
}

TEST(LoadModel, LegacyExpertsWithMixedTypesAreReported) {
  FixtureSpec spec;
  spec.arch = Arch::kMixtral;
  spec.n_expert = 2;
  spec.legacy_experts = true;
  std::unique_ptr<GgufFile> file = FixtureFileOrFail(spec);
  ASSERT_NE(file, nullptr);
  Edits e;
  e.retype["blk.0.ffn_up.1.weight"] = GgmlType::kF16;
  absl::StatusOr<Model> m = LoadModel(*Edit(*file, e));
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("blk.0.ffn_up.1.weight"), absl::string_view::npos)
      << m.status();
}

TEST(WeightView, CoversEveryRowOfATensor) {
  std::unique_ptr<GgufFile> file = FixtureFileOrFail(FixtureSpec{});
  ASSERT_NE(file, nullptr);
  const GgufTensor* t = file->FindTensor("blk.0.ffn_down_exps.weight");
  ASSERT_NE(t, nullptr);
  const WeightView v = weight_view(*t);
  EXPECT_EQ(v.cols, 32);
  EXPECT_EQ(v.rows, 64 * 8);
  EXPECT_EQ(v.row_bytes * v.rows, t->nbytes);
  EXPECT_EQ(v.data, t->data);
}

}  // namespace
}  // namespace moegraph
