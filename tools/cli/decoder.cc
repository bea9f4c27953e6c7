#include "tools/cli/decoder.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <random>
#include <string_view>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cpu/simd_kernels.h"
#include "cpu/thread_pool.h"
#include "loader/host_memory.h"
#include "loader/placement.h"
#include "loader/status_util.h"
#include "residency/simulator.h"
#include "residency/trace.h"
#include "tools/cli/commands.h"

// What each flag means to each command: tools/cli/command_line.cc.
ABSL_FLAG(std::string, backend, "auto", "cpu | cuda | auto");
ABSL_FLAG(std::string, arm, "", "resident | graph | eager | host | stage");
ABSL_FLAG(int32_t, steps_per_launch, 1, "decode steps captured in one CUDA graph");
ABSL_FLAG(std::string, ub, "512", "prompt tokens per ubatch (bench: a list)");
ABSL_FLAG(bool, swa_full, false, "windowed layers keep every position's KV (no ring)");
ABSL_FLAG(float, temp, 0.0f, "sampling temperature (0: greedy)");
ABSL_FLAG(float, top_p, 0.95f, "sampling's top-p (1: off)");
ABSL_FLAG(float, min_p, 0.05f, "sampling's min-p (0: off)");
ABSL_FLAG(std::string, t, "", "CPU backend threads (empty or 0: the physical cores)");
ABSL_FLAG(std::string, kv_type, "f16", "the KV cache's element type, f16 or f32");
ABSL_FLAG(int32_t, n_cpu_moe, -1, "llama.cpp's --n-cpu-moe: layers whose experts stay on the host");
ABSL_FLAG(std::string, host_cache, "", "cpu: the disk tier's host cache, a size (8G, 512M)");
ABSL_FLAG(double, drop_cold_experts, 0.0,
          "cpu: skip a routed expert that is not cached and weighs under F / k (0: off)");
ABSL_FLAG(bool, drop_in_prompts, false, "cpu: --drop-cold-experts in prompts too");
ABSL_FLAG(int32_t, n_expert_used, 0, "experts a token, at most the model's top-k (0: its top-k)");
ABSL_FLAG(std::string, load_mode, "", "auto | none | mmap | mlock | mmap+mlock (llama.cpp's)");
ABSL_FLAG(bool, mmap, false, "llama.cpp's older --mmap: --load-mode mmap");
ABSL_FLAG(bool, no_mmap, false, "llama.cpp's older --no-mmap: --load-mode none");
ABSL_FLAG(bool, mlock, false,
          "llama.cpp's older --mlock: --load-mode mmap+mlock (mlock with --no-mmap)");

