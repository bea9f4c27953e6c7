// moegraph bench: every arm side by side in one run, like llama-bench. One
// engine per (arm, slots); the arms of one slot count live together and their
// repetitions interleave (A B A B ...), so drift hits every arm alike. Arms that
// ignore --slots (resident holds every expert, stage has k scratch slots) run
// once, with the first slot count's group.
//
// Tests, as llama-bench's: pp<p> feeds p prompt tokens and times them (CUDA:
// the batched prefill in ubatches of -ub, or one T=1 step each with
// MOEGRAPH_PREFILL=steps, a routing trace or a routing record; the CPU
// backend: one batch where every expert is resident, else T=1 steps); tg<n> feeds one token and
// generates n, timing all n steps; pp<p>+tg<n> feeds p and generates n, timing all, t/s over p + n.
// -p, -n and -t take lists, a row each. Each (engine, test) runs once untimed first (graph capture,
// cache warm-up).
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
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
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "capture/doors.h"
#include "capture/engine.h"
#include "cpu/cpu_backend.h"
#include "cpu/thread_pool.h"
#include "loader/ggml_type.h"
#include "loader/gguf.h"
#include "loader/model_config.h"
#include "loader/placement.h"
#include "loader/status_util.h"
#include "residency/trace.h"
#include "tools/cli/commands.h"
#include "tools/cli/decoder.h"

// Defined with the decoding flags (tools/cli/decoder.cc).
ABSL_DECLARE_FLAG(int32_t, steps_per_launch);
ABSL_DECLARE_FLAG(std::string, t);
ABSL_DECLARE_FLAG(std::string, ub);
ABSL_DECLARE_FLAG(std::string, kv_type);

// What each flag means: tools/cli/command_line.cc.
ABSL_FLAG(std::string, arms, "resident,graph,eager,host,stage", "arms to compare");
ABSL_FLAG(int32_t, r, 5, "timed repetitions of every test");
ABSL_FLAG(std::string, pg, "", "a pp+tg test: P,N");
ABSL_FLAG(std::string, routing_trace, "", "routing trace whose selections replace the router's");
ABSL_FLAG(std::string, record_routing, "", "write the routing the run used here");

namespace moegraph {
namespace {

// llama-bench's defaults: -p 512 -n 128 (run's -n is 16).
constexpr int kDefaultPrompt = 512;
constexpr int kDefaultGenerate = 128;

double Mib(uint64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

struct BenchTest {
  std::string name;             // pp<p> | tg<n> | pp<p>+tg<n>
  int prompt = 0;               // tokens fed
  int generate = 0;             // n_predict
  bool decode = false;          // the decode steps are timed (tg, pp+tg)
  int counted = 0;              // the tokens t/s counts: p, n or p + n
  int n_prompt = 0, n_gen = 0;  // llama-bench's fields
  int steps() const { return counted; }
};

// One timed run of a test: the time and the counters' deltas.
struct Sample {
  double seconds = 0;
  uint64_t steps = 0;
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t bytes_staged = 0;
  uint64_t stage_ns = 0;
  uint64_t host_syncs = 0;
  uint64_t launches = 0;
};

// One engine of one arm at one slot count.
class Target {
 public:
  virtual ~Target() = default;
  virtual absl::StatusOr<Sample> Run(const BenchTest& test) = 0;
  virtual int32_t slots() const = 0;  // as allocated, over all size classes
  // Every step's selection so far, [(step * n_layer + layer) * k + rank].
  virtual absl::StatusOr<std::vector<int32_t>> Routing() = 0;
};

std::vector<int32_t> Prompt(const BenchTest& test, int n_vocab) {
  std::vector<int32_t> ids(static_cast<size_t>(test.prompt));
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = 1 + static_cast<int32_t>(i % static_cast<size_t>(std::max(n_vocab - 1, 1)));
  }
  return ids;
}

double TimedSeconds(const BenchTest& test, const GenerateStats& stats) {
  return test.decode ? stats.prompt_seconds + stats.decode_seconds : stats.prompt_seconds;
}

void AddCounters(const EngineCounters& before, const EngineCounters& after, Sample& s) {
  s.steps = after.steps - before.steps;
  s.hits = after.hits - before.hits;
  s.misses = after.misses - before.misses;
  s.bytes_staged = after.bytes_staged - before.bytes_staged;
  s.stage_ns = after.stage_ns - before.stage_ns;
}

// The CPU backend with the arms mapped as `moegraph run` maps them.
class CpuTarget final : public Target {
 public:
  static absl::StatusOr<std::unique_ptr<Target>> Create(const Model& model,
                                                        const ExpertStore* store,
                                                        const Doors& doors, Arm arm, int32_t slots,
                                                        int ctx, const CpuForwardOptions& cpu,
                                                        const RoutingTrace* trace,
                                                        ExpertFileReader* disk) {
    CpuBackendOptions options;
    options.disk = disk;
    options.max_ctx = ctx;
    options.fast = cpu;
    options.fast.batch_matmul = doors.batch_matmul;
    options.fast.overlap_reads = doors.read_overlap;
    options.fast.amx = doors.amx;
    options.n_slots = slots;
    options.resident = arm == Arm::kResident;
    options.policy = doors.policy;
    options.protected_frac = doors.protected_frac;
    options.cache = doors.moe_cache;
    options.routing_trace = trace;
    auto target = std::unique_ptr<CpuTarget>(new CpuTarget());
    target->n_vocab_ = model.config.n_vocab;
    MG_ASSIGN_OR_RETURN(target->backend_, CpuBackend::Create(model, store, options));
    return std::unique_ptr<Target>(std::move(target));
  }

