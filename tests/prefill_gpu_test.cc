// The batched prefill (capture/engine_prefill.cc) against the T=1 path it
// replaces: the logits after prompts across ubatch boundaries and tails, the
// greedy continuation against the CPU backend's on f32 fixtures, qwen35moe's
// Gated DeltaNet state across calls, the slot tables left as they were, and
// the door that brings the steps back.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "capture/engine.h"
#include "cpu/cpu_backend.h"
#include "loader/fixture.h"
#include "tests/cuda_test_util.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::LoadedModel;
using testing_util::LoadFixture;

#define SKIP_WITHOUT_DEVICE()                                    \
  do {                                                           \
    if (CudaDeviceCount() == 0) {                                \
      GTEST_SKIP() << "no CUDA device (" << NoCudaDeviceReason() \
                   << "): the engine "                           \
                      "tests need a GPU";                        \
    }                                                            \
  } while (0)

constexpr int kMaxCtx = 720;

double Nmse(const std::vector<float>& got, const std::vector<float>& want) {
  double err = 0.0, ref = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    err += d * d;
    ref += static_cast<double>(want[i]) * want[i];
  }
  return ref > 0 ? err / ref : err;
}

// The emulated tree runs every test under MOEGRAPH_EMU_SEED 1, 2 and 3 (the
// blocks' order): each run takes the fixture of its seed too, so the three
// cover three models. 1 elsewhere.
uint64_t FixtureSeed() {
  const char* seed = std::getenv("MOEGRAPH_EMU_SEED");
  return seed != nullptr ? std::strtoull(seed, nullptr, 10) : 1;
}

std::vector<int32_t> RandomPrompt(std::mt19937& rng, int n, int n_vocab) {
  std::uniform_int_distribution<int32_t> id(0, n_vocab - 1);
  std::vector<int32_t> prompt(static_cast<size_t>(n));
  for (int32_t& t : prompt) t = id(rng);
  return prompt;
}

std::unique_ptr<LoadedModel> Fixture(uint64_t seed, GgmlType expert_type,
                                     Arch arch = Arch::kQwen3Moe) {
  FixtureSpec spec;
  spec.arch = arch;
  spec.n_layer = 2;
  spec.n_expert = 8;
  spec.n_expert_used = 2;
  spec.expert_type = expert_type;
  spec.router_skew = 0.8f;
  spec.seed = seed;
  absl::StatusOr<std::unique_ptr<LoadedModel>> loaded = LoadFixture(spec);
  EXPECT_TRUE(loaded.ok()) << loaded.status();
  return loaded.ok() ? std::move(*loaded) : nullptr;
}

// qwen35moe on f32 weights: Gated DeltaNet layers 0 and 2 (heads of
// ssm_head_dim), gated attention layers 1 and 3 (full_attention_interval 2).
std::unique_ptr<LoadedModel> Qwen35Fixture(uint64_t seed, int ssm_head_dim = 32) {
  FixtureSpec spec;
  spec.arch = Arch::kQwen35Moe;
  spec.n_layer = 4;
  spec.full_attention_interval = 2;
  spec.ssm_head_dim = ssm_head_dim;
  spec.n_expert = 8;
  spec.n_expert_used = 2;
  spec.expert_type = GgmlType::kF32;
  spec.dense_type = GgmlType::kF32;
  spec.router_skew = 0.8f;
  spec.seed = seed;
  absl::StatusOr<std::unique_ptr<LoadedModel>> loaded = LoadFixture(spec);
  EXPECT_TRUE(loaded.ok()) << loaded.status();
  return loaded.ok() ? std::move(*loaded) : nullptr;
}

