// Expert placement: every block holds exactly the bytes Model::expert reads from
// the file (merged and legacy storage, several quant types), projections and
// blocks are aligned as the layout promises, layers with different expert types
// get their own size classes, and the allocator and progress hooks are honoured.
#include "loader/placement.h"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "loader/fixture.h"
#include "loader/gguf.h"
#include "loader/model_config.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::LoadedModel;
using testing_util::LoadFixture;
using testing_util::MessageHas;

constexpr ExpertProj kProjections[] = {ExpertProj::kGate, ExpertProj::kUp, ExpertProj::kDown};

// Every block's projections equal the model's slices byte for byte, with the
// same matrix shape and type, and the padding between them is zero.
void ExpectBlocksHoldTheModelBytes(const Model& model, const ExpertStore& store) {
  for (int layer = 0; layer < model.config.n_layer; ++layer) {
    const ExpertBlockLayout& layout = store.layout(layer);
    for (int e = 0; e < model.config.n_expert; ++e) {
      const uint8_t* block = store.block(layer, e);
      std::vector<bool> covered(layout.block_bytes, false);
      for (ExpertProj proj : kProjections) {
        const WeightView want = model.expert(layer, proj, e);
        const WeightView got = ProjectionView(layout, proj, block);
        ASSERT_EQ(got.type, want.type);
        ASSERT_EQ(got.rows, want.rows);
        ASSERT_EQ(got.cols, want.cols);
        ASSERT_EQ(got.row_bytes, want.row_bytes);
        const size_t bytes = static_cast<size_t>(want.rows) * want.row_bytes;
        ASSERT_EQ(std::memcmp(got.data, want.data, bytes), 0)
            << "layer " << layer << " expert " << e << " projection " << static_cast<int>(proj);
        for (size_t i = 0; i < bytes; ++i) covered[layout[proj].offset + i] = true;
      }
      for (size_t i = 0; i < layout.block_bytes; ++i) {
        if (!covered[i]) {
          ASSERT_EQ(block[i], 0) << "padding byte " << i << " of layer " << layer;
        }
      }
    }
  }
}

struct StoreCase {
  const char* name;
  Arch arch;
  bool legacy_experts;
  GgmlType expert_type;
  int n_head_kv;
};

void PrintTo(const StoreCase& c, std::ostream* os) { *os << c.name; }

class ExpertStoreTest : public ::testing::TestWithParam<StoreCase> {};

TEST_P(ExpertStoreTest, EveryBlockHoldsExactlyTheExpertSlices) {
  FixtureSpec spec;
  spec.arch = GetParam().arch;
  spec.legacy_experts = GetParam().legacy_experts;
  spec.expert_type = GetParam().expert_type;
  spec.n_head_kv = GetParam().n_head_kv;
  spec.n_layer = 2;
  spec.n_expert = 4;
  spec.n_embd = 256;  // the k-quants need rows of 256
  spec.n_ff_exp = 256;
  spec.n_vocab = 32;
  spec.seed = 11;
  absl::StatusOr<std::unique_ptr<LoadedModel>> loaded = LoadFixture(spec);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const Model& model = (*loaded)->model;
  absl::StatusOr<ExpertStore> store = ExpertStore::Create(model);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_EQ(store->n_layer(), 2);
  ASSERT_EQ(store->n_expert(), 4);
  ASSERT_EQ(store->size_classes().size(), 1u);  // both layers have the same layout
  EXPECT_EQ(store->size_classes()[0].layers, (std::vector<int>{0, 1}));
  EXPECT_EQ(store->total_bytes(), 2 * 4 * store->size_classes()[0].block_bytes);
  ExpectBlocksHoldTheModelBytes(model, *store);
  // Blocks are packed back to back, layer after layer.
  for (int e = 1; e < 4; ++e) {
    EXPECT_EQ(store->block(1, e) - store->block(1, e - 1),
              static_cast<ptrdiff_t>(store->block_bytes(1)));
  }
  EXPECT_EQ(store->block(1, 0) - store->block(0, 3), static_cast<ptrdiff_t>(store->block_bytes(0)));
}

INSTANTIATE_TEST_SUITE_P(
    ArchsAndTypes, ExpertStoreTest,
    ::testing::Values(StoreCase{"qwen3moe_f32", Arch::kQwen3Moe, false, GgmlType::kF32, 2},
                      StoreCase{"olmoe_q8_0", Arch::kOlmoe, false, GgmlType::kQ8_0, 4},
                      StoreCase{"qwen2moe_q4_K", Arch::kQwen2Moe, false, GgmlType::kQ4_K, 2},
                      StoreCase{"mixtral_q6_K", Arch::kMixtral, false, GgmlType::kQ6_K, 2},
                      StoreCase{"mixtral_legacy_q4_0", Arch::kMixtral, true, GgmlType::kQ4_0, 2},
                      StoreCase{"mixtral_legacy_bf16", Arch::kMixtral, true, GgmlType::kBF16, 2},
                      StoreCase{"qwen3moe_q5_K", Arch::kQwen3Moe, false, GgmlType::kQ5_K, 2},
                      StoreCase{"qwen3moe_f16", Arch::kQwen3Moe, false, GgmlType::kF16, 2}),
    [](const ::testing::TestParamInfo<StoreCase>& info) { return std::string(info.param.name); });