  absl::StatusOr<Sample> Run(const BenchTest& test) override {
    backend_->Reset();
    const EngineCounters before = backend_->counters();
    GenerateStats stats;
    MG_RETURN_IF_ERROR(
        backend_->Generate(Prompt(test, n_vocab_), test.generate, &stats).status());
    Sample s;
    AddCounters(before, backend_->counters(), s);
    s.seconds = TimedSeconds(test, stats);
    return s;
  }

  int32_t slots() const override {
    int32_t n = 0;
    for (const SlotPoolInfo& pool : backend_->pools()) n += pool.n_slots;
    return n;
  }

  absl::StatusOr<std::vector<int32_t>> Routing() override { return backend_->routing(); }

 private:
  CpuTarget() = default;
  int n_vocab_ = 0;
  std::unique_ptr<CpuBackend> backend_;
};

// Work the host submits per step of an eager walk: kernels and copies, the host
// arm's two slot-table writes counted as two; its per-miss copies come from the
// miss count instead.
uint64_t EagerLaunchesPerStep(const StepWalk& walk) {
  uint64_t n = 0;
  for (const WalkEntry& e : walk.entries) {
    if (e.op == StepOp::kHostStageCopy) continue;
    if (e.op == StepOp::kHostWriteSlots) {
      n += 2;
    } else if (e.kind == EntryKind::kKernel || e.kind == EntryKind::kMemcpyD2H ||
               e.kind == EntryKind::kMemcpyH2D) {
      ++n;
    }
  }
  return n;
}

class CudaTarget final : public Target {
 public:
  static absl::StatusOr<std::unique_ptr<Target>> Create(
      const Model& model, std::shared_ptr<const ExpertStore> experts, const Doors& doors,
      int32_t slots, int32_t sharing_engines, int ctx, int32_t ubatch, const RoutingTrace* trace,
      int64_t record_steps) {
    CudaEngineOptions options;
    options.max_ctx = ctx;
    MG_ASSIGN_OR_RETURN(options.kv_type, ReadKvType());
    options.n_slots = slots;
    options.sharing_engines = sharing_engines;
    options.doors = doors;
    options.steps_per_launch = absl::GetFlag(FLAGS_steps_per_launch);
    options.ubatch = ubatch;
    options.routing_trace = trace;
    options.routing_record_steps = record_steps;
    auto target = std::unique_ptr<CudaTarget>(new CudaTarget());
    target->n_vocab_ = model.config.n_vocab;
    MG_ASSIGN_OR_RETURN(target->engine_, CudaEngine::Create(model, std::move(experts), options));
    target->eager_launches_per_step_ = EagerLaunchesPerStep(target->engine_->Walk());
    return std::unique_ptr<Target>(std::move(target));
  }

  absl::StatusOr<Sample> Run(const BenchTest& test) override {
    // Counter readbacks sync the host: outside the host-counter window.
    MG_ASSIGN_OR_RETURN(const EngineCounters before, engine_->ReadCounters());
    const HostCounters host_before = engine_->host_counters();
    GenerateStats stats;
    MG_RETURN_IF_ERROR(engine_->Generate(Prompt(test, n_vocab_), test.generate, &stats).status());
    const HostCounters host_after = engine_->host_counters();
    MG_ASSIGN_OR_RETURN(const EngineCounters after, engine_->ReadCounters());
    Sample s;
    AddCounters(before, after, s);
    // The batched prefill's tokens count as fed tokens (the CPU backend's
    // steps count a prompt's too) and its experts as the decode's do: read in
    // place (hits) or copied (misses, bytes), so a pp row's hit %, MiB/tok
    // and stage GB/s are the prompt's.
    s.steps += host_after.prefill_tokens - host_before.prefill_tokens;
    s.hits += host_after.prefill_experts_in_place - host_before.prefill_experts_in_place;
    s.misses += host_after.prefill_experts_streamed - host_before.prefill_experts_streamed;
    s.bytes_staged += host_after.prefill_bytes_streamed - host_before.prefill_bytes_streamed;
    s.seconds = TimedSeconds(test, stats);
    s.host_syncs = host_after.host_syncs - host_before.host_syncs;
    s.launches = (host_after.graph_launches - host_before.graph_launches) +
                 (host_after.eager_steps - host_before.eager_steps) * eager_launches_per_step_ +
                 (engine_->arm() == Arm::kHost ? s.misses : 0);
    return s;
  }

  int32_t slots() const override {
    int32_t n = 0;
    for (const SlotPoolInfo& pool : engine_->pools()) n += pool.n_slots;
    return n;
  }

  absl::StatusOr<std::vector<int32_t>> Routing() override { return engine_->ReadRoutingRecord(); }

