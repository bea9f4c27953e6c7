// `moegraph run` and `moegraph bench` with --backend cuda, as a user runs them:
// every arm (graph, eager, host, stage, resident) prints the CPU backend's
// tokens, and bench replaying one routing trace counts the CPU backend's hits,
// misses and bytes staged, with the host syncs the design promises per token;
// `moegraph serve` samples each request with its own settings on the device.
// Skips without a device; the emulated tree runs it on the CPU emulator
// (docs/EMULATOR.md), where bench also says its speeds are not a GPU's.
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "capture/engine.h"
#include "loader/fixture.h"
#include "tests/serve_process.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::BenchJsonRows;
using testing_util::IdsAfter;
using testing_util::ProcessResult;
using testing_util::RunProcessWithArgs;
using testing_util::TempPath;

constexpr int kLayers = 3;

// `moegraph COMMAND -m FIXTURE --backend BACKEND ARGS` (ARGS split at spaces).
ProcessResult Moegraph(const std::string& command, const std::string& fixture,
                       const std::string& backend, const std::string& args) {
  return RunProcessWithArgs({MOEGRAPH_BIN, command, "-m", fixture, "--backend", backend}, args);
}

class CliCudaTest : public testing_util::FixtureFileTest {
 protected:
  static void SetUpTestSuite() {
    // f32 experts: the device's logits are within 1e-6 of the CPU's, so greedy
    // tokens agree.
    FixtureSpec spec;
    spec.arch = Arch::kQwen3Moe;
    spec.n_layer = kLayers;
    spec.n_expert = 16;
    spec.n_expert_used = 4;
    spec.expert_type = GgmlType::kF32;
    spec.router_skew = 1.0f;
    spec.seed = 31;
    WriteSuiteFixture(spec, "cli_cuda.gguf");
  }
  void SetUp() override {
    FixtureFileTest::SetUp();
    if (CudaDeviceCount() == 0) {
      GTEST_SKIP() << "no CUDA device (" << NoCudaDeviceReason() << ")";
    }
  }
};

// perplexity's chunks on the device (each position a recorded decode step) and
// on the CPU backend: the same perplexity, and a base saved on one read by the
// other as no divergence, on the resident and graph arms; with fewer experts a
// token too.
TEST_F(CliCudaTest, PerplexityOnTheDeviceIsTheCpuBackends) {
  const std::string text = TempPath("cuda-ppl.txt");
  {
    std::FILE* f = std::fopen(text.c_str(), "w");
    ASSERT_NE(f, nullptr);
    for (int i = 0; i < 80; ++i) std::fprintf(f, "%c", "abc defg,hij.\n"[(i * 7 + i / 5) % 14]);
    std::fclose(f);
  }
  const std::string base = TempPath("cuda-ppl.base");
  const ProcessResult cpu = Moegraph("perplexity", fixture_path(), "cpu",
                                     "-f " + text + " -c 32 --kl-divergence-base " + base);
  ASSERT_EQ(cpu.exit_code, 0) << cpu.err;
  const std::string final_line = "Final estimate: PPL = ";
  const auto ppl = [&](const std::string& out) {
    const size_t at = out.find(final_line);
    return at == std::string::npos ? -1.0 : std::stod(out.substr(at + final_line.size()));
  };
  const double want = ppl(cpu.out);
  ASSERT_GT(want, 0) << cpu.out;
  for (const std::string arm : {"resident", "graph"}) {
    const ProcessResult cuda =
        Moegraph("perplexity", fixture_path(), "cuda", "-f " + text + " -c 32 --arm " + arm);
    ASSERT_EQ(cuda.exit_code, 0) << arm << ": " << cuda.err;
    EXPECT_NEAR(ppl(cuda.out), want, 1e-4 * want) << arm << ": " << cuda.out;
    const ProcessResult kl = Moegraph("perplexity", fixture_path(), "cuda",
                                      "--kl-divergence --kl-divergence-base " + base + " --arm " +
                                          arm);
    ASSERT_EQ(kl.exit_code, 0) << arm << ": " << kl.err;
    EXPECT_TRUE(testing_util::Contains(kl.err, "Same top p")) << kl.err;  // the chunk table
  }
  // --n-expert-used 1 on both: the device runs each token's best expert alone
  // as the CPU backend does (another perplexity than every expert's).
  const std::string one = "-f " + text + " -c 32 --n-expert-used 1";
  const ProcessResult cpu_one = Moegraph("perplexity", fixture_path(), "cpu", one);
  ASSERT_EQ(cpu_one.exit_code, 0) << cpu_one.err;
  const double want_one = ppl(cpu_one.out);
  EXPECT_NE(want_one, want);
  const ProcessResult cuda_one = Moegraph("perplexity", fixture_path(), "cuda", one);
  ASSERT_EQ(cuda_one.exit_code, 0) << cuda_one.err;
  EXPECT_NEAR(ppl(cuda_one.out), want_one, 1e-4 * want_one) << cuda_one.out;
}

