#include "tools/cli/decoder.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <optional>
#include <random>
#include <string_view>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cpu/simd_kernels.h"
#include "cpu/thread_pool.h"
#include "loader/status_util.h"
#include "residency/simulator.h"
#include "tools/cli/commands.h"

ABSL_FLAG(std::string, backend, "auto",
          "run, chat, serve, bench: cpu | cuda | auto (auto: cuda when a device exists, else cpu)");
ABSL_FLAG(
    std::string, arm, "",
    "run, chat, serve: resident | graph | eager | host | stage (the doors' twin; a door set in "
    "the environment wins)");
ABSL_FLAG(
    int32_t, steps_per_launch, 1,
    "run, chat, serve, bench: decode steps captured in one CUDA graph (the host waits once per "
    "launch)");
ABSL_FLAG(float, temp, 0.0f,
          "run, chat, serve: sampling temperature; 0 is greedy decoding (the argmax), > 0 samples "
          "after --top-k, --top-p and --min-p");
ABSL_FLAG(float, top_p, 0.95f,
          "run, chat, serve: sampling keeps the most likely tokens holding this share of the "
          "probability (1: off)");
ABSL_FLAG(
    float, min_p, 0.05f,
    "run, chat, serve: sampling drops tokens less likely than this share of the most likely one "
    "(0: off)");

ABSL_FLAG(int32_t, t, 0, "run, chat, serve, bench: CPU backend threads (0: the physical cores)");
ABSL_FLAG(std::string, kv_type, "f16",
          "run, chat, serve, bench: the CPU backend's KV cache element type, f16 or f32");

namespace moegraph {
namespace {

std::string Rate(int tokens, double seconds) {
  return tokens > 0 && seconds > 0 ? absl::StrFormat("%.2f tok/s", tokens / seconds) : "n/a";
}

double Mib(uint64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

// The process's peak resident set (getrusage's ru_maxrss, in KiB on Linux).
uint64_t PeakRssBytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<uint64_t>(usage.ru_maxrss) * 1024;
}

// The sampler's settings from --temp, --top-k, --top-p, --min-p and --seed (a
// random seed when unset, so the banner can print it).
absl::StatusOr<SamplingParams> ReadSampling() {
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

// --slots N | auto (the default); 0 means auto.
absl::StatusOr<int32_t> ReadSlots() {
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

// One line: the policy and the slot arithmetic of every size class, or where
// a resident backend reads its experts.
std::string Banner(const CpuBackend& backend, const ExpertStore* store,
                   const CpuBackendOptions& options) {
  if (options.resident) {
    return "backend cpu: resident, every expert read in place from the model file (no copy; "
           "--slots N for a cache of N host slots)";
  }
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
                         Mib(pool_bytes), Mib(store->total_bytes()));
}

}  // namespace

std::string DescribeSampling(const SamplingParams& p) {
  if (sample_is_greedy(p.temperature)) return "sampling: greedy (--temp 0)";
  return absl::StrFormat("sampling: temp %.2f, top-k %d, top-p %.2f, min-p %.2f, seed %d",
                         p.temperature, p.top_k, p.top_p, p.min_p, p.seed);
}

absl::StatusOr<bool> BackendIsCuda() {
  const std::string backend = absl::GetFlag(FLAGS_backend);
  if (backend != "cpu" && backend != "cuda" && backend != "auto") {
    return absl::InvalidArgumentError(
        absl::StrFormat("--backend '%s' is not one of cpu, cuda, auto", backend));
  }
  const bool cuda = backend != "cpu" && CudaDeviceCount() > 0;
  if (backend == "cuda" && !cuda) {
    return absl::FailedPreconditionError(
        absl::StrCat("--backend cuda: no CUDA device is available (", NoCudaDeviceReason(), ")"));
  }
  return cuda;
}

absl::StatusOr<CpuForwardOptions> ReadCpuFlags() {
  CpuForwardOptions options;
  options.threads = absl::GetFlag(FLAGS_t);
  if (options.threads < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "-t %d: threads must be positive (0: the physical cores)", options.threads));
  }
  const std::string kv = absl::GetFlag(FLAGS_kv_type);
  if (kv == "f16") {
    options.kv_type = KvCacheType::kF16;
  } else if (kv == "f32") {
    options.kv_type = KvCacheType::kF32;
  } else {
    return absl::InvalidArgumentError(absl::StrFormat("--kv-type '%s' is not f16 or f32", kv));
  }
  return options;
}