 private:
  CudaTarget() = default;
  int n_vocab_ = 0;
  uint64_t eager_launches_per_step_ = 0;
  std::unique_ptr<CudaEngine> engine_;
};

// ---- flags ----

absl::StatusOr<std::vector<Arm>> ParseArms(const std::string& text) {
  std::vector<Arm> arms;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    const std::string name(absl::StripAsciiWhitespace(part));
    absl::StatusOr<Arm> arm = ParseArm(name);
    if (!arm.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--arms '%s': '%s' is not an arm (resident, graph, eager, host, stage)", text, name));
    }
    if (std::find(arms.begin(), arms.end(), *arm) != arms.end()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--arms '%s': '%s' is listed twice", text, name));
    }
    arms.push_back(*arm);
  }
  return arms;
}

// --slots 16,32,64 | auto; auto is 0.
absl::StatusOr<std::vector<int32_t>> ParseSlotList(const std::string& text) {
  std::vector<int32_t> slots;
  if (absl::StripAsciiWhitespace(text).empty()) return std::vector<int32_t>{0};
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    const absl::string_view word = absl::StripAsciiWhitespace(part);
    int32_t n = 0;
    if (word == "auto") {
      n = 0;
    } else if (!absl::SimpleAtoi(word, &n) || n < 1) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--slots '%s': '%s' is not a positive slot count or auto", text, std::string(word)));
    }
    if (std::find(slots.begin(), slots.end(), n) != slots.end()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--slots '%s': '%s' is listed twice", text, std::string(word)));
    }
    slots.push_back(n);
  }
  return slots;
}

bool UsesSlots(Arm arm) { return arm != Arm::kResident && arm != Arm::kStage; }

// ---- results ----

struct Row {
  int threads = 0;  // the CPU backend's; 0 on CUDA
  int32_t ubatch = 0;
  Arm arm = Arm::kGraph;
  int32_t slots = 0;            // as allocated
  int32_t slots_requested = 0;  // 0: auto; -1: an arm that ignores --slots
  size_t test = 0;              // index into the tests
  std::vector<Sample> samples;
};

struct RowStats {
  std::vector<double> ts;
  double avg_ts = 0;
  double stddev_ts = 0;
  uint64_t steps = 0, hits = 0, misses = 0, bytes = 0, stage_ns = 0, syncs = 0, launches = 0;
  double seconds = 0;

  double hit_rate() const {
    return hits + misses > 0 ? static_cast<double>(hits) / static_cast<double>(hits + misses) : 0;
  }
  double per_step(uint64_t v) const {
    return steps > 0 ? static_cast<double>(v) / static_cast<double>(steps) : 0;
  }
  double mib_per_token() const { return steps > 0 ? Mib(bytes) / static_cast<double>(steps) : 0; }
  // CPU: bytes over the time inside the stage memcpys; CUDA: over the timed wall
  // time (the copies overlap expert compute, so a lower bound on the link's rate).
  double stage_gbps(bool cpu) const {
    const double ns = cpu ? static_cast<double>(stage_ns) : seconds * 1e9;
    return ns > 0 ? static_cast<double>(bytes) / ns : 0;
  }
};

RowStats Summarize(const Row& row, const BenchTest& test) {
  RowStats s;
  for (const Sample& x : row.samples) {
    s.ts.push_back(x.seconds > 0 ? test.steps() / x.seconds : 0);
    s.steps += x.steps;
    s.hits += x.hits;
    s.misses += x.misses;
    s.bytes += x.bytes_staged;
    s.stage_ns += x.stage_ns;
    s.syncs += x.host_syncs;
    s.launches += x.launches;
    s.seconds += x.seconds;
  }
  for (double t : s.ts) s.avg_ts += t / static_cast<double>(s.ts.size());
  if (s.ts.size() > 1) {
    double sq = 0;
    for (double t : s.ts) sq += (t - s.avg_ts) * (t - s.avg_ts);
    s.stddev_ts = std::sqrt(sq / static_cast<double>(s.ts.size() - 1));
  }
  return s;
}

struct ModelInfo {
  std::string filename;  // as -m gave it
  std::string name;      // "qwen3moe 4L 16x top-4 q4_K"
  uint64_t size_bytes = 0;
  uint64_t params = 0;
};

ModelInfo DescribeModel(const Model& model) {
  const ModelConfig& c = model.config;
  ModelInfo info;
  info.name = absl::StrFormat(
      "%s %dL %dx top-%d %s", Av(arch_gguf_name(c.arch)), c.n_layer, c.n_expert, c.n_expert_used,
      ggml_type_name(
          static_cast<uint32_t>(model.expert(c.n_layer_dense_lead, ExpertProj::kGate, 0).type)));
  info.filename = model.file->path();
  info.size_bytes = model.file->total_size();
  for (const GgufTensor& t : model.file->tensors()) {
    info.params += static_cast<uint64_t>(t.n_elements());
  }
  return info;
}

std::string HumanCount(uint64_t n) {
  const double v = static_cast<double>(n);
  if (v >= 1e9) return absl::StrFormat("%.2f B", v / 1e9);
  if (v >= 1e6) return absl::StrFormat("%.2f M", v / 1e6);
  return absl::StrFormat("%.2f K", v / 1e3);
}

std::string ThreadsCell(const Row& row) {
  return row.threads > 0 ? absl::StrCat(row.threads) : std::string("-");
}