// The trained model's perplexity over the first two chunks of 128 of its
// held-out text on the device: llama.cpp's running value after chunk 2
// (tests/data/kjv-moe/llama.json, tools/llama-crosscheck/kjv-moe.sh) within 0.1%.
TEST_F(CliCudaTest, TheTrainedModelsPerplexityOnTheDeviceIsLlamaCpps) {
  std::ifstream in(MOEGRAPH_SOURCE_DIR "/tests/data/kjv-moe/llama.json");
  const nlohmann::json want = nlohmann::json::parse(in)["perplexity"][1];
  ASSERT_EQ(want["n_ctx"].get<int>(), 128);
  const double ppl = want["per_chunk"][1].get<double>();
  const ProcessResult r = RunProcessWithArgs(
      {MOEGRAPH_BIN, "perplexity", "-m", MOEGRAPH_SOURCE_DIR "/models/kjv-moe-f16.gguf", "-f",
       MOEGRAPH_SOURCE_DIR "/models/kjv-held-out.txt", "--backend", "cuda"},
      "-c 128 --chunks 2 --arm resident");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string label = "Final estimate: PPL = ";
  const size_t at = r.out.find(label);
  ASSERT_NE(at, std::string::npos) << r.out;
  EXPECT_NEAR(std::stod(r.out.substr(at + label.size())), ppl, 1e-3 * ppl) << r.out;
}