namespace moegraph {
namespace {

std::string Rate(int tokens, double seconds) {
  return tokens > 0 && seconds > 0 ? absl::StrFormat("%.2f tok/s", tokens / seconds) : "n/a";
}

double Mib(uint64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }
double Gib(uint64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0); }

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
  // llama.cpp: 40 unless given; 0 or below keeps every token.
  p.top_k = top_k == kUnsetTopK ? 40 : std::max(top_k, 0);
  p.top_p = absl::GetFlag(FLAGS_top_p);
  p.min_p = absl::GetFlag(FLAGS_min_p);
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--temp %g must be 0 (greedy) or positive", p.temperature));
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

// A \r-rewritten line on stderr while `what` loads (the model file, the
// experts), only on a terminal.
LoadProgressFn TerminalProgress(const std::string& what) {
  if (isatty(STDERR_FILENO) == 0) return nullptr;
  return [what, last_print = -1.0](uint64_t done, uint64_t total, double seconds) mutable {
    if (done < total && seconds - last_print < 0.1) return;
    last_print = seconds;
    std::fprintf(stderr, "\rloading %s: %.1f / %.1f MiB (%.0f MiB/s)", what.c_str(), Mib(done),
                 Mib(total), seconds > 0 ? Mib(done) / seconds : 0.0);
    if (done == total) std::fputc('\n', stderr);
  };
}

// The --load-mode value options stand for.
std::string LoadModeName(const LoadOptions& options) {
  switch (options.mode) {
    case LoadMode::kRead:
      return options.lock ? "mlock" : "none";
    case LoadMode::kMap:
      return options.lock ? "mmap+mlock" : "mmap";
    case LoadMode::kAuto:
      break;
  }
  return "auto";
}

// One line: the policy and the slot arithmetic of every size class, or where
// a resident backend reads its experts.
std::string Banner(const CpuBackend& backend, const ExpertStore* store,
                   const CpuBackendOptions& options) {
  if (options.resident) {
    return "backend cpu: resident, every expert read in place from the model's bytes (no slot "
           "copies; --slots N for a cache of N host slots)";
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

absl::StatusOr<int32_t> HostCacheSlots(const ExpertStore& store, const ModelConfig& config,
                                       uint64_t bytes) {
  size_t largest_block = 0;
  for (const SizeClass& c : store.size_classes()) {
    largest_block = std::max(largest_block, c.block_bytes);
  }
  if (largest_block == 0) {
    return absl::InvalidArgumentError("--host-cache: the model has no routed experts to cache");
  }
  const uint64_t all = static_cast<uint64_t>(config.n_moe_layer()) * config.n_expert;
  const uint64_t working_set = static_cast<uint64_t>(config.n_moe_layer()) * config.n_expert_used;
  const uint64_t fit = bytes / largest_block;
  if (fit < working_set) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--host-cache %.1f MiB holds %d experts of %.3f MiB, fewer than one token's working set "
        "(%d MoE layers x %d experts = %d, %.1f MiB): every expert would be read from disk "
        "every token",
        Mib(bytes), fit, Mib(largest_block), config.n_moe_layer(), config.n_expert_used,
        working_set, Mib(working_set * largest_block)));
  }
  return static_cast<int32_t>(std::min(fit, all));
}

absl::Status CheckHostCache(const Model& model, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  MG_ASSIGN_OR_RETURN(const ExpertStore store, ExpertStore::Layouts(model));
  return HostCacheSlots(store, model.config, bytes).status();
}

std::string HumanSize(uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  return b >= 1073741824.0 ? absl::StrFormat("%.2f GiB", b / 1073741824.0)
                           : absl::StrFormat("%.2f MiB", Mib(bytes));
}

absl::Status AutoHostCache(const Model& model, int ctx, DecoderFlags* flags, std::FILE* info) {
  if (flags->cuda || flags->host_cache_bytes > 0 || flags->slots != 0 || flags->n_cpu_moe >= 0 ||
      flags->doors.arm == Arm::kResident || !flags->doors.doors.moe_cache ||
      flags->load.mode != LoadMode::kAuto || model.config.n_expert == 0) {
    return absl::OkStatus();
  }
  const uint64_t available = HostMemoryAvailable();
  const uint64_t tensors = model.file->total_data_bytes();
  if (available == 0 || tensors + kHostMemoryRailBytes <= available) return absl::OkStatus();
  MG_ASSIGN_OR_RETURN(const ExpertStore store, ExpertStore::Layouts(model));
  const ModelConfig& cfg = model.config;
  const uint64_t experts = store.total_bytes();
  const uint64_t kv = KvCacheBytes(cfg, ctx, flags->cpu.kv_type, flags->cpu.ring_slack()) +
                      RecurrentStateBytes(cfg) * (1 + kStateCheckpoints);
  const uint64_t rest = tensors - experts + kv + kHostMemoryRailBytes;
  const uint64_t budget = available > rest ? available - rest : 0;
  const std::string arithmetic = absl::StrFormat(
      "%s available (%s, MemAvailable or the memory cgroup's room) - %s of other tensors - "
      "%s of KV cache and state - a 1 GiB rail = %s",
      HumanSize(available), std::string(kMemAvailableVar), HumanSize(tensors - experts),
      HumanSize(kv), HumanSize(budget));
  // Either way the file is mapped, its pages faulted in as used, not read.
  flags->load.mode = LoadMode::kMap;
  flags->load.fault_in = false;
  if (!HostCacheSlots(store, cfg, budget).ok()) {
    std::fprintf(info,
                 "host cache: off: the file's %s of tensors do not fit, but %s for experts is "
                 "under one token's working set; the file is mapped and faulted in as used "
                 "(--host-cache SIZE sets a cache)\n",
                 HumanSize(tensors).c_str(), arithmetic.c_str());
    return absl::OkStatus();
  }
  std::fprintf(info,
               "host cache: auto: the file's %s of tensors do not fit in memory; %s for %s of "
               "experts (--host-cache SIZE sets it)\n",
               HumanSize(tensors).c_str(), arithmetic.c_str(), HumanSize(experts).c_str());
  flags->host_cache_bytes = budget;
  return absl::OkStatus();
}

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

