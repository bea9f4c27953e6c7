#include "loader/gguf_writer.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace moegraph {
namespace {

constexpr char kAlignmentKey[] = "general.alignment";
constexpr uint32_t kVersion = 3;
constexpr size_t kMaxTensorNameBytes = 63;  // GGML_MAX_NAME (64) less the NUL

// Misuse of the writer is a programming error: report and abort.
[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "GgufWriter: %s\n", what.c_str());
  std::abort();
}

template <typename T>
void Put(std::vector<uint8_t>& out, T v) {
  const size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &v, sizeof(T));
}

void PutString(std::vector<uint8_t>& out, std::string_view s) {
  Put<uint64_t>(out, s.size());
  out.insert(out.end(), s.begin(), s.end());
}

template <typename T>
std::vector<uint8_t> EncodeScalar(GgufType type, T v) {
  std::vector<uint8_t> out;
  Put<uint32_t>(out, static_cast<uint32_t>(type));
  Put<T>(out, v);
  return out;
}

std::vector<uint8_t> EncodeArray(GgufType element_type, const void* data, size_t n,
                                 size_t element_bytes) {
  std::vector<uint8_t> out;
  Put<uint32_t>(out, static_cast<uint32_t>(GgufType::kArray));
  Put<uint32_t>(out, static_cast<uint32_t>(element_type));
  Put<uint64_t>(out, n);
  const auto* bytes = static_cast<const uint8_t*>(data);
  out.insert(out.end(), bytes, bytes + n * element_bytes);
  return out;
}

void PadTo(std::vector<uint8_t>& out, uint64_t alignment) {
  out.resize((out.size() + alignment - 1) / alignment * alignment, 0);
}

uint64_t Padded(uint64_t n, uint64_t alignment) {
  return (n + alignment - 1) / alignment * alignment;
}

}  // namespace

GgufWriter::GgufWriter(uint32_t alignment) : alignment_(alignment) {
  if (!std::has_single_bit(alignment)) {
    Fail(absl::StrCat("alignment ", alignment, " is not a power of two"));
  }
  if (alignment != kGgufDefaultAlignment) SetUint32(kAlignmentKey, alignment);
}

void GgufWriter::Set(const std::string& key, std::vector<uint8_t> encoded) {
  if (key.empty()) Fail("empty key");
  if (key == kAlignmentKey && encoded != EncodeScalar<uint32_t>(GgufType::kUint32, alignment_)) {
    Fail(absl::StrCat(kAlignmentKey, " must be the u32 given to the constructor (", alignment_,
                      ")"));
  }
  for (Value& v : kvs_) {
    if (v.key == key) {
      v.encoded = std::move(encoded);
      return;
    }
  }
  kvs_.push_back({key, std::move(encoded)});
}

void GgufWriter::SetUint8(const std::string& key, uint8_t v) {
  Set(key, EncodeScalar(GgufType::kUint8, v));
}
void GgufWriter::SetInt8(const std::string& key, int8_t v) {
  Set(key, EncodeScalar(GgufType::kInt8, v));
}
void GgufWriter::SetUint16(const std::string& key, uint16_t v) {
  Set(key, EncodeScalar(GgufType::kUint16, v));
}
void GgufWriter::SetInt16(const std::string& key, int16_t v) {
  Set(key, EncodeScalar(GgufType::kInt16, v));
}
void GgufWriter::SetUint32(const std::string& key, uint32_t v) {
  Set(key, EncodeScalar(GgufType::kUint32, v));
}
void GgufWriter::SetInt32(const std::string& key, int32_t v) {
  Set(key, EncodeScalar(GgufType::kInt32, v));
}
void GgufWriter::SetUint64(const std::string& key, uint64_t v) {
  Set(key, EncodeScalar(GgufType::kUint64, v));
}
void GgufWriter::SetInt64(const std::string& key, int64_t v) {
  Set(key, EncodeScalar(GgufType::kInt64, v));
}
void GgufWriter::SetFloat32(const std::string& key, float v) {
  Set(key, EncodeScalar(GgufType::kFloat32, v));
}
void GgufWriter::SetFloat64(const std::string& key, double v) {
  Set(key, EncodeScalar(GgufType::kFloat64, v));
}
void GgufWriter::SetBool(const std::string& key, bool v) {
  Set(key, EncodeScalar<uint8_t>(GgufType::kBool, v ? 1 : 0));
}