void PrintMarkdown(const ModelInfo& model, std::string_view backend,
                   const std::vector<BenchTest>& tests, const std::vector<Row>& rows) {
  const bool cpu = backend == "cpu";
  // As llama-bench, an n_ubatch column only where -ub lists several.
  const bool ubatches = std::any_of(rows.begin(), rows.end(),
                                    [&](const Row& r) { return r.ubatch != rows[0].ubatch; });
  absl::PrintF(
      "| model | size | params | backend | threads |%s arm | slots | test | t/s | hit %% | MiB/tok | "
      "stage GB/s | syncs/tok | launches/tok |\n",
      ubatches ? " n_ubatch |" : "");
  absl::PrintF(
      "| ----- | ---: | -----: | ------- | ------: |%s --- | ----: | ---- | --: | ----: | ------: | "
      "---------: | --------: | -----------: |\n",
      ubatches ? " -------: |" : "");
  for (const Row& row : rows) {
    const BenchTest& test = tests[row.test];
    const RowStats s = Summarize(row, test);
    absl::PrintF(
        "| %s | %s | %s | %s | %s |%s %s | %d | %s | %.2f ± %.2f | %.1f | %.3f | %.2f | "
        "%.2f | %.2f |\n",
        model.name, HumanSize(model.size_bytes), HumanCount(model.params), Av(backend),
        ThreadsCell(row), ubatches ? absl::StrCat(" ", row.ubatch, " |") : "",
        Av(ArmName(row.arm)), row.slots, test.name, s.avg_ts, s.stddev_ts,
        100.0 * s.hit_rate(), s.mib_per_token(), s.stage_gbps(cpu), s.per_step(s.syncs),
        s.per_step(s.launches));
  }
}

std::string JsonNumber(double v) { return std::isfinite(v) ? absl::StrFormat("%.6g", v) : "0"; }

// A row's fields in order, each as a JSON value (strings quoted).
std::vector<std::pair<std::string, std::string>> RowFields(const ModelInfo& model,
                                                           std::string_view backend,
                                                           const BenchTest& test, const Row& row) {
  const bool cpu = backend == "cpu";
  const RowStats s = Summarize(row, test);
  std::vector<std::string> ts, ns;
  for (double t : s.ts) ts.push_back(JsonNumber(t));
  for (const Sample& x : row.samples) ns.push_back(absl::StrCat(std::llround(x.seconds * 1e9)));
  double avg_ns = 0, stddev_ns = 0;
  for (const Sample& x : row.samples) avg_ns += x.seconds * 1e9 / row.samples.size();
  if (row.samples.size() > 1) {
    for (const Sample& x : row.samples) stddev_ns += std::pow(x.seconds * 1e9 - avg_ns, 2);
    stddev_ns = std::sqrt(stddev_ns / static_cast<double>(row.samples.size() - 1));
  }
  auto quoted = [](std::string_view text) { return absl::StrCat("\"", Av(text), "\""); };
  // llama-bench's fields under its names first (tools/llama-bench's
  // test::get_fields, samples_ns and samples_ts), then moegraph's own.
  return {
      {"model_filename", quoted(model.filename)},
      {"model_type", quoted(model.name)},
      {"model_size", absl::StrCat(model.size_bytes)},
      {"model_n_params", absl::StrCat(model.params)},
      {"backends", quoted(backend)},
      {"n_ubatch", absl::StrCat(row.ubatch)},
      {"n_threads", row.threads > 0 ? absl::StrCat(row.threads) : "null"},
      {"type_k", quoted(absl::GetFlag(FLAGS_kv_type))},
      {"type_v", quoted(absl::GetFlag(FLAGS_kv_type))},
      {"n_prompt", absl::StrCat(test.n_prompt)},
      {"n_gen", absl::StrCat(test.n_gen)},
      {"n_depth", "0"},
      {"avg_ns", absl::StrCat(std::llround(avg_ns))},
      {"stddev_ns", absl::StrCat(std::llround(stddev_ns))},
      {"avg_ts", JsonNumber(s.avg_ts)},
      {"stddev_ts", JsonNumber(s.stddev_ts)},
      {"samples_ns", absl::StrCat("[", absl::StrJoin(ns, ", "), "]")},
      {"samples_ts", absl::StrCat("[", absl::StrJoin(ts, ", "), "]")},
      {"backend", quoted(backend)},
      {"arm", quoted(ArmName(row.arm))},
      {"slots", absl::StrCat(row.slots)},
      {"slots_requested", row.slots_requested > 0    ? absl::StrCat(row.slots_requested)
                          : row.slots_requested == 0 ? quoted("auto")
                                                     : "null"},
      {"test", quoted(test.name)},
      {"steps_per_launch", absl::StrCat(absl::GetFlag(FLAGS_steps_per_launch))},
      {"hits", absl::StrCat(s.hits)},
      {"misses", absl::StrCat(s.misses)},
      {"hit_rate", JsonNumber(s.hit_rate())},
      {"mib_staged_per_token", JsonNumber(s.mib_per_token())},
      {"stage_gbps", JsonNumber(s.stage_gbps(cpu))},
      {"host_syncs_per_token", JsonNumber(s.per_step(s.syncs))},
      {"launches_per_token", JsonNumber(s.per_step(s.launches))},
  };
}

std::string JsonObject(const std::vector<std::pair<std::string, std::string>>& fields) {
  std::vector<std::string> parts;
  for (const auto& [key, value] : fields) parts.push_back(absl::StrCat("\"", key, "\": ", value));
  return absl::StrCat("{", absl::StrJoin(parts, ", "), "}");
}