std::unique_ptr<CudaEngine> MakeEngine(const Model& model, bool batched, int32_t slots,
                                       KvCacheType kv_type, int ubatch = 512) {
  CudaEngineOptions options;
  options.max_ctx = kMaxCtx;
  options.kv_type = kv_type;
  options.n_slots = slots;
  options.ubatch = ubatch;
  options.doors.batched_prefill = batched;
  absl::StatusOr<std::unique_ptr<CudaEngine>> engine = CudaEngine::Create(model, options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(*engine) : nullptr;
}

// The T=1 path, the batched prefill in ubatches of 512 and in ubatches of 8, on
// tight slots (3).
struct PromptEngines {
  PromptEngines(const Model& model, KvCacheType kv_type)
      : steps(MakeEngine(model, false, 3, kv_type)),
        batched(MakeEngine(model, true, 3, kv_type)),
        small(MakeEngine(model, true, 3, kv_type, 8)) {}
  bool ok() const { return steps != nullptr && batched != nullptr && small != nullptr; }
  std::unique_ptr<CudaEngine> steps, batched, small;
};

// The prompt's last logits from the batched engines (one ubatch, ubatches of 8)
// are the T=1 path's within an NMSE of bound.
void ExpectBatchedLogitsAreTheSteps(const PromptEngines& engines,
                                    const std::vector<int32_t>& prompt, double bound) {
  ASSERT_TRUE(engines.steps->Generate(prompt, 1).ok());
  absl::StatusOr<std::vector<float>> want = engines.steps->LastLogits();
  ASSERT_TRUE(want.ok()) << want.status();
  for (CudaEngine* engine : {engines.batched.get(), engines.small.get()}) {
    ASSERT_TRUE(engine->Generate(prompt, 1).ok());
    absl::StatusOr<std::vector<float>> got = engine->LastLogits();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_LT(Nmse(*got, *want), bound);
  }
}

class PrefillTest : public ::testing::Test {
 protected:
  void SetUp() override { SKIP_WITHOUT_DEVICE(); }
  void TearDown() override { testing_util::PrintDeviceOnFailure(); }
};

// Prompts of 1, 31, 512 and 700 tokens (one ubatch, a ubatch and a
// tail), and 31 in ubatches of 8: the last logits within the oracle test's
// bound of the T=1 path's, with tight slots so experts are streamed.
TEST_F(PrefillTest, LogitsEqualTheStepPathsAcrossUbatchesAndTails) {
  const uint64_t seed = FixtureSeed();
  std::unique_ptr<LoadedModel> loaded = Fixture(seed, GgmlType::kQ8_0);
  ASSERT_NE(loaded, nullptr);
  const Model& model = loaded->model;
  PromptEngines engines(model, KvCacheType::kF16);
  ASSERT_TRUE(engines.ok());
  CudaEngine* steps = engines.steps.get();
  CudaEngine* batched = engines.batched.get();
  CudaEngine* small = engines.small.get();
  std::mt19937 rng(static_cast<uint32_t>(seed));
  for (int n : {1, 31, 512, 700}) {
    SCOPED_TRACE("seed " + std::to_string(seed) + ", prompt " + std::to_string(n));
    const std::vector<int32_t> prompt = RandomPrompt(rng, n, model.config.n_vocab);
    ASSERT_TRUE(steps->Generate(prompt, 1).ok());
    absl::StatusOr<std::vector<float>> want = steps->LastLogits();
    ASSERT_TRUE(want.ok()) << want.status();
    const HostCounters before = batched->host_counters();
    ASSERT_TRUE(batched->Generate(prompt, 1).ok());
    absl::StatusOr<std::vector<float>> got = batched->LastLogits();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_LT(Nmse(*got, *want), 5e-4);
    const HostCounters& after = batched->host_counters();
    EXPECT_EQ(after.prefill_tokens - before.prefill_tokens, static_cast<uint64_t>(n));
    EXPECT_EQ(after.prefill_ubatches - before.prefill_ubatches,
              static_cast<uint64_t>((n + 511) / 512));
    EXPECT_EQ(after.prompt_steps, 0u);
    if (n == 31) {
      const uint64_t ubatches = small->host_counters().prefill_ubatches;
      ASSERT_TRUE(small->Generate(prompt, 1).ok());
      EXPECT_EQ(small->host_counters().prefill_ubatches - ubatches, 4u);  // 8, 8, 8, 7
      absl::StatusOr<std::vector<float>> tail = small->LastLogits();
      ASSERT_TRUE(tail.ok()) << tail.status();
      EXPECT_LT(Nmse(*tail, *want), 5e-4);
    }
  }
  EXPECT_EQ(steps->host_counters().prompt_steps, 1u + 31 + 512 + 700);
  EXPECT_EQ(steps->host_counters().prefill_tokens, 0u);
}

// gpt-oss (a window of 4 on layer 0, sinks, YaRN, the output, router and
// expert biases, swiglu_oai) on f32 weights and an f32 KV cache, where no
// router near-tie can flip an expert between the GEMMs' rounding and the T=1
// path's: prompts of 31 and 200 tokens (past a split of the attention), in
// ubatches of 512 and of 8, give the T=1 path's last logits within the oracle
// test's f32 bound.
TEST_F(PrefillTest, GptOssPromptsGiveTheStepPathsLogits) {
  std::unique_ptr<LoadedModel> loaded = Fixture(FixtureSeed(), GgmlType::kF32, Arch::kGptOss);
  ASSERT_NE(loaded, nullptr);
  const Model& model = loaded->model;
  PromptEngines engines(model, KvCacheType::kF32);
  ASSERT_TRUE(engines.ok());
  std::mt19937 rng(3);
  for (int n : {31, 200}) {
    SCOPED_TRACE("prompt " + std::to_string(n));
    ExpectBatchedLogitsAreTheSteps(engines, RandomPrompt(rng, n, model.config.n_vocab), 1e-6);
  }
  EXPECT_EQ(engines.batched->host_counters().prompt_steps, 0u);
  EXPECT_EQ(engines.small->host_counters().prefill_ubatches, 4u + 25u);  // 31 and 200 in 8s
}

// gpt-oss's windowed layers (n_swa 4) in rings of n_swa + ubatch rows (12, in
// a context of 720) against --swa-full's caches: prompts (in ubatches of 8),
// decodes, a continuation and a rewind give the same tokens and the same
// logits bit for bit. The rewind to position 10, which the rings no longer
// hold, feeds its kept positions again (one ring refill); the continuation
// does not.
TEST_F(PrefillTest, WindowedLayersInRingsGiveTheFullCachesBits) {
  std::unique_ptr<LoadedModel> loaded = Fixture(FixtureSeed(), GgmlType::kF32, Arch::kGptOss);
  ASSERT_NE(loaded, nullptr);
  const Model& model = loaded->model;
  ASSERT_EQ(model.config.n_swa, 4);
  auto make = [&](bool swa_full) {
    CudaEngineOptions options;
    options.max_ctx = kMaxCtx;
    options.kv_type = KvCacheType::kF32;
    options.n_slots = 3;
    options.ubatch = 8;
    options.swa_full = swa_full;
    absl::StatusOr<std::unique_ptr<CudaEngine>> engine = CudaEngine::Create(model, options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? std::move(*engine) : nullptr;
  };
  std::unique_ptr<CudaEngine> rings = make(false), full = make(true);
  ASSERT_TRUE(rings != nullptr && full != nullptr);
  std::mt19937 rng(5);
  const std::vector<int32_t> prompt = RandomPrompt(rng, 40, model.config.n_vocab);
  const std::vector<int32_t> next = RandomPrompt(rng, 3, model.config.n_vocab);
  struct Call {
    const char* what;
    const std::vector<int32_t>& prompt;
    int start;
    uint64_t refills;  // the rings' refills after it
  };
  for (const Call& call : {Call{"prompt", prompt, 0, 0}, Call{"continuation", next, 40 + 19, 0},
                           Call{"rewind", next, 10, 1}}) {
    SCOPED_TRACE(call.what);
    absl::StatusOr<std::vector<int32_t>> want =
        full->Generate(call.prompt, 20, nullptr, nullptr, call.start);
    ASSERT_TRUE(want.ok()) << want.status();
    absl::StatusOr<std::vector<int32_t>> got =
        rings->Generate(call.prompt, 20, nullptr, nullptr, call.start);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, *want);
    absl::StatusOr<std::vector<float>> want_logits = full->LastLogits();
    absl::StatusOr<std::vector<float>> got_logits = rings->LastLogits();
    ASSERT_TRUE(want_logits.ok() && got_logits.ok());
    EXPECT_EQ(0, std::memcmp(got_logits->data(), want_logits->data(),
                             want_logits->size() * sizeof(float)));
    EXPECT_EQ(rings->host_counters().ring_refills, call.refills);
  }
  EXPECT_EQ(full->host_counters().ring_refills, 0u);
}

// f32 fixtures: after prompts of 31 and 700 tokens the greedy continuation is
// the CPU backend's, token for token (an f32 KV cache on the device, as the
// oracle test).
TEST_F(PrefillTest, F32ContinuationsAreTheCpuBackendsTokens) {
  const uint64_t seed = FixtureSeed();
  std::unique_ptr<LoadedModel> loaded = Fixture(seed, GgmlType::kF32);
  ASSERT_NE(loaded, nullptr);
  const Model& model = loaded->model;
  std::unique_ptr<CudaEngine> engine = MakeEngine(model, true, 3, KvCacheType::kF32);
  ASSERT_NE(engine, nullptr);
  CpuBackendOptions cpu_options;
  cpu_options.max_ctx = kMaxCtx;
  cpu_options.resident = true;
  cpu_options.oracle_arithmetic = true;  // f64: the tokens a near-tie cannot move
  absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create(model, nullptr, cpu_options);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  std::mt19937 rng(static_cast<uint32_t>(seed) + 10);
  for (int n : {31, 700}) {
    SCOPED_TRACE("seed " + std::to_string(seed) + ", prompt " + std::to_string(n));
    const std::vector<int32_t> prompt = RandomPrompt(rng, n, model.config.n_vocab);
    (*cpu)->Reset();
    absl::StatusOr<std::vector<int32_t>> want = (*cpu)->Generate(prompt, 8);
    ASSERT_TRUE(want.ok()) << want.status();
    absl::StatusOr<std::vector<int32_t>> got = engine->Generate(prompt, 8);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, *want);
  }
  EXPECT_EQ(engine->host_counters().prompt_steps, 0u);
}

