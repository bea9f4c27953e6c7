// GGUF v3 writer: metadata and tensors, aligned and padded as the spec and
// llama.cpp's gguf_write_to_file do. Tensor data can be given as bytes or as a
// fill callback, so a multi-GiB fixture streams to disk without being held.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "loader/ggml_type.h"
#include "loader/gguf.h"

namespace moegraph {

class GgufWriter {
 public:
  // Fills dst (exactly the tensor's byte size).
  using FillFn = std::function<void(uint8_t* dst, size_t nbytes)>;

  explicit GgufWriter(uint32_t alignment = kGgufDefaultAlignment);

  void SetUint32(const std::string& key, uint32_t v);
  void SetInt32(const std::string& key, int32_t v);
  void SetUint64(const std::string& key, uint64_t v);
  void SetFloat32(const std::string& key, float v);
  void SetBool(const std::string& key, bool v);
  void SetString(const std::string& key, const std::string& v);
  void SetStringArray(const std::string& key, const std::vector<std::string>& v);
  void SetInt32Array(const std::string& key, const std::vector<int32_t>& v);
  void SetFloat32Array(const std::string& key, const std::vector<float>& v);
  // The remaining value types, so every GGUF type can be written.
  void SetUint8(const std::string& key, uint8_t v);
  void SetInt8(const std::string& key, int8_t v);
  void SetUint16(const std::string& key, uint16_t v);
  void SetInt16(const std::string& key, int16_t v);
  void SetInt64(const std::string& key, int64_t v);
  void SetFloat64(const std::string& key, double v);
  // An array of n numeric or bool elements of element_type, little-endian in
  // data (n * element size bytes). String and array elements are programming errors.
  void SetArray(const std::string& key, GgufType element_type, const void* data, size_t n);
  // kv's key and value, whatever its type, as llama.cpp's gguf_set_kv copies one.
  void SetValue(const GgufKV& kv);

  // shape in ggml order (shape[0] is the row length). Bytes must equal the
  // type's size for that shape; a mismatch is a programming error (CHECK).
  void AddTensor(const std::string& name, GgmlType type, std::vector<int64_t> shape,
                 std::vector<uint8_t> bytes);
  void AddTensor(const std::string& name, GgmlType type, std::vector<int64_t> shape, FillFn fill);

  std::vector<uint8_t> Serialize() const;
  absl::Status WriteFile(const std::string& path) const;  // names the path on error

  // The bytes Serialize returns; the largest tensor's (WriteFile holds one
  // tensor at a time).
  uint64_t FileBytes() const;
  uint64_t LargestTensorBytes() const;

 private:
  struct Value {
    std::string key;
    std::vector<uint8_t> encoded;  // value type, then the value, as written
  };
  struct Tensor {
    std::string name;
    GgmlType type;
    std::vector<int64_t> shape;
    uint64_t nbytes;
    std::vector<uint8_t> bytes;  // empty when fill is set
    FillFn fill;
  };

  // Replaces the value of an existing key, as llama.cpp's gguf_set_* do.
  void Set(const std::string& key, std::vector<uint8_t> encoded);
  void CheckNewTensor(const std::string& name, GgmlType type, const std::vector<int64_t>& shape,
                      uint64_t* nbytes) const;
  // Everything before the data section, padded to the alignment.
  std::vector<uint8_t> SerializeHeader() const;

  std::vector<Value> kvs_;
  std::vector<Tensor> tensors_;
  uint32_t alignment_;
};

}  // namespace moegraph