std::string StartupLines(const DecoderFlags& flags) {
  std::string lines;
  if (!flags.doors.all_default || flags.verbose) absl::StrAppend(&lines, flags.doors.banner, "\n");
  if (!flags.backend_note.empty()) absl::StrAppend(&lines, flags.backend_note, "\n");
  absl::StrAppend(&lines, DescribeSampling(flags.sampling), "\n");
  return lines;
}

std::string DescribeSampling(const SamplingParams& p) {
  if (sample_is_greedy(p.temperature)) return "sampling: greedy (--temp 0)";
  return absl::StrFormat("sampling: temp %.2f, top-k %d, top-p %.2f, min-p %.2f, seed %d",
                         p.temperature, p.top_k, p.top_p, p.min_p, p.seed);
}

absl::StatusOr<bool> BackendIsCuda(std::string* note) {
  const std::string backend = absl::GetFlag(FLAGS_backend);
  if (backend != "cpu" && backend != "cuda" && backend != "auto") {
    return absl::InvalidArgumentError(
        absl::StrFormat("--backend '%s' is not one of cpu, cuda, auto", backend));
  }
  if (backend == "cpu") return false;
  if (CudaDeviceCount() > 0) return true;
  const std::string reason = absl::GetFlag(FLAGS_verbose)
                                 ? absl::StrCat(" (", NoCudaDeviceReason(), ")")
                                 : std::string(" (--verbose gives the CUDA runtime's reason)");
  if (backend == "cuda") {
    return absl::FailedPreconditionError(absl::StrCat("--backend cuda: no CUDA device", reason));
  }
  *note = absl::StrCat("no CUDA device: running on the CPU backend",
                       absl::GetFlag(FLAGS_verbose) ? reason : "");
  return false;
}

absl::StatusOr<int> ParseThreads(absl::string_view text) {
  int threads = 0;
  if (!text.empty() && !absl::SimpleAtoi(text, &threads)) {
    return absl::InvalidArgumentError(absl::StrFormat("-t '%s' is not a thread count", text));
  }
  if (threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("-t %d: threads must be at least 1 (or 0: the physical cores)", threads));
  }
  const int logical = LogicalCpus();
  if (threads > logical) {
    std::fprintf(stderr,
                 "warning: -t %d: this machine has %d logical CPUs; running %d threads (more "
                 "would only wait for each other)\n",
                 threads, logical, logical);
    threads = logical;
  }
  return threads;
}

absl::StatusOr<int32_t> ParseUbatch(absl::string_view text) {
  int32_t ubatch = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &ubatch)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("-ub '%s' is not a token count", std::string(text)));
  }
  if (ubatch < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("-ub %d: a ubatch needs at least 1 token", ubatch));
  }
  return ubatch;
}

absl::StatusOr<int32_t> ReadUbatch() { return ParseUbatch(absl::GetFlag(FLAGS_ub)); }

absl::StatusOr<KvCacheType> ReadKvType() {
  const std::string kv = absl::GetFlag(FLAGS_kv_type);
  if (kv == "f16") return KvCacheType::kF16;
  if (kv == "f32") return KvCacheType::kF32;
  return absl::InvalidArgumentError(
      absl::StrFormat("--kv-type '%s' is not f16 or f32 (llama.cpp's -ctk/-ctv spell it too)", kv));
}

absl::StatusOr<CpuForwardOptions> ReadCpuFlags() {
  CpuForwardOptions options;
  MG_ASSIGN_OR_RETURN(options.threads, ParseThreads(absl::GetFlag(FLAGS_t)));
  MG_ASSIGN_OR_RETURN(options.kv_type, ReadKvType());
  MG_ASSIGN_OR_RETURN(options.ubatch, ReadUbatch());
  options.swa_full = absl::GetFlag(FLAGS_swa_full);
  return options;
}

