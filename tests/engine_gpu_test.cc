// The CUDA engine on a device (every test skips without one): logits against
// the CPU oracle by NMSE, greedy tokens equal to the oracle's on f32 fixtures,
// identical tokens and logits across the arms (resident, graph, eager, host,
// stage), device residency tables equal to a host PolicyCache fed the routing
// the engine recorded, host synchronizations per token in each mode, and no
// error left behind by a failed CUDA call that CudaStatus reported.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "capture/engine.h"
#include "loader/fixture.h"
#include "reference/oracle.h"
#include "residency/cache.h"
#include "tests/cuda_test_util.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::BitEqual;
using testing_util::LoadedModel;
using testing_util::LoadFixture;
using testing_util::MessageHas;

#define SKIP_WITHOUT_DEVICE()                                                        \
  do {                                                                               \
    if (CudaDeviceCount() == 0) {                                                    \
      GTEST_SKIP() << "no CUDA device (" << NoCudaDeviceReason() << "): the engine " \
                      "tests need a GPU";                                            \
    }                                                                                \
  } while (0)

const std::vector<int32_t> kPrompt = {3, 17, 101, 42, 42, 0, 127, 64};

// Launchers return cudaGetLastError(), so an error a failed call left behind
// would fail the next launch, however good; CudaStatus consumes it.
TEST(CudaStatusTest, AFailedCallsErrorDoesNotReachTheNextLaunch) {
  SKIP_WITHOUT_DEVICE();
  void* ptr = nullptr;
  const cudaError_t err = cudaMalloc(&ptr, size_t{1} << 62);  // 4 EiB: no device has it
  ASSERT_EQ(err, cudaErrorMemoryAllocation);
  const absl::Status status = CudaStatus(err, "a test allocation");
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(MessageHas(status, "a test allocation")) << status;
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

double Nmse(const std::vector<float>& got, const std::vector<float>& want) {
  double err = 0;
  double ref = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    err += d * d;
    ref += static_cast<double>(want[i]) * want[i];
  }
  return ref > 0 ? err / ref : err;
}

Doors DoorsOf(Arm arm) {
  Doors d;
  d.graph = arm != Arm::kEager && arm != Arm::kHost;
  d.moe_cache = arm != Arm::kStage;
  d.residency = arm == Arm::kHost ? ResidencyMode::kHost : ResidencyMode::kDevice;
  d.resident = arm == Arm::kResident;
  return d;
}

