#include "loader/requantize.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "loader/gguf_writer.h"
#include "loader/quant.h"
#include "loader/quantize.h"

namespace moegraph {
namespace {

bool EndsWith(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

bool Has(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

// tensor_allows_quantization's rules for the tensors moegraph's architectures carry.
bool AllowsQuantization(const GgufTensor& t) {
  const std::string& n = t.name;
  return t.n_dims >= 2 && EndsWith(n, "weight") && !Has(n, "_norm.weight") &&
         !Has(n, "ffn_gate_inp.weight") && !Has(n, "ssm_conv1d") && !Has(n, "attn_rel_b.weight");
}

// tensor_type_fallback: a type whose block divides the rows.
GgmlType Fallback(GgmlType target, int64_t ncols) {
  const int64_t block = ggml_type_info(static_cast<uint32_t>(target))->block_size;
  if (ncols % block == 0) return target;
  GgmlType type = target;
  switch (target) {
    case GgmlType::kIQ4_XS: type = GgmlType::kIQ4_NL; break;
    case GgmlType::kQ2_K:
    case GgmlType::kQ3_K: type = GgmlType::kQ4_0; break;
    case GgmlType::kQ4_K: type = GgmlType::kQ5_0; break;
    case GgmlType::kQ5_K: type = GgmlType::kQ5_1; break;
    case GgmlType::kQ6_K: type = GgmlType::kQ8_0; break;
    default: break;
  }
  return ncols % ggml_type_info(static_cast<uint32_t>(type))->block_size == 0 ? type : GgmlType::kF16;
}

}  // namespace

GgmlType PureQuantizedType(const GgufTensor& t, GgmlType target) {
  if (!AllowsQuantization(t)) return t.ggml_type();
  return Fallback(target, t.ne[0]);
}

int PureFileType(GgmlType target) {
  switch (target) {  // llama.h's llama_ftype
    case GgmlType::kF32: return 0;
    case GgmlType::kF16: return 1;
    case GgmlType::kQ4_0: return 2;
    case GgmlType::kQ4_1: return 3;
    case GgmlType::kQ8_0: return 7;
    case GgmlType::kQ5_0: return 8;
    case GgmlType::kQ5_1: return 9;
    case GgmlType::kQ2_K: return 10;
    case GgmlType::kQ3_K: return 11;  // Q3_K_S: q3_K throughout
    case GgmlType::kQ4_K: return 14;  // Q4_K_S
    case GgmlType::kQ5_K: return 16;  // Q5_K_S
    case GgmlType::kQ6_K: return 18;
    case GgmlType::kIQ4_NL: return 25;
    case GgmlType::kIQ4_XS: return 30;
    case GgmlType::kBF16: return 32;
    default: return -1;
  }
}

absl::Status RequantizeFile(const GgufFile& in, GgmlType target, const std::string& out_path,
                            const std::function<void(const std::string&)>& progress) {
  if (!quant_supported(target)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "type %s: moegraph writes %s", ggml_type_name(static_cast<uint32_t>(target)),
        quant_supported_names()));
  }
  GgufWriter out(in.alignment());
  for (const GgufKV& kv : in.kvs()) out.SetValue(kv);
  if (const int ftype = PureFileType(target); ftype >= 0) {
    out.SetUint32("general.file_type", static_cast<uint32_t>(ftype));
  }
  out.SetUint32("general.quantization_version", 2);  // GGML_QNT_VERSION
  for (const GgufTensor& t : in.tensors()) {
    const GgmlType from = t.ggml_type(), to = PureQuantizedType(t, target);
    std::vector<int64_t> shape(t.ne, t.ne + t.n_dims);
    if (to == from) {
      out.AddTensor(t.name, to, shape, [&t](uint8_t* dst, size_t n) {
        std::memcpy(dst, t.data, n);
      });
      continue;
    }
    if (!quant_supported(from)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: tensor %s is %s, which moegraph cannot read", in.path(), t.name,
          ggml_type_name(t.type)));
    }
    out.AddTensor(t.name, to, shape, [&t, from, to, &progress](uint8_t* dst, size_t) {
      if (progress) progress(t.name);
      const int64_t cols = t.ne[0], rows = t.n_elements() / cols;
      const size_t in_row = ggml_row_size(from, cols), out_row = ggml_row_size(to, cols);
      std::vector<float> row(static_cast<size_t>(cols));
      for (int64_t r = 0; r < rows; ++r) {
        dequantize_row(from, t.data + r * in_row, row.data(), cols);
        quantize_row(to, row.data(), dst + r * out_row, cols);
      }
    });
  }
  return out.WriteFile(out_path);
}

}  // namespace moegraph