namespace {

// The CPU backend's KV cache and recurrent state against MemAvailable.
absl::Status CheckKvMemory(const Model& model, bool cuda, const CpuForwardOptions& cpu, int ctx) {
  if (cuda) return absl::OkStatus();
  const ModelConfig& cfg = model.config;
  const KvCacheType kv_type = cpu.kv_type;
  const uint64_t kv = KvCacheBytes(cfg, ctx, kv_type, cpu.ring_slack());
  const uint64_t state = RecurrentStateBytes(cfg) * (1 + kStateCheckpoints);
  const uint64_t available = HostMemoryAvailable();
  if (available > 0 && kv + state > available) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "--ctx %d: a context of that many positions (--ctx, or the prompt and -n) needs a KV "
        "cache of %.2f GiB (K and V of %d layers at %d positions, or a windowed layer's ring, x "
        "%d KV heads x %d x %d bytes)%s and this machine has %.2f GiB available (MemAvailable); "
        "a smaller --ctx or -n fits",
        ctx, Gib(kv), cfg.n_kv_layers(), ctx, cfg.n_head_kv, cfg.head_dim,
        kv_type == KvCacheType::kF16 ? 2 : 4,
        state > 0 ? absl::StrFormat(" beside a recurrent state and its %d checkpoints of %.2f GiB",
                                    kStateCheckpoints, Gib(state))
                  : "",
        Gib(available)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckContext(const Model& model, bool cuda, const CpuForwardOptions& cpu, int ctx,
                          std::FILE* info) {
  const ModelConfig& cfg = model.config;
  if (cfg.n_ctx_train > 0 && ctx > cfg.n_ctx_train) {
    std::fprintf(info,
                 "warning: a context of %d positions is above the %d the model was trained for "
                 "(%s.context_length); text past them may degrade\n",
                 ctx, cfg.n_ctx_train, std::string(arch_gguf_name(cfg.arch)).c_str());
  }
  return CheckKvMemory(model, cuda, cpu, ctx);
}

absl::Status ApplyExpertsUsed(const DecoderFlags& flags, const std::string& path, Model* model,
                              std::FILE* info) {
  if (flags.n_expert_used == 0) return absl::OkStatus();
  ModelConfig& cfg = model->config;
  if (cfg.n_expert == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--n-expert-used %d: %s has no experts", flags.n_expert_used, path));
  }
  if (flags.n_expert_used > cfg.n_expert_used) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--n-expert-used %d must be at most %s's top-k, %d (expert_used_count): fewer experts a "
        "token, not more",
        flags.n_expert_used, path, cfg.n_expert_used));
  }
  std::fprintf(info, "experts a token: %d of the model's %d (--n-expert-used)\n",
               flags.n_expert_used, cfg.n_expert_used);
  cfg.n_expert_used = flags.n_expert_used;
  return absl::OkStatus();
}

