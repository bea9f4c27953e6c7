// The CPU backend against the oracle: tokens and logits bit for bit on every
// architecture and several expert types, from heavy eviction (slots = k) to
// every expert resident; cache on and off; its residency state against a fresh
// ResidencyCache fed the routing it recorded; its counters against each other.
#include "cpu/cpu_backend.h"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "loader/fixture.h"
#include "loader/gguf.h"
#include "loader/model_config.h"
#include "loader/placement.h"
#include "loader/status_util.h"
#include "reference/ops.h"
#include "reference/oracle.h"
#include "residency/cache.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::BitEqual;
using testing_util::LoadedModel;
using testing_util::LoadFixture;
using testing_util::MessageHas;

const std::vector<int32_t> kPrompt = {3, 17, 101, 42, 42, 0, 127, 64, 9, 9, 88, 5};
constexpr int kDecodeSteps = 10;

// The prompt in one Forward, then greedy decode steps: every logit row and
// every token picked.
struct Transcript {
  std::vector<float> logits;
  std::vector<int32_t> tokens;
};

Transcript Decode(Oracle& engine) {
  Transcript out;
  absl::StatusOr<std::vector<float>> logits = engine.Forward(kPrompt);
  EXPECT_TRUE(logits.ok()) << logits.status();
  if (!logits.ok()) return out;
  const size_t n_vocab = logits->size() / kPrompt.size();
  out.logits = *logits;
  for (int step = 0; step < kDecodeSteps; ++step) {
    const absl::Span<const float> last =
        absl::MakeConstSpan(out.logits).subspan(out.logits.size() - n_vocab);
    out.tokens.push_back(ArgMax(last));
    logits = engine.Forward({out.tokens.back()});
    EXPECT_TRUE(logits.ok()) << logits.status();
    if (!logits.ok()) return out;
    out.logits.insert(out.logits.end(), logits->begin(), logits->end());
  }
  return out;
}

constexpr int kMaxCtx = 32;

Transcript OracleTranscript(const Model& model) {
  absl::StatusOr<std::unique_ptr<Oracle>> oracle = Oracle::Create(model, kMaxCtx);
  EXPECT_TRUE(oracle.ok()) << oracle.status();
  return oracle.ok() ? Decode(**oracle) : Transcript();
}

// The counters agree with each other and with the steps run.
void ExpectCountersConsistent(const CpuBackend& backend, const Model& model,
                              const ExpertStore& store) {
  const EngineCounters& c = backend.counters();
  const uint64_t steps = kPrompt.size() + kDecodeSteps;
  EXPECT_EQ(c.steps, steps);
  EXPECT_EQ(c.hits + c.misses, steps * model.config.n_layer * model.config.n_expert_used);
  ASSERT_EQ(store.size_classes().size(), 1u);
  EXPECT_EQ(c.bytes_staged, c.misses * store.size_classes()[0].block_bytes);
  EXPECT_LE(c.evictions, c.misses);
  EXPECT_EQ(backend.routing().size(),
            steps * model.config.n_layer * model.config.n_expert_used);
}

struct ModelCase {
  const char* name;
  Arch arch;
  bool legacy_experts;
  GgmlType expert_type;
  int n_head_kv;
  int width;  // n_embd and n_ff_exp; the k-quants need 256
};

struct SlotCase {
  const char* name;
  int32_t n_slots;  // 0: auto
  ResidencyPolicy policy;
  PoolMode pool_mode;
};

void PrintTo(const ModelCase& c, std::ostream* os) { *os << c.name; }
void PrintTo(const SlotCase& c, std::ostream* os) { *os << c.name; }

using BackendCase = std::tuple<ModelCase, SlotCase>;

class CpuBackendOracleTest : public ::testing::TestWithParam<BackendCase> {};