absl::StatusOr<DecoderFlags> ReadDecoderFlags() {
  DecoderFlags flags;
  MG_ASSIGN_OR_RETURN(flags.cpu, ReadCpuFlags());
  MG_ASSIGN_OR_RETURN(flags.cuda, BackendIsCuda());
  flags.steps_per_launch = absl::GetFlag(FLAGS_steps_per_launch);
  if (flags.steps_per_launch < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--steps-per-launch %d must be at least 1", flags.steps_per_launch));
  }
  std::optional<Arm> arm;
  if (const std::string text = absl::GetFlag(FLAGS_arm); !text.empty()) {
    MG_ASSIGN_OR_RETURN(arm, ParseArm(text));
  }
  MG_ASSIGN_OR_RETURN(flags.doors, ResolveDoors(arm, ProcessEnv()));
  MG_ASSIGN_OR_RETURN(flags.slots, ReadSlots());
  MG_ASSIGN_OR_RETURN(flags.sampling, ReadSampling());
  return flags;
}

absl::StatusOr<std::unique_ptr<Decoder>> Decoder::Create(const Model& model,
                                                         const DecoderFlags& flags, int max_ctx,
                                                         std::FILE* info) {
  auto d = std::unique_ptr<Decoder>(new Decoder());
  d->sampling_ = flags.sampling;
  if (flags.cuda) {
    CudaEngineOptions options;
    options.sampling = flags.sampling;
    options.max_ctx = max_ctx;
    options.n_slots = flags.slots;
    options.doors = flags.doors.doors;
    options.steps_per_launch = flags.steps_per_launch;
    MG_ASSIGN_OR_RETURN(d->cuda_, CudaEngine::Create(model, options, TerminalProgress()));
    std::fprintf(info, "%s\n", d->cuda_->banner().c_str());
    return d;
  }
  // The CPU backend, with the doors mapped where they mean something on the host.
  CpuBackendOptions options;
  options.max_ctx = max_ctx;
  options.n_slots = flags.slots;
  options.policy = flags.doors.doors.policy;
  options.protected_frac = flags.doors.doors.protected_frac;
  options.cache = flags.doors.doors.moe_cache;
  options.fast = flags.cpu;
  // Slots copy experts the host already holds: they mean something only as a
  // cache smaller than the experts, so --slots auto is resident too.
  options.resident =
      flags.doors.arm == Arm::kResident || (flags.slots == 0 && flags.doors.doors.moe_cache);
  switch (flags.doors.arm) {
    case Arm::kResident:
      if (flags.slots != 0) std::fprintf(info, "backend cpu: arm resident ignores --slots\n");
      break;
    case Arm::kEager:
    case Arm::kHost:
      std::fprintf(info, "backend cpu: arm %s runs the CPU pipeline (no device, no graph)\n",
                   std::string(ArmName(flags.doors.arm)).c_str());
      break;
    case Arm::kGraph:
    case Arm::kStage:
      break;
  }
  if (flags.steps_per_launch != 1) {
    std::fprintf(info, "backend cpu: --steps-per-launch applies to CUDA graphs only\n");
  }
  if (!options.resident) {
    MG_ASSIGN_OR_RETURN(ExpertStore store,
                        ExpertStore::Create(model, AlignedHostAllocator(), TerminalProgress()));
    d->store_ = std::make_unique<ExpertStore>(std::move(store));
  }
  MG_ASSIGN_OR_RETURN(d->cpu_, CpuBackend::Create(model, d->store_.get(), options));
  d->file_bytes_ = model.file->file_size();
  d->kv_bytes_ = KvCacheBytes(model.config, max_ctx, options.fast.kv_type);
  std::fprintf(info, "%s\n", Banner(*d->cpu_, d->store_.get(), options).c_str());
  std::fprintf(info, "backend cpu: %d threads, SIMD %s, KV cache %s; a prompt runs %s\n",
               options.fast.threads > 0 ? options.fast.threads : PhysicalCores(),
               SimdTargetName().c_str(), options.fast.kv_type == KvCacheType::kF16 ? "f16" : "f32",
               d->cpu_->BatchesPrompts() ? "as one batch" : "token by token (slots < experts)");
  return d;
}