absl::StatusOr<DecoderFlags> ReadDecoderFlags() {
  if (const char* set = std::getenv(std::string(kMemAvailableVar).c_str());
      set != nullptr && *set != '\0' && ParseMemorySize(set).value_or(0) == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s='%s' is not a size: bytes, or a number with K, M, G or T (binary: 8G)",
        std::string(kMemAvailableVar), set));
  }
  DecoderFlags flags;
  flags.verbose = absl::GetFlag(FLAGS_verbose);
  MG_ASSIGN_OR_RETURN(flags.cpu, ReadCpuFlags());
  MG_ASSIGN_OR_RETURN(flags.cuda, BackendIsCuda(&flags.backend_note));
  flags.steps_per_launch = absl::GetFlag(FLAGS_steps_per_launch);
  if (flags.steps_per_launch < 1 || flags.steps_per_launch > kMaxStepsPerLaunch) {
    return absl::InvalidArgumentError(absl::StrFormat("--steps-per-launch %d is not in [1, %d]",
                                                      flags.steps_per_launch, kMaxStepsPerLaunch));
  }
  std::optional<Arm> arm;
  if (const std::string text = absl::GetFlag(FLAGS_arm); !text.empty()) {
    MG_ASSIGN_OR_RETURN(arm, ParseArm(text));
  }
  MG_ASSIGN_OR_RETURN(flags.doors, ResolveDoors(arm, ProcessEnv()));
  MG_ASSIGN_OR_RETURN(flags.slots, ReadSlots());
  flags.n_cpu_moe = absl::GetFlag(FLAGS_n_cpu_moe);
  if (flags.n_cpu_moe < -1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--n-cpu-moe %d: layers must not be negative", flags.n_cpu_moe));
  }
  if (flags.n_cpu_moe >= 0 && flags.slots != 0) {
    return absl::InvalidArgumentError(
        "--n-cpu-moe and --slots both size the expert cache: give one of them");
  }
  MG_ASSIGN_OR_RETURN(flags.sampling, ReadSampling());
  MG_ASSIGN_OR_RETURN(flags.load, ReadLoadFlags(flags.cuda));
  flags.drop_cold = absl::GetFlag(FLAGS_drop_cold_experts);
  flags.drop_in_prompts = absl::GetFlag(FLAGS_drop_in_prompts);
  if (!(flags.drop_cold >= 0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--drop-cold-experts %g must be 0 (off) or more: a share of 1/k", flags.drop_cold));
  }
  if (flags.drop_cold > 0 && flags.cuda) {
    return absl::InvalidArgumentError(
        "--drop-cold-experts: the CPU backend drops (add --backend cpu); the CUDA engine does not");
  }
  flags.n_expert_used = absl::GetFlag(FLAGS_n_expert_used);
  if (flags.n_expert_used < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--n-expert-used %d must be 1 or more (0: the model's top-k)", flags.n_expert_used));
  }
  MG_ASSIGN_OR_RETURN(flags.host_cache_bytes, ReadHostCache(flags.cuda, &flags.load));
  if (flags.host_cache_bytes > 0) {
    if (flags.slots != 0 || flags.n_cpu_moe >= 0) {
      return absl::InvalidArgumentError(
          "--host-cache sizes the expert cache: give it without --slots or --n-cpu-moe");
    }
    if (flags.doors.arm == Arm::kResident) {
      return absl::InvalidArgumentError(
          "--host-cache reads experts from the file; --arm resident keeps them all in memory");
    }
  }
  return flags;
}

absl::StatusOr<uint64_t> ReadHostCache(bool cuda, LoadOptions* load) {
  const std::string text = absl::GetFlag(FLAGS_host_cache);
  if (text.empty()) return 0;
  absl::StatusOr<uint64_t> bytes = ParseByteSize(text);
  if (!bytes.ok() || *bytes == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--host-cache '%s' is not a size: bytes, or a number with K, M, G or T (binary: 8G)",
        text));
  }
  if (cuda) {
    return absl::InvalidArgumentError(
        "--host-cache: the disk tier serves the CPU backend (add --backend cpu); the CUDA "
        "engine copies every expert into host memory at load");
  }
  if (!absl::GetFlag(FLAGS_load_mode).empty() || absl::GetFlag(FLAGS_mmap) ||
      absl::GetFlag(FLAGS_no_mmap) || absl::GetFlag(FLAGS_mlock)) {
    return absl::InvalidArgumentError(
        "--host-cache maps the file and reads the experts itself: leave out --load-mode, "
        "--mmap, --no-mmap and --mlock");
  }
  // The dense weights are mapped and faulted in as used; the experts' pages never are.
  load->mode = LoadMode::kMap;
  load->fault_in = false;
  return *bytes;
}

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text) {
  const std::optional<uint64_t> bytes = ParseMemorySize(text);
  if (!bytes.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("'%s' is not a size", absl::StripAsciiWhitespace(text)));
  }
  return *bytes;
}

