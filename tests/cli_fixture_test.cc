// `moegraph make-fixture` as a user runs it: the binary in a subprocess, its file
// loaded back with LoadModel, and bad flags refused with the flag named.
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>

#include "loader/gguf.h"
#include "loader/model_config.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::CommandResult;
using testing_util::RunCommand;
using testing_util::TempPath;

// `moegraph make-fixture ARGS` with stdout and stderr together.
CommandResult MakeFixture(const std::string& args) {
  return RunCommand(std::string(MOEGRAPH_BIN) + " make-fixture " + args + " 2>&1");
}

TEST(CliMakeFixture, WritesAFileThatLoads) {
  const std::string path = TempPath("qwen2moe.gguf");
  const CommandResult r = MakeFixture(
      "--arch qwen2moe --layers 3 --experts 6 --top-k 2 --embd 64 --ff 32 --shared-ff 64 "
      "--heads 4 --kv-heads 2 --vocab 300 --quant q8_0,expert=q4_0 --router-skew 2 --seed 9 "
      "-o " +
      path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(path), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("qwen2moe"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("MiB"), std::string::npos) << r.output;

  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<Model> model = LoadModel(**file);
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelConfig& c = model->config;
  EXPECT_EQ(c.arch, Arch::kQwen2Moe);
  EXPECT_EQ(c.n_layer, 3);
  EXPECT_EQ(c.n_expert, 6);
  EXPECT_EQ(c.n_expert_used, 2);
  EXPECT_EQ(c.n_embd, 64);
  EXPECT_EQ(c.n_ff_exp, 32);
  EXPECT_EQ(c.n_ff_shexp, 64);
  EXPECT_EQ(c.n_head_kv, 2);
  EXPECT_EQ(c.n_vocab, 300);
  EXPECT_EQ(model->layers[0].wq->ggml_type(), GgmlType::kQ8_0);
  EXPECT_EQ(model->layers[2].up_exps->ggml_type(), GgmlType::kQ4_0);
  EXPECT_EQ(model->layers[1].router->ggml_type(), GgmlType::kF32);
  std::remove(path.c_str());
}

TEST(CliMakeFixture, LegacyMixtralExperts) {
  const std::string path = TempPath("mixtral.gguf");
  const CommandResult r =
      MakeFixture("--arch mixtral --experts 4 --legacy-experts --quant f16 -o " + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<Model> model = LoadModel(**file);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->config.rope_type, RopeType::kNorm);
  EXPECT_EQ(model->layers[0].gate_legacy.size(), 4u);
  EXPECT_EQ(model->expert(1, ExpertProj::kDown, 3).type, GgmlType::kF16);
  std::remove(path.c_str());
}

TEST(CliMakeFixture, BadValuesFailNamingTheFlag) {
  const std::string path = TempPath("bad.gguf");
  struct Case {
    std::string args;
    std::string expect;
  };
  const Case cases[] = {
      {"--experts 8 --top-k 9 -o " + path, "--top-k 9 exceeds --experts 8"},
      {"--embd 100 --quant q4_K -o " + path, "--embd 100"},
      {"--quant iq2_xxs -o " + path, "--quant iq2_xxs is not supported (f32, f16, q4_0"},
      {"--quant q9_9 -o " + path, "q9_9"},
      {"--arch gpt2 -o " + path, "--arch gpt2"},
      {"--layers two -o " + path, "layers"},
      {"", "-o"},
      {"-o " + path + " extra", "extra"},
  };
  for (const Case& c : cases) {
    const CommandResult r = MakeFixture(c.args);
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_NE(access(path.c_str(), F_OK), 0) << c.args << " left a file behind";
  }
}

}  // namespace
}  // namespace moegraph
