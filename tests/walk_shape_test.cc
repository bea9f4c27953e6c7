// What `moegraph inspect --walk` prints (capture/walk_shape.h) against the
// launches the CUDA engine makes: one decode step of each arm (resident; graph,
// its walk captured) on the emulator, every launch's kernel, grid and block
// recorded (emulator/testing.h) and held to the shape's rows one by one, so a
// launcher whose grid drifts from kernels/launch_geometry.h, or a walk that
// changes without the shape, fails here. Fixtures: qwen3moe, qwen2moe (a gated
// shared expert), glm4moe (a leading dense layer, an ungated shared expert),
// qwen35moe (Gated DeltaNet layers around a gated attention one), each with
// other weight types.
#include <gtest/gtest.h>

#include <cctype>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "capture/engine.h"
#include "capture/walk_shape.h"
#include "emulator/testing.h"
#include "loader/fixture.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using moegraph_emu::LaunchRecorder;
using moegraph_emu::RecordedLaunch;
using testing_util::LoadedModel;
using testing_util::LoadFixture;

constexpr int kMaxCtx = 64;

struct ShapeCase {
  Arch arch;
  GgmlType dense;
  GgmlType expert;
  Arm arm;
};

void PrintTo(const ShapeCase& c, std::ostream* os) {
  *os << arch_gguf_name(c.arch) << " " << ggml_type_name(static_cast<uint32_t>(c.dense)) << "/"
      << ggml_type_name(static_cast<uint32_t>(c.expert)) << " " << ArmName(c.arm);
}

// The name KernelName gives the launch's kernel: GCC spells a matvec's
// GgmlType enumerator (k and ggml's name in capitals), a chain's Chain
// enumerator (after a stray '<': the enum's scope is cut off) and uint16_t.
std::string EmulatorName(const WalkLaunch& launch) {
  if (launch.kernel == "grouped_matvec_kernel") {
    std::string type = launch.instance;
    for (char& c : type) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return "grouped_matvec_kernel<k" + type + ">";
  }
  if (launch.kernel == "chained_matvec_kernel") {
    return launch.instance.starts_with("pair ") ? "chained_matvec_kernel<<kExpertFfn>"
                                                : "chained_matvec_kernel<<kResidualRouter>";
  }
  if (launch.kernel == "attention_split_kernel") {
    return launch.instance == "f16" ? "attention_split_kernel<short unsigned int>"
                                    : "attention_split_kernel<float>";
  }
  return launch.kernel;
}

std::string Dims(const dim3& d) {
  return std::to_string(d.x) + "," + std::to_string(d.y) + "," + std::to_string(d.z);
}

class WalkShapeTest : public ::testing::TestWithParam<ShapeCase> {};