void GgufWriter::SetString(const std::string& key, const std::string& v) {
  std::vector<uint8_t> encoded;
  Put<uint32_t>(encoded, static_cast<uint32_t>(GgufType::kString));
  PutString(encoded, v);
  Set(key, std::move(encoded));
}

void GgufWriter::SetStringArray(const std::string& key, const std::vector<std::string>& v) {
  std::vector<uint8_t> encoded;
  Put<uint32_t>(encoded, static_cast<uint32_t>(GgufType::kArray));
  Put<uint32_t>(encoded, static_cast<uint32_t>(GgufType::kString));
  Put<uint64_t>(encoded, v.size());
  for (const std::string& s : v) PutString(encoded, s);
  Set(key, std::move(encoded));
}

void GgufWriter::SetInt32Array(const std::string& key, const std::vector<int32_t>& v) {
  SetArray(key, GgufType::kInt32, v.data(), v.size());
}

void GgufWriter::SetFloat32Array(const std::string& key, const std::vector<float>& v) {
  SetArray(key, GgufType::kFloat32, v.data(), v.size());
}

void GgufWriter::SetArray(const std::string& key, GgufType element_type, const void* data,
                          size_t n) {
  const uint64_t element_bytes = gguf_scalar_bytes(element_type);
  if (element_bytes == 0) {
    Fail(absl::StrCat("SetArray: element type ", static_cast<uint32_t>(element_type),
                      " is not numeric"));
  }
  Set(key, EncodeArray(element_type, data, n, element_bytes));
}

void GgufWriter::SetValue(const GgufKV& kv) {
  switch (kv.type) {
    case GgufType::kUint8:
      return SetUint8(kv.key, static_cast<uint8_t>(kv.u64));
    case GgufType::kInt8:
      return SetInt8(kv.key, static_cast<int8_t>(kv.i64));
    case GgufType::kUint16:
      return SetUint16(kv.key, static_cast<uint16_t>(kv.u64));
    case GgufType::kInt16:
      return SetInt16(kv.key, static_cast<int16_t>(kv.i64));
    case GgufType::kUint32:
      return SetUint32(kv.key, static_cast<uint32_t>(kv.u64));
    case GgufType::kInt32:
      return SetInt32(kv.key, static_cast<int32_t>(kv.i64));
    case GgufType::kUint64:
      return SetUint64(kv.key, kv.u64);
    case GgufType::kInt64:
      return SetInt64(kv.key, kv.i64);
    case GgufType::kFloat32:
      return SetFloat32(kv.key, static_cast<float>(kv.f64));
    case GgufType::kFloat64:
      return SetFloat64(kv.key, kv.f64);
    case GgufType::kBool:
      return SetBool(kv.key, kv.u64 != 0);
    case GgufType::kString:
      return SetString(kv.key, std::string(kv.str));
    case GgufType::kArray:
      if (kv.array_type == GgufType::kString) {
        return SetStringArray(
            kv.key, std::vector<std::string>(kv.array_strings.begin(), kv.array_strings.end()));
      }
      return SetArray(kv.key, kv.array_type, kv.array_data, kv.array_n);
  }
  Fail(absl::StrCat("SetValue: key '", kv.key, "' has unknown type ",
                    static_cast<uint32_t>(kv.type)));
}

void GgufWriter::CheckNewTensor(const std::string& name, GgmlType type,
                                const std::vector<int64_t>& shape, uint64_t* nbytes) const {
  if (name.empty() || name.size() > kMaxTensorNameBytes) {
    Fail(absl::StrCat("tensor name '", name, "' must be 1 to ", kMaxTensorNameBytes, " bytes"));
  }
  for (const Tensor& t : tensors_) {
    if (t.name == name) Fail(absl::StrCat("duplicate tensor '", name, "'"));
  }
  const GgmlTypeInfo* info = ggml_type_info(static_cast<uint32_t>(type));
  if (info == nullptr) Fail(absl::StrCat("tensor '", name, "': unknown ggml type"));
  if (shape.empty() || shape.size() > static_cast<size_t>(kGgufMaxDims)) {
    Fail(absl::StrCat("tensor '", name, "': ", shape.size(), " dimensions"));
  }
  int64_t n_elements = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n_elements, d, &n_elements)) {
      Fail(absl::StrCat("tensor '", name, "': bad dimension ", d));
    }
  }
  if (shape[0] % info->block_size != 0) {
    Fail(absl::StrCat("tensor '", name, "': row length ", shape[0], " is not a multiple of ",
                      info->block_size));
  }
  *nbytes = static_cast<uint64_t>(n_elements / info->block_size) * info->type_size;
}