TEST_P(CpuBackendOracleTest, TokensAndLogitsEqualTheOracleBitForBit) {
  const auto& [model_case, slot_case] = GetParam();
  FixtureSpec spec;
  spec.arch = model_case.arch;
  spec.legacy_experts = model_case.legacy_experts;
  spec.expert_type = model_case.expert_type;
  spec.n_head_kv = model_case.n_head_kv;
  spec.n_embd = model_case.width;
  spec.n_ff_exp = model_case.width;
  spec.n_vocab = 128;
  spec.router_skew = 1.0f;
  spec.seed = 7;
  absl::StatusOr<std::unique_ptr<LoadedModel>> loaded = LoadFixture(spec);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const Model& model = (*loaded)->model;
  absl::StatusOr<ExpertStore> store = ExpertStore::Create(model);
  ASSERT_TRUE(store.ok()) << store.status();

  CpuBackendOptions options;
  options.max_ctx = kMaxCtx;
  options.oracle_arithmetic = true;  // the pipeline, checked against the oracle bit for bit
  options.n_slots = slot_case.n_slots;
  options.policy = slot_case.policy;
  options.pool_mode = slot_case.pool_mode;
  absl::StatusOr<std::unique_ptr<CpuBackend>> backend = CpuBackend::Create(model, &*store, options);
  ASSERT_TRUE(backend.ok()) << backend.status();

  const Transcript want = OracleTranscript(model);
  const Transcript got = Decode(**backend);
  ASSERT_FALSE(want.logits.empty());
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_TRUE(BitEqual(got.logits, want.logits));
  ExpectCountersConsistent(**backend, model, *store);

  const EngineCounters& c = (*backend)->counters();
  const int n_keys = spec.n_layer * spec.n_expert;
  if (slot_case.n_slots == 0) {
    // Every expert fits: each is staged once at most, nothing is evicted.
    EXPECT_EQ((*backend)->pools()[0].n_slots, n_keys);
    EXPECT_LE(c.misses, static_cast<uint64_t>(n_keys));
    EXPECT_EQ(c.evictions, 0u);
  } else {
    EXPECT_EQ((*backend)->pools()[0].n_slots, slot_case.n_slots);
    EXPECT_GT(c.evictions, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    ArchsTypesAndSlots, CpuBackendOracleTest,
    ::testing::Combine(
        ::testing::Values(
            ModelCase{"qwen3moe_f32", Arch::kQwen3Moe, false, GgmlType::kF32, 2, 64},
            ModelCase{"olmoe_q8_0", Arch::kOlmoe, false, GgmlType::kQ8_0, 4, 64},
            ModelCase{"qwen2moe_q4_0", Arch::kQwen2Moe, false, GgmlType::kQ4_0, 2, 64},
            ModelCase{"mixtral_f16", Arch::kMixtral, false, GgmlType::kF16, 2, 64},
            ModelCase{"mixtral_legacy_bf16", Arch::kMixtral, true, GgmlType::kBF16, 2, 64},
            ModelCase{"qwen3moe_q4_K", Arch::kQwen3Moe, false, GgmlType::kQ4_K, 2, 256}),
        ::testing::Values(SlotCase{"k_lru", 2, ResidencyPolicy::kLru, PoolMode::kGlobal},
                          SlotCase{"k_slru", 2, ResidencyPolicy::kSlru, PoolMode::kGlobal},
                          SlotCase{"k_hazard", 2, ResidencyPolicy::kHazard, PoolMode::kGlobal},
                          SlotCase{"middle_per_layer", 8, ResidencyPolicy::kHazard,
                                   PoolMode::kPerLayer},
                          SlotCase{"auto", 0, ResidencyPolicy::kHazard, PoolMode::kGlobal})),
    [](const ::testing::TestParamInfo<BackendCase>& info) {
      return std::string(std::get<0>(info.param).name) + "_" + std::get<1>(info.param).name;
    });

// A skewed router over 8 experts with 4 slots: some experts recur (hits), the
// pool is too small for the rest (misses that evict).
class CpuBackendCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    FixtureSpec spec;
    spec.arch = Arch::kQwen3Moe;
    spec.expert_type = GgmlType::kQ8_0;
    spec.n_vocab = 128;
    spec.router_skew = 2.0f;
    spec.seed = 13;
    absl::StatusOr<std::unique_ptr<LoadedModel>> loaded = LoadFixture(spec);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    loaded_ = std::move(*loaded);
    absl::StatusOr<ExpertStore> store = ExpertStore::Create(loaded_->model);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::make_unique<ExpertStore>(std::move(*store));
  }

  std::unique_ptr<CpuBackend> NewBackend(bool cache,
                                         ResidencyPolicy policy = kDefaultResidencyPolicy) {
    CpuBackendOptions options;
    options.max_ctx = kMaxCtx;
    options.n_slots = 4;
    options.cache = cache;
    options.policy = policy;
    absl::StatusOr<std::unique_ptr<CpuBackend>> backend =
        CpuBackend::Create(loaded_->model, &*store_, options);
    EXPECT_TRUE(backend.ok()) << backend.status();
    return backend.ok() ? std::move(*backend) : nullptr;
  }

  std::unique_ptr<LoadedModel> loaded_;
  std::unique_ptr<ExpertStore> store_;
};

