// moegraph run: decode of a text prompt (-p, -f), printed as text while it is
// generated, or of token ids (--tokens), printed as ids, with tok/s; greedy, or
// sampled with llama.cpp's flags (--temp, --top-k, --top-p, --min-p, --seed). The CUDA
// engine (capture/engine.h) runs each step as one graph replay with experts in
// pinned host memory; the CPU backend runs the same expert path on the host:
// experts repacked into blocks, a residency cache of slots, one T=1 step per token.
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "capture/doors.h"
#include "capture/engine.h"
#include "loader/gguf.h"
#include "loader/model_config.h"
#include "loader/placement.h"
#include "loader/status_util.h"
#include "reference/cpu_backend.h"
#include "residency/simulator.h"
#include "text/tokenizer.h"
#include "text/vocab.h"
#include "tools/commands.h"

// Shared with simulate (a list there); run takes one count or auto.

ABSL_FLAG(std::string, tokens, "",
          "run: prompt token ids, comma-separated (e.g. 1,2,3), instead of -p/-f text; the "
          "output is ids too");
ABSL_FLAG(int32_t, n, moegraph::kDefaultTokensFlag,
          "tokens to generate (default: run 16, bench 128)");
ABSL_FLAG(std::string, backend, "auto",
          "run: cpu | cuda | auto (auto: cuda when a device exists, else cpu)");
ABSL_FLAG(std::string, arm, "",
          "run: resident | graph | eager | host | stage (the doors' twin; a door set in the "
          "environment wins)");
ABSL_FLAG(int32_t, steps_per_launch, 1,
          "run: decode steps captured in one CUDA graph (the host waits once per launch)");
ABSL_FLAG(bool, ignore_eos, false,
          "run: with -p/-f, go on past end-of-generation tokens (EOS, EOT, <|im_end|>, ...)");
ABSL_FLAG(bool, special, false, "run: with -p/-f, print control tokens' text too");
ABSL_FLAG(float, temp, 0.0f,
          "run: sampling temperature; 0 is greedy decoding (the argmax), > 0 samples after "
          "--top-k, --top-p and --min-p");
ABSL_FLAG(float, top_p, 0.95f,
          "run: sampling keeps the most likely tokens holding this share of the probability "
          "(1: off)");
ABSL_FLAG(float, min_p, 0.05f,
          "run: sampling drops tokens less likely than this share of the most likely one (0: off)");

namespace moegraph {
namespace {

absl::StatusOr<std::vector<int32_t>> ParseTokens(const std::string& text) {
  std::vector<int32_t> ids;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &id)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--tokens '%s': '%s' is not a token id", text, std::string(part)));
    }
    ids.push_back(id);
  }
  return ids;
}

std::string Rate(int tokens, double seconds) {
  return tokens > 0 && seconds > 0 ? absl::StrFormat("%.2f tok/s", tokens / seconds) : "n/a";
}

double Mib(uint64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

// The sampler's settings from --temp, --top-k, --top-p, --min-p and --seed (a
// random seed when unset, so the banner can print it).
absl::StatusOr<SamplingParams> ParseSampling() {
  SamplingParams p;
  p.temperature = absl::GetFlag(FLAGS_temp);
  const int32_t top_k = absl::GetFlag(FLAGS_top_k);
  p.top_k = top_k == kUnsetFlag ? 40 : top_k;
  p.top_p = absl::GetFlag(FLAGS_top_p);
  p.min_p = absl::GetFlag(FLAGS_min_p);
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--temp %g must be 0 (greedy) or positive", p.temperature));
  }
  if (p.top_k < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--top-k %d must be 0 (off) or positive", p.top_k));
  }
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrFormat("--top-p %g must be in (0, 1]", p.top_p));
  }
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrFormat("--min-p %g must be in [0, 1]", p.min_p));
  }
  const int64_t seed = absl::GetFlag(FLAGS_seed);
  if (seed < kUnsetFlag) {
    return absl::InvalidArgumentError(absl::StrFormat("--seed %d is negative", seed));
  }
  p.seed = seed == kUnsetFlag ? std::random_device{}() : static_cast<uint64_t>(seed);
  return p;
}

std::string DescribeSampling(const SamplingParams& p) {
  if (sample_is_greedy(p.temperature)) return "sampling: greedy (--temp 0)";
  return absl::StrFormat("sampling: temp %.2f, top-k %d, top-p %.2f, min-p %.2f, seed %d",
                         p.temperature, p.top_k, p.top_p, p.min_p, p.seed);
}