// json: an array, an object a line; jsonl: an object a line.
void PrintJson(const ModelInfo& model, std::string_view backend,
               const std::vector<BenchTest>& tests, const std::vector<Row>& rows, bool lines) {
  if (!lines) std::printf("[\n");
  for (size_t i = 0; i < rows.size(); ++i) {
    const std::string object = JsonObject(RowFields(model, backend, tests[rows[i].test], rows[i]));
    if (lines) {
      std::printf("%s\n", object.c_str());
    } else {
      std::printf("  %s%s\n", object.c_str(), i + 1 < rows.size() ? "," : "");
    }
  }
  if (!lines) std::printf("]\n");
}

// RFC 4180: a header of the JSON fields' names, then a row each; strings
// unquoted from JSON, samples_ts its values joined by spaces, null empty.
void PrintCsv(const ModelInfo& model, std::string_view backend, const std::vector<BenchTest>& tests,
              const std::vector<Row>& rows) {
  auto cell = [](std::string value) {
    if (value == "null") return std::string();
    if (value.size() >= 2 && value.front() == '[') {
      value = absl::StrReplaceAll(value.substr(1, value.size() - 2), {{",", ""}});
    } else if (value.size() >= 2 && value.front() == '"') {
      value = value.substr(1, value.size() - 2);
    }
    if (value.find_first_of(",\"\n") == std::string::npos) return value;
    return absl::StrCat("\"", absl::StrReplaceAll(value, {{"\"", "\"\""}}), "\"");
  };
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto fields = RowFields(model, backend, tests[rows[i].test], rows[i]);
    std::vector<std::string> cells;
    if (i == 0) {
      for (const auto& field : fields) cells.push_back(field.first);
      std::printf("%s\n", absl::StrJoin(cells, ",").c_str());
      cells.clear();
    }
    for (const auto& field : fields) cells.push_back(cell(field.second));
    std::printf("%s\n", absl::StrJoin(cells, ",").c_str());
  }
}

// ---- the run ----

struct Plan {
  std::vector<Arm> arms;
  std::vector<int32_t> slots;
  std::vector<BenchTest> tests;
  std::vector<int> threads;      // -t: one row group each (CPU backend)
  std::vector<int32_t> ubatches;  // -ub: one row group each
  int reps = 0;
  int ctx = 0;
  std::string format;  // md | json | jsonl | csv
  bool cuda = false;
  std::string backend_note;  // no device: the CPU backend
  CpuForwardOptions cpu;     // --kv-type (threads: the group's)
  LoadOptions load;          // --load-mode, or --mmap / --no-mmap / --mlock
  uint64_t host_cache = 0;   // --host-cache: the CPU arms' slots over the file; 0: off
};

// A comma-separated list of non-negative numbers (repeats kept, as llama-bench
// keeps them), each error naming flag.
absl::StatusOr<std::vector<int>> ParseCountList(std::string_view flag, const std::string& text) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    const absl::string_view word = absl::StripAsciiWhitespace(part);
    int n = 0;
    if (!absl::SimpleAtoi(word, &n) || n < 0) {
      return absl::InvalidArgumentError(absl::StrFormat("%s '%s': '%s' is not a count (0 or more)",
                                                        flag, text, std::string(word)));
    }
    out.push_back(n);
  }
  return out;
}

// The tests of -p (default 512), -n (default 128) and -pg, in llama-bench's
// order; a value listed twice is a row twice, as there.
absl::StatusOr<std::vector<BenchTest>> MakeTests() {
  std::vector<BenchTest> tests;
  const std::string p_text = absl::GetFlag(FLAGS_p);
  MG_ASSIGN_OR_RETURN(
      const std::vector<int> ps,
      ParseCountList("-p", p_text.empty() ? absl::StrCat(kDefaultPrompt) : p_text));
  for (const int p : ps) {
    if (p > 0) tests.push_back({absl::StrCat("pp", p), p, 0, false, p, p, 0});
  }
  const std::string n_text = absl::GetFlag(FLAGS_n);
  MG_ASSIGN_OR_RETURN(
      const std::vector<int> ns,
      ParseCountList("-n", n_text.empty() ? absl::StrCat(kDefaultGenerate) : n_text));
  // A tg row feeds one token to start from; llama-bench's n_prompt is 0.
  for (const int n : ns) {
    if (n > 0) tests.push_back({absl::StrCat("tg", n), 1, n, true, n, 0, n});
  }
  if (const std::string text = absl::GetFlag(FLAGS_pg); !text.empty()) {
    MG_ASSIGN_OR_RETURN(const std::vector<int> pg, ParseCountList("-pg", text));
    for (size_t i = 0; i < pg.size(); i += 2) {
      if (i + 1 == pg.size() || pg[i] < 1 || pg[i + 1] < 1) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "-pg '%s': pairs of a prompt length and a token count, both positive (e.g. 512,128; "
            "each -pg adds one)",
            text));
      }
      tests.push_back({absl::StrCat("pp", pg[i], "+tg", pg[i + 1]), pg[i], pg[i + 1], true,
                       pg[i] + pg[i + 1], pg[i], pg[i + 1]});
    }
  }
  if (tests.empty()) return absl::InvalidArgumentError("-p 0 and -n 0 leave no test to run");
  return tests;
}