Decoder::~Decoder() = default;

absl::StatusOr<std::vector<int32_t>> Decoder::Generate(absl::Span<const int32_t> prompt,
                                                       int n_predict, int start,
                                                       GenerateStats* stats,
                                                       const TokenSink& sink) {
  if (cuda_ != nullptr) return cuda_->Generate(prompt, n_predict, stats, sink, start);
  if (start > cpu_->n_past()) {
    return absl::InternalError(absl::StrFormat(
        "backend cpu: cannot continue at position %d: it holds %d", start, cpu_->n_past()));
  }
  cpu_->Truncate(start);
  return cpu_->Generate(prompt, n_predict, stats, sink, sampling_);
}

absl::Status Decoder::SetSampling(const SamplingParams& sampling) {
  if (cuda_ != nullptr) MG_RETURN_IF_ERROR(cuda_->SetSampling(sampling));
  sampling_ = sampling;
  return absl::OkStatus();
}

absl::StatusOr<EngineCounters> Decoder::ExpertCounters() {
  if (cuda_ != nullptr) return cuda_->ReadCounters();
  return cpu_->counters();
}

absl::StatusOr<std::vector<std::pair<std::string, double>>> Decoder::Counters() {
  MG_ASSIGN_OR_RETURN(const EngineCounters c, ExpertCounters());
  std::vector<std::pair<std::string, double>> out;
  if (cuda_ != nullptr) {
    out.push_back(
        {"graph_launches_total", static_cast<double>(cuda_->host_counters().graph_launches)});
    out.push_back({"host_syncs_total", static_cast<double>(cuda_->host_counters().host_syncs)});
  } else {
    out.push_back({"graph_launches_total", 0.0});
    out.push_back({"host_syncs_total", 0.0});
  }
  out.push_back({"steps_total", static_cast<double>(c.steps)});
  out.push_back({"expert_hits_total", static_cast<double>(c.hits)});
  out.push_back({"expert_misses_total", static_cast<double>(c.misses)});
  out.push_back({"expert_evictions_total", static_cast<double>(c.evictions)});
  out.push_back({"bytes_staged_total", static_cast<double>(c.bytes_staged)});
  return out;
}

absl::Status Decoder::PrintSummary(std::FILE* out, const GenerateStats& stats, size_t generated) {
  MG_ASSIGN_OR_RETURN(const EngineCounters c, ExpertCounters());
  const std::string backend =
      cuda_ == nullptr ? "backend cpu"
                       : absl::StrCat("backend cuda (arm ", Av(ArmName(cuda_->arm())), ")");
  const uint64_t selected = c.hits + c.misses;
  std::string memory = absl::StrFormat("peak RSS %.0f MiB", Mib(PeakRssBytes()));
  if (cuda_ == nullptr) {
    absl::StrAppendFormat(&memory, " (file %.0f MiB, KV cache %.0f MiB)", Mib(file_bytes_),
                          Mib(kv_bytes_));
  }
  absl::FPrintF(
      out,
      "%s: %d tokens (%d prompt, %s; %d generated, %s); hit %.1f%%, %d misses, "
      "%d evictions, %.2f MiB staged; %s\n",
      backend, c.steps, stats.prompt_tokens, Rate(stats.prompt_tokens, stats.prompt_seconds),
      generated, Rate(stats.decode_steps, stats.decode_seconds),
      selected > 0 ? 100.0 * static_cast<double>(c.hits) / static_cast<double>(selected) : 0.0,
      c.misses, c.evictions, Mib(c.bytes_staged), memory);
  return absl::OkStatus();
}

}  // namespace moegraph
