// `moegraph inspect` as a user runs it: the binary in a subprocess on files
// written by GgufWriter, valid, truncated and corrupted; --walk on a fixture.
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "capture/walk_shape.h"
#include "gtest/gtest.h"
#include "loader/fixture.h"
#include "loader/gguf.h"
#include "loader/gguf_writer.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::ProcessResult;
using testing_util::RunProcess;
using testing_util::TempPath;

class CliInspectTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = TempPath("cli_inspect");
    std::filesystem::create_directories(dir_);
    GgufWriter w;
    w.SetString("general.architecture", "qwen3moe");
    w.SetString("general.name", "tiny test model");
    w.SetUint32("qwen3moe.block_count", 2);
    w.SetUint32("qwen3moe.expert_count", 8);
    w.SetFloat32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6f);
    w.SetStringArray("tokenizer.ggml.tokens", {"tok_a_SECRET", "tok_b", "tok_c"});
    w.SetString("tokenizer.chat_template", std::string(500, 'x'));
    w.AddTensor("token_embd.weight", GgmlType::kF32, {64, 16}, std::vector<uint8_t>(4096, 1));
    w.AddTensor("blk.0.ffn_gate_exps.weight", GgmlType::kQ4_K, {256, 4, 8},
                std::vector<uint8_t>(32 * 144, 2));
    bytes_ = w.Serialize();
    valid_ = Write("valid.gguf", bytes_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Write(const std::string& name, const std::vector<uint8_t>& bytes) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()),
               static_cast<std::streamsize>(bytes.size()));
    return path;
  }

  // MOEGRAPH_BIN with args, stdout and stderr apart.
  ProcessResult Inspect(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {MOEGRAPH_BIN};
    argv.insert(argv.end(), args.begin(), args.end());
    return RunProcess(argv);
  }

  std::filesystem::path dir_;
  std::vector<uint8_t> bytes_;
  std::string valid_;
};

TEST_F(CliInspectTest, ValidFilePrintsHeaderParametersAndTensorTable) {
  ProcessResult r = Inspect({"inspect", valid_});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  for (const char* expected :
       {"GGUF version:  3", "alignment:     32", "architecture:  qwen3moe", "qwen3moe.block_count",
        "= 2", "qwen3moe.expert_count", "= 8", "1e-06", "\"tiny test model\"", "[str x 3]",
        "token_embd.weight", "blk.0.ffn_gate_exps.weight", "q4_K", "[256, 4, 8]", "[64, 16]",
        "total: 2 tensors"}) {
    EXPECT_NE(r.out.find(expected), std::string::npos) << "missing '" << expected << "' in\n"
                                                       << r.out;
  }
  // Tokenizer arrays and long strings are summarized, never dumped.
  EXPECT_EQ(r.out.find("tok_a_SECRET"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(500 bytes)"), std::string::npos) << r.out;
}

// The model section: how moegraph reads the file (its dense and NextN layers,
// routing, attention) and where its bytes go; a file it cannot load says why.
TEST_F(CliInspectTest, ModelSectionDescribesWhatMoegraphReads) {
  FixtureSpec spec;
  spec.arch = Arch::kGlm4Moe;
  spec.n_layer = 3;
  const std::string glm = (dir_ / "glm.gguf").string();
  ASSERT_TRUE(WriteFixture(spec, glm).ok());
  ProcessResult r = Inspect({"inspect", glm});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* expected :
       {"model (as moegraph reads it):",
        "3 decoded (2 with experts, the first 1 with a dense FFN "
        "of 64); 1 NextN not read",
        "8 per layer of 32, top-2, sigmoid with a score bias "
        "(exp_probs_b), weights normalized x 2.5, silu; a shared expert of 32",
        "RoPE neox on 8 dims", "q/k/v biases", "routed experts ", "dense FFN ", "shared expert ",
        "MiB not read", "KiB per position (f16), decoded layers only"}) {
    EXPECT_NE(r.out.find(expected), std::string::npos) << "missing '" << expected << "' in\n"
                                                       << r.out;
  }
  spec = FixtureSpec();
  spec.arch = Arch::kGptOss;
  spec.n_layer = 3;
  const std::string oss = (dir_ / "oss.gguf").string();
  ASSERT_TRUE(WriteFixture(spec, oss).ok());
  r = Inspect({"inspect", oss});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* expected :
       {"softmax over the chosen k with a router bias, swiglu_oai, expert biases",
        "YaRN x32 over 4096", "a window of 4 on 2 layers; sinks; q/k/v/o biases",
        "the 2 windowed layers keep rings of 516 rows (window + -ub 512", "norms/biases/sinks "}) {
    EXPECT_NE(r.out.find(expected), std::string::npos) << "missing '" << expected << "' in\n"
                                                       << r.out;
  }
  // The hand-made file of SetUp has no hyper-parameters to speak of.
  r = Inspect({"inspect", valid_});
  EXPECT_NE(r.out.find("model: not loadable by moegraph: "), std::string::npos) << r.out;
}