// --slots N | auto (the default); 0 means auto.
absl::StatusOr<int32_t> ParseSlots() {
  const std::string text = absl::GetFlag(FLAGS_slots);
  if (text.empty() || text == "auto") return 0;
  int32_t n = 0;
  if (!absl::SimpleAtoi(text, &n) || n < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--slots '%s' is not a positive slot count or auto", text));
  }
  return n;
}

// A \r-rewritten line on stderr while the experts load, only on a terminal.
LoadProgressFn TerminalProgress() {
  if (isatty(STDERR_FILENO) == 0) return nullptr;
  return [last_print = -1.0](uint64_t done, uint64_t total, double seconds) mutable {
    if (done < total && seconds - last_print < 0.1) return;
    last_print = seconds;
    std::fprintf(stderr, "\rloading experts: %.1f / %.1f MiB (%.0f MiB/s)", Mib(done), Mib(total),
                 seconds > 0 ? Mib(done) / seconds : 0.0);
    if (done == total) std::fputc('\n', stderr);
  };
}

// One line: the policy and the slot arithmetic of every size class.
std::string Banner(const CpuBackend& backend, const ExpertStore& store,
                   const CpuBackendOptions& options) {
  int32_t slots = 0;
  uint64_t pool_bytes = 0;
  std::string classes;
  for (size_t c = 0; c < backend.pools().size(); ++c) {
    const SlotPoolInfo& pool = backend.pools()[c];
    absl::StrAppendFormat(&classes, "; class %d: %d layers, %d slots x %.3f MiB = %.2f MiB", c,
                          pool.layers.size(), pool.n_slots, Mib(pool.block_bytes),
                          Mib(pool.pool_bytes()));
    slots += pool.n_slots;
    pool_bytes += pool.pool_bytes();
  }
  const std::string policy = !options.cache
                                 ? std::string("no cache (MOEGRAPH_MOE_CACHE=0)")
                                 : DescribePolicy(options.policy, options.protected_frac);
  return absl::StrFormat("backend cpu: %s, %s pool, %d slots%s%s; pool %.2f MiB, experts %.2f MiB",
                         policy, Av(PoolModeName(options.pool_mode)), slots,
                         options.cache && options.n_slots == 0 ? " (auto)" : "", classes,
                         Mib(pool_bytes), Mib(store.total_bytes()));
}

// Where a run's lines go, and what happens to each generated token.
struct RunOutput {
  std::FILE* info = stdout;  // banner, notes, summary: stdout with --tokens, stderr with text
  bool print_ids = true;     // --tokens: the "prompt:" and "generated:" lines
  TokenSink sink;            // text: print each token as it comes; stop at EOG
};

// The one summary line of a run.
void PrintSummary(std::FILE* out, std::string_view backend, const EngineCounters& c,
                  const GenerateStats& stats, size_t generated) {
  const uint64_t selected = c.hits + c.misses;
  absl::FPrintF(
      out,
      "%s: %d tokens (%d prompt, %s; %d generated, %s); hit %.1f%%, %d misses, "
      "%d evictions, %.2f MiB staged\n",
      Av(backend), c.steps, stats.prompt_tokens, Rate(stats.prompt_tokens, stats.prompt_seconds),
      generated, Rate(stats.decode_steps, stats.decode_seconds),
      selected > 0 ? 100.0 * static_cast<double>(c.hits) / static_cast<double>(selected) : 0.0,
      c.misses, c.evictions, Mib(c.bytes_staged));
}

void PrintTokens(const std::vector<int32_t>& prompt, const std::vector<int32_t>& generated) {
  std::printf("prompt: %s\n", absl::StrJoin(prompt, " ").c_str());
  std::printf("generated: %s\n", absl::StrJoin(generated, " ").c_str());
}