// qwen35moe (Gated DeltaNet layers around gated attention ones) on f32
// weights: a prompt of 31 tokens in one ubatch and in ubatches of 8 (the conv
// window and the state cross them) gives the T=1 path's last logits within the
// f32 bound, and the greedy continuation of a prompt of 40 is the CPU
// backend's (its f64 arithmetic) token for token.
TEST_F(PrefillTest, Qwen35PromptsGiveTheStepPathsLogitsAndTheCpuBackendsTokens) {
  const uint64_t seed = FixtureSeed();
  std::unique_ptr<LoadedModel> loaded = Qwen35Fixture(seed);
  ASSERT_NE(loaded, nullptr);
  const Model& model = loaded->model;
  ASSERT_EQ(model.config.n_kv_layers(), 2);
  PromptEngines engines(model, KvCacheType::kF32);
  ASSERT_TRUE(engines.ok());
  std::mt19937 rng(static_cast<uint32_t>(seed) + 20);
  ExpectBatchedLogitsAreTheSteps(engines, RandomPrompt(rng, 31, model.config.n_vocab), 1e-6);
  EXPECT_EQ(engines.small->host_counters().prefill_ubatches, 4u);  // 8, 8, 8, 7
  EXPECT_EQ(engines.batched->host_counters().prompt_steps, 0u);

  CpuBackendOptions cpu_options;
  cpu_options.max_ctx = kMaxCtx;
  cpu_options.resident = true;
  cpu_options.oracle_arithmetic = true;
  absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create(model, nullptr, cpu_options);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const std::vector<int32_t> longer = RandomPrompt(rng, 40, model.config.n_vocab);
  absl::StatusOr<std::vector<int32_t>> cpu_tokens = (*cpu)->Generate(longer, 8);
  ASSERT_TRUE(cpu_tokens.ok()) << cpu_tokens.status();
  absl::StatusOr<std::vector<int32_t>> tokens = engines.small->Generate(longer, 8);
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  EXPECT_EQ(*tokens, *cpu_tokens);
}