std::unique_ptr<CudaEngine> MakeEngine(const Model& model, Arm arm, int32_t slots,
                                       int steps_per_launch = 1, bool record_routing = false,
                                       ResidencyPolicy policy = kDefaultResidencyPolicy,
                                       KvCacheType kv_type = KvCacheType::kF16,
                                       bool batched_prefill = true) {
  CudaEngineOptions options;
  options.max_ctx = 64;
  options.kv_type = kv_type;
  options.n_slots = slots;
  options.doors = DoorsOf(arm);
  options.doors.policy = policy;
  options.doors.batched_prefill = batched_prefill;
  options.steps_per_launch = steps_per_launch;
  options.record_routing = record_routing;
  absl::StatusOr<std::unique_ptr<CudaEngine>> engine = CudaEngine::Create(model, options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return nullptr;
  EXPECT_EQ((*engine)->arm(), arm);
  return std::move(*engine);
}

struct OracleCase {
  Arch arch;
  GgmlType expert_type;
  bool legacy = false;
};

void PrintTo(const OracleCase& c, std::ostream* os) {
  *os << arch_gguf_name(c.arch) << " " << ggml_type_name(static_cast<uint32_t>(c.expert_type))
      << (c.legacy ? " legacy" : "");
}

class EngineOracleTest : public ::testing::TestWithParam<OracleCase> {
 protected:
  void TearDown() override { testing_util::PrintDeviceOnFailure(); }
};

TEST_P(EngineOracleTest, LogitsMatchTheOracleAndF32TokensAreEqual) {
  SKIP_WITHOUT_DEVICE();
  const OracleCase c = GetParam();
  FixtureSpec spec;
  spec.arch = c.arch;
  spec.expert_type = c.expert_type;
  spec.legacy_experts = c.legacy;
  // K-quants need rows of 256.
  spec.n_embd = 256;
  spec.n_ff_exp = 256;
  spec.n_head = 4;
  spec.n_head_kv = c.arch == Arch::kOlmoe ? 4 : 2;
  spec.n_expert = 8;
  spec.n_expert_used = 2;
  spec.router_skew = 1.0f;
  spec.seed = 7;
  absl::StatusOr<std::unique_ptr<LoadedModel>> loaded = LoadFixture(spec);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const Model& model = (*loaded)->model;

  absl::StatusOr<std::unique_ptr<Oracle>> oracle = Oracle::Create(model, 64);
  ASSERT_TRUE(oracle.ok()) << oracle.status();
  // Tight slots so the expert path both hits and misses. An f32 model keeps an
  // f32 KV cache (the exact comparison), the quantized ones the default f16.
  const KvCacheType kv_type =
      c.expert_type == GgmlType::kF32 ? KvCacheType::kF32 : KvCacheType::kF16;
  std::unique_ptr<CudaEngine> engine =
      MakeEngine(model, Arm::kGraph, 3, 1, false, kDefaultResidencyPolicy, kv_type);
  ASSERT_NE(engine, nullptr);

  for (size_t n = 1; n <= kPrompt.size(); n += 3) {
    const absl::Span<const int32_t> prompt = absl::MakeConstSpan(kPrompt).subspan(0, n);
    (*oracle)->Reset();
    absl::StatusOr<std::vector<float>> want = (*oracle)->Forward(prompt);
    ASSERT_TRUE(want.ok()) << want.status();
    const std::vector<float> last(want->end() - model.config.n_vocab, want->end());
    ASSERT_TRUE(engine->Generate(prompt, 1).ok());
    absl::StatusOr<std::vector<float>> got = engine->LastLogits();
    ASSERT_TRUE(got.ok()) << got.status();
    const double bound = c.expert_type == GgmlType::kF32 ? 1e-6 : 5e-4;
    EXPECT_LT(Nmse(*got, last), bound) << "prompt length " << n;
  }

  if (c.expert_type == GgmlType::kF32) {
    (*oracle)->Reset();
    absl::StatusOr<std::vector<int32_t>> want = (*oracle)->Generate(kPrompt, 12);
    ASSERT_TRUE(want.ok()) << want.status();
    absl::StatusOr<std::vector<int32_t>> got = engine->Generate(kPrompt, 12);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, *want);

    // Sampled: the device's draw is the oracle's, bit for bit, on f32 logits
    // within 1e-6 of each other.
    CudaEngineOptions options;
    options.max_ctx = 64;
    options.kv_type = KvCacheType::kF32;
    options.n_slots = 3;
    options.sampling.temperature = 1.2f;
    options.sampling.top_k = 60;
    options.sampling.top_p = 0.97f;
    options.sampling.min_p = 0.002f;
    options.sampling.seed = 99;
    absl::StatusOr<std::unique_ptr<CudaEngine>> sampler = CudaEngine::Create(model, options);
    ASSERT_TRUE(sampler.ok()) << sampler.status();
    (*oracle)->Reset();
    want = (*oracle)->Generate(kPrompt, 12, nullptr, nullptr, options.sampling);
    ASSERT_TRUE(want.ok()) << want.status();
    got = (*sampler)->Generate(kPrompt, 12);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, *want);

    // The same settings given later to the greedy engine (a server request's
    // own): the same draw, with no graph captured again; then greedy again.
    ASSERT_TRUE(engine->Generate(kPrompt, 2).ok());
    const uint64_t captures = engine->host_counters().captures;
    ASSERT_TRUE(engine->SetSampling(options.sampling).ok());
    got = engine->Generate(kPrompt, 12);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, *want);
    EXPECT_EQ(engine->host_counters().captures, captures);
    ASSERT_TRUE(engine->SetSampling(SamplingParams{}).ok());
    (*oracle)->Reset();
    absl::StatusOr<std::vector<int32_t>> greedy = (*oracle)->Generate(kPrompt, 12);
    ASSERT_TRUE(greedy.ok()) << greedy.status();
    got = engine->Generate(kPrompt, 12);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, *greedy);
    SamplingParams bad = options.sampling;
    bad.top_p = 0.0f;
    const absl::Status refused = engine->SetSampling(bad);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(refused.message()).find("--top-p 0"), std::string::npos) << refused;
    EXPECT_EQ(engine->sampling().top_p, 1.0f);

    // A second call that keeps the KV cache (a chat's next turn): the oracle
    // continues from n_past(), the engine from the position it is given.
    (*oracle)->Reset();
    absl::StatusOr<std::vector<int32_t>> first = (*oracle)->Generate(kPrompt, 5);
    ASSERT_TRUE(first.ok()) << first.status();
    const int kept = (*oracle)->n_past();
    const std::vector<int32_t> next = {first->back(), 7, 8};
    want = (*oracle)->Generate(next, 6);
    ASSERT_TRUE(want.ok()) << want.status();
    got = engine->Generate(kPrompt, 5);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, *first);
    GenerateStats stats;
    got = engine->Generate(next, 6, &stats, nullptr, kept);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, *want);
    EXPECT_EQ(stats.prompt_tokens, 3);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, EngineOracleTest,
    ::testing::Values(
        OracleCase{Arch::kQwen3Moe, GgmlType::kF32}, OracleCase{Arch::kQwen3Moe, GgmlType::kQ4_K},
        OracleCase{Arch::kOlmoe, GgmlType::kQ8_0}, OracleCase{Arch::kQwen2Moe, GgmlType::kF32},
        OracleCase{Arch::kQwen2Moe, GgmlType::kQ6_K},
        OracleCase{Arch::kMixtral, GgmlType::kQ5_K, /*legacy=*/true},
        OracleCase{Arch::kMixtral, GgmlType::kF16}, OracleCase{Arch::kQwen3Moe, GgmlType::kMXFP4},
        OracleCase{Arch::kQwen3Moe, GgmlType::kIQ4_XS}, OracleCase{Arch::kOlmoe, GgmlType::kQ4_1},
        OracleCase{Arch::kOlmoe, GgmlType::kIQ4_NL}, OracleCase{Arch::kQwen2Moe, GgmlType::kQ2_K},
        OracleCase{Arch::kQwen2Moe, GgmlType::kQ5_1}, OracleCase{Arch::kMixtral, GgmlType::kQ3_K},
        OracleCase{Arch::kMixtral, GgmlType::kQ5_0, /*legacy=*/true},
        OracleCase{Arch::kGlm4Moe, GgmlType::kF32}, OracleCase{Arch::kGlm4Moe, GgmlType::kQ4_K},
        OracleCase{Arch::kGptOss, GgmlType::kF32}, OracleCase{Arch::kGptOss, GgmlType::kMXFP4}),
    [](const ::testing::TestParamInfo<OracleCase>& info) {
      // gtest names take no '-' (gpt-oss).
      return absl::StrReplaceAll(
          absl::StrFormat("%s_%s%s", arch_gguf_name(info.param.arch),
                          ggml_type_name(static_cast<uint32_t>(info.param.expert_type)),
                          info.param.legacy ? "_legacy" : ""),
          {{"-", ""}});
    });

class EngineArmsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_DEVICE();
    FixtureSpec spec;
    spec.arch = Arch::kQwen2Moe;  // the shared expert too
    spec.n_layer = 3;
    spec.n_expert = 16;
    spec.n_expert_used = 4;
    spec.expert_type = GgmlType::kQ8_0;
    spec.router_skew = 0.8f;
    spec.seed = 11;
    absl::StatusOr<std::unique_ptr<LoadedModel>> loaded = LoadFixture(spec);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    loaded_ = std::move(*loaded);
  }
  void TearDown() override { testing_util::PrintDeviceOnFailure(); }
  const Model& model() const { return loaded_->model; }

  std::unique_ptr<LoadedModel> loaded_;
};

TEST_F(EngineArmsTest, EveryArmGivesTheSameTokensAndLogits) {
  constexpr int kPredict = 16;
  std::vector<int32_t> want_tokens;
  std::vector<float> want_logits;
  for (Arm arm : {Arm::kGraph, Arm::kEager, Arm::kHost, Arm::kStage, Arm::kResident}) {
    // Slots = k: heavy eviction wherever a policy runs.
    std::unique_ptr<CudaEngine> engine = MakeEngine(model(), arm, 4);
    ASSERT_NE(engine, nullptr) << ArmName(arm);
    absl::StatusOr<std::vector<int32_t>> tokens = engine->Generate(kPrompt, kPredict);
    ASSERT_TRUE(tokens.ok()) << ArmName(arm) << ": " << tokens.status();
    absl::StatusOr<std::vector<float>> logits = engine->LastLogits();
    ASSERT_TRUE(logits.ok()) << logits.status();
    absl::StatusOr<EngineCounters> counters = engine->ReadCounters();
    ASSERT_TRUE(counters.ok()) << counters.status();
    // The prompt is batched: the steps are the decode's, and the prefill read
    // its experts in place or streamed them as the arm keeps them.
    const HostCounters& host = engine->host_counters();
    EXPECT_EQ(host.prompt_steps, 0u) << ArmName(arm);
    EXPECT_EQ(host.prefill_tokens, kPrompt.size()) << ArmName(arm);
    EXPECT_GT(host.prefill_experts_in_place + host.prefill_experts_streamed, 0u);
    EXPECT_EQ(host.prefill_bytes_streamed,
              host.prefill_experts_streamed * engine->pools()[0].block_bytes);
    if (arm == Arm::kResident) {
      EXPECT_EQ(host.prefill_experts_streamed, 0u);
    }
    if (arm == Arm::kStage) {
      EXPECT_EQ(host.prefill_experts_in_place, 0u);
    }
    const uint64_t steps = kPredict - 1;
    EXPECT_EQ(counters->steps, steps) << ArmName(arm);
    const uint64_t selected = steps * 3 * 4;
    EXPECT_EQ(counters->hits + counters->misses, selected) << ArmName(arm);
    if (arm == Arm::kResident) {
      EXPECT_EQ(counters->bytes_staged, 0u);
    } else {
      EXPECT_GT(counters->bytes_staged, 0u) << ArmName(arm);
    }
    if (arm == Arm::kStage) {
      EXPECT_EQ(counters->misses, selected);
    }
    if (want_tokens.empty()) {
      want_tokens = *tokens;
      want_logits = *logits;
      continue;
    }
    EXPECT_EQ(*tokens, want_tokens) << ArmName(arm);
    EXPECT_TRUE(BitEqual(*logits, want_logits)) << ArmName(arm);
  }
}

