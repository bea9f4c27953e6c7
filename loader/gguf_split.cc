#include "loader/gguf_split.h"

#include <cstdio>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "loader/gguf_writer.h"
#include "loader/status_util.h"

namespace moegraph {
namespace {

// gguf-split pads each tensor to GGUF_DEFAULT_ALIGNMENT when it sums a shard's size.
uint64_t PaddedBytes(uint64_t n) {
  return (n + kGgufDefaultAlignment - 1) / kGgufDefaultAlignment * kGgufDefaultAlignment;
}

bool IsSplitKey(std::string_view key) {
  return key == kSplitNoKey || key == kSplitCountKey || key == kSplitTensorsCountKey;
}

// The shape as gguf_write_to_buf writes it: ggml_n_dims dimensions (trailing 1s dropped,
// at least one).
std::vector<int64_t> WrittenShape(const GgufTensor& t) {
  int n_dims = 1;
  for (int i = kGgufMaxDims - 1; i >= 1; --i) {
    if (t.ne[i] > 1) {
      n_dims = i + 1;
      break;
    }
  }
  return std::vector<int64_t>(t.ne, t.ne + n_dims);
}

// "-%05d-of-%05d.gguf", llama_split_path's format after the prefix.
std::string Postfix(int split_no, int split_count) {
  return absl::StrCat("-", absl::Dec(split_no + 1, absl::kZeroPad5), "-of-",
                      absl::Dec(split_count, absl::kZeroPad5), ".gguf");
}

}  // namespace

std::string SplitPath(std::string_view prefix, int split_no, int split_count) {
  return absl::StrCat(Av(prefix), Postfix(split_no, split_count));
}

std::optional<std::string> SplitPrefix(std::string_view path, int split_no, int split_count) {
  const std::string postfix = Postfix(split_no, split_count);
  if (path.size() <= postfix.size() || !absl::EndsWith(Av(path), postfix)) return std::nullopt;
  return std::string(path.substr(0, path.size() - postfix.size()));
}

absl::StatusOr<std::vector<std::vector<size_t>>> PlanSplit(const GgufFile& file,
                                                           const SplitOptions& options) {
  if (options.max_bytes == 0 && options.max_tensors < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--split-max-tensors ", options.max_tensors, " must be at least 1"));
  }
  const std::vector<GgufTensor>& tensors = file.tensors();
  std::vector<std::vector<size_t>> plan(1);
  // gguf-split's new_ctx_out: a shard closed with no tensors is an error, except a first
  // shard left empty on purpose.
  auto next_shard = [&](const GgufTensor& t) -> absl::Status {
    if (plan.back().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          file.path(), ": tensor '", t.name, "' (", t.nbytes,
          " bytes) would leave a shard with no tensors; --split-max-size is below its size"));
    }
    plan.emplace_back();
    return absl::OkStatus();
  };
  if (options.no_tensor_first_split) plan.emplace_back();
  uint64_t shard_bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t n_bytes = PaddedBytes(tensors[i].nbytes);
    const bool split = options.max_bytes > 0
                           ? shard_bytes + n_bytes > options.max_bytes
                           : i > 0 && i % static_cast<size_t>(options.max_tensors) == 0;
    if (split) {
      MG_RETURN_IF_ERROR(next_shard(tensors[i]));
      shard_bytes = n_bytes;
    } else {
      shard_bytes += n_bytes;
    }
    plan.back().push_back(i);
  }
  return plan;
}

absl::StatusOr<std::vector<std::string>> WriteSplit(const GgufFile& file,
                                                    const std::vector<std::vector<size_t>>& plan,
                                                    const std::string& prefix) {
  const int split_count = static_cast<int>(plan.size());
  if (split_count > UINT16_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        file.path(), ": ", split_count, " shards; split.count is a u16 (at most 65535)"));
  }
  if (file.tensors().size() > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat(
        file.path(), ": ", file.tensors().size(), " tensors do not fit split.tensors.count (i32)"));
  }
  std::vector<std::string> paths;
  for (int i = 0; i < split_count; ++i) {
    // As gguf-split's split_strategy: every key in shard 1 (gguf_set_kv), then in every
    // shard split.no, split.tensors.count and split.count, replacing any the input had.
    // split.count comes last: it is set once the shards are known, and gguf_set_val_u16
    // removes a key and appends it.
    GgufWriter writer(i == 0 ? static_cast<uint32_t>(file.alignment()) : kGgufDefaultAlignment);
    if (i == 0) {
      for (const GgufKV& kv : file.kvs()) {
        if (!IsSplitKey(kv.key)) writer.SetValue(kv);
      }
    }
    writer.SetUint16(kSplitNoKey, static_cast<uint16_t>(i));
    writer.SetInt32(kSplitTensorsCountKey, static_cast<int32_t>(file.tensors().size()));
    writer.SetUint16(kSplitCountKey, static_cast<uint16_t>(split_count));
    for (size_t index : plan[i]) {
      const GgufTensor& t = file.tensors()[index];
      // The data is padded to the shard's own alignment, which is where its tensor infos
      // say the next tensor starts (gguf-split pads to 32, the same unless the input's
      // general.alignment differs).
      writer.AddTensor(t.name, t.ggml_type(), WrittenShape(t),
                       [&t](uint8_t* dst, size_t n) { std::memcpy(dst, t.data, n); });
    }
    paths.push_back(SplitPath(prefix, i, split_count));
    if (absl::Status s = writer.WriteFile(paths.back()); !s.ok()) {
      for (const std::string& written : paths) std::remove(written.c_str());
      return s;
    }
  }
  return paths;
}

}  // namespace moegraph