// The CPU backend with the doors mapped where they mean something on the host.
absl::Status RunCpu(const Model& model, const std::vector<int32_t>& prompt, int n_predict, int ctx,
                    int32_t slots, const ResolvedDoors& doors, const SamplingParams& sampling,
                    const RunOutput& out) {
  CpuBackendOptions options;
  options.max_ctx = ctx;
  options.n_slots = slots;
  options.policy = doors.doors.policy;
  options.protected_frac = doors.doors.protected_frac;
  options.cache = doors.doors.moe_cache;
  switch (doors.arm) {
    case Arm::kResident:
      options.n_slots = 0;
      std::fprintf(out.info, "backend cpu: arm resident holds every expert in a slot%s\n",
                   slots != 0 ? " (--slots ignored)" : "");
      break;
    case Arm::kEager:
    case Arm::kHost:
      std::fprintf(out.info, "backend cpu: arm %s runs the CPU pipeline (no device, no graph)\n",
                   std::string(ArmName(doors.arm)).c_str());
      break;
    case Arm::kGraph:
    case Arm::kStage:
      break;
  }
  if (absl::GetFlag(FLAGS_steps_per_launch) != 1) {
    std::fprintf(out.info, "backend cpu: --steps-per-launch applies to CUDA graphs only\n");
  }
  MG_ASSIGN_OR_RETURN(ExpertStore store,
                      ExpertStore::Create(model, AlignedHostAllocator(), TerminalProgress()));
  MG_ASSIGN_OR_RETURN(std::unique_ptr<CpuBackend> cpu, CpuBackend::Create(model, store, options));
  std::fprintf(out.info, "%s\n", Banner(*cpu, store, options).c_str());
  GenerateStats stats;
  MG_ASSIGN_OR_RETURN(std::vector<int32_t> generated,
                      cpu->Generate(prompt, n_predict, &stats, out.sink, sampling));
  if (out.print_ids) PrintTokens(prompt, generated);
  PrintSummary(out.info, "backend cpu", cpu->counters(), stats, generated.size());
  return absl::OkStatus();
}

absl::Status RunCuda(const Model& model, const std::vector<int32_t>& prompt, int n_predict, int ctx,
                     int32_t slots, const ResolvedDoors& doors, const SamplingParams& sampling,
                     const RunOutput& out) {
  CudaEngineOptions options;
  options.sampling = sampling;
  options.max_ctx = ctx;
  options.n_slots = slots;
  options.doors = doors.doors;
  options.steps_per_launch = absl::GetFlag(FLAGS_steps_per_launch);
  MG_ASSIGN_OR_RETURN(std::unique_ptr<CudaEngine> engine,
                      CudaEngine::Create(model, options, TerminalProgress()));
  std::fprintf(out.info, "%s\n", engine->banner().c_str());
  GenerateStats stats;
  MG_ASSIGN_OR_RETURN(std::vector<int32_t> generated,
                      engine->Generate(prompt, n_predict, &stats, out.sink));
  if (out.print_ids) PrintTokens(prompt, generated);
  MG_ASSIGN_OR_RETURN(const EngineCounters counters, engine->ReadCounters());
  PrintSummary(out.info, absl::StrCat("backend cuda (arm ", Av(ArmName(engine->arm())), ")"),
               counters, stats, generated.size());
  return absl::OkStatus();
}

// The prompt: token ids from --tokens, or text from -p or -f (exactly one).
struct PromptSource {
  std::vector<int32_t> ids;
  std::optional<std::string> text;
};

absl::StatusOr<PromptSource> ReadPromptSource() {
  const std::string tokens = absl::GetFlag(FLAGS_tokens);
  MG_ASSIGN_OR_RETURN(std::optional<std::string> text, PromptText());
  const bool has_tokens = !absl::StripAsciiWhitespace(tokens).empty();
  if (has_tokens == text.has_value()) {
    return absl::InvalidArgumentError(
        has_tokens ? "give the prompt once: -p TEXT, -f FILE or --tokens IDS"
                   : "a prompt is required: -p TEXT, -f FILE or --tokens IDS (e.g. 1,2,3)");
  }
  PromptSource source;
  if (has_tokens) {
    MG_ASSIGN_OR_RETURN(source.ids, ParseTokens(tokens));
  } else {
    source.text = std::move(text);
  }
  return source;
}