// A sink gets the tokens Generate returns, in order, S = 1 and S = 3, and stopping
// it ends the decode at that token, with no launch after it.
TEST_F(EngineArmsTest, ASinkStreamsTheTokensAndStopsTheDecode) {
  constexpr int kPredict = 7;
  for (const int steps_per_launch : {1, 3}) {
    SCOPED_TRACE(steps_per_launch);
    std::unique_ptr<CudaEngine> engine = MakeEngine(model(), Arm::kGraph, 5, steps_per_launch);
    ASSERT_NE(engine, nullptr);
    absl::StatusOr<std::vector<int32_t>> full = engine->Generate(kPrompt, kPredict);
    ASSERT_TRUE(full.ok()) << full.status();
    std::vector<int32_t> seen;
    absl::StatusOr<std::vector<int32_t>> streamed =
        engine->Generate(kPrompt, kPredict, nullptr, [&](int32_t token) {
          seen.push_back(token);
          return true;
        });
    ASSERT_TRUE(streamed.ok()) << streamed.status();
    EXPECT_EQ(*streamed, *full);
    EXPECT_EQ(seen, *full);

    absl::StatusOr<EngineCounters> before = engine->ReadCounters();
    ASSERT_TRUE(before.ok());
    seen.clear();
    absl::StatusOr<std::vector<int32_t>> stopped =
        engine->Generate(kPrompt, kPredict, nullptr, [&](int32_t token) {
          seen.push_back(token);
          return seen.size() < 2;
        });
    ASSERT_TRUE(stopped.ok()) << stopped.status();
    EXPECT_EQ(*stopped, std::vector<int32_t>(full->begin(), full->begin() + 2));
    absl::StatusOr<EngineCounters> after = engine->ReadCounters();
    ASSERT_TRUE(after.ok());
    // The prompt is batched (no steps), then launches until the one holding
    // the second token.
    const uint64_t decode_launched = static_cast<uint64_t>(steps_per_launch);
    EXPECT_EQ(after->steps - before->steps, decode_launched);
  }
}