TEST_F(CliCudaTest, EveryArmPrintsTheCpuBackendsTokens) {
  const std::string flags = "--tokens 1,2,3,4,5 -n 12 --slots 12";
  const ProcessResult cpu = Moegraph("run", fixture_path(), "cpu", flags);
  ASSERT_EQ(cpu.exit_code, 0) << cpu.err;
  const std::vector<int32_t> want = IdsAfter(cpu.out, "generated");
  ASSERT_EQ(want.size(), 12u) << cpu.out;
  for (const std::string arm : {"graph", "eager", "host", "stage", "resident"}) {
    const ProcessResult cuda = Moegraph("run", fixture_path(), "cuda", flags + " --arm " + arm);
    ASSERT_EQ(cuda.exit_code, 0) << arm << ": " << cuda.err;
    EXPECT_EQ(IdsAfter(cuda.out, "generated"), want) << arm << ":\n" << cuda.out;
    EXPECT_TRUE(testing_util::Contains(cuda.out, "backend cuda (arm " + arm + ")"));
    EXPECT_TRUE(testing_util::Contains(cuda.out, "prompts: 5 tokens in 1 ubatch (")) << arm << ":\n"
                                                                                     << cuda.out;
    EXPECT_TRUE(testing_util::Contains(cuda.out, "0 as T=1 steps")) << arm << ":\n" << cuda.out;
  }
  // MOEGRAPH_PREFILL=steps: the T=1 prompt, the same tokens.
  ASSERT_EQ(setenv("MOEGRAPH_PREFILL", "steps", 1), 0);  // the child inherits it
  const ProcessResult steps = Moegraph("run", fixture_path(), "cuda", flags);
  unsetenv("MOEGRAPH_PREFILL");
  ASSERT_EQ(steps.exit_code, 0) << steps.err;
  EXPECT_EQ(IdsAfter(steps.out, "generated"), want);
  EXPECT_TRUE(testing_util::Contains(steps.out, "prompts: 0 tokens in 0 ubatches")) << steps.out;
  EXPECT_TRUE(testing_util::Contains(steps.out, "5 as T=1 steps")) << steps.out;
  // S = 4 steps per graph launch: the same tokens.
  const ProcessResult batched =
      Moegraph("run", fixture_path(), "cuda", flags + " --steps-per-launch 4");
  ASSERT_EQ(batched.exit_code, 0) << batched.err;
  EXPECT_EQ(IdsAfter(batched.out, "generated"), want);

  // Sampled with one seed: the device draws the CPU backend's tokens.
  const std::string sampled = flags + " --temp 1.3 --top-k 30 --top-p 0.97 --seed 4";
  const ProcessResult cpu_sampled = Moegraph("run", fixture_path(), "cpu", sampled);
  ASSERT_EQ(cpu_sampled.exit_code, 0) << cpu_sampled.err;
  const ProcessResult cuda_sampled =
      Moegraph("run", fixture_path(), "cuda", sampled + " --steps-per-launch 3");
  ASSERT_EQ(cuda_sampled.exit_code, 0) << cuda_sampled.err;
  EXPECT_EQ(IdsAfter(cuda_sampled.out, "generated"), IdsAfter(cpu_sampled.out, "generated"));
  EXPECT_NE(IdsAfter(cpu_sampled.out, "generated"), want);  // not the greedy tokens
}

// The turns' lines of a chat's stderr, without their rates.
std::vector<std::string> TurnLines(const std::string& err) {
  std::vector<std::string> out;
  std::istringstream lines(err);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind("turn ", 0) == 0) out.push_back(line.substr(0, line.find(';')));
  }
  return out;
}

// Three turns of `moegraph chat -m fixture -n 5` on the CPU and on the device
// (cuda_flags added): the same replies, the same prefills at the same positions.
void ExpectTheDevicesChatIsTheCpus(const std::string& fixture,
                                   const std::vector<std::string>& cuda_flags) {
  const std::string input = "first message\nsecond one\nand a third\n";
  const std::vector<std::string> args = {MOEGRAPH_BIN, "chat", "-m",    fixture,
                                         "-n",         "5",    "--ctx", "256"};
  std::vector<std::string> cpu_args = args, cuda_args = args;
  cpu_args.insert(cpu_args.end(), {"--backend", "cpu"});
  cuda_args.insert(cuda_args.end(), {"--backend", "cuda"});
  cuda_args.insert(cuda_args.end(), cuda_flags.begin(), cuda_flags.end());
  const ProcessResult cpu = testing_util::RunProcess(cpu_args, input);
  ASSERT_EQ(cpu.exit_code, 0) << cpu.err;
  const ProcessResult cuda = testing_util::RunProcess(cuda_args, input);
  ASSERT_EQ(cuda.exit_code, 0) << cuda.err;
  EXPECT_EQ(cuda.out, cpu.out);
  const std::vector<std::string> turns = TurnLines(cpu.err);
  ASSERT_EQ(turns.size(), 3u) << cpu.err;
  EXPECT_EQ(TurnLines(cuda.err), turns) << cuda.err;
}

// A chat on the device keeps its KV cache between turns as the CPU backend does
// (two steps a graph launch).
TEST_F(CliCudaTest, ChatContinuesOnTheDeviceAsOnTheCpu) {
  ExpectTheDevicesChatIsTheCpus(fixture_path(), {"--steps-per-launch", "2"});
}