absl::Status Run() {
  const std::string path = absl::GetFlag(FLAGS_m);
  if (path.empty()) return absl::InvalidArgumentError("-m FILE is required");
  MG_ASSIGN_OR_RETURN(PromptSource source, ReadPromptSource());
  const int n_flag = absl::GetFlag(FLAGS_n);
  const int n_predict = n_flag == kDefaultTokensFlag ? kRunDefaultTokens : n_flag;
  if (n_predict < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("-n %d must not be negative", n_predict));
  }
  const std::string backend = absl::GetFlag(FLAGS_backend);
  if (backend != "cpu" && backend != "cuda" && backend != "auto") {
    return absl::InvalidArgumentError(
        absl::StrFormat("--backend '%s' is not one of cpu, cuda, auto", backend));
  }
  const bool has_device = backend != "cpu" && CudaDeviceCount() > 0;
  if (backend == "cuda" && !has_device) {
    return absl::FailedPreconditionError(
        absl::StrCat("--backend cuda: no CUDA device is available (", NoCudaDeviceReason(), ")"));
  }
  const int32_t steps_per_launch = absl::GetFlag(FLAGS_steps_per_launch);
  if (steps_per_launch < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--steps-per-launch %d must be at least 1", steps_per_launch));
  }
  std::optional<Arm> arm;
  if (const std::string text = absl::GetFlag(FLAGS_arm); !text.empty()) {
    MG_ASSIGN_OR_RETURN(arm, ParseArm(text));
  }
  MG_ASSIGN_OR_RETURN(const ResolvedDoors doors, ResolveDoors(arm, ProcessEnv()));
  MG_ASSIGN_OR_RETURN(const int32_t slots, ParseSlots());
  MG_ASSIGN_OR_RETURN(const SamplingParams sampling, ParseSampling());

  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  if (!file.ok()) return file.status();
  absl::StatusOr<Model> model = LoadModel(**file);
  if (!model.ok()) return model.status();

  // Text: the file's own tokenizer, specials parsed and BOS added as llama-cli does.
  std::unique_ptr<Tokenizer> tokenizer;
  std::vector<int32_t>& prompt = source.ids;
  if (source.text.has_value()) {
    MG_ASSIGN_OR_RETURN(Vocab vocab, Vocab::FromGguf(**file));
    MG_ASSIGN_OR_RETURN(tokenizer, Tokenizer::Create(std::move(vocab)));
    absl::StatusOr<std::vector<int32_t>> ids = tokenizer->Tokenize(*source.text, true, true);
    if (!ids.ok())
      return absl::InvalidArgumentError(absl::StrCat("-p/-f: ", ids.status().message()));
    if (ids->empty()) return absl::InvalidArgumentError("-p/-f: the prompt has no tokens");
    prompt = std::move(*ids);
  }
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= model->config.n_vocab) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--tokens: token %d (position %d) is outside the vocabulary [0, %d) of %s", prompt[i], i,
          model->config.n_vocab, path));
    }
  }
  // Generate feeds every generated token back but the last.
  const int needed = static_cast<int>(prompt.size()) + (n_predict > 0 ? n_predict - 1 : 0);
  int ctx = absl::GetFlag(FLAGS_ctx);
  if (ctx < 0 || (ctx > 0 && ctx < needed)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--ctx %d is too small: %d prompt tokens and %d generated need %d", ctx,
                        prompt.size(), n_predict, needed));
  }
  if (ctx == 0) ctx = needed;

  RunOutput out;
  TextStream stream;
  if (tokenizer != nullptr) {
    // The text goes to stdout as it comes, everything else to stderr.
    out.info = stderr;
    out.print_ids = false;
    const bool ignore_eos = absl::GetFlag(FLAGS_ignore_eos);
    const bool special = absl::GetFlag(FLAGS_special);
    out.sink = [&](int32_t token) {
      if (!ignore_eos && tokenizer->vocab().IsEog(token)) return false;
      const std::string text = stream.Push(tokenizer->Piece(token, special));
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fflush(stdout);
      return true;
    };
  }
  std::fprintf(out.info, "%s\n%s\n", doors.banner.c_str(), DescribeSampling(sampling).c_str());
  const absl::Status status =
      has_device ? RunCuda(*model, prompt, n_predict, ctx, slots, doors, sampling, out)
                 : RunCpu(*model, prompt, n_predict, ctx, slots, doors, sampling, out);
  if (tokenizer != nullptr) {
    const std::string rest = stream.Flush();
    std::fwrite(rest.data(), 1, rest.size(), stdout);
    std::fputc('\n', stdout);
  }
  return status;
}

}  // namespace

int RunRun(const std::vector<std::string>& args) { return RunModelCommand("run", args, Run); }

}  // namespace moegraph