// Row i of the record is the logits that picked generated token i: the same bits
// as the last logits of a decode of that prefix, with S = 2 steps per graph.
TEST_F(EngineArmsTest, TheLogitsRecordHoldsTheLogitsThatPickedEachToken) {
  constexpr int kPredict = 6;
  CudaEngineOptions options;
  options.max_ctx = 64;
  options.n_slots = 5;
  options.steps_per_launch = 2;
  options.record_logits = true;
  absl::StatusOr<std::unique_ptr<CudaEngine>> recorded = CudaEngine::Create(model(), options);
  ASSERT_TRUE(recorded.ok()) << recorded.status();
  absl::StatusOr<std::vector<int32_t>> tokens = (*recorded)->Generate(kPrompt, kPredict);
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  const int n_prompt = static_cast<int>(kPrompt.size());
  absl::StatusOr<std::vector<float>> rows = (*recorded)->ReadLogitsRecord(n_prompt - 1, kPredict);
  ASSERT_TRUE(rows.ok()) << rows.status();
  const size_t n_vocab = static_cast<size_t>(model().config.n_vocab);
  ASSERT_EQ(rows->size(), kPredict * n_vocab);

  // Prompts as steps, as the recording engine runs them: the same bits.
  std::unique_ptr<CudaEngine> plain = MakeEngine(model(), Arm::kGraph, 5, 1, false,
                                                 kDefaultResidencyPolicy, KvCacheType::kF16, false);
  ASSERT_NE(plain, nullptr);
  std::vector<int32_t> prefix = kPrompt;
  for (int i = 0; i < kPredict; ++i) {
    absl::StatusOr<std::vector<int32_t>> next = plain->Generate(prefix, 1);
    ASSERT_TRUE(next.ok()) << next.status();
    EXPECT_EQ((*next)[0], (*tokens)[static_cast<size_t>(i)]) << "token " << i;
    absl::StatusOr<std::vector<float>> last = plain->LastLogits();
    ASSERT_TRUE(last.ok()) << last.status();
    EXPECT_TRUE(BitEqual(*last, std::vector<float>(rows->begin() + i * n_vocab,
                                                   rows->begin() + (i + 1) * n_vocab)))
        << "row " << i;
    prefix.push_back((*tokens)[static_cast<size_t>(i)]);
  }
  EXPECT_EQ((*recorded)->ReadLogitsRecord(60, 5).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(plain->ReadLogitsRecord(0, 1).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(EngineArmsTest, SplitExpertPassesGiveTheSameBits) {
  std::unique_ptr<CudaEngine> single = MakeEngine(model(), Arm::kGraph, 5);
  CudaEngineOptions options;
  options.max_ctx = 64;
  options.n_slots = 5;
  options.doors.split_passes = true;
  absl::StatusOr<std::unique_ptr<CudaEngine>> split = CudaEngine::Create(model(), options);
  ASSERT_TRUE(split.ok()) << split.status();
  ASSERT_NE(single, nullptr);
  absl::StatusOr<std::vector<int32_t>> a = (*split)->Generate(kPrompt, 8);
  absl::StatusOr<std::vector<int32_t>> b = single->Generate(kPrompt, 8);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  absl::StatusOr<std::vector<float>> la = (*split)->LastLogits();
  absl::StatusOr<std::vector<float>> lb = single->LastLogits();
  ASSERT_TRUE(la.ok() && lb.ok());
  EXPECT_TRUE(BitEqual(*la, *lb));
}

// MOEGRAPH_CHAIN=0: attn_out and the router, and the one expert pass's gate/up
// and down, as two launches each: the chained launches' bits, on the graph
// arm (expert_ffn_ready) and the resident arm (expert_ffn_all), with two
// kernel nodes fewer a MoE layer chained.
TEST_F(EngineArmsTest, ChainedLaunchesGiveTheTwoLaunchesBits) {
  for (const Arm arm : {Arm::kGraph, Arm::kResident}) {
    SCOPED_TRACE(ArmName(arm));
    std::unique_ptr<CudaEngine> chained = MakeEngine(model(), arm, 5);
    ASSERT_NE(chained, nullptr);
    CudaEngineOptions options;
    options.max_ctx = 64;
    options.n_slots = 5;
    options.doors = DoorsOf(arm);
    options.doors.chained_matvecs = false;
    absl::StatusOr<std::unique_ptr<CudaEngine>> pairs = CudaEngine::Create(model(), options);
    ASSERT_TRUE(pairs.ok()) << pairs.status();
    absl::StatusOr<std::vector<int32_t>> a = chained->Generate(kPrompt, 8);
    absl::StatusOr<std::vector<int32_t>> b = (*pairs)->Generate(kPrompt, 8);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(*a, *b);
    absl::StatusOr<std::vector<float>> la = chained->LastLogits();
    absl::StatusOr<std::vector<float>> lb = (*pairs)->LastLogits();
    ASSERT_TRUE(la.ok() && lb.ok());
    EXPECT_TRUE(BitEqual(*la, *lb));
    const int layer = model().config.n_layer - 1;
    EXPECT_EQ(KernelsInLayer(chained->Walk(), layer), KernelsInLayer((*pairs)->Walk(), layer) - 2);
  }
}

TEST_F(EngineArmsTest, DeviceTablesEqualAHostCacheFedTheRecordedRouting) {
  for (const ResidencyPolicy policy : {ResidencyPolicy::kHazard, ResidencyPolicy::kSlru}) {
    for (const Arm arm : {Arm::kEager, Arm::kGraph}) {
      SCOPED_TRACE(testing::Message() << PolicyName(policy) << " " << ArmName(arm));
      std::unique_ptr<CudaEngine> engine =
          MakeEngine(model(), arm, 6, 1, /*record_routing=*/true, policy);
      ASSERT_NE(engine, nullptr);
      ASSERT_TRUE(engine->Generate(kPrompt, 12).ok());
      ASSERT_TRUE(engine->Generate({5, 6, 7}, 6).ok());  // state carries over
      ASSERT_EQ(engine->pools().size(), 1u);

      CacheConfig config;
      config.n_layer = model().config.n_layer;
      config.n_expert = model().config.n_expert;
      config.k = model().config.n_expert_used;
      config.n_slots = 6;
      config.protected_frac = Doors().protected_frac;
      absl::StatusOr<PolicyCache> cache = PolicyCache::Create(policy, config);
      ASSERT_TRUE(cache.ok()) << cache.status();
      const std::vector<int32_t>& routing = engine->routing();
      const size_t per_step = static_cast<size_t>(config.n_layer * config.k);
      ASSERT_EQ(routing.size(), (kPrompt.size() + 11 + 3 + 5) * per_step);
      uint64_t hits = 0;
      uint64_t misses = 0;
      for (size_t at = 0; at < routing.size(); at += static_cast<size_t>(config.k)) {
        const int32_t layer = static_cast<int32_t>((at % per_step) / config.k);
        const LayerStep& step = cache->Step(layer, routing.data() + at);
        hits += static_cast<uint64_t>(step.outcome.n_hits);
        misses += static_cast<uint64_t>(step.outcome.n_misses);
      }
      absl::StatusOr<ResidencySnapshot> device = engine->ReadResidency(0);
      ASSERT_TRUE(device.ok()) << device.status();
      const ResidencySnapshot host = cache->Snapshot();
      EXPECT_EQ(device->table, host.table);
      EXPECT_EQ(device->owner, host.owner);
      EXPECT_EQ(device->stamp, host.stamp);
      EXPECT_EQ(device->seg, host.seg);
      EXPECT_EQ(device->clock, host.clock);
      EXPECT_EQ(device->n_protected, host.n_protected);
      EXPECT_EQ(device->last_visit, host.last_visit);
      EXPECT_EQ(device->frequency, host.frequency);
      EXPECT_EQ(device->long_frequency, host.long_frequency);
      EXPECT_EQ(device->visits, host.visits);
      EXPECT_EQ(device->cell_hits, host.cell_hits);
      EXPECT_EQ(device->cell_trials, host.cell_trials);
      absl::StatusOr<EngineCounters> counters = engine->ReadCounters();
      ASSERT_TRUE(counters.ok());
      EXPECT_EQ(counters->hits, hits);
      EXPECT_EQ(counters->misses, misses);
      EXPECT_GT(counters->evictions, 0u);
    }
  }
}

TEST_F(EngineArmsTest, HostSyncsPerTokenAreOnePerLaunchInGraphMode) {
  constexpr int kDecode = 8;  // a multiple of every S below
  for (int s : {1, 4}) {
    std::unique_ptr<CudaEngine> engine = MakeEngine(
        model(), Arm::kGraph, 6, s, false, kDefaultResidencyPolicy, KvCacheType::kF16, false);
    ASSERT_NE(engine, nullptr);
    const HostCounters before = engine->host_counters();
    ASSERT_TRUE(engine->Generate(kPrompt, kDecode + 1).ok());
    const HostCounters after = engine->host_counters();
    const uint64_t prompt_launches = (kPrompt.size() + s - 1) / s;
    const uint64_t decode_launches = kDecode / s;
    EXPECT_EQ(after.graph_launches - before.graph_launches, prompt_launches + decode_launches)
        << "S=" << s;
    // One wait per launch, plus the one readback of the generated tokens.
    EXPECT_EQ(after.host_syncs - before.host_syncs, prompt_launches + decode_launches + 1)
        << "S=" << s;
    EXPECT_EQ(after.eager_steps, before.eager_steps);
    EXPECT_GE(after.captures - before.captures, 1u);
    EXPECT_LE(after.captures - before.captures, 2u);  // S steps, and a shorter remainder
    // A longer prompt (by S tokens: the same remainder walk) captures nothing
    // new: the prompt's length is read on the device.
    std::vector<int32_t> longer(kPrompt.begin(), kPrompt.end());
    for (int i = 0; i < s; ++i) longer.push_back(3 + i);
    const HostCounters again = engine->host_counters();
    ASSERT_TRUE(engine->Generate(longer, kDecode + 1).ok());
    EXPECT_EQ(engine->host_counters().captures, again.captures) << "S=" << s;
    if (s > 1) {
      // A prompt one token past a multiple of S needs a one-step remainder
      // walk: captured once, then reused by the next such prompt.
      std::vector<int32_t> ragged(kPrompt.begin(), kPrompt.end());
      ragged.push_back(7);
      const uint64_t before_ragged = engine->host_counters().captures;
      ASSERT_TRUE(engine->Generate(ragged, kDecode + 1).ok());
      EXPECT_EQ(engine->host_counters().captures, before_ragged + 1) << "S=" << s;
      for (int i = 0; i < s; ++i) ragged.push_back(9 + i);
      ASSERT_TRUE(engine->Generate(ragged, kDecode + 1).ok());
      EXPECT_EQ(engine->host_counters().captures, before_ragged + 1) << "S=" << s;
    }
  }
}

TEST_F(EngineArmsTest, TheHostArmSyncsOncePerMoeLayerAndOncePerToken) {
  std::unique_ptr<CudaEngine> engine = MakeEngine(
      model(), Arm::kHost, 6, 1, false, kDefaultResidencyPolicy, KvCacheType::kF16, false);
  ASSERT_NE(engine, nullptr);
  const HostCounters before = engine->host_counters();
  ASSERT_TRUE(engine->Generate(kPrompt, 5).ok());
  const HostCounters after = engine->host_counters();
  const uint64_t steps = kPrompt.size() + 4;
  const uint64_t n_layer = static_cast<uint64_t>(model().config.n_layer);
  EXPECT_EQ(after.host_syncs - before.host_syncs, steps * (n_layer + 1) + 1);
  EXPECT_EQ(after.eager_steps - before.eager_steps, steps);
  EXPECT_EQ(after.graph_launches, before.graph_launches);
  // Two table copies per layer step, plus the prompt and each missed block.
  EXPECT_GT(after.h2d_memcpys - before.h2d_memcpys, steps * n_layer * 2);
}

TEST_F(EngineArmsTest, BadOptionsAreErrorsNamingTheFlag) {
  CudaEngineOptions options;
  options.max_ctx = 64;
  options.n_slots = 2;  // below top-k 4
  absl::StatusOr<std::unique_ptr<CudaEngine>> below = CudaEngine::Create(model(), options);
  ASSERT_FALSE(below.ok());
  EXPECT_TRUE(MessageHas(below.status(), "--slots")) << below.status();

  options.n_slots = 0;
  options.steps_per_launch = 0;
  absl::StatusOr<std::unique_ptr<CudaEngine>> steps = CudaEngine::Create(model(), options);
  ASSERT_FALSE(steps.ok());
  EXPECT_TRUE(MessageHas(steps.status(), "--steps-per-launch")) << steps.status();

  options.steps_per_launch = 1;
  options.max_ctx = 4;
  absl::StatusOr<std::unique_ptr<CudaEngine>> small = CudaEngine::Create(model(), options);
  ASSERT_TRUE(small.ok()) << small.status();
  absl::StatusOr<std::vector<int32_t>> over = (*small)->Generate(kPrompt, 2);
  ASSERT_FALSE(over.ok());
  EXPECT_TRUE(MessageHas(over.status(), "--ctx")) << over.status();
}

// The CUDA pinned allocator, counting what passes through it.
struct CountingPinnedAllocator {
  HostAllocator inner = CudaPinnedAllocator();
  int allocations = 0;
  int frees = 0;

  HostAllocator Hooks() {
    HostAllocator a;
    a.context = this;
    a.alloc = [](size_t bytes, void* context) {
      auto* self = static_cast<CountingPinnedAllocator*>(context);
      ++self->allocations;
      return self->inner.alloc(bytes, self->inner.context);
    };
    a.free = [](void* ptr, size_t bytes, void* context) {
      auto* self = static_cast<CountingPinnedAllocator*>(context);
      ++self->frees;
      self->inner.free(ptr, bytes, self->inner.context);
    };
    return a;
  }
};

std::unique_ptr<CudaEngine> MakeSharedEngine(const Model& model,
                                             std::shared_ptr<const ExpertStore> experts, Arm arm,
                                             int32_t slots) {
  CudaEngineOptions options;
  options.max_ctx = 64;
  options.n_slots = slots;
  options.doors = DoorsOf(arm);
  absl::StatusOr<std::unique_ptr<CudaEngine>> engine =
      CudaEngine::Create(model, std::move(experts), options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return nullptr;
  EXPECT_EQ((*engine)->arm(), arm);
  return std::move(*engine);
}

TEST_F(EngineArmsTest, EnginesOnOneSharedStoreDecodeAsEnginesWithTheirOwn) {
  constexpr int kPredict = 12;
  CountingPinnedAllocator counting;
  std::shared_ptr<const ExpertStore> shared;
  {
    absl::StatusOr<ExpertStore> store = ExpertStore::Create(model(), counting.Hooks());
    ASSERT_TRUE(store.ok()) << store.status();
    shared = std::make_shared<const ExpertStore>(std::move(*store));
  }
  // Every way an arm reads the store: graph through its device mapping (stage
  // copy kernel), host by cudaMemcpyAsync from its host address, resident by the
  // upload at Create.
  std::vector<std::unique_ptr<CudaEngine>> on_shared;
  for (Arm arm : {Arm::kGraph, Arm::kHost, Arm::kResident}) {
    std::unique_ptr<CudaEngine> own = MakeEngine(model(), arm, 4);
    ASSERT_NE(own, nullptr) << ArmName(arm);
    on_shared.push_back(MakeSharedEngine(model(), shared, arm, 4));
    CudaEngine* engine = on_shared.back().get();
    ASSERT_NE(engine, nullptr) << ArmName(arm);
    EXPECT_EQ(&engine->experts(), shared.get()) << ArmName(arm);
    EXPECT_NE(&own->experts(), shared.get()) << ArmName(arm);

    absl::StatusOr<std::vector<int32_t>> want = own->Generate(kPrompt, kPredict);
    ASSERT_TRUE(want.ok()) << ArmName(arm) << ": " << want.status();
    absl::StatusOr<std::vector<int32_t>> got = engine->Generate(kPrompt, kPredict);
    ASSERT_TRUE(got.ok()) << ArmName(arm) << ": " << got.status();
    EXPECT_EQ(*got, *want) << ArmName(arm);
    absl::StatusOr<std::vector<float>> want_logits = own->LastLogits();
    absl::StatusOr<std::vector<float>> got_logits = engine->LastLogits();
    ASSERT_TRUE(want_logits.ok() && got_logits.ok());
    EXPECT_TRUE(BitEqual(*got_logits, *want_logits)) << ArmName(arm);
  }
  // One allocation for three engines; the last holder frees it, once.
  EXPECT_EQ(counting.allocations, 1);
  EXPECT_EQ(shared.use_count(), 4);
  on_shared.clear();
  EXPECT_EQ(counting.frees, 0);
  shared.reset();
  EXPECT_EQ(counting.frees, 1);
}

TEST_F(EngineArmsTest, AStoreOfAnotherModelIsAnErrorNamingTheStore) {
  FixtureSpec spec;
  spec.arch = Arch::kQwen2Moe;
  spec.n_layer = 3;
  spec.n_expert = 8;  // the fixture of the test holds 16
  spec.n_expert_used = 4;
  spec.expert_type = GgmlType::kQ8_0;
  absl::StatusOr<std::unique_ptr<LoadedModel>> other = LoadFixture(spec);
  ASSERT_TRUE(other.ok()) << other.status();
  absl::StatusOr<std::shared_ptr<const ExpertStore>> store =
      CudaEngine::PinExperts((*other)->model);
  ASSERT_TRUE(store.ok()) << store.status();
  CudaEngineOptions options;
  options.max_ctx = 64;
  absl::StatusOr<std::unique_ptr<CudaEngine>> engine =
      CudaEngine::Create(model(), *store, options);
  ASSERT_FALSE(engine.ok());
  EXPECT_TRUE(MessageHas(engine.status(), "shared expert store")) << engine.status();
  EXPECT_EQ(store->use_count(), 1);  // the failed engine holds no reference
}

// The attention kernel holds a head's q in shared memory: a wider head is
// refused before anything is allocated, naming the file and the head_dim.
// qwen35moe at the largest sizes issue 41 names, at a small width: 60 layers
// (45 Gated DeltaNet, 15 gated attention; llama.cpp labels 60 layers
// 397B-A17B, src/models/qwen35moe.cpp L28-33) of 512 experts, top-8, a gated
// shared expert, q4_0 experts. The graph arm on 2 k slots a layer (960 of
// 30,720) gives the resident arm's tokens and last logits bit for bit through
// misses and evictions, the prompt batched.
TEST(EngineScaleTest, Qwen35AtSixtyLayersOf512ExpertsDecodesAsTheResidentArm) {
  SKIP_WITHOUT_DEVICE();
  FixtureSpec spec;
  spec.arch = Arch::kQwen35Moe;
  spec.n_layer = 60;
  spec.n_expert = 512;
  spec.n_expert_used = 8;
  spec.n_embd = 64;
  spec.n_ff_exp = 32;
  spec.ssm_head_dim = 32;
  spec.expert_type = GgmlType::kQ4_0;
  spec.router_skew = 1.0f;
  spec.seed = 3;
  absl::StatusOr<std::unique_ptr<LoadedModel>> loaded = LoadFixture(spec);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const Model& model = (*loaded)->model;
  ASSERT_EQ(model.config.n_kv_layers(), 15);
  constexpr int kPredict = 6;
  std::unique_ptr<CudaEngine> resident = MakeEngine(model, Arm::kResident, 0);
  std::unique_ptr<CudaEngine> cached = MakeEngine(model, Arm::kGraph, 2 * 8 * 60);
  ASSERT_TRUE(resident != nullptr && cached != nullptr);
  absl::StatusOr<std::vector<int32_t>> want = resident->Generate(kPrompt, kPredict);
  ASSERT_TRUE(want.ok()) << want.status();
  absl::StatusOr<std::vector<int32_t>> got = cached->Generate(kPrompt, kPredict);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, *want);
  absl::StatusOr<std::vector<float>> want_logits = resident->LastLogits();
  absl::StatusOr<std::vector<float>> got_logits = cached->LastLogits();
  ASSERT_TRUE(want_logits.ok() && got_logits.ok());
  EXPECT_TRUE(BitEqual(*got_logits, *want_logits));
  absl::StatusOr<EngineCounters> counters = cached->ReadCounters();
  ASSERT_TRUE(counters.ok()) << counters.status();
  EXPECT_EQ(counters->hits + counters->misses, uint64_t{kPredict - 1} * 60 * 8);
  EXPECT_GT(counters->misses, 0u);
  EXPECT_GT(counters->evictions, 0u);
  EXPECT_EQ(cached->host_counters().prefill_tokens, kPrompt.size());
}

TEST_F(EngineArmsTest, AHeadWiderThanTheAttentionTakesIsAnErrorNamingIt) {
  FixtureSpec spec;
  spec.n_layer = 1;
  spec.n_head = 2;
  spec.n_head_kv = 1;
  spec.head_dim = 288;
  absl::StatusOr<std::unique_ptr<LoadedModel>> wide = LoadFixture(spec);
  ASSERT_TRUE(wide.ok()) << wide.status();
  CudaEngineOptions options;
  options.max_ctx = 8;
  absl::StatusOr<std::unique_ptr<CudaEngine>> engine = CudaEngine::Create((*wide)->model, options);
  ASSERT_FALSE(engine.ok());
  EXPECT_TRUE(MessageHas(engine.status(), "head_dim of at most 256 (this model's is 288)"))
      << engine.status();
}

// More experts a thread than the router's block ranks (router_topk_fits: top-k
// x ceil(experts / 128) at most 128) is refused by the keys, before any
// upload; one expert fewer in the top-k is taken.
TEST_F(EngineArmsTest, ARouterTheTopKDoesNotTakeIsAnErrorNamingItsKeys) {
  FixtureSpec spec;
  spec.n_layer = 1;
  spec.n_expert = 257;
  spec.n_expert_used = 43;
  spec.expert_variants = 1;
  absl::StatusOr<std::unique_ptr<LoadedModel>> wide = LoadFixture(spec);
  ASSERT_TRUE(wide.ok()) << wide.status();
  CudaEngineOptions options;
  options.max_ctx = 8;
  absl::StatusOr<std::unique_ptr<CudaEngine>> engine = CudaEngine::Create((*wide)->model, options);
  ASSERT_FALSE(engine.ok());
  EXPECT_TRUE(MessageHas(engine.status(), "expert_used_count x ceil(expert_count / 128) at most "
                                          "128 (this model: 257 experts, top-43)"))
      << engine.status();
  spec.n_expert_used = 42;
  absl::StatusOr<std::unique_ptr<LoadedModel>> fits = LoadFixture(spec);
  ASSERT_TRUE(fits.ok()) << fits.status();
  engine = CudaEngine::Create((*fits)->model, options);
  EXPECT_TRUE(engine.ok()) << engine.status();
}

// A head not a multiple of 8 wide takes the f32 cache: the f16 one is read 8
// elements at a time. The refusal names the flag that lifts it.
TEST_F(EngineArmsTest, AnF16CacheOfHeadsNotAMultipleOf8IsAnErrorNamingTheFlag) {
  FixtureSpec spec;
  spec.n_layer = 1;
  spec.n_head = 2;
  spec.n_head_kv = 1;
  spec.head_dim = 12;
  absl::StatusOr<std::unique_ptr<LoadedModel>> narrow = LoadFixture(spec);
  ASSERT_TRUE(narrow.ok()) << narrow.status();
  CudaEngineOptions options;
  options.max_ctx = 8;
  absl::StatusOr<std::unique_ptr<CudaEngine>> engine =
      CudaEngine::Create((*narrow)->model, options);
  ASSERT_FALSE(engine.ok());
  EXPECT_TRUE(MessageHas(engine.status(), "head_dim is 12: give --kv-type f32")) << engine.status();
  options.kv_type = KvCacheType::kF32;
  engine = CudaEngine::Create((*narrow)->model, options);
  EXPECT_TRUE(engine.ok()) << engine.status();
}

}  // namespace
}  // namespace moegraph