TEST_P(WalkShapeTest, EveryLaunchOfAStepIsTheShapesRow) {
  const ShapeCase c = GetParam();
  FixtureSpec spec;
  spec.arch = c.arch;
  spec.dense_type = c.dense;
  spec.expert_type = c.expert;
  spec.n_layer = 3;  // glm4moe: one dense layer, then two with experts
  spec.n_embd = 256;  // K-quants take rows of 256
  spec.n_ff_exp = 256;
  spec.n_expert = 8;
  spec.n_expert_used = 2;
  spec.full_attention_interval = 2;  // qwen35moe: DeltaNet, gated attention, DeltaNet
  absl::StatusOr<std::unique_ptr<LoadedModel>> loaded = LoadFixture(spec);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const Model& model = (*loaded)->model;

  WalkShapeOptions shape_options;
  shape_options.arm = c.arm;
  shape_options.max_ctx = kMaxCtx;
  absl::StatusOr<WalkShape> shape = ShapeWalk(model, shape_options);
  ASSERT_TRUE(shape.ok()) << shape.status();

  // The arm with every door at its default, the prompt as one T=1 step: the
  // step's launches are those of one walk (the graph arm's as it captures them).
  CudaEngineOptions options;
  options.max_ctx = kMaxCtx;
  options.doors.resident = c.arm == Arm::kResident;
  options.doors.batched_prefill = false;
  absl::StatusOr<std::unique_ptr<CudaEngine>> engine = CudaEngine::Create(model, options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  ASSERT_EQ((*engine)->arm(), c.arm);

  // The shape follows the engine's walk: the same entries in the same order.
  const StepWalk walk = (*engine)->Walk();
  ASSERT_EQ(walk.entries.size(), shape->walk.entries.size());
  for (size_t i = 0; i < walk.entries.size(); ++i) {
    EXPECT_EQ(EntryLabel(walk.entries[i]), EntryLabel(shape->walk.entries[i])) << "entry " << i;
    EXPECT_EQ(walk.entries[i].stream, shape->walk.entries[i].stream) << "entry " << i;
  }
  for (int layer = 0; layer < model.config.n_layer; ++layer) {
    int rows = 0;
    for (const WalkLaunch& l : shape->launches) rows += l.layer == layer;
    EXPECT_EQ(rows, KernelsInLayer(walk, layer)) << "layer " << layer;
  }
  // The shared expert rides the expert passes where its gate, up and down are
  // the experts' types and shapes (here: one type for all and qwen35moe's or
  // glm4moe's expert-wide shared FFN), its gate (f32 as the router) in the
  // router: then a layer has the node budget of qwen3moe's, plus nothing.
  const ModelConfig& cfg = model.config;
  const std::vector<bool> in_passes = SharedExpertInPasses(model);
  const std::vector<bool> in_router = SharedGateInRouter(model);
  for (int layer = 0; layer < cfg.n_layer; ++layer) {
    const bool rides = cfg.moe_layer(layer) && cfg.n_ff_shexp == cfg.n_ff_exp &&
                       c.dense == c.expert;
    EXPECT_EQ(in_passes[static_cast<size_t>(layer)], rides) << "layer " << layer;
    EXPECT_EQ(in_router[static_cast<size_t>(layer)], cfg.moe_layer(layer) && cfg.shexp_gated)
        << "layer " << layer;
    // The chained launches (MOEGRAPH_CHAIN) take 2 more.
    if (rides) {
      EXPECT_LE(KernelsInLayer(walk, layer), c.arm == Arm::kResident ? 4 : 6);
    }
  }

  std::vector<RecordedLaunch> launched;
  {
    LaunchRecorder recorder;
    absl::StatusOr<std::vector<int32_t>> tokens = (*engine)->Generate({3}, 1);
    ASSERT_TRUE(tokens.ok()) << tokens.status();
    launched = recorder.launches();
  }
  ASSERT_EQ(launched.size(), shape->launches.size());
  for (size_t i = 0; i < launched.size(); ++i) {
    const WalkLaunch& want = shape->launches[i];
    const std::string where = "launch " + std::to_string(i) + " (layer " +
                              std::to_string(want.layer) + " " +
                              std::string(StepOpName(want.op)) + ")";
    EXPECT_EQ(launched[i].kernel, EmulatorName(want)) << where;
    EXPECT_EQ(Dims(launched[i].grid), Dims(want.grid)) << where;
    EXPECT_EQ(Dims(launched[i].block), Dims(want.block)) << where;
  }
}

std::vector<ShapeCase> Cases() {
  const struct {
    Arch arch;
    GgmlType dense, expert;
  } models[] = {
      {Arch::kQwen3Moe, GgmlType::kQ8_0, GgmlType::kQ4_K},
      {Arch::kQwen2Moe, GgmlType::kQ6_K, GgmlType::kQ8_0},
      {Arch::kGlm4Moe, GgmlType::kQ8_0, GgmlType::kQ5_0},
      {Arch::kQwen35Moe, GgmlType::kQ6_K, GgmlType::kQ4_K},
      {Arch::kQwen35Moe, GgmlType::kQ4_K, GgmlType::kQ4_K},  // the shared expert in the passes
  };
  std::vector<ShapeCase> cases;
  for (const auto& m : models) {
    for (Arm arm : {Arm::kResident, Arm::kGraph}) cases.push_back({m.arch, m.dense, m.expert, arm});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, WalkShapeTest, ::testing::ValuesIn(Cases()));

// What a user can get wrong is refused by flag, before any weight is read.
TEST(WalkShapeOptionsTest, BadOptionsNameTheirFlag) {
  FixtureSpec spec;
  absl::StatusOr<std::unique_ptr<LoadedModel>> loaded = LoadFixture(spec);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const Model& model = (*loaded)->model;
  auto error = [&](WalkShapeOptions o) {
    const absl::StatusOr<WalkShape> shape = ShapeWalk(model, o);
    return shape.ok() ? std::string("ok") : std::string(shape.status().message());
  };
  WalkShapeOptions eager;
  eager.arm = Arm::kEager;
  EXPECT_NE(error(eager).find("--arm eager"), std::string::npos) << error(eager);
  WalkShapeOptions few;
  few.slots = spec.n_expert_used - 1;
  EXPECT_NE(error(few).find("--slots 1"), std::string::npos) << error(few);
  WalkShapeOptions resident_slots;
  resident_slots.arm = Arm::kResident;
  resident_slots.slots = 4;
  EXPECT_NE(error(resident_slots).find("--slots 4"), std::string::npos) << error(resident_slots);
  WalkShapeOptions no_ctx;
  no_ctx.max_ctx = 0;
  EXPECT_NE(error(no_ctx).find("--ctx 0"), std::string::npos) << error(no_ctx);
  WalkShapeOptions enough;
  enough.slots = spec.n_expert_used;
  EXPECT_EQ(error(enough), "ok");
}

// A weight the kernels do not take is refused by its tensor's name, as the
// engine refuses it: qkv_kernel leaves mxfp4 out.
TEST(WalkShapeOptionsTest, AWeightTheKernelsDoNotTakeIsNamed) {
  FixtureSpec spec;
  spec.dense_type = GgmlType::kMXFP4;
  absl::StatusOr<std::unique_ptr<LoadedModel>> loaded = LoadFixture(spec);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const absl::StatusOr<WalkShape> shape = ShapeWalk((*loaded)->model, WalkShapeOptions{});
  ASSERT_FALSE(shape.ok());
  EXPECT_NE(shape.status().message().find("blk.0.attn_q.weight"), std::string::npos)
      << shape.status();
}

// inspect --walk refuses a router the kernels do not take as the engine does,
// by its keys: 257 experts leave each of the block's threads 3, and 43 x 3
// candidates would not fit its 128.
TEST(WalkShapeOptionsTest, ARouterTheKernelsDoNotTakeIsNamed) {
  FixtureSpec spec;
  spec.n_layer = 1;
  spec.n_expert = 257;
  spec.n_expert_used = 43;
  spec.expert_variants = 1;
  absl::StatusOr<std::unique_ptr<LoadedModel>> loaded = LoadFixture(spec);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const absl::StatusOr<WalkShape> shape = ShapeWalk((*loaded)->model, WalkShapeOptions{});
  ASSERT_FALSE(shape.ok());
  EXPECT_NE(shape.status().message().find("this model: 257 experts, top-43"), std::string::npos)
      << shape.status();
  EXPECT_NE(shape.status().message().find("expert_used_count"), std::string::npos)
      << shape.status();
}

}  // namespace
}  // namespace moegraph