// The Gated DeltaNet state holds every position fed and only those: a chat's
// next turn from the end continues it (no refill), and three turns give the
// tokens of the whole conversation run at once; a rewind (or an edit) feeds
// the kept positions again from 0 (one state refill, ResumePosition 0) and
// gives the tokens of a fresh engine fed the same ids.
TEST_F(PrefillTest, Qwen35StateResumesOnlyAtItsEnd) {
  std::unique_ptr<LoadedModel> loaded = Qwen35Fixture(FixtureSeed());
  ASSERT_NE(loaded, nullptr);
  const Model& model = loaded->model;
  const int n_vocab = model.config.n_vocab;
  std::unique_ptr<CudaEngine> chat = MakeEngine(model, true, 3, KvCacheType::kF32, 8);
  ASSERT_NE(chat, nullptr);
  std::mt19937 rng(7);
  std::vector<int32_t> conversation;  // every id fed so far
  int fed = 0;
  for (int turn = 0; turn < 3; ++turn) {
    SCOPED_TRACE("turn " + std::to_string(turn));
    const std::vector<int32_t> question = RandomPrompt(rng, 5 + 4 * turn, n_vocab);
    EXPECT_EQ(chat->ResumePosition(fed), fed);
    absl::StatusOr<std::vector<int32_t>> reply =
        chat->Generate(question, 6, nullptr, nullptr, fed);
    ASSERT_TRUE(reply.ok()) << reply.status();
    conversation.insert(conversation.end(), question.begin(), question.end());
    conversation.insert(conversation.end(), reply->begin(), reply->end() - 1);
    fed = static_cast<int>(conversation.size());
    // The conversation up to this reply at once gives the reply.
    std::unique_ptr<CudaEngine> once = MakeEngine(model, true, 3, KvCacheType::kF32, 8);
    ASSERT_NE(once, nullptr);
    const std::vector<int32_t> head(conversation.begin(), conversation.end() - 5);
    absl::StatusOr<std::vector<int32_t>> whole = once->Generate(head, 6);
    ASSERT_TRUE(whole.ok()) << whole.status();
    EXPECT_EQ(*whole, *reply);
  }
  EXPECT_EQ(chat->host_counters().state_refills, 0u);

  const std::vector<int32_t> edit = RandomPrompt(rng, 4, n_vocab);
  EXPECT_EQ(chat->ResumePosition(10), 0);
  absl::StatusOr<std::vector<int32_t>> rewound = chat->Generate(edit, 6, nullptr, nullptr, 10);
  ASSERT_TRUE(rewound.ok()) << rewound.status();
  EXPECT_EQ(chat->host_counters().state_refills, 1u);
  std::vector<int32_t> ids(conversation.begin(), conversation.begin() + 10);
  ids.insert(ids.end(), edit.begin(), edit.end());
  std::unique_ptr<CudaEngine> fresh = MakeEngine(model, true, 3, KvCacheType::kF32, 8);
  ASSERT_NE(fresh, nullptr);
  absl::StatusOr<std::vector<int32_t>> want = fresh->Generate(ids, 6);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(*rewound, *want);
  EXPECT_EQ(fresh->host_counters().state_refills, 0u);
}

