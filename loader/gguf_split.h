// Split GGUF models, as llama.cpp's gguf-split writes them: PREFIX-00001-of-00003.gguf, ...
// Shard 1 carries every metadata key; every shard carries split.no (u16, 0-based),
// split.tensors.count (i32, the model's tensors in all shards) and split.count (u16).
// GgufFile::Open reads them (loader/gguf.h); WriteSplit writes them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "loader/gguf.h"

namespace moegraph {

// LLM_KV_SPLIT_NO, LLM_KV_SPLIT_COUNT, LLM_KV_SPLIT_TENSORS_COUNT (llama.cpp src/llama-arch.cpp).
inline constexpr char kSplitNoKey[] = "split.no";
inline constexpr char kSplitCountKey[] = "split.count";
inline constexpr char kSplitTensorsCountKey[] = "split.tensors.count";

// "PREFIX-0000N-of-0000M.gguf" for 0-based split_no, as llama_split_path (src/llama.cpp).
std::string SplitPath(std::string_view prefix, int split_no, int split_count);

// PREFIX when path is SplitPath(PREFIX, split_no, split_count) with a non-empty PREFIX,
// as llama_split_prefix (src/llama.cpp); otherwise none.
std::optional<std::string> SplitPrefix(std::string_view path, int split_no, int split_count);

// How tensors are grouped into shards, as gguf-split's split_strategy
// (tools/gguf-split/gguf-split.cpp): a new shard every max_tensors tensors, or (when
// max_bytes > 0) before the tensor that would take the shard's data, each tensor padded
// to 32 bytes, past max_bytes.
struct SplitOptions {
  int max_tensors = 128;  // gguf-split's default --split-max-tensors
  uint64_t max_bytes = 0;
  bool no_tensor_first_split = false;  // shard 1 holds the metadata only
};

// The tensors (indices into file.tensors(), in order) of each shard.
absl::StatusOr<std::vector<std::vector<size_t>>> PlanSplit(const GgufFile& file,
                                                           const SplitOptions& options);

// Writes plan's shards of file to SplitPath(prefix, i, plan.size()) and returns their
// paths. Shard 1 has file's metadata (its split.* keys replaced), the others only the
// split.* keys and the default alignment, as gguf-split writes them.
absl::StatusOr<std::vector<std::string>> WriteSplit(const GgufFile& file,
                                                    const std::vector<std::vector<size_t>>& plan,
                                                    const std::string& prefix);

}  // namespace moegraph