void GgufWriter::AddTensor(const std::string& name, GgmlType type, std::vector<int64_t> shape,
                           std::vector<uint8_t> bytes) {
  uint64_t nbytes = 0;
  CheckNewTensor(name, type, shape, &nbytes);
  if (bytes.size() != nbytes) {
    Fail(absl::StrCat("tensor '", name, "': ", bytes.size(), " bytes given, shape needs ", nbytes));
  }
  tensors_.push_back({name, type, std::move(shape), nbytes, std::move(bytes), nullptr});
}

void GgufWriter::AddTensor(const std::string& name, GgmlType type, std::vector<int64_t> shape,
                           FillFn fill) {
  uint64_t nbytes = 0;
  CheckNewTensor(name, type, shape, &nbytes);
  if (!fill) Fail(absl::StrCat("tensor '", name, "': empty fill function"));
  tensors_.push_back({name, type, std::move(shape), nbytes, {}, std::move(fill)});
}

std::vector<uint8_t> GgufWriter::SerializeHeader() const {
  std::vector<uint8_t> out;
  Put<uint32_t>(out, kGgufMagic);
  Put<uint32_t>(out, kVersion);
  Put<uint64_t>(out, tensors_.size());
  Put<uint64_t>(out, kvs_.size());
  for (const Value& v : kvs_) {
    PutString(out, v.key);
    out.insert(out.end(), v.encoded.begin(), v.encoded.end());
  }
  uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    PutString(out, t.name);
    Put<uint32_t>(out, static_cast<uint32_t>(t.shape.size()));
    for (int64_t d : t.shape) Put<int64_t>(out, d);
    Put<uint32_t>(out, static_cast<uint32_t>(t.type));
    Put<uint64_t>(out, offset);
    offset += Padded(t.nbytes, alignment_);
  }
  PadTo(out, alignment_);
  return out;
}

std::vector<uint8_t> GgufWriter::Serialize() const {
  std::vector<uint8_t> out = SerializeHeader();
  for (const Tensor& t : tensors_) {
    const size_t at = out.size();
    if (t.fill) {
      out.resize(at + t.nbytes);
      t.fill(out.data() + at, t.nbytes);
    } else {
      out.insert(out.end(), t.bytes.begin(), t.bytes.end());
    }
    PadTo(out, alignment_);
  }
  return out;
}

uint64_t GgufWriter::FileBytes() const {
  uint64_t bytes = SerializeHeader().size();
  for (const Tensor& t : tensors_) bytes += Padded(t.nbytes, alignment_);
  return bytes;
}

uint64_t GgufWriter::LargestTensorBytes() const {
  uint64_t largest = 0;
  for (const Tensor& t : tensors_) largest = std::max(largest, t.nbytes);
  return largest;
}

absl::Status GgufWriter::WriteFile(const std::string& path) const {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    const int err = errno;
    return absl::ErrnoToStatus(err, absl::StrCat(path, ": cannot create"));
  }
  bool ok = true;
  auto write = [&](const uint8_t* data, size_t n) { ok = ok && std::fwrite(data, 1, n, f) == n; };
  const std::vector<uint8_t> header = SerializeHeader();
  write(header.data(), header.size());
  // Filled tensors go through one buffer, one tensor at a time.
  std::vector<uint8_t> buffer;
  const std::vector<uint8_t> zeros(alignment_, 0);
  for (const Tensor& t : tensors_) {
    if (!ok) break;
    if (t.fill) {
      buffer.resize(t.nbytes);
      t.fill(buffer.data(), t.nbytes);
      write(buffer.data(), buffer.size());
    } else {
      write(t.bytes.data(), t.bytes.size());
    }
    write(zeros.data(), Padded(t.nbytes, alignment_) - t.nbytes);
  }
  const int write_err = ok ? 0 : errno;
  const bool closed = std::fclose(f) == 0;
  if (ok && closed) return absl::OkStatus();
  const int err = write_err != 0 ? write_err : errno;
  std::remove(path.c_str());
  return absl::ErrnoToStatus(err, absl::StrCat(path, ": write failed"));
}

}  // namespace moegraph