// A warm cache, then a 700-token prompt: the slot table, owners, stamps and
// segments (every array of the policy's state) as they were, while the
// prefill read experts in place and streamed the others.
TEST_F(PrefillTest, APromptLeavesTheDecodeSetAsItWas) {
  std::unique_ptr<LoadedModel> loaded = Fixture(4, GgmlType::kQ8_0);
  ASSERT_NE(loaded, nullptr);
  const Model& model = loaded->model;
  std::unique_ptr<CudaEngine> engine = MakeEngine(model, true, 6, KvCacheType::kF16);
  ASSERT_NE(engine, nullptr);
  std::mt19937 rng(4);
  ASSERT_TRUE(engine->Generate(RandomPrompt(rng, 5, model.config.n_vocab), 24).ok());
  absl::StatusOr<ResidencySnapshot> warm = engine->ReadResidency(0);
  ASSERT_TRUE(warm.ok()) << warm.status();
  absl::StatusOr<EngineCounters> counters = engine->ReadCounters();
  ASSERT_TRUE(counters.ok()) << counters.status();
  const HostCounters before = engine->host_counters();

  ASSERT_TRUE(engine->Generate(RandomPrompt(rng, 700, model.config.n_vocab), 0).ok());
  absl::StatusOr<ResidencySnapshot> after = engine->ReadResidency(0);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(*after == *warm);
  absl::StatusOr<EngineCounters> later = engine->ReadCounters();
  ASSERT_TRUE(later.ok()) << later.status();
  EXPECT_EQ(later->hits, counters->hits);
  EXPECT_EQ(later->misses, counters->misses);
  EXPECT_EQ(later->evictions, counters->evictions);
  const HostCounters& host = engine->host_counters();
  const uint64_t in_place = host.prefill_experts_in_place - before.prefill_experts_in_place;
  const uint64_t streamed = host.prefill_experts_streamed - before.prefill_experts_streamed;
  EXPECT_GT(in_place, 0u);
  EXPECT_GT(streamed, 0u);
  // Two ubatches x two layers x at most eight experts each.
  EXPECT_LE(in_place + streamed, 2u * 2 * 8);
  EXPECT_EQ(host.prefill_bytes_streamed - before.prefill_bytes_streamed,
            streamed * engine->pools()[0].block_bytes);
}