// qwen35moe (Gated DeltaNet layers around gated attention ones, f32): a chat on
// the device carries the layers' state between turns (the CPU backend from
// its checkpoints, the device from where it ended).
TEST_F(CliCudaTest, AQwen35ChatKeepsItsStateOnTheDeviceAsOnTheCpu) {
  const std::string fixture = TempPath("cli_cuda_qwen35.gguf");
  const ProcessResult made = testing_util::RunProcess(
      {MOEGRAPH_BIN, "make-fixture", "--arch", "qwen35moe", "--layers", "4",
       "--full-attn-interval", "2", "--experts", "16", "--top-k", "4", "--ssm-head-dim", "32",
       "--quant", "f32", "--seed", "7", "-o", fixture},
      "");
  ASSERT_EQ(made.exit_code, 0) << made.err;
  ExpectTheDevicesChatIsTheCpus(fixture, {});
  std::filesystem::remove(fixture);
}

TEST_F(CliCudaTest, BenchOnOneRoutingTraceCountsWhatTheCpuBackendCounts) {
  const std::string trace = TempPath("cli_cuda_routing.mgtr");
  const ProcessResult record =
      Moegraph("bench", fixture_path(), "cpu",
               "--arms graph --slots 12 -p 0 -n 8 -r 1 --record-routing " + trace);
  ASSERT_EQ(record.exit_code, 0) << record.err;

  const std::string flags =
      "--arms graph,host,stage --slots 12 -p 4 -n 8 -r 1 -o json --routing-trace " + trace;
  const ProcessResult cpu = Moegraph("bench", fixture_path(), "cpu", flags);
  const ProcessResult cuda = Moegraph("bench", fixture_path(), "cuda", flags);
  ASSERT_EQ(cpu.exit_code, 0) << cpu.err;
  ASSERT_EQ(cuda.exit_code, 0) << cuda.err;
  const std::vector<std::map<std::string, std::string>> want = BenchJsonRows(cpu.out);
  const std::vector<std::map<std::string, std::string>> got = BenchJsonRows(cuda.out);
  ASSERT_EQ(want.size(), 6u) << cpu.out;  // 3 arms x (pp4, tg8)
  ASSERT_EQ(got.size(), want.size()) << cuda.out;
  for (size_t i = 0; i < got.size(); ++i) {
    const std::string row = got[i].at("arm") + " " + got[i].at("test");
    EXPECT_EQ(got[i].at("backend"), CudaDeviceIsEmulated() ? "\"cuda-emulator\"" : "\"cuda\"");
    EXPECT_EQ(row, want[i].at("arm") + " " + want[i].at("test"));
    EXPECT_EQ(got[i].at("hits"), want[i].at("hits")) << row;
    EXPECT_EQ(got[i].at("misses"), want[i].at("misses")) << row;
    EXPECT_EQ(got[i].at("mib_staged_per_token"), want[i].at("mib_staged_per_token")) << row;
  }
  // tg8 runs 8 steps: one host sync per step in the graph arm, one per MoE layer
  // and the step's own in the host arm, and one more for the generated tokens.
  ASSERT_EQ(got[1].at("arm") + got[1].at("test"), "\"graph\"\"tg8\"");
  EXPECT_DOUBLE_EQ(std::stod(got[1].at("host_syncs_per_token")), (8 + 1) / 8.0);
  ASSERT_EQ(got[3].at("arm") + got[3].at("test"), "\"host\"\"tg8\"");
  EXPECT_DOUBLE_EQ(std::stod(got[3].at("host_syncs_per_token")), (8 * (kLayers + 1) + 1) / 8.0);
  if (CudaDeviceIsEmulated()) {
    EXPECT_TRUE(testing_util::Contains(cuda.err, "runs on the CPU emulator"));
  }
  std::remove(trace.c_str());
}