// --slots auto holds every expert where host memory allows, else what fits
// beside a 1 GiB rail, and refuses less than top-k slots, naming the flag.
TEST_F(CpuBackendCacheTest, AutoSlotsFollowTheHostMemoryAvailable) {
  const uint64_t block = store_->size_classes()[0].block_bytes;
  const uint64_t rail = uint64_t{1} << 30;
  const int32_t n_keys = loaded_->model.config.n_layer * loaded_->model.config.n_expert;
  const int32_t k = loaded_->model.config.n_expert_used;
  auto slots_with = [&](uint64_t available) -> absl::StatusOr<int32_t> {
    CpuBackendOptions options;
    options.max_ctx = kMaxCtx;
    options.host_available_bytes = available;
    MG_ASSIGN_OR_RETURN(std::unique_ptr<CpuBackend> backend,
                        CpuBackend::Create(loaded_->model, &*store_, options));
    return backend->pools()[0].n_slots;
  };
  EXPECT_EQ(slots_with(uint64_t{64} << 30).value_or(-1), n_keys);
  EXPECT_EQ(slots_with(rail + 5 * block + block / 2).value_or(-1), 5);
  const absl::StatusOr<int32_t> short_of_k = slots_with(rail + (k - 1) * block);
  ASSERT_FALSE(short_of_k.ok());
  EXPECT_TRUE(MessageHas(short_of_k.status(), "--slots auto")) << short_of_k.status();
  // With the cache off the k scratch slots need no budget.
  CpuBackendOptions off;
  off.max_ctx = kMaxCtx;
  off.cache = false;
  off.host_available_bytes = rail;
  EXPECT_TRUE(CpuBackend::Create(loaded_->model, &*store_, off).ok());
}

TEST_F(CpuBackendCacheTest, CacheOnAndOffGiveIdenticalLogits) {
  std::unique_ptr<CpuBackend> on = NewBackend(true);
  std::unique_ptr<CpuBackend> off = NewBackend(false);
  ASSERT_TRUE(on && off);
  const Transcript cached = Decode(*on);
  const Transcript staged = Decode(*off);
  ASSERT_FALSE(cached.logits.empty());
  EXPECT_EQ(cached.tokens, staged.tokens);
  EXPECT_TRUE(BitEqual(cached.logits, staged.logits));

  const EngineCounters& c = on->counters();
  EXPECT_GT(c.hits, 0u);
  EXPECT_GT(c.misses, 0u);
  EXPECT_GT(c.evictions, 0u);
  ExpectCountersConsistent(*on, loaded_->model, *store_);

  // Off: every selected expert is copied every step; nothing is kept.
  const EngineCounters& s = off->counters();
  const Model& model = loaded_->model;
  EXPECT_EQ(s.hits, 0u);
  EXPECT_EQ(s.evictions, 0u);
  EXPECT_EQ(s.misses, s.steps * model.config.n_layer * model.config.n_expert_used);
  ExpectCountersConsistent(*off, model, *store_);
  EXPECT_EQ(off->cache(0), nullptr);
  EXPECT_EQ(off->pools()[0].n_slots, model.config.n_expert_used);
  EXPECT_EQ(off->routing(), on->routing());
}