absl::StatusOr<Plan> MakePlan() {
  Plan plan;
  MG_ASSIGN_OR_RETURN(plan.arms, ParseArms(absl::GetFlag(FLAGS_arms)));
  MG_ASSIGN_OR_RETURN(plan.slots, ParseSlotList(absl::GetFlag(FLAGS_slots)));
  plan.format = absl::GetFlag(FLAGS_o).empty() ? "md" : absl::GetFlag(FLAGS_o);
  if (plan.format != "md" && plan.format != "json" && plan.format != "jsonl" &&
      plan.format != "csv") {
    return absl::InvalidArgumentError(
        absl::StrFormat("-o '%s': bench prints md (the default), json, jsonl or csv", plan.format));
  }
  plan.reps = absl::GetFlag(FLAGS_r);
  if (plan.reps < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("-r %d must be at least 1", plan.reps));
  }
  MG_ASSIGN_OR_RETURN(plan.tests, MakeTests());
  int64_t needed = 0;
  for (const BenchTest& test : plan.tests) {
    needed = std::max<int64_t>(needed, int64_t{test.prompt} + test.generate);
  }
  if (needed > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "-p/-n/-pg: the tests need %d positions, more than a context holds", needed));
  }
  plan.ctx = absl::GetFlag(FLAGS_ctx);
  if (plan.ctx < 0 || (plan.ctx > 0 && plan.ctx < needed)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--ctx %d is too small: the tests need %d positions", plan.ctx, needed));
  }
  if (plan.ctx == 0) plan.ctx = static_cast<int>(needed);
  if (const int s = absl::GetFlag(FLAGS_steps_per_launch); s < 1 || s > kMaxStepsPerLaunch) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--steps-per-launch %d is not in [1, %d]", s, kMaxStepsPerLaunch));
  }
  MG_ASSIGN_OR_RETURN(plan.cuda, BackendIsCuda(&plan.backend_note));
  MG_ASSIGN_OR_RETURN(plan.load, ReadLoadFlags(plan.cuda));
  MG_ASSIGN_OR_RETURN(plan.cpu.kv_type, ReadKvType());
  MG_ASSIGN_OR_RETURN(plan.host_cache, ReadHostCache(plan.cuda, &plan.load));
  if (plan.host_cache > 0 && !absl::GetFlag(FLAGS_slots).empty()) {
    return absl::InvalidArgumentError(
        "--host-cache sizes the expert cache: give it without --slots");
  }
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_ub), ',')) {
    MG_ASSIGN_OR_RETURN(const int32_t ub, ParseUbatch(part));
    plan.ubatches.push_back(ub);
  }
  const std::string threads = absl::GetFlag(FLAGS_t);
  for (absl::string_view part : absl::StrSplit(threads, ',')) {
    MG_ASSIGN_OR_RETURN(int t, ParseThreads(absl::StripAsciiWhitespace(part)));
    if (t == 0) t = PhysicalCores();
    plan.threads.push_back(t);
  }
  return plan;
}

// The doors of an arm; a door in the environment that turns it into another arm
// would mislabel its row, so that is an error.
absl::StatusOr<Doors> ArmDoors(Arm arm) {
  MG_ASSIGN_OR_RETURN(const ResolvedDoors resolved, ResolveDoors(arm, ProcessEnv()));
  if (resolved.arm != arm) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--arms %s: the MOEGRAPH_* doors in the environment make it the %s arm; unset them to "
        "benchmark the arms",
        Av(ArmName(arm)), Av(ArmName(resolved.arm))));
  }
  return resolved.doors;
}