// moegraph serve on the device: each request samples with its own settings
// (one upload to the buffer the captured sampling kernel reads), its text equal
// to `moegraph run`'s on the CPU backend with those flags (and the device's
// f32 KV cache: the CPU's default f16 one moves the logits enough to change a
// draw); the second request prefills only what follows the KV prefix the first
// left on the device. Logprobs are refused by name (the CPU backend scores).
TEST_F(CliCudaTest, ServeSamplesEachRequestWithItsOwnSettings) {
  using nlohmann::json;
  const std::string tokenizer_json = testing_util::Qwen3TokenizerJson(MOEGRAPH_SOURCE_DIR);
  if (!std::filesystem::exists(tokenizer_json)) {
    GTEST_SKIP() << tokenizer_json
                 << " is missing: tools/fetch-vocab.sh fetches it (make deps does)";
  }
  const std::string fixture = TempPath("cli_cuda_serve.gguf");
  const ProcessResult made = testing_util::MakeVocabFixture(MOEGRAPH_BIN, tokenizer_json, fixture);
  ASSERT_EQ(made.exit_code, 0) << made.err;
  const std::string prompt = "Hello there";
  // run's text, with bytes that are not UTF-8 as U+FFFD, as JSON carries it.
  const auto run_text = [&](const std::string& flags) {
    const ProcessResult r = RunProcessWithArgs(
        {MOEGRAPH_BIN, "run", "-m", fixture, "--backend", "cpu", "--kv-type", "f32", "-p", prompt},
        flags);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    const std::string text = r.out.substr(0, r.out.size() - 1);  // less run's newline
    return json::parse(json(text).dump(-1, ' ', false, json::error_handler_t::replace))
        .get<std::string>();
  };
  const std::string sampled = run_text("-n 3 --temp 0.9 --seed 3");
  const std::string greedy = run_text("-n 3 --temp 0");
  ASSERT_NE(sampled, greedy);

  testing_util::ServeProcess server(MOEGRAPH_BIN);
  const int port =
      server.Start({"-m", fixture, "--backend", "cuda", "--ctx", "64", "--kv-type", "f32"});
  ASSERT_GT(port, 0) << server.Log();
  httplib::Client client("127.0.0.1", port);
  client.set_read_timeout(600, 0);
  for (const auto& [body, want] :
       {std::pair{json{{"prompt", prompt}, {"max_tokens", 3}, {"temperature", 0.9}, {"seed", 3}},
                  sampled},
        std::pair{json{{"prompt", prompt}, {"max_tokens", 3}, {"temperature", 0}}, greedy}}) {
    const httplib::Result r = client.Post("/v1/completions", body.dump(), "application/json");
    ASSERT_TRUE(r) << server.Log();
    ASSERT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(json::parse(r->body)["choices"][0]["text"], want) << body.dump();
  }
  // The CUDA engine keeps no prompt positions' logits: logprobs are refused by
  // name; an echo alone needs none.
  const httplib::Result scored = client.Post(
      "/v1/completions", json{{"prompt", prompt}, {"max_tokens", 1}, {"logprobs", 1}}.dump(),
      "application/json");
  ASSERT_TRUE(scored) << server.Log();
  EXPECT_EQ(scored->status, 400) << scored->body;
  EXPECT_EQ(json::parse(scored->body)["error"]["param"], "logprobs") << scored->body;
  EXPECT_TRUE(testing_util::Contains(scored->body, "--backend cpu")) << scored->body;
  const httplib::Result echo = client.Post(
      "/v1/completions", json{{"prompt", prompt}, {"max_tokens", 0}, {"echo", true}}.dump(),
      "application/json");
  ASSERT_TRUE(echo) << server.Log();
  EXPECT_EQ(json::parse(echo->body)["choices"][0]["text"], prompt) << echo->body;
  EXPECT_EQ(server.Stop(SIGTERM), 0) << server.Log();
  std::smatch m;
  const std::string log = server.Log();
  ASSERT_TRUE(
      std::regex_search(log, m, std::regex(R"(cmpl-2: prompt (\d+) tokens \((\d+) cached\))")))
      << log;
  EXPECT_EQ(std::stoi(m[2]), std::stoi(m[1]) - 1) << log;
  std::remove(fixture.c_str());
}

}  // namespace
}  // namespace moegraph