absl::StatusOr<LoadOptions> ReadLoadFlags(bool cuda) {
  const std::string flag = absl::GetFlag(FLAGS_load_mode);
  const bool map = absl::GetFlag(FLAGS_mmap), no_map = absl::GetFlag(FLAGS_no_mmap);
  const bool lock = absl::GetFlag(FLAGS_mlock);
  if (!flag.empty() && (map || no_map || lock)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--load-mode %s and --mmap/--no-mmap/--mlock both say how to load: give one", flag));
  }
  if (map && no_map) return absl::InvalidArgumentError("--mmap and --no-mmap: give one");
  std::string mode = flag;
  if (mode.empty()) {
    mode = no_map ? (lock ? "mlock" : "none") : lock ? "mmap+mlock" : map ? "mmap" : "auto";
  }
  LoadOptions options;
  if (mode == "auto") {
    options.mode = cuda ? LoadMode::kMap : LoadMode::kAuto;
    options.fault_in = !cuda;
  } else if (mode == "none" || mode == "mlock") {
    options.mode = LoadMode::kRead;
    options.lock = mode == "mlock";
  } else if (mode == "mmap" || mode == "mmap+mlock") {
    options.mode = LoadMode::kMap;
    options.fault_in = true;
    options.lock = mode == "mmap+mlock";
  } else if (mode == "dio") {
    return absl::InvalidArgumentError(
        "--load-mode dio: direct I/O is not supported (none reads the file into memory, mmap "
        "maps it)");
  } else {
    return absl::InvalidArgumentError(
        absl::StrFormat("--load-mode '%s' is not auto, none, mmap, mlock or mmap+mlock", mode));
  }
  return options;
}

