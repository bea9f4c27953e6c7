// Writes the seed corpus for gguf_fuzz: small valid GGUF files covering every
// value type, arrays, tensors of several types, custom alignment, v2 and v3.
#include <cstdio>
#include <string>
#include <vector>

#include "loader/gguf_writer.h"

namespace moegraph {
namespace {

std::vector<uint8_t> Pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(seed + i * 31);
  return out;
}

GgufWriter EveryValueType() {
  GgufWriter w;
  w.SetUint8("u8", 1);
  w.SetInt8("i8", -1);
  w.SetUint16("u16", 2);
  w.SetInt16("i16", -2);
  w.SetUint32("u32", 3);
  w.SetInt32("i32", -3);
  w.SetFloat32("f32", 0.5f);
  w.SetBool("bool", true);
  w.SetString("general.architecture", "qwen3moe");
  w.SetUint64("u64", 4);
  w.SetInt64("i64", -4);
  w.SetFloat64("f64", 0.25);
  const std::vector<uint16_t> u16 = {1, 2, 3};
  w.SetArray("a.u16", GgufType::kUint16, u16.data(), u16.size());
  w.SetInt32Array("tokenizer.ggml.token_type", {1, 1, 3});
  w.SetFloat32Array("tokenizer.ggml.scores", {0.0f, -1.0f, -2.0f});
  w.SetStringArray("tokenizer.ggml.tokens", {"<s>", "a", "bc"});
  return w;
}

GgufWriter SeveralTensors(uint32_t alignment) {
  GgufWriter w(alignment);
  w.SetString("general.architecture", "qwen3moe");
  w.SetUint32("qwen3moe.block_count", 1);
  w.AddTensor("token_embd.weight", GgmlType::kF32, {4, 2}, Pattern(32, 1));
  w.AddTensor("blk.0.attn_q.weight", GgmlType::kF16, {4, 4}, Pattern(32, 2));
  w.AddTensor("blk.0.ffn_up_exps.weight", GgmlType::kQ4_0, {32, 1, 2}, Pattern(36, 3));
  w.AddTensor("blk.0.ffn_down_exps.weight", GgmlType::kQ8_0, {32, 2}, Pattern(68, 4));
  w.AddTensor("blk.0.ffn_gate_exps.weight", GgmlType::kQ4_K, {256}, Pattern(144, 5));
  w.AddTensor("output.weight", GgmlType::kMXFP4, {32, 1, 1, 1}, Pattern(17, 6));
  return w;
}

bool Write(const std::string& path, std::vector<uint8_t> bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return false;
  const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  return std::fclose(f) == 0 && ok;
}

}  // namespace
}  // namespace moegraph

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUTPUT_DIR\n", argv[0]);
    return 2;
  }
  using moegraph::Write;
  const std::string dir = argv[1];
  std::vector<uint8_t> v2 = moegraph::SeveralTensors(32).Serialize();
  v2[4] = 2;  // v2 shares v3's layout
  const bool ok = Write(dir + "/values.gguf", moegraph::EveryValueType().Serialize()) &&
                  Write(dir + "/tensors_v3.gguf", moegraph::SeveralTensors(32).Serialize()) &&
                  Write(dir + "/tensors_v2.gguf", v2) &&
                  Write(dir + "/tensors_align64.gguf", moegraph::SeveralTensors(64).Serialize()) &&
                  Write(dir + "/empty.gguf", moegraph::GgufWriter().Serialize());
  if (!ok) {
    std::perror(dir.c_str());
    return 1;
  }
  return 0;
}
