// GGUF reader: a validated, read-only view of a mapped GGUF v2/v3 file, or of
// every shard of a split model (llama.cpp's gguf-split: loader/gguf_split.h).
//
// Open() checks everything before it returns (header, every key and value,
// every tensor info, alignment, data bounds, and for a split model the shard
// set), so callers never see a malformed file. Errors are absl::Status values
// whose message names the file, the field (key or tensor name) and the byte
// offset where the problem was found.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "loader/ggml_type.h"

namespace moegraph {

inline constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" little-endian
inline constexpr uint32_t kGgufDefaultAlignment = 32;
inline constexpr int kGgufMaxDims = 4;

// Value types as numbered by the GGUF spec.
enum class GgufType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

std::string_view gguf_type_name(GgufType type);
// Bytes of one value of a scalar type; 0 for string and array.
uint64_t gguf_scalar_bytes(GgufType type);

// One metadata key/value. Scalars are decoded; arrays point into the mapping.
struct GgufKV {
  std::string key;
  GgufType type;
  GgufType array_type = GgufType::kUint8;  // element type when type == kArray
  uint64_t offset = 0;                     // file offset of the key's length field

  // Scalar payload (one of these, by type).
  uint64_t u64 = 0;  // unsigned integers and bool
  int64_t i64 = 0;   // signed integers
  double f64 = 0;    // float32 and float64
  std::string_view str;

  // Array payload: n elements; numeric arrays are raw little-endian bytes in the
  // mapping, string arrays are decoded into views.
  uint64_t array_n = 0;
  const uint8_t* array_data = nullptr;
  std::vector<std::string_view> array_strings;
};

struct GgufTensor {
  std::string name;
  uint32_t type = 0;  // a ggml type id known to ggml_type_info()
  int n_dims = 0;
  int64_t ne[kGgufMaxDims] = {1, 1, 1, 1};  // ggml order: ne[0] is the row length
  uint64_t offset = 0;       // relative to the start of the data section
  uint64_t info_offset = 0;  // file offset of this tensor's info record
  uint64_t nbytes = 0;
  const uint8_t* data = nullptr;  // inside the mapping of the file holding it
  int shard = 0;                  // that file: GgufFile::shard(shard)