TEST(ExpertLayoutTest, ProjectionsAndBlocksAreAlignedTo256Bytes) {
  // n_embd 64, n_ff 32 in q8_0 (34 bytes per 32 values): gate and up are 32 rows
  // of 68 bytes (2176), down 64 rows of 34 (2176). Each starts on the next
  // multiple of 256 after the one before it: 0, 2304, 4608; the block ends at
  // 4608 + 2176 = 6784, rounded up to 6912.
  FixtureSpec spec;
  spec.expert_type = GgmlType::kQ8_0;
  spec.n_layer = 1;
  absl::StatusOr<std::unique_ptr<LoadedModel>> loaded = LoadFixture(spec);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const ExpertBlockLayout layout = ExpertLayoutOf((*loaded)->model, 0);
  EXPECT_EQ(layout[ExpertProj::kGate].offset, 0u);
  EXPECT_EQ(layout[ExpertProj::kGate].bytes(), 2176u);
  EXPECT_EQ(layout[ExpertProj::kUp].offset, 2304u);
  EXPECT_EQ(layout[ExpertProj::kDown].offset, 4608u);
  EXPECT_EQ(layout[ExpertProj::kDown].rows, 64);
  EXPECT_EQ(layout[ExpertProj::kDown].row_bytes, 34u);
  EXPECT_EQ(layout.block_bytes, 6912u);

  absl::StatusOr<ExpertStore> store = ExpertStore::Create((*loaded)->model);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(store->block(0, 0)) % 4096, 0u);
  for (int e = 0; e < spec.n_expert; ++e) {
    for (ExpertProj proj : kProjections) {
      const WeightView v = ProjectionView(store->layout(0), proj, store->block(0, e));
      EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data) % kBlockAlignment, 0u);
    }
  }
}

// A model whose layer 1 experts come from a second fixture with another expert
// type: the two files share every shape, so only the block layouts differ.
struct MixedModel {
  std::unique_ptr<LoadedModel> base, other;
  Model model;
};

absl::StatusOr<std::unique_ptr<MixedModel>> LoadMixedModel(GgmlType base_type,
                                                            GgmlType layer1_type) {
  FixtureSpec spec;
  spec.n_layer = 3;
  spec.expert_type = base_type;
  auto mixed = std::make_unique<MixedModel>();
  absl::StatusOr<std::unique_ptr<LoadedModel>> base = LoadFixture(spec);
  if (!base.ok()) return base.status();
  spec.expert_type = layer1_type;
  absl::StatusOr<std::unique_ptr<LoadedModel>> other = LoadFixture(spec);
  if (!other.ok()) return other.status();
  mixed->base = std::move(*base);
  mixed->other = std::move(*other);
  mixed->model = mixed->base->model;
  LayerTensors& layer1 = mixed->model.layers[1];
  const LayerTensors& from = mixed->other->model.layers[1];
  layer1.gate_exps = from.gate_exps;
  layer1.up_exps = from.up_exps;
  layer1.down_exps = from.down_exps;
  return mixed;
}

TEST(ExpertStoreClassesTest, LayersWithDifferentExpertTypesGetTheirOwnSizeClass) {
  absl::StatusOr<std::unique_ptr<MixedModel>> mixed =
      LoadMixedModel(GgmlType::kF32, GgmlType::kQ8_0);
  ASSERT_TRUE(mixed.ok()) << mixed.status();
  const Model& model = (*mixed)->model;
  absl::StatusOr<ExpertStore> store = ExpertStore::Create(model);
  ASSERT_TRUE(store.ok()) << store.status();
  const std::vector<SizeClass>& classes = store->size_classes();
  ASSERT_EQ(classes.size(), 2u);
  EXPECT_EQ(classes[0].layers, (std::vector<int>{0, 2}));
  EXPECT_EQ(classes[1].layers, (std::vector<int>{1}));
  EXPECT_EQ(store->class_of(0), 0);
  EXPECT_EQ(store->class_of(1), 1);
  EXPECT_EQ(store->class_of(2), 0);
  EXPECT_EQ(classes[0].layout[ExpertProj::kGate].type, GgmlType::kF32);
  EXPECT_EQ(classes[1].layout[ExpertProj::kGate].type, GgmlType::kQ8_0);
  // f32: three 8192-byte projections; q8_0: 6912 as worked out above. No padding
  // to the largest block.
  EXPECT_EQ(classes[0].block_bytes, 24576u);
  EXPECT_EQ(classes[1].block_bytes, 6912u);
  EXPECT_EQ(store->total_bytes(), 8 * (2 * 24576u + 6912u));
  ExpectBlocksHoldTheModelBytes(model, *store);
}

