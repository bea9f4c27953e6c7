// moegraph quantize: a GGUF model rewritten with its weight matrices in one
// type, as llama.cpp's `llama-quantize --pure IN OUT TYPE` writes it
// (loader/requantize.h), then read back and listed by type.
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "loader/ggml_type.h"
#include "loader/gguf.h"
#include "loader/quantize.h"
#include "loader/requantize.h"
#include "loader/status_util.h"
#include "tools/cli/commands.h"

namespace moegraph {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// A ggml type name in any case (q8_0, Q8_0, q4_k), or llama-quantize's _S name
// of a k-quant (Q4_K_S), which --pure writes as that type throughout.
absl::StatusOr<GgmlType> ParseTarget(std::string name) {
  std::string lower = absl::AsciiStrToLower(name);
  if (lower.size() > 2 && lower.substr(lower.size() - 2) == "_s" && lower[lower.size() - 3] == 'k') {
    lower.resize(lower.size() - 2);
  }
  for (uint32_t id = 0; id < 64; ++id) {
    const GgmlTypeInfo* info = ggml_type_info(id);
    if (info != nullptr && absl::AsciiStrToLower(std::string(info->name)) == lower &&
        quant_supported(static_cast<GgmlType>(id))) {
      return static_cast<GgmlType>(id);
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "TYPE '", name, "': one of ", quant_supported_names(),
      " (llama-quantize's mixtures such as Q4_K_M are not written; Q4_K_S is q4_K throughout)"));
}

absl::Status Quantize(const std::vector<std::string>& args) {
  MG_ASSIGN_OR_RETURN(const GgmlType target, ParseTarget(args[2]));
  MG_ASSIGN_OR_RETURN(const std::unique_ptr<GgufFile> in, GgufFile::Open(args[0]));
  for (int i = 0; i < in->shard_count(); ++i) {
    std::error_code error;
    if (std::filesystem::equivalent(in->shard(i).path(), args[1], error)) {
      return absl::InvalidArgumentError(
          absl::StrCat(args[1], ": is the input; choose another OUT.gguf"));
    }
  }
  MG_RETURN_IF_ERROR(RequantizeFile(*in, target, args[1], nullptr));
  MG_ASSIGN_OR_RETURN(const std::unique_ptr<GgufFile> out, GgufFile::Open(args[1]));
  std::map<std::string, int> types;
  for (const GgufTensor& t : out->tensors()) ++types[ggml_type_name(t.type)];
  std::string counts;
  for (const auto& [type, n] : types) absl::StrAppend(&counts, counts.empty() ? "" : ", ", n, " ", type);
  std::printf("wrote %s: %.2f MiB (from %.2f MiB), %zu tensors: %s\n", args[1].c_str(),
              static_cast<double>(out->total_size()) / kMiB,
              static_cast<double>(in->total_size()) / kMiB, out->tensors().size(), counts.c_str());
  return absl::OkStatus();
}

}  // namespace

int RunQuantize(const std::vector<std::string>& args) {
  if (args.size() != 3) {
    std::fprintf(stderr, "usage: moegraph quantize IN.gguf OUT.gguf TYPE\n");
    return 2;
  }
  if (absl::Status s = Quantize(args); !s.ok()) {
    std::fprintf(stderr, "moegraph quantize: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}

}  // namespace moegraph