TEST_F(CpuBackendCacheTest, ResidencyStateEqualsAFreshCacheFedTheRecordedRouting) {
  for (const ResidencyPolicy policy :
       {ResidencyPolicy::kLru, ResidencyPolicy::kSlru, ResidencyPolicy::kHazard}) {
    SCOPED_TRACE(PolicyName(policy));
    std::unique_ptr<CpuBackend> backend = NewBackend(true, policy);
    ASSERT_TRUE(backend);
    Decode(*backend);
    const PolicyCache* state = backend->cache(0);
    ASSERT_NE(state, nullptr);
    EXPECT_EQ(state->policy(), policy);
    EXPECT_TRUE(state->CheckInvariants().ok()) << state->CheckInvariants();

    absl::StatusOr<PolicyCache> replay = PolicyCache::Create(policy, state->config());
    ASSERT_TRUE(replay.ok()) << replay.status();
    const int n_layer = loaded_->model.config.n_layer;
    const int k = loaded_->model.config.n_expert_used;
    const std::vector<int32_t>& routing = backend->routing();
    ASSERT_EQ(routing.size() % static_cast<size_t>(n_layer * k), 0u);
    for (size_t row = 0; row * k < routing.size(); ++row) {
      replay->Step(static_cast<int32_t>(row % n_layer), routing.data() + row * k);
    }
    EXPECT_TRUE(replay->Snapshot() == state->Snapshot());
    EXPECT_FALSE(state->Snapshot().table.empty());
    EXPECT_GT(backend->counters().evictions, 0u);  // the state is not a trivial fill
  }
  std::unique_ptr<CpuBackend> backend = NewBackend(true);
  ASSERT_TRUE(backend);
  Decode(*backend);
  const PolicyCache* state = backend->cache(0);

  // Every occupied slot holds the block of the expert its owner names.
  const SlotPoolInfo& pool = backend->pools()[0];
  ASSERT_EQ(pool.n_slots, 4);
  const int n_expert = loaded_->model.config.n_expert;
  for (int32_t slot = 0; slot < pool.n_slots; ++slot) {
    const int32_t key = state->owner()[slot];
    ASSERT_NE(key, kNoKey) << "slot " << slot;
    EXPECT_EQ(std::memcmp(backend->slot_block(0, slot),
                          store_->block(key / n_expert, key % n_expert), pool.block_bytes),
              0)
        << "slot " << slot << " key " << key;
  }
}

TEST_F(CpuBackendCacheTest, RoutingIsTheOraclesSelectionStepByStep) {
  std::unique_ptr<CpuBackend> backend = NewBackend(true);
  ASSERT_TRUE(backend);
  const Transcript run = Decode(*backend);
  ASSERT_EQ(run.tokens.size(), static_cast<size_t>(kDecodeSteps));
  // Replays the same tokens through an oracle whose provider records what it is asked for.
  struct Recorder final : ExpertProvider {
    explicit Recorder(const Model& m) : model(m) {}
    void Provide(int layer, absl::Span<const int32_t> experts,
                 absl::Span<ExpertWeights> weights) override {
      ids.insert(ids.end(), experts.begin(), experts.end());
      model.Provide(layer, experts, weights);
    }
    ModelExpertProvider model;
    std::vector<int32_t> ids;
  } recorder(loaded_->model);
  absl::StatusOr<std::unique_ptr<Oracle>> oracle =
      Oracle::Create(loaded_->model, kMaxCtx, &recorder);
  ASSERT_TRUE(oracle.ok()) << oracle.status();
  std::vector<int32_t> fed = kPrompt;
  fed.insert(fed.end(), run.tokens.begin(), run.tokens.end());
  for (const int32_t token : fed) ASSERT_TRUE((*oracle)->Forward({token}).ok());
  EXPECT_EQ(recorder.ids, backend->routing());
}

TEST_F(CpuBackendCacheTest, BadOptionsAndInputsAreErrors) {
  CpuBackendOptions options;
  options.max_ctx = 4;
  options.n_slots = 1;
  absl::StatusOr<std::unique_ptr<CpuBackend>> small =
      CpuBackend::Create(loaded_->model, &*store_, options);
  ASSERT_FALSE(small.ok());
  EXPECT_TRUE(MessageHas(small.status(), "--slots 1")) << small.status();
  options.n_slots = -3;
  absl::StatusOr<std::unique_ptr<CpuBackend>> negative =
      CpuBackend::Create(loaded_->model, &*store_, options);
  ASSERT_FALSE(negative.ok());
  EXPECT_TRUE(MessageHas(negative.status(), "--slots -3")) << negative.status();
  options.n_slots = 0;
  options.protected_frac = 1.5;
  absl::StatusOr<std::unique_ptr<CpuBackend>> frac =
      CpuBackend::Create(loaded_->model, &*store_, options);
  ASSERT_FALSE(frac.ok());
  EXPECT_TRUE(MessageHas(frac.status(), "--protected-frac")) << frac.status();

  options.protected_frac = 0.5;
  absl::StatusOr<std::unique_ptr<CpuBackend>> backend =
      CpuBackend::Create(loaded_->model, &*store_, options);
  ASSERT_TRUE(backend.ok()) << backend.status();
  absl::StatusOr<std::vector<float>> bad_token = (*backend)->Forward({1, 128});
  ASSERT_FALSE(bad_token.ok());
  EXPECT_TRUE(MessageHas(bad_token.status(), "token 128 at index 1")) << bad_token.status();
  absl::StatusOr<std::vector<float>> too_long = (*backend)->Forward({1, 2, 3, 4, 5});
  ASSERT_FALSE(too_long.ok());
  EXPECT_TRUE(MessageHas(too_long.status(), "context size 4")) << too_long.status();
  // Neither error ran a step.
  EXPECT_EQ((*backend)->n_past(), 0);
  EXPECT_EQ((*backend)->counters().steps, 0u);
  EXPECT_TRUE((*backend)->routing().empty());
}