  GgmlType ggml_type() const { return static_cast<GgmlType>(type); }
  int64_t n_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
  std::string shape_string() const;  // "[2048, 768, 128]"
};

// Called as bytes come into memory: bytes so far (non-decreasing, ending at
// total), the total, and seconds since the load began.
using LoadProgressFn = std::function<void(uint64_t bytes_done, uint64_t total, double seconds)>;

// How Open brings the tensors' bytes into memory (llama.cpp's --load-mode).
enum class LoadMode {
  kMap,   // mmap: the file's pages, read as they are first touched (or at Open, fault_in)
  kRead,  // none: read into anonymous memory (huge pages where the kernel gives
          // them), each part's page-cache pages dropped once copied
  kAuto,  // kRead where the tensors fit in the memory available less a 1 GiB
          // rail, else kMap
};

struct LoadOptions {
  LoadMode mode = LoadMode::kMap;
  bool fault_in = false;         // kMap: every page read at Open, not during decode
  bool lock = false;             // mlock the tensors' bytes (llama.cpp's mlock)
  uint64_t available_bytes = 0;  // kAuto and kRead's check; 0: MemAvailable
  LoadProgressFn progress;       // reads and faults, over every shard
};

class GgufFile {
 public:
  // Maps and validates the file at path. When its split.count is above 1 it must
  // be shard 1 of a split model (PREFIX-00001-of-0000N.gguf); every shard is then
  // mapped and validated, and tensors() holds all of theirs, kvs() shard 1's.
  static absl::StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path);
  // Open, then Load(options).
  static absl::StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path,
                                                        const LoadOptions& options);
  // Brings every shard's tensor bytes into memory as options say (once, after
  // Open(path)). Errors name the file: more to read than memory holds (before
  // anything is allocated), a failed read, a lock refused (with RLIMIT_MEMLOCK).
  absl::Status Load(const LoadOptions& options);
  // Validates a copy of bytes; name stands for the file in messages. One file:
  // its split keys are not followed.
  static absl::StatusOr<std::unique_ptr<GgufFile>> FromBytes(std::string name,
                                                             absl::Span<const uint8_t> bytes);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  // Of this file (shard 1 of a split model).
  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }
  uint64_t file_size() const { return size_; }
  // Bytes mapped for the model: every shard's file_size().
  uint64_t total_size() const;
  // Every shard's tensor data section (file_size() less its header).
  uint64_t total_data_bytes() const;
  // kMap or kRead: where the tensors' bytes are (Open(path): kMap).
  LoadMode load_mode() const { return load_mode_; }
  bool locked() const { return locked_; }

  // The files of a split model, shard(0) being this one; a single file is one shard.
  int shard_count() const { return 1 + static_cast<int>(shards_.size()); }
  const GgufFile& shard(int i) const { return i == 0 ? *this : *shards_[i - 1]; }

  const std::vector<GgufKV>& kvs() const { return kvs_; }
  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  const GgufKV* FindKey(std::string_view key) const;
  const GgufTensor* FindTensor(std::string_view name) const;

  // Typed getters. A missing key is NotFound; a key of another type is
  // InvalidArgument; both messages name the file, key and offset. GetUint
  // accepts any integer type holding a non-negative value, GetInt any integer
  // type, GetFloat float32/float64 (and integers).
  absl::StatusOr<uint64_t> GetUint(std::string_view key) const;
  absl::StatusOr<int64_t> GetInt(std::string_view key) const;
  absl::StatusOr<double> GetFloat(std::string_view key) const;
  absl::StatusOr<bool> GetBool(std::string_view key) const;
  absl::StatusOr<std::string_view> GetString(std::string_view key) const;
  absl::StatusOr<std::vector<std::string_view>> GetStringArray(std::string_view key) const;
  absl::StatusOr<std::vector<int64_t>> GetIntArray(std::string_view key) const;
  // An array of flags: bools, or integers (nonzero is true), as llama.cpp's
  // get_arr reads a per-layer flag.
  absl::StatusOr<std::vector<bool>> GetFlagArray(std::string_view key) const;
  absl::StatusOr<std::vector<double>> GetFloatArray(std::string_view key) const;

  // "FILE: key 'K' at byte N: what" / "FILE: tensor 'T' at byte N: what", FILE being
  // the shard holding the tensor.
  absl::Status KeyError(const GgufKV& kv, std::string_view what) const;
  absl::Status TensorError(const GgufTensor& t, std::string_view what) const;

 private:
  GgufFile() = default;
  // Maps and validates one file.
  static absl::StatusOr<std::unique_ptr<GgufFile>> Map(const std::string& path);
  absl::Status Parse();
  // When split.count > 1: maps shards 2.. into shards_ and their tensors into tensors_.
  absl::Status OpenShards();
  // This file's data section: read into copy (kRead) or faulted in; `done`
  // counts bytes over all shards for progress.
  absl::Status ReadData(uint64_t* done, uint64_t total, const LoadOptions& options,
                        std::chrono::steady_clock::time_point start);
  absl::Status FaultIn(uint64_t* done, uint64_t total, const LoadOptions& options,
                       std::chrono::steady_clock::time_point start);
  // The tensor bytes now in use: the read copy, else the mapping's data section.
  uint8_t* data_begin() const;

  std::string path_;
  const uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  void* map_ = nullptr;        // mmap base, when mapped
  std::vector<uint8_t> copy_;  // owned bytes, when built from memory
  void* data_copy_ = nullptr;  // the data section in anonymous memory (kRead)
  LoadMode load_mode_ = LoadMode::kMap;
  bool locked_ = false;
  uint32_t version_ = 0;
  uint64_t alignment_ = kGgufDefaultAlignment;
  uint64_t data_offset_ = 0;
  std::vector<GgufKV> kvs_;
  std::vector<GgufTensor> tensors_;
  std::vector<std::unique_ptr<GgufFile>> shards_;  // shards 2.. of a split model
  // Name -> index; the views point into the files' bytes, which outlive the maps.
  std::unordered_map<std::string_view, size_t> key_index_;
  std::unordered_map<std::string_view, size_t> tensor_index_;
};

}  // namespace moegraph