absl::Status Bench() {
  const std::string path = absl::GetFlag(FLAGS_m);
  if (path.empty()) return absl::InvalidArgumentError("-m FILE is required");
  MG_ASSIGN_OR_RETURN(const Plan plan, MakePlan());
  std::vector<Doors> doors;
  for (Arm arm : plan.arms) {
    MG_ASSIGN_OR_RETURN(Doors d, ArmDoors(arm));
    doors.push_back(d);
  }
  MG_ASSIGN_OR_RETURN(const std::unique_ptr<GgufFile> file, GgufFile::Open(path));
  MG_ASSIGN_OR_RETURN(const Model model, LoadModel(*file));
  const ModelConfig& cfg = model.config;

  std::optional<RoutingTrace> trace;
  if (const std::string trace_path = absl::GetFlag(FLAGS_routing_trace); !trace_path.empty()) {
    absl::StatusOr<RoutingTrace> read = ReadTrace(trace_path);
    // The reader's errors name the file already.
    if (!read.ok()) return Prefixed(read.status(), "--routing-trace");
    if (const absl::Status s = CheckRoutingTrace(*read, cfg); !s.ok()) {
      return Prefixed(absl::Status(s.code(), absl::StrCat(s.message(), " (it must match ", path,
                                                          ")")),
                      absl::StrCat("--routing-trace ", trace_path));
    }
    trace = std::move(*read);
  }
  const std::string record_path = absl::GetFlag(FLAGS_record_routing);
  int64_t steps_per_engine = 0;
  for (const BenchTest& test : plan.tests) steps_per_engine += (1 + plan.reps) * test.steps();

  // Numbers from the CPU emulator say so in every row.
  const std::string backend =
      !plan.cuda ? "cpu" : (CudaDeviceIsEmulated() ? "cuda-emulator" : "cuda");
  const ModelInfo info = DescribeModel(model);
  // Notes go to stderr: stdout holds the table (or JSON, CSV) alone.
  std::FILE* notes = stderr;
  MG_RETURN_IF_ERROR(CheckContext(model, plan.cuda, plan.cpu, plan.ctx, notes));
  MG_RETURN_IF_ERROR(CheckHostCache(model, plan.host_cache));
  MG_RETURN_IF_ERROR(ReadWeights(file.get(), plan.load, notes));
  if (!plan.backend_note.empty()) std::fprintf(notes, "note: %s\n", plan.backend_note.c_str());
  if (plan.cuda && (plan.threads.size() > 1 || !absl::GetFlag(FLAGS_t).empty())) {
    std::fprintf(notes, "note: -t applies to the CPU backend only\n");
  }
  // Row groups: each (thread count, ubatch) of the lists, in llama-bench's
  // nesting (threads outer); CUDA has one thread group.
  struct RowGroup {
    int threads = 0;
    int32_t ubatch = 0;
  };
  std::vector<RowGroup> row_groups;
  for (const int threads : plan.cuda ? std::vector<int>{0} : plan.threads) {
    for (const int32_t ub : plan.ubatches) row_groups.push_back({threads, ub});
  }
  if (!plan.cuda) {
    std::fprintf(notes,
                 "note: backend cpu: arms map as in `moegraph run`: resident reads every expert in "
                 "place (no slots), "
                 "stage turns the cache off, graph/eager/host run the CPU pipeline with the "
                 "policy; no device, so host syncs and launches are 0\n");
  }
  if (plan.cuda && CudaDeviceIsEmulated()) {
    std::fprintf(notes,
                 "note: backend cuda runs on the CPU emulator (docs/EMULATOR.md): hit %%, MiB/tok, "
                 "syncs/tok and launches/tok are the engine's own; t/s and stage GB/s are the "
                 "emulator's, not a GPU's\n");
  }
  std::fprintf(notes, "note: policy %s; stage GB/s is %s\n",
               DescribePolicy(doors[0].policy, doors[0].protected_frac).c_str(),
               plan.cuda ? "bytes staged / timed wall time (a lower bound on the copy path)"
                         : "bytes staged / time inside the stage memcpys");
  if (trace.has_value()) {
    std::fprintf(notes, "note: routing from %s: %lld steps (they wrap around), %s\n",
                 absl::GetFlag(FLAGS_routing_trace).c_str(),
                 static_cast<long long>(trace->n_steps),
                 trace->weights.empty() ? "weights 1/k" : "the trace's weights");
  }

  // One copy of the experts, pinned on CUDA, shared by every engine of the run;
  // the CPU backend's resident arm reads the file in place and needs none.
  std::shared_ptr<const ExpertStore> store;
  std::unique_ptr<ExpertFileReader> disk;  // --host-cache: the arms with slots read misses here
  std::vector<int32_t> slot_list = plan.slots;
  if (plan.cuda) {
    MG_ASSIGN_OR_RETURN(store, CudaEngine::PinExperts(model));
  } else if (plan.host_cache > 0) {
    MG_ASSIGN_OR_RETURN(ExpertStore s, ExpertStore::Layouts(model));
    MG_ASSIGN_OR_RETURN(const int32_t slots, HostCacheSlots(s, cfg, plan.host_cache));
    slot_list = {slots};
    store = std::make_shared<const ExpertStore>(std::move(s));
    MG_ASSIGN_OR_RETURN(disk, ExpertFileReader::Open(model));
    std::fprintf(notes,
                 "note: --host-cache %.0f MiB: %d expert slots; the arms with slots read each "
                 "miss from %s%s, so MiB/tok is the blocks read from disk and stage GB/s their "
                 "bytes over the time decode waited on them (above the disk's rate where reads "
                 "overlap the experts already there); stage reads every selected expert each token; resident reads the file "
                 "in place\n",
                 plan.host_cache / 1048576.0, slots, path.c_str(),
                 disk->direct() ? " with O_DIRECT" : " through the page cache");
  } else if (std::any_of(plan.arms.begin(), plan.arms.end(),
                         [](Arm arm) { return arm != Arm::kResident; })) {
    MG_ASSIGN_OR_RETURN(ExpertStore s, ExpertStore::Create(model));
    store = std::make_shared<const ExpertStore>(std::move(s));
  }
  const RoutingTrace* trace_ptr = trace.has_value() ? &*trace : nullptr;
  const bool progress = isatty(STDERR_FILENO) != 0;

  // Engines in output order (arm, then slot count); rows (engine, test). Engine
  // g's group is its slot count's index; arms that ignore --slots join group 0.
  struct Engine {
    size_t arm = 0;
    int32_t slots_requested = 0;  // 0: auto; -1: an arm that ignores --slots
    size_t group = 0;
  };
  std::vector<Engine> engines;
  for (size_t a = 0; a < plan.arms.size(); ++a) {
    if (!UsesSlots(plan.arms[a])) {
      engines.push_back({a, -1, 0});
      continue;
    }
    for (size_t s = 0; s < slot_list.size(); ++s) engines.push_back({a, slot_list[s], s});
  }
  // Rows: (row group, engine, test).
  const size_t n_tests = plan.tests.size();
  std::vector<Row> rows;
  for (const RowGroup& rg : row_groups) {
    for (const Engine& e : engines) {
      for (size_t t = 0; t < n_tests; ++t) {
        rows.push_back({rg.threads, rg.ubatch, plan.arms[e.arm], 0, e.slots_requested, t, {}});
      }
    }
  }

  for (size_t row_group = 0; row_group < row_groups.size(); ++row_group) {
    CpuForwardOptions cpu = plan.cpu;
    cpu.threads = row_groups[row_group].threads;
    cpu.ubatch = row_groups[row_group].ubatch;
    const size_t first_row = row_group * engines.size() * n_tests;
    for (size_t group = 0; group < slot_list.size(); ++group) {
      std::vector<size_t> members;  // engine indices
      std::vector<std::unique_ptr<Target>> targets;
      // The engines without a pool policy (resident, stage) are made first, so the
      // others budget --slots auto from what they leave: the first of those splits
      // the free memory evenly among them all, and the rest take its slot count,
      // so every arm of the group runs at the same count and all of them fit.
      std::vector<size_t> order;
      for (size_t g = 0; g < engines.size(); ++g) {
        if (engines[g].group == group && engines[g].slots_requested < 0) order.push_back(g);
      }
      const size_t fixed_engines = order.size();
      for (size_t g = 0; g < engines.size(); ++g) {
        if (engines[g].group == group && engines[g].slots_requested >= 0) order.push_back(g);
      }
      const int32_t sharing = static_cast<int32_t>(order.size() - fixed_engines);
      int32_t auto_slots = 0;  // the count the first auto engine of the group got
      for (const size_t g : order) {
        const Engine& e = engines[g];
        // Engine 0 (always in group 0) is the one whose routing is recorded.
        const int64_t record_steps =
            g == 0 && row_group == 0 && !record_path.empty() ? steps_per_engine : 0;
        const int32_t slots = e.slots_requested != 0 ? std::max(e.slots_requested, 0) : auto_slots;
        absl::StatusOr<std::unique_ptr<Target>> target =
            plan.cuda ? CudaTarget::Create(model, store, doors[e.arm], slots,
                                           e.slots_requested == 0 && slots == 0 ? sharing : 1,
                                           plan.ctx, cpu.ubatch, trace_ptr, record_steps)
                      : CpuTarget::Create(model, store.get(), doors[e.arm], plan.arms[e.arm], slots,
                                          plan.ctx, cpu, trace_ptr, disk.get());
        if (!target.ok()) {
          return Prefixed(target.status(), absl::StrCat("arm ", Av(ArmName(plan.arms[e.arm]))));
        }
        if (plan.cuda && e.slots_requested == 0) {
          if (auto_slots == 0) {
            auto_slots = (*target)->slots();
          } else if ((*target)->slots() != auto_slots) {
            // The budget left this arm less than the first: a fair row needs one count.
            return absl::ResourceExhaustedError(absl::StrFormat(
                "--slots auto: arm %s got %d slots where the group's first arm got %d; pass "
                "--slots %d (or fewer) to run every arm at one count",
                Av(ArmName(plan.arms[e.arm])), (*target)->slots(), auto_slots, (*target)->slots()));
          }
        }
        members.push_back(g);
        targets.push_back(std::move(*target));
      }
      for (size_t t = 0; t < n_tests; ++t) {
        const BenchTest& test = plan.tests[t];
        for (auto& target : targets) MG_RETURN_IF_ERROR(target->Run(test).status());
        for (int rep = 0; rep < plan.reps; ++rep) {
          for (size_t i = 0; i < targets.size(); ++i) {
            Row& row = rows[first_row + members[i] * n_tests + t];
            if (progress) {
              std::fprintf(
                  stderr, "\rbench: %s slots %d %s%s rep %d/%d        ",
                  std::string(ArmName(row.arm)).c_str(), targets[i]->slots(), test.name.c_str(),
                  plan.cuda ? "" : absl::StrCat(" -t ", row.threads).c_str(), rep + 1, plan.reps);
            }
            MG_ASSIGN_OR_RETURN(const Sample sample, targets[i]->Run(test));
            row.slots = targets[i]->slots();
            row.samples.push_back(sample);
          }
        }
      }
      if (group == 0 && row_group == 0 && !record_path.empty()) {
        // Every arm computes the same outputs, so routes alike: engine 0's routing.
        const size_t recorder = static_cast<size_t>(
            std::find(members.begin(), members.end(), size_t{0}) - members.begin());
        MG_ASSIGN_OR_RETURN(const std::vector<int32_t> routing, targets[recorder]->Routing());
        MG_RETURN_IF_ERROR(WriteRoutingRecord(routing, cfg, record_path));
      }
    }
  }
  if (progress) std::fprintf(stderr, "\r%60s\r", "");
  if (plan.format == "json" || plan.format == "jsonl") {
    PrintJson(info, backend, plan.tests, rows, plan.format == "jsonl");
  } else if (plan.format == "csv") {
    PrintCsv(info, backend, plan.tests, rows);
  } else {
    PrintMarkdown(info, backend, plan.tests, rows);
  }
  if (!record_path.empty()) {
    std::fprintf(notes, "note: wrote the routing of %lld steps to %s\n",
                 static_cast<long long>(steps_per_engine), record_path.c_str());
  }
  return absl::OkStatus();
}

}  // namespace

int RunBench(const std::vector<std::string>& args) {
  return RunModelCommand("bench", args, Bench);
}

}  // namespace moegraph
