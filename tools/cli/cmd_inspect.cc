// moegraph inspect FILE: what a GGUF file holds, without loading any weights.
#include <algorithm>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "loader/ggml_type.h"
#include "loader/gguf.h"
#include "loader/status_util.h"
#include "tools/cli/commands.h"

namespace moegraph {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;
constexpr size_t kMaxShownString = 60;

// File text is escaped so a crafted name cannot drive the terminal.
std::string Escaped(std::string_view s) { return absl::CHexEscape(Av(s)); }

std::string QuotedString(std::string_view s) {
  if (s.size() <= kMaxShownString) return absl::StrCat("\"", Escaped(s), "\"");
  return absl::StrCat("\"", Escaped(s.substr(0, kMaxShownString)), "...\" (", s.size(), " bytes)");
}

// One value on one line; arrays are summarized, never dumped.
std::string FormatValue(const GgufKV& kv) {
  switch (kv.type) {
    case GgufType::kUint8:
    case GgufType::kUint16:
    case GgufType::kUint32:
    case GgufType::kUint64:
      return absl::StrCat(kv.u64);
    case GgufType::kInt8:
    case GgufType::kInt16:
    case GgufType::kInt32:
    case GgufType::kInt64:
      return absl::StrCat(kv.i64);
    case GgufType::kFloat32:
      return absl::StrFormat("%.7g", kv.f64);
    case GgufType::kFloat64:
      return absl::StrFormat("%.15g", kv.f64);
    case GgufType::kBool:
      return kv.u64 != 0 ? "true" : "false";
    case GgufType::kString:
      return QuotedString(kv.str);
    case GgufType::kArray:
      return absl::StrCat("[", Av(gguf_type_name(kv.array_type)), " x ", kv.array_n, "]");
  }
  return "?";
}

bool HasPrefix(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

void AppendSection(std::string& out, std::string_view title,
                   const std::vector<const GgufKV*>& kvs) {
  if (kvs.empty()) return;
  size_t width = 0;
  for (const GgufKV* kv : kvs) width = std::max(width, Escaped(kv->key).size());
  absl::StrAppend(&out, "\n", Av(title), " (", kvs.size(), "):\n");
  for (const GgufKV* kv : kvs) {
    absl::StrAppend(&out, absl::StrFormat("  %-*s = %s\n", static_cast<int>(width),
                                          Escaped(kv->key), FormatValue(*kv)));
  }
}

std::string FormatInspect(const GgufFile& file) {
  std::string out;
  absl::StrAppend(&out, "file:          ", file.path(), "\n");
  absl::StrAppend(&out, "GGUF version:  ", file.version(), "\n");
  absl::StrAppend(&out, absl::StrFormat("size:          %d bytes (%.2f MiB)\n", file.total_size(),
                                        file.total_size() / kMiB));
  if (file.shard_count() > 1) {
    absl::StrAppend(&out, "shards:        ", file.shard_count(), "\n");
    for (int i = 0; i < file.shard_count(); ++i) {
      absl::StrAppend(&out, absl::StrFormat("  %s  %d bytes\n", file.shard(i).path(),
                                            file.shard(i).file_size()));
    }
  }
  absl::StrAppend(&out, "alignment:     ", file.alignment(), "\n");

  std::string arch;
  const GgufKV* arch_kv = file.FindKey("general.architecture");
  if (arch_kv == nullptr) {
    absl::StrAppend(&out, "architecture:  (general.architecture is not set)\n");
  } else if (arch_kv->type != GgufType::kString) {
    absl::StrAppend(&out, "architecture:  (general.architecture is ",
                    Av(gguf_type_name(arch_kv->type)), ", not str)\n");
  } else {
    arch = std::string(arch_kv->str);
    absl::StrAppend(&out, "architecture:  ", Escaped(arch), "\n");
  }

  std::vector<const GgufKV*> hparams, tokenizer, other;
  const std::string arch_prefix = arch + ".";
  for (const GgufKV& kv : file.kvs()) {
    if (HasPrefix(kv.key, "general.") || (!arch.empty() && HasPrefix(kv.key, arch_prefix))) {
      hparams.push_back(&kv);
    } else if (HasPrefix(kv.key, "tokenizer.")) {
      tokenizer.push_back(&kv);
    } else {
      other.push_back(&kv);
    }
  }
  AppendSection(out, "hyper-parameters", hparams);
  AppendSection(out, "tokenizer", tokenizer);
  AppendSection(out, "other keys", other);

  size_t name_width = 4;
  size_t shape_width = 5;
  for (const GgufTensor& t : file.tensors()) {
    name_width = std::max(name_width, Escaped(t.name).size());
    shape_width = std::max(shape_width, t.shape_string().size());
  }
  const int nw = static_cast<int>(name_width);
  const int sw = static_cast<int>(shape_width);
  absl::StrAppend(&out, "\ntensors (", file.tensors().size(), "):\n");
  absl::StrAppend(
      &out, absl::StrFormat("  %-*s  %-8s  %-*s  %10s\n", nw, "name", "type", sw, "shape", "MiB"));
  uint64_t total_bytes = 0;
  for (const GgufTensor& t : file.tensors()) {
    total_bytes += t.nbytes;
    absl::StrAppend(&out,
                    absl::StrFormat("  %-*s  %-8s  %-*s  %10.2f\n", nw, Escaped(t.name),
                                    ggml_type_name(t.type), sw, t.shape_string(), t.nbytes / kMiB));
  }
  absl::StrAppend(&out, absl::StrFormat("total: %d tensors, %.2f MiB\n", file.tensors().size(),
                                        total_bytes / kMiB));
  return out;
}

}  // namespace

int RunInspect(const std::vector<std::string>& args) {
  // The file as its argument, or as -m like every other command's model.
  const std::string flag = absl::GetFlag(FLAGS_m);
  if (args.size() + (flag.empty() ? 0 : 1) != 1) {
    std::fprintf(stderr, "usage: moegraph inspect FILE (or -m FILE)\n");
    return 2;
  }
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(flag.empty() ? args[0] : flag);
  if (!file.ok()) {
    std::fprintf(stderr, "moegraph inspect: %s\n", std::string(file.status().message()).c_str());
    return 1;
  }
  const std::string text = FormatInspect(**file);
  std::fwrite(text.data(), 1, text.size(), stdout);
  return 0;
}

}  // namespace moegraph
