// moegraph-gates: runs the gates (gates/gates.h) on the CPU backend or the CUDA
// engine and prints one line per gate and a summary. Without -m it writes its
// own small fixtures to a temporary folder: a skewed router over more experts
// than slots, so a decode hits, misses and evicts.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "capture/engine.h"
#include "gates/gate.h"
#include "gates/gates.h"
#include "loader/fixture.h"
#include "loader/gguf.h"
#include "loader/model_config.h"
#include "loader/status_util.h"

ABSL_FLAG(bool, list, false, "print the gates with one-line descriptions and exit");
ABSL_FLAG(std::string, only, "", "run only these gates (comma-separated names)");
ABSL_FLAG(std::string, m, "",
          "model file (GGUF); empty: small fixtures written to a temporary folder");
ABSL_FLAG(std::string, backend, "auto",
          "cpu | cuda | auto (auto: cuda when a device exists, else cpu)");
ABSL_FLAG(int32_t, slots, 0,
          "expert slots over all size classes; 0: a quarter of the experts (at least top-k)");

namespace moegraph {
namespace {

// A model with the file its weights point into.
struct LoadedModel {
  std::unique_ptr<GgufFile> file;
  Model model;
};

absl::StatusOr<std::unique_ptr<LoadedModel>> Load(const std::string& path) {
  auto loaded = std::make_unique<LoadedModel>();
  MG_ASSIGN_OR_RETURN(loaded->file, GgufFile::Open(path));
  MG_ASSIGN_OR_RETURN(loaded->model, LoadModel(*loaded->file));
  return loaded;
}

// The harness's own fixtures: 3 layers of 16 experts, top-4, a skewed router.
FixtureSpec FixtureOf(GgmlType expert_type) {
  FixtureSpec spec;
  spec.arch = Arch::kQwen3Moe;
  spec.n_layer = 3;
  spec.n_expert = 16;
  spec.n_expert_used = 4;
  spec.expert_type = expert_type;
  // K-quant rows are 256 wide.
  spec.n_embd = expert_type == GgmlType::kQ4_K ? 256 : 64;
  spec.n_ff_exp = expert_type == GgmlType::kQ4_K ? 256 : 32;
  spec.router_skew = 1.0f;
  spec.seed = 5;
  return spec;
}

// A temporary folder, removed with everything in it when this goes away.
class TempFolder {
 public:
  static absl::StatusOr<std::unique_ptr<TempFolder>> Create() {
    std::error_code error;
    std::filesystem::path base = std::filesystem::temp_directory_path(error);
    if (error) base = "/tmp";
    std::string pattern = (base / "moegraph-gates-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) {
      return absl::InternalError(
          absl::StrFormat("cannot create a temporary folder from %s", pattern));
    }
    return std::unique_ptr<TempFolder>(new TempFolder(pattern));
  }
  TempFolder(const TempFolder&) = delete;
  TempFolder& operator=(const TempFolder&) = delete;
  ~TempFolder() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  explicit TempFolder(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

absl::Status Run(int* exit_code) {
  const std::vector<Gate> gates = AllGates();
  if (absl::GetFlag(FLAGS_list)) {
    std::fputs(ListGates(gates).c_str(), stdout);
    return absl::OkStatus();
  }
  MG_ASSIGN_OR_RETURN(const std::vector<const Gate*> selected,
                      SelectGates(gates, absl::GetFlag(FLAGS_only)));

  const std::string backend = absl::GetFlag(FLAGS_backend);
  if (backend != "cpu" && backend != "cuda" && backend != "auto") {
    return absl::InvalidArgumentError(
        absl::StrFormat("--backend '%s' is not one of cpu, cuda, auto", backend));
  }
  const bool has_device = CudaDeviceCount() > 0;
  if (backend == "cuda" && !has_device) {
    return absl::FailedPreconditionError(
        absl::StrCat("--backend cuda: no CUDA device is available (", NoCudaDeviceReason(), ")"));
  }
  GateContext context;
  context.backend = backend == "cpu" || !has_device ? Backend::kCpu : Backend::kCuda;
  context.cuda_skip_reason =
      has_device ? "needs the CUDA engine, and --backend cpu was asked for"
                 : absl::StrCat("needs a CUDA device (", NoCudaDeviceReason(), ")");
  context.make_engine =
      context.backend == Backend::kCuda ? CudaEngineFactory() : CpuEngineFactory();

  std::unique_ptr<TempFolder> temp;
  std::vector<std::unique_ptr<LoadedModel>> models;
  const std::string path = absl::GetFlag(FLAGS_m);
  if (!path.empty()) {
    MG_ASSIGN_OR_RETURN(models.emplace_back(), Load(path));
    context.model = {path, &models.back()->model};
    context.oracle_models = {context.model};
  } else {
    MG_ASSIGN_OR_RETURN(temp, TempFolder::Create());
    for (const GgmlType type : {GgmlType::kQ8_0, GgmlType::kF32, GgmlType::kQ4_K}) {
      const std::string name =
          absl::StrFormat("qwen3moe-%s", ggml_type_name(static_cast<uint32_t>(type)));
      const std::string file = absl::StrFormat("%s/%s.gguf", temp->path(), name);
      MG_RETURN_IF_ERROR(WriteFixture(FixtureOf(type), file));
      MG_ASSIGN_OR_RETURN(models.emplace_back(), Load(file));
      context.oracle_models.push_back({name, &models.back()->model});
    }
    context.model = context.oracle_models.front();
  }

  const ModelConfig& config = context.model.model->config;
  const int32_t n_keys = config.n_moe_layer() * config.n_expert;
  context.n_slots = absl::GetFlag(FLAGS_slots);
  if (context.n_slots < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--slots %d must not be negative", context.n_slots));
  }
  if (context.n_slots == 0) context.n_slots = std::max(config.n_expert_used, n_keys / 4);
  std::fprintf(stderr, "moegraph-gates: backend %s, model %s, %d of %d experts in slots\n",
               context.backend == Backend::kCuda ? "cuda" : "cpu", context.model.name.c_str(),
               context.n_slots, n_keys);

  const RunSummary summary = RunGates(selected, context, [](const std::string& line) {
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  });
  *exit_code = summary.exit_code();
  return absl::OkStatus();
}

}  // namespace
}  // namespace moegraph

namespace {

constexpr char kUsage[] =
    "usage: moegraph-gates [--list] [--only NAME,...] [-m FILE] [--backend cpu|cuda|auto] "
    "[--slots N]\n"
    "runs the engagement gates (docs/GATES.md): a line per gate, PASS, FAIL or SKIP, then a\n"
    "summary; exit 0 when none failed\n"
    "\n"
    "flags:\n"
    "  --list\n"
    "      print the gates with one-line descriptions and exit\n"
    "  --only NAME[,NAME...]\n"
    "      run only these gates (default: all)\n"
    "  -m FILE\n"
    "      model file (GGUF) (default: small fixtures written to a temporary folder)\n"
    "  --backend cpu|cuda|auto\n"
    "      cuda when a device exists, else cpu; GPU gates SKIP on cpu (default: auto)\n"
    "  --slots N\n"
    "      expert slots over all size classes (default: 0: a quarter of the experts, at least "
    "top-k)\n";

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    if (arg == "-h" || arg == "--help" || arg == "-help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
  }
  const std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() > 1) {
    std::fprintf(stderr, "moegraph-gates: unexpected argument '%s'\n", args[1]);
    return 2;
  }
  int exit_code = 0;
  try {
    const absl::Status status = moegraph::Run(&exit_code);
    if (!status.ok()) {
      std::fprintf(stderr, "moegraph-gates: %s\n", std::string(status.message()).c_str());
      return 2;
    }
  } catch (const std::exception& e) {
    // Errors are Statuses; one that escapes as an exception still ends in a line.
    std::fprintf(stderr, "moegraph-gates: internal error: %s\n", e.what());
    return 1;
  }
  return exit_code;
}