absl::Status ReadWeights(GgufFile* file, const LoadOptions& load, std::FILE* info) {
  const std::string& path = file->path();
  LoadOptions options = load;
  const bool reads = load.mode != LoadMode::kMap || load.fault_in || load.lock;
  if (reads && !options.progress) options.progress = TerminalProgress(path);
  const auto start = std::chrono::steady_clock::now();
  if (const absl::Status s = file->Load(options); !s.ok()) {
    return Prefixed(s, absl::StrCat("--load-mode ", LoadModeName(load)));
  }
  if (reads) {
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const uint64_t bytes = file->total_data_bytes();
    std::fprintf(info, "load: %s: %.2f GiB of tensors %s in %.1f s (%.0f MiB/s)%s\n", path.c_str(),
                 Gib(bytes),
                 file->load_mode() == LoadMode::kRead ? "read into memory" : "mapped, faulted in",
                 seconds, seconds > 0 ? Mib(bytes) / seconds : 0.0,
                 file->locked() ? ", locked" : "");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Decoder>> Decoder::Create(const Model& model,
                                                         const DecoderFlags& flags, int max_ctx,
                                                         std::FILE* info) {
  auto d = std::unique_ptr<Decoder>(new Decoder());
  d->sampling_ = flags.sampling;
  MG_RETURN_IF_ERROR(CheckKvMemory(model, flags.cuda, flags.cpu, max_ctx));
  if (flags.cuda) {
    CudaEngineOptions options;
    options.sampling = flags.sampling;
    options.max_ctx = max_ctx;
    options.kv_type = flags.cpu.kv_type;
    options.n_slots = flags.slots;
    if (flags.n_cpu_moe >= 0) {
      // llama.cpp keeps the experts of the first N layers on the host and the
      // rest on the GPU: here, slots for the other MoE layers' experts.
      const ModelConfig& cfg = model.config;
      const int gpu_layers =
          std::max(cfg.n_layer - std::max(flags.n_cpu_moe, cfg.n_layer_dense_lead), 0);
      options.n_slots = std::max(gpu_layers * cfg.n_expert, cfg.n_expert_used);
      std::fprintf(info, "--n-cpu-moe %d: %d slots, the experts of %d of %d MoE layers\n",
                   flags.n_cpu_moe, options.n_slots, gpu_layers, cfg.n_moe_layer());
    }
    options.doors = flags.doors.doors;
    options.steps_per_launch = flags.steps_per_launch;
    options.ubatch = flags.cpu.ubatch;
    options.swa_full = flags.cpu.swa_full;
    if (flags.every_position_logits) {
      options.record_logits = true;
      options.doors.batched_prefill = false;
    }
    MG_ASSIGN_OR_RETURN(d->cuda_, CudaEngine::Create(model, options, TerminalProgress("experts")));
    std::fprintf(info, "%s\n", d->cuda_->banner().c_str());
    return d;
  }
  // The CPU backend, with the doors mapped where they mean something on the host.
  d->ubatch_ = flags.cpu.ubatch;
  d->drop_cold_ = flags.drop_cold;
  CpuBackendOptions options;
  options.max_ctx = max_ctx;
  options.n_slots = flags.slots;
  options.policy = flags.doors.doors.policy;
  options.protected_frac = flags.doors.doors.protected_frac;
  options.cache = flags.doors.doors.moe_cache;
  options.fast = flags.cpu;
  options.fast.batch_matmul = flags.doors.doors.batch_matmul;
  options.fast.overlap_reads = flags.doors.doors.read_overlap;
  options.fast.amx = flags.doors.doors.amx;
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
  if (flags.n_cpu_moe >= 0) {
    std::fprintf(info,
                 "backend cpu: every expert is in host memory already; --n-cpu-moe is "
                 "ignored\n");
  }
  options.drop_cold = flags.drop_cold;
  options.drop_in_prompts = flags.drop_in_prompts;
  if (flags.host_cache_bytes > 0) {
    options.resident = false;
    MG_ASSIGN_OR_RETURN(ExpertStore store, ExpertStore::Layouts(model));
    MG_ASSIGN_OR_RETURN(options.n_slots, HostCacheSlots(store, model.config,
                                                         flags.host_cache_bytes));
    d->store_ = std::make_unique<ExpertStore>(std::move(store));
    MG_ASSIGN_OR_RETURN(d->disk_, ExpertFileReader::Open(model));
    options.disk = d->disk_.get();
    std::fprintf(info, "host cache: %d expert slots in %.0f MiB (--host-cache) for %.2f MiB of "
                 "experts; misses read from %s%s\n", options.n_slots, Mib(flags.host_cache_bytes),
                 Mib(d->store_->total_bytes()),
                 model.file->path().c_str(),
                 d->disk_->direct() ? " with O_DIRECT" : " through the page cache (its "
                                                          "filesystem refuses O_DIRECT)");
  } else if (!options.resident) {
    MG_ASSIGN_OR_RETURN(ExpertStore store, ExpertStore::Create(model, AlignedHostAllocator(),
                                                               TerminalProgress("experts")));
    d->store_ = std::make_unique<ExpertStore>(std::move(store));
  }
  MG_ASSIGN_OR_RETURN(d->cpu_, CpuBackend::Create(model, d->store_.get(), options));
  d->file_bytes_ = model.file->total_size();
  d->kv_bytes_ = d->cpu_->kv_cache_bytes();
  d->state_bytes_ = RecurrentStateBytes(model.config);
  std::fprintf(info, "%s\n", Banner(*d->cpu_, d->store_.get(), options).c_str());
  const int threads = options.fast.threads > 0 ? options.fast.threads : PhysicalCores();
  std::fprintf(info, "backend cpu: %d thread%s, SIMD %s, KV cache %s; a prompt runs %s\n", threads,
               threads == 1 ? "" : "s", SimdTargetLabel().c_str(),
               options.fast.kv_type == KvCacheType::kF16 ? "f16" : "f32",
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

absl::StatusOr<std::vector<float>> Decoder::AllLogits(absl::Span<const int32_t> tokens) {
  if (cuda_ != nullptr) {
    MG_RETURN_IF_ERROR(cuda_->Generate(tokens, 1).status());
    return cuda_->ReadLogitsRecord(0, static_cast<int>(tokens.size()));
  }
  cpu_->Reset();
  return cpu_->Forward(tokens);
}

absl::StatusOr<std::vector<TokenLogprobs>> Decoder::Score(absl::Span<const int32_t> tokens,
                                                           int start, int from, int top_n) {
  if (cuda_ != nullptr) {
    return absl::FailedPreconditionError(kCudaScoresNoTokens);
  }
  return ScoreTokens(*cpu_, tokens, start, from, top_n, ubatch_);
}

absl::StatusOr<std::vector<int32_t>> Decoder::Routing() const {
  if (cuda_ != nullptr) {
    return absl::InvalidArgumentError("--record-routing: the CPU backend records routing here");
  }
  return cpu_->routing();
}

absl::Status WriteRoutingRecord(const std::vector<int32_t>& routing, const ModelConfig& cfg,
                                const std::string& path) {
  RoutingTrace trace;
  trace.n_layer = cfg.n_layer;
  trace.n_expert = cfg.n_expert;
  trace.k = cfg.n_expert_used;
  const size_t row = static_cast<size_t>(cfg.n_layer) * static_cast<size_t>(cfg.n_expert_used);
  trace.n_steps = static_cast<int64_t>(routing.size() / row);
  trace.ids.assign(routing.begin(), routing.end());
  const absl::Status status = WriteTrace(trace, path);
  return status.ok() ? status : Prefixed(status, absl::StrCat("--record-routing ", path));
}

int Decoder::ResumePosition(int start) const {
  return cuda_ != nullptr ? cuda_->ResumePosition(start) : cpu_->ResumePosition(start);
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
  out.push_back({"disk_reads_total", static_cast<double>(c.disk_reads)});
  out.push_back({"disk_bytes_total", static_cast<double>(c.disk_bytes)});
  out.push_back({"experts_dropped_total", static_cast<double>(c.dropped)});
  out.push_back({"expert_weight_dropped_total", c.dropped_weight});
  return out;
}

absl::StatusOr<std::string> Decoder::ExpertSummary() {
  MG_ASSIGN_OR_RETURN(const EngineCounters c, ExpertCounters());
  const uint64_t selected = c.hits + c.misses;
  std::string line = absl::StrFormat(
      "hit %.1f%%, %d misses, %d evictions, %.2f MiB staged",
      selected > 0 ? 100.0 * static_cast<double>(c.hits) / static_cast<double>(selected) : 0.0,
      c.misses, c.evictions, Mib(c.bytes_staged));
  if (disk_ != nullptr) {
    absl::StrAppendFormat(&line, " (%d disk reads, %.2f MiB read, %.1f ms waiting on them)",
                          c.disk_reads, Mib(c.disk_bytes), c.stage_ns * 1e-6);
  }
  if (c.dropped > 0 || drop_cold_ > 0) {
    absl::StrAppendFormat(&line, ", %d routings dropped (weight %.3f in all, %.4f each)",
                          c.dropped, c.dropped_weight,
                          c.dropped > 0 ? c.dropped_weight / c.dropped : 0.0);
  }
  return line;
}

absl::Status Decoder::PrintSummary(std::FILE* out, const GenerateStats& stats, size_t generated) {
  MG_ASSIGN_OR_RETURN(const std::string experts, ExpertSummary());
  const std::string backend =
      cuda_ == nullptr ? "backend cpu"
                       : absl::StrCat("backend cuda (arm ", Av(ArmName(cuda_->arm())), ")");
  // How the device ran the prompts (every one this engine ran).
  std::string prompt_path;
  if (cuda_ != nullptr) {
    const HostCounters& h = cuda_->host_counters();
    prompt_path = absl::StrFormat(
        "; prompts: %d tokens in %d ubatch%s (%d experts in place, %d streamed), %d as T=1 steps",
        h.prefill_tokens, h.prefill_ubatches, h.prefill_ubatches == 1 ? "" : "es",
        h.prefill_experts_in_place, h.prefill_experts_streamed, h.prompt_steps);
  }
  std::string memory = absl::StrFormat("peak RSS %.0f MiB", Mib(PeakRssBytes()));
  if (cuda_ == nullptr) {
    absl::StrAppendFormat(&memory, " (file %.0f MiB, KV cache %.0f MiB%s)", Mib(file_bytes_),
                          Mib(kv_bytes_),
                          state_bytes_ > 0
                              ? absl::StrFormat(", recurrent state %.1f MiB and up to %d "
                                                "checkpoints of it",
                                                Mib(state_bytes_), kStateCheckpoints)
                              : "");
  }
  absl::FPrintF(out, "%s: %d prompt token%s (%s) + %d generated (%s) = %d; %s; %s%s\n", backend,
                stats.prompt_tokens, stats.prompt_tokens == 1 ? "" : "s",
                Rate(stats.prompt_tokens, stats.prompt_seconds), generated,
                Rate(stats.decode_steps, stats.decode_seconds), stats.prompt_tokens + generated,
                experts, memory, prompt_path);
  return absl::OkStatus();
}

}  // namespace moegraph
