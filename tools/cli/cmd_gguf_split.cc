// moegraph gguf-split: a GGUF model into shards as llama.cpp's gguf-split --split writes
// them (loader/gguf_split.h), with its flags' spellings.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "loader/gguf.h"
#include "loader/gguf_split.h"
#include "loader/status_util.h"
#include "tools/cli/commands.h"

// What each flag means: tools/cli/command_line.cc.
ABSL_FLAG(int32_t, split_max_tensors, moegraph::kUnsetFlag,
          "gguf-split: most tensors in one shard (unset: 128, as llama.cpp's gguf-split)");
ABSL_FLAG(std::string, split_max_size, "",
          "gguf-split: most tensor bytes in one shard, N followed by M (10^6) or G (10^9)");
ABSL_FLAG(bool, no_tensor_first_split, false,
          "gguf-split: shard 1 holds the metadata and no tensors");
ABSL_FLAG(bool, dry_run, false, "gguf-split: print the shards and write nothing");

namespace moegraph {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// gguf-split's split_str_to_n_bytes: decimal megabytes or gigabytes.
absl::StatusOr<uint64_t> MaxSizeBytes(const std::string& text) {
  const std::string_view number = std::string_view(text).substr(0, text.size() - 1);
  const char unit = text.empty() ? '\0' : text.back();
  uint64_t n = 0;
  if ((unit != 'M' && unit != 'G') || !absl::SimpleAtoi(Av(number), &n) || n == 0 ||
      n > (uint64_t{1} << 32)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--split-max-size '", text, "': expected a positive number followed by M or G (4G)"));
  }
  return n * (unit == 'M' ? 1000 * 1000 : 1000 * 1000 * 1000);
}

absl::StatusOr<SplitOptions> Options() {
  SplitOptions options;
  const int32_t max_tensors = absl::GetFlag(FLAGS_split_max_tensors);
  const std::string max_size = absl::GetFlag(FLAGS_split_max_size);
  if (max_tensors != kUnsetFlag && !max_size.empty()) {
    return absl::InvalidArgumentError(
        "--split-max-tensors and --split-max-size: give one of them, as llama.cpp's gguf-split");
  }
  if (!max_size.empty()) {
    MG_ASSIGN_OR_RETURN(options.max_bytes, MaxSizeBytes(max_size));
  } else if (max_tensors != kUnsetFlag) {
    if (max_tensors < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--split-max-tensors ", max_tensors, " must be at least 1"));
    }
    options.max_tensors = max_tensors;
  }
  options.no_tensor_first_split = absl::GetFlag(FLAGS_no_tensor_first_split);
  return options;
}

// Writing a shard over a file that is mapped (the input, or one of its shards) would
// pull the bytes from under the copy.
absl::Status CheckNotInput(const GgufFile& in, const std::string& out) {
  for (int i = 0; i < in.shard_count(); ++i) {
    std::error_code error;
    if (std::filesystem::equivalent(in.shard(i).path(), out, error)) {
      return absl::InvalidArgumentError(
          absl::StrCat(out, ": is the input ", in.shard(i).path(), "; choose another OUT_PREFIX"));
    }
  }
  return absl::OkStatus();
}

absl::Status Split(const std::vector<std::string>& args) {
  MG_ASSIGN_OR_RETURN(const SplitOptions options, Options());
  MG_ASSIGN_OR_RETURN(const std::unique_ptr<GgufFile> in, GgufFile::Open(args[0]));
  MG_ASSIGN_OR_RETURN(const std::vector<std::vector<size_t>> plan, PlanSplit(*in, options));
  const int n = static_cast<int>(plan.size());
  // As gguf-split's print_info, with the tensor bytes in MiB.
  std::printf("n_split: %d\n", n);
  for (int i = 0; i < n; ++i) {
    uint64_t bytes = 0;
    for (size_t t : plan[i]) bytes += in->tensors()[t].nbytes;
    std::printf("split %05d: n_tensors = %zu, tensor data = %.2f MiB\n", i + 1, plan[i].size(),
                static_cast<double>(bytes) / kMiB);
  }
  if (absl::GetFlag(FLAGS_dry_run)) return absl::OkStatus();
  for (int i = 0; i < n; ++i) MG_RETURN_IF_ERROR(CheckNotInput(*in, SplitPath(args[1], i, n)));
  MG_ASSIGN_OR_RETURN(const std::vector<std::string> paths, WriteSplit(*in, plan, args[1]));
  // Reading the shards back validates them as every command will open them.
  MG_ASSIGN_OR_RETURN(const std::unique_ptr<GgufFile> out, GgufFile::Open(paths[0]));
  for (int i = 0; i < out->shard_count(); ++i) {
    std::printf("wrote %s: %.2f MiB\n", out->shard(i).path().c_str(),
                static_cast<double>(out->shard(i).file_size()) / kMiB);
  }
  std::printf("%d shards, %zu tensors, %.2f MiB\n", out->shard_count(), out->tensors().size(),
              static_cast<double>(out->total_size()) / kMiB);
  return absl::OkStatus();
}

}  // namespace

int RunGgufSplit(const std::vector<std::string>& args) {
  if (args.size() != 2) {
    std::fprintf(stderr, "usage: moegraph gguf-split [flags] IN.gguf OUT_PREFIX\n");
    return 2;
  }
  if (absl::Status s = Split(args); !s.ok()) {
    std::fprintf(stderr, "moegraph gguf-split: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}

}  // namespace moegraph