TEST(CpuBackendSizeClassTest, TwoSizeClassesRunTwoPoolsAndMatchTheOracle) {
  // Layers 0 and 2 keep f32 experts, layer 1 takes q8_0 ones from a second
  // fixture with the same shapes: two size classes, one pool and cache each.
  FixtureSpec spec;
  spec.n_layer = 3;
  spec.n_vocab = 128;
  spec.router_skew = 1.0f;
  absl::StatusOr<std::unique_ptr<LoadedModel>> base = LoadFixture(spec);
  spec.expert_type = GgmlType::kQ8_0;
  absl::StatusOr<std::unique_ptr<LoadedModel>> other = LoadFixture(spec);
  ASSERT_TRUE(base.ok() && other.ok());
  Model model = (*base)->model;
  model.layers[1].gate_exps = (*other)->model.layers[1].gate_exps;
  model.layers[1].up_exps = (*other)->model.layers[1].up_exps;
  model.layers[1].down_exps = (*other)->model.layers[1].down_exps;
  absl::StatusOr<ExpertStore> store = ExpertStore::Create(model);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_EQ(store->size_classes().size(), 2u);

  CpuBackendOptions options;
  options.max_ctx = kMaxCtx;
  options.n_slots = 6;  // 4 for the two f32 layers, 2 for the q8_0 one
  options.oracle_arithmetic = true;
  absl::StatusOr<std::unique_ptr<CpuBackend>> backend = CpuBackend::Create(model, &*store, options);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const Transcript want = OracleTranscript(model);
  const Transcript got = Decode(**backend);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_TRUE(BitEqual(got.logits, want.logits));

  const std::vector<SlotPoolInfo>& pools = (*backend)->pools();
  ASSERT_EQ(pools.size(), 2u);
  EXPECT_EQ(pools[0].n_slots, 4);
  EXPECT_EQ(pools[1].n_slots, 2);
  EXPECT_EQ(pools[0].layers, (std::vector<int>{0, 2}));
  EXPECT_EQ(pools[1].block_bytes, store->size_classes()[1].block_bytes);

  // Each class's cache equals a fresh one fed that class's rows of the routing,
  // its layers renumbered 0.. within the class.
  const int k = model.config.n_expert_used;
  const std::vector<int32_t>& routing = (*backend)->routing();
  uint64_t staged = 0;
  for (size_t c = 0; c < pools.size(); ++c) {
    const PolicyCache* state = (*backend)->cache(static_cast<int>(c));
    ASSERT_NE(state, nullptr);
    absl::StatusOr<PolicyCache> replay = PolicyCache::Create(state->policy(), state->config());
    ASSERT_TRUE(replay.ok()) << replay.status();
    uint64_t class_misses = 0;
    for (size_t row = 0; row * k < routing.size(); ++row) {
      const int layer = static_cast<int>(row % 3);
      if (store->class_of(layer) != static_cast<int>(c)) continue;
      const int local = layer == 2 ? 1 : 0;
      class_misses += replay->Step(local, routing.data() + row * k).outcome.n_misses;
    }
    EXPECT_EQ(replay->table(), state->table()) << "class " << c;
    EXPECT_EQ(replay->owner(), state->owner()) << "class " << c;
    EXPECT_TRUE(replay->Snapshot() == state->Snapshot()) << "class " << c;
    staged += class_misses * pools[c].block_bytes;
  }
  EXPECT_EQ((*backend)->counters().bytes_staged, staged);
}

}  // namespace
}  // namespace moegraph
