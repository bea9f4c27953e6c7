// libFuzzer target: any bytes either parse into a GgufFile whose every field and
// tensor byte can be read, or fail with a located error. ASan/UBSan catch the rest.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "loader/gguf.h"

namespace {

// Reads every parsed field through the public API, so an out-of-bounds view or
// pointer is touched while the sanitizers watch.
uint64_t TouchEverything(const moegraph::GgufFile& file) {
  uint64_t sum = file.version() + file.alignment() + file.data_offset() + file.file_size();
  for (const moegraph::GgufKV& kv : file.kvs()) {
    if (file.FindKey(kv.key) != &kv) std::abort();
    sum += kv.key.size() + kv.u64 + static_cast<uint64_t>(kv.i64) + kv.offset;
    for (char ch : kv.str) sum += static_cast<uint8_t>(ch);
    for (std::string_view s : kv.array_strings) {
      for (char ch : s) sum += static_cast<uint8_t>(ch);
    }
    (void)file.GetUint(kv.key);
    (void)file.GetInt(kv.key);
    (void)file.GetFloat(kv.key);
    (void)file.GetBool(kv.key);
    (void)file.GetString(kv.key);
    (void)file.GetStringArray(kv.key);
    if (auto ints = file.GetIntArray(kv.key); ints.ok()) {
      for (int64_t v : *ints) sum += static_cast<uint64_t>(v);
    }
    if (auto floats = file.GetFloatArray(kv.key); floats.ok()) sum += floats->size();
  }
  for (const moegraph::GgufTensor& t : file.tensors()) {
    if (file.FindTensor(t.name) != &t) std::abort();
    sum += t.type + static_cast<uint64_t>(t.n_elements()) + t.offset + t.info_offset;
    sum += t.shape_string().size();
    for (uint64_t i = 0; i < t.nbytes; ++i) sum += t.data[i];
  }
  return sum;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file = moegraph::GgufFile::FromBytes("fuzz.gguf", absl::Span<const uint8_t>(data, size));
  if (file.ok()) {
    volatile uint64_t sink = TouchEverything(**file);
    (void)sink;
  } else if (file.status().message().find(" at byte ") == absl::string_view::npos) {
    std::abort();  // every rejection must say where
  }
  return 0;
}