// A Gated DeltaNet head the mixer kernel cannot hold (ssm.state_size 16, not
// a multiple of a warp) is refused naming the key, before any allocation.
TEST_F(PrefillTest, Qwen35AStateSizeTheKernelDoesNotTakeIsNamed) {
  std::unique_ptr<LoadedModel> loaded = Qwen35Fixture(1, 16);
  ASSERT_NE(loaded, nullptr);
  CudaEngineOptions options;
  options.max_ctx = 64;
  absl::StatusOr<std::unique_ptr<CudaEngine>> engine = CudaEngine::Create(loaded->model, options);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(engine.status().message()).find("ssm.state_size"), std::string::npos)
      << engine.status();
  EXPECT_NE(std::string(engine.status().message()).find("this model: 16"), std::string::npos)
      << engine.status();
}

TEST_F(PrefillTest, AUbatchOfNoTokensIsAnErrorNamingTheFlag) {
  std::unique_ptr<LoadedModel> loaded = Fixture(1, GgmlType::kQ8_0);
  ASSERT_NE(loaded, nullptr);
  CudaEngineOptions options;
  options.max_ctx = 64;
  options.ubatch = 0;
  absl::StatusOr<std::unique_ptr<CudaEngine>> engine = CudaEngine::Create(loaded->model, options);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(engine.status().message()).find("-ub 0"), std::string::npos)
      << engine.status();
}

}  // namespace
}  // namespace moegraph