TEST_F(CliInspectTest, TruncatedFileFailsNamingFieldAndOffset) {
  auto f = GgufFile::FromBytes("valid", bytes_);
  ASSERT_TRUE(f.ok());
  const GgufTensor& last = (*f)->tensors().back();
  std::vector<uint8_t> cut(bytes_.begin(), bytes_.end() - 1000);
  const std::string path = Write("cut.gguf", cut);
  ProcessResult r = Inspect({"inspect", path});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.out, "");
  EXPECT_NE(r.err.find(path + ": tensor 'blk.0.ffn_gate_exps.weight' at byte " +
                       std::to_string(last.info_offset) + ": data"),
            std::string::npos)
      << r.err;
}

TEST_F(CliInspectTest, CorruptedTensorTypeFailsNamingTensorAndOffset) {
  auto f = GgufFile::FromBytes("valid", bytes_);
  ASSERT_TRUE(f.ok());
  const GgufTensor& t = (*f)->tensors()[1];
  std::vector<uint8_t> bad = bytes_;
  // The type field sits after the name (8 + length), n_dims (4) and the dims.
  const size_t type_at = t.info_offset + 8 + t.name.size() + 4 + 8 * t.n_dims;
  bad[type_at] = 31;  // a removed ggml type
  ProcessResult r = Inspect({"inspect", Write("bad_type.gguf", bad)});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("tensor 'blk.0.ffn_gate_exps.weight' at byte " + std::to_string(type_at) +
                       ": unknown ggml type 31"),
            std::string::npos)
      << r.err;
}

TEST_F(CliInspectTest, CorruptedBytesNeverCrash) {
  for (size_t i = 0; i < 64; ++i) {
    std::vector<uint8_t> bad = bytes_;
    const size_t at = (i * 37) % 400;
    bad[at] ^= 0xFF;
    ProcessResult r = Inspect({"inspect", Write("flip.gguf", bad)});
    ASSERT_NE(r.exit_code, -1) << "crashed with byte " << at << " flipped";
    if (r.exit_code != 0) {
      EXPECT_EQ(r.exit_code, 1);
      EXPECT_NE(r.err.find(" at byte "), std::string::npos) << r.err;
    }
  }
}

// --walk prints the library's table (capture/walk_shape.h) for the flags given,
// and refuses a bad value by its flag before any weight is read.
TEST_F(CliInspectTest, WalkPrintsTheStepsLaunchesForItsFlags) {
  FixtureSpec spec;
  spec.arch = Arch::kQwen2Moe;
  spec.n_embd = 256;
  spec.n_ff_exp = 256;
  spec.dense_type = GgmlType::kQ8_0;
  spec.expert_type = GgmlType::kQ4_K;
  const std::string path = (dir_ / "qwen2.gguf").string();
  ASSERT_TRUE(WriteFixture(spec, path).ok());
  absl::StatusOr<std::unique_ptr<testing_util::LoadedModel>> loaded =
      testing_util::LoadFixture(spec);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  WalkShapeOptions options;
  options.arm = Arm::kResident;
  options.max_ctx = 1000;
  options.kv_type = KvCacheType::kF32;
  absl::StatusOr<WalkShape> shape = ShapeWalk((*loaded)->model, options);
  ASSERT_TRUE(shape.ok()) << shape.status();
  ProcessResult r =
      Inspect({"inspect", "--walk", "-m", path, "--arm", "resident", "-c", "1000", "-ctk", "f32"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("arm resident"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\n| layer | kernel | grid | block | weight bytes |\n"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find(FormatWalkShape(*shape)), std::string::npos) << r.out;
  // Without flags: the graph arm at the default context, another table.
  options = WalkShapeOptions();
  shape = ShapeWalk((*loaded)->model, options);
  ASSERT_TRUE(shape.ok()) << shape.status();
  r = Inspect({"inspect", "--walk", path});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find(FormatWalkShape(*shape)), std::string::npos) << r.out;

  for (const auto& [flags, named] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--arm", "host"}, "--arm host"},
           {{"--arm", "fast"}, "--arm"},
           {{"--slots", "1"}, "--slots 1"},
           {{"--slots", "many"}, "--slots 'many'"},
           {{"--ctx", "-5"}, "--ctx -5"},
           {{"--kv-type", "q4"}, "--kv-type 'q4'"}}) {
    std::vector<std::string> args = {"inspect", "--walk", path};
    args.insert(args.end(), flags.begin(), flags.end());
    const ProcessResult bad = Inspect(args);
    EXPECT_EQ(bad.exit_code, 1) << flags[0];
    EXPECT_EQ(bad.out, "");
    EXPECT_NE(bad.err.find(named), std::string::npos) << bad.err;
  }
}

TEST_F(CliInspectTest, MissingFileAndMissingArgument) {
  ProcessResult missing = Inspect({"inspect", (dir_ / "nope.gguf").string()});
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.err.find("nope.gguf"), std::string::npos) << missing.err;
  ProcessResult usage = Inspect({"inspect"});
  EXPECT_EQ(usage.exit_code, 2);
  EXPECT_NE(usage.err.find("usage: moegraph inspect FILE"), std::string::npos) << usage.err;
}

}  // namespace
}  // namespace moegraph