TEST(ExpertStoreClassesTest, LegacyExpertsOfOneLayerMustShareATypeNamingTheTensor) {
  FixtureSpec spec;
  spec.arch = Arch::kMixtral;
  spec.legacy_experts = true;
  spec.n_layer = 1;
  absl::StatusOr<std::unique_ptr<LoadedModel>> f32 = LoadFixture(spec);
  spec.expert_type = GgmlType::kQ8_0;
  absl::StatusOr<std::unique_ptr<LoadedModel>> q8 = LoadFixture(spec);
  ASSERT_TRUE(f32.ok() && q8.ok());
  Model model = (*f32)->model;
  model.layers[0].up_legacy[3] = (*q8)->model.layers[0].up_legacy[3];
  absl::StatusOr<ExpertStore> store = ExpertStore::Create(model);
  ASSERT_FALSE(store.ok());
  EXPECT_TRUE(MessageHas(store.status(), "blk.0.ffn_up.3.weight")) << store.status();
  EXPECT_TRUE(MessageHas(store.status(), "expert 3 of layer 0")) << store.status();
}

// Counts what passes through it, on top of the default allocator, and hands out
// memory filled with a non-zero pattern.
struct CountingAllocator {
  HostAllocator inner = AlignedHostAllocator();
  bool fail = false;
  int allocs = 0;
  int frees = 0;
  size_t bytes = 0;

  HostAllocator Hooks() {
    HostAllocator a;
    a.context = this;
    a.alloc = [](size_t n, void* ctx) -> void* {
      auto* self = static_cast<CountingAllocator*>(ctx);
      if (self->fail) return nullptr;
      ++self->allocs;
      self->bytes = n;
      // Garbage, so the padding check below sees the store zero it.
      void* p = self->inner.alloc(n, self->inner.context);
      if (p != nullptr) std::memset(p, 0xA5, n);
      return p;
    };
    a.free = [](void* p, size_t n, void* ctx) {
      auto* self = static_cast<CountingAllocator*>(ctx);
      ++self->frees;
      EXPECT_EQ(n, self->bytes);
      self->inner.free(p, n, self->inner.context);
    };
    return a;
  }
};

TEST(ExpertStoreAllocatorTest, TheStoreLivesInTheGivenAllocationAndFreesItOnce) {
  FixtureSpec spec;
  spec.n_layer = 2;
  absl::StatusOr<std::unique_ptr<LoadedModel>> loaded = LoadFixture(spec);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  CountingAllocator counting;
  {
    absl::StatusOr<ExpertStore> store = ExpertStore::Create((*loaded)->model, counting.Hooks());
    ASSERT_TRUE(store.ok()) << store.status();
    EXPECT_EQ(counting.allocs, 1);
    EXPECT_EQ(counting.bytes, store->total_bytes());
    ExpertStore moved = std::move(*store);  // the allocation moves, not a copy
    EXPECT_EQ(counting.allocs, 1);
    EXPECT_EQ(counting.frees, 0);
    ExpectBlocksHoldTheModelBytes((*loaded)->model, moved);
  }
  EXPECT_EQ(counting.frees, 1);

  counting.fail = true;
  absl::StatusOr<ExpertStore> failed = ExpertStore::Create((*loaded)->model, counting.Hooks());
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(MessageHas(failed.status(), "cannot allocate")) << failed.status();
  EXPECT_TRUE(MessageHas(failed.status(), "fixture")) << failed.status();
}

TEST(ExpertStoreProgressTest, ProgressRisesMonotonicallyToTheTotal) {
  FixtureSpec spec;
  spec.n_layer = 3;
  absl::StatusOr<std::unique_ptr<LoadedModel>> loaded = LoadFixture(spec);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  struct Report {
    uint64_t done, total;
    double seconds;
  };
  std::vector<Report> reports;
  absl::StatusOr<ExpertStore> store =
      ExpertStore::Create((*loaded)->model, AlignedHostAllocator(),
                          [&](uint64_t done, uint64_t total, double seconds) {
                            reports.push_back({done, total, seconds});
                          });
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_GE(reports.size(), 2u);
  for (size_t i = 0; i < reports.size(); ++i) {
    EXPECT_EQ(reports[i].total, store->total_bytes());
    EXPECT_GT(reports[i].done, 0u);
    EXPECT_LE(reports[i].done, reports[i].total);
    EXPECT_GE(reports[i].seconds, 0.0);
    if (i > 0) {
      EXPECT_GT(reports[i].done, reports[i - 1].done);
      EXPECT_GE(reports[i].seconds, reports[i - 1].seconds);
    }
  }
  EXPECT_EQ(reports.back().done, store->total_bytes());
}

}  // namespace
}  // namespace moegraph
