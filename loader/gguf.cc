// GGUF reader. The checks follow llama.cpp's gguf_init_from_reader (ggml/src/gguf.cpp)
// one for one, plus the classes of the published GGUF parser bugs:
//   CVE-2024-21825  array / string-array counts overflowing an allocation
//   CVE-2024-23496  string length overflowing an allocation (gguf_fread_str)
//   CVE-2024-21802  n_dims > 4 writing past ne[4] (info->ne)
//   CVE-2024-21836  n_tensors overflowing the tensor-info allocation
//   CVE-2024-23605  n_kv overflowing the key/value allocation
//   CVE-2025-53630  running data-section size overflowing size_t
//   CVE-2026-27940  bypass of the above: undersized allocation from an overflowing size
//                   sum (GHSA-3p4r-fq3f-q74v); here every end offset is checked against
//                   the file instead of being summed into an allocation
//   CVE-2026-33298  element count x type size overflowing size_t (GHSA-96jg-mvhq-q7q7)
//   llama.cpp #27203  element count overflow slipping past the check when the wrapped
//                     product is negative
//   llama.cpp #24997  general.alignment without an upper bound (capped at 1 MiB)
//   llama.cpp #26690  array element type not checked before the data is used
// Every byte is read through Cursor, which never reads past the end of the file, and
// every count is bounded by the bytes left before anything is allocated for it.
#include "loader/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "loader/gguf_split.h"
#include "loader/host_memory.h"
#include "loader/status_util.h"

namespace moegraph {

static_assert(std::endian::native == std::endian::little, "GGUF is read as little-endian");

namespace {

constexpr uint64_t kMaxStringBytes = uint64_t{1} << 30;    // GGUF_MAX_STRING_LENGTH
constexpr uint64_t kMaxArrayElements = uint64_t{1} << 30;  // GGUF_MAX_ARRAY_ELEMENTS
constexpr uint64_t kMaxAlignment = uint64_t{1} << 20;      // llama.cpp #24997
constexpr size_t kMaxTensorNameBytes = 63;                 // GGML_MAX_NAME (64) less the NUL
constexpr uint32_t kMaxVersion = 3;
constexpr char kAlignmentKey[] = "general.alignment";
// Smallest encodings of one record, to bound claimed counts by the bytes left.
constexpr uint64_t kMinKvBytes = 8 + 1 + 4 + 1;          // key length, key, type, u8 value
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 4 + 8;  // name length, n_dims, type, offset

// A problem found while reading one record: where, and what.
struct Problem {
  uint64_t at;
  std::string what;
};
using Outcome = std::optional<Problem>;

// Names and strings from the file go into messages escaped and bounded.
std::string Printable(std::string_view s) {
  constexpr size_t kMaxShown = 80;
  if (s.size() <= kMaxShown) return absl::CHexEscape(Av(s));
  return absl::StrCat(absl::CHexEscape(Av(s.substr(0, kMaxShown))), "...");
}

bool IsValueType(uint32_t type) { return type <= static_cast<uint32_t>(GgufType::kFloat64); }

bool IsIntegerType(GgufType type) {
  switch (type) {
    case GgufType::kUint8:
    case GgufType::kInt8:
    case GgufType::kUint16:
    case GgufType::kInt16:
    case GgufType::kUint32:
    case GgufType::kInt32:
    case GgufType::kUint64:
    case GgufType::kInt64:
      return true;
    default:
      return false;
  }
}

bool IsSignedType(GgufType type) {
  return type == GgufType::kInt8 || type == GgufType::kInt16 || type == GgufType::kInt32 ||
         type == GgufType::kInt64;
}

uint64_t AlignUp(uint64_t x, uint64_t alignment) { return (x + alignment - 1) & ~(alignment - 1); }

// Bounds-checked reader over the file bytes.
class Cursor {
 public:
  Cursor(const uint8_t* base, uint64_t size) : base_(base), size_(size) {}

  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return size_ - pos_; }
  const uint8_t* here() const { return base_ + pos_; }

  bool Skip(uint64_t n) {
    if (n > remaining()) return false;
    pos_ += n;
    return true;
  }

  template <typename T>
  bool Read(T* out) {
    if (sizeof(T) > remaining()) return false;
    std::memcpy(out, base_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }

 private:
  const uint8_t* base_;
  uint64_t size_;
  uint64_t pos_ = 0;
};

Problem Truncated(const Cursor& c, uint64_t need, std::string_view field) {
  return {c.pos(), absl::StrCat("file ends inside ", Av(field), " (needs ", need, " bytes, ",
                                c.remaining(), " left)")};
}

template <typename T>
Outcome ReadField(Cursor& c, T* out, std::string_view field) {
  if (!c.Read(out)) return Truncated(c, sizeof(T), field);
  return std::nullopt;
}

// A u64 length and that many bytes; the view points into the file.
Outcome ReadString(Cursor& c, std::string_view* out, std::string_view field) {
  const uint64_t at = c.pos();
  uint64_t length = 0;
  if (auto p = ReadField(c, &length, absl::StrCat(Av(field), " length"))) return p;
  if (length > kMaxStringBytes) {
    return Problem{at, absl::StrCat(Av(field), " length ", length, " exceeds the limit of ",
                                    kMaxStringBytes, " bytes")};
  }
  if (length > c.remaining()) {
    return Problem{at,
                   absl::StrCat(Av(field), " length ", length, " runs past the end of the file (",
                                c.remaining(), " bytes left)")};
  }
  *out = std::string_view(reinterpret_cast<const char*>(c.here()), length);
  c.Skip(length);
  return std::nullopt;
}

Outcome ReadScalar(Cursor& c, GgufKV* kv) {
  const std::string field = absl::StrCat(Av(gguf_type_name(kv->type)), " value");
  switch (kv->type) {
    case GgufType::kUint8: {
      uint8_t v;
      if (auto p = ReadField(c, &v, field)) return p;
      kv->u64 = v;
      break;
    }
    case GgufType::kInt8: {
      int8_t v;
      if (auto p = ReadField(c, &v, field)) return p;
      kv->i64 = v;
      break;
    }
    case GgufType::kUint16: {
      uint16_t v;
      if (auto p = ReadField(c, &v, field)) return p;
      kv->u64 = v;
      break;
    }
    case GgufType::kInt16: {
      int16_t v;
      if (auto p = ReadField(c, &v, field)) return p;
      kv->i64 = v;
      break;
    }
    case GgufType::kUint32: {
      uint32_t v;
      if (auto p = ReadField(c, &v, field)) return p;
      kv->u64 = v;
      break;
    }
    case GgufType::kInt32: {
      int32_t v;
      if (auto p = ReadField(c, &v, field)) return p;
      kv->i64 = v;
      break;
    }
    case GgufType::kFloat32: {
      float v;
      if (auto p = ReadField(c, &v, field)) return p;
      kv->f64 = v;
      break;
    }
    case GgufType::kBool: {
      uint8_t v;
      if (auto p = ReadField(c, &v, field)) return p;
      kv->u64 = v != 0;  // as llama.cpp: any non-zero byte is true
      break;
    }
    case GgufType::kUint64:
      if (auto p = ReadField(c, &kv->u64, field)) return p;
      break;
    case GgufType::kInt64:
      if (auto p = ReadField(c, &kv->i64, field)) return p;
      break;
    case GgufType::kFloat64:
      if (auto p = ReadField(c, &kv->f64, field)) return p;
      break;
    case GgufType::kString:
      return ReadString(c, &kv->str, "string value");
    case GgufType::kArray:
      break;  // handled by ReadArray
  }
  return std::nullopt;
}

Outcome ReadArray(Cursor& c, GgufKV* kv) {
  const uint64_t type_at = c.pos();
  uint32_t element_type = 0;
  if (auto p = ReadField(c, &element_type, "array element type")) return p;
  if (!IsValueType(element_type)) {
    return Problem{type_at, absl::StrCat("unknown array element type ", element_type)};
  }
  kv->array_type = static_cast<GgufType>(element_type);
  if (kv->array_type == GgufType::kArray) {
    return Problem{type_at, "nested arrays are not supported"};
  }
  const uint64_t count_at = c.pos();
  if (auto p = ReadField(c, &kv->array_n, "array element count")) return p;
  if (kv->array_n > kMaxArrayElements) {
    return Problem{count_at, absl::StrCat("array element count ", kv->array_n,
                                          " exceeds the limit of ", kMaxArrayElements)};
  }
  // A string element is at least its 8-byte length. The count is at most 2^30,
  // so the product cannot overflow.
  const bool strings = kv->array_type == GgufType::kString;
  const uint64_t min_element_bytes = strings ? 8 : gguf_scalar_bytes(kv->array_type);
  const uint64_t min_bytes = kv->array_n * min_element_bytes;
  if (min_bytes > c.remaining()) {
    return Problem{count_at,
                   absl::StrCat("array of ", kv->array_n, " ", Av(gguf_type_name(kv->array_type)),
                                " needs at least ", min_bytes, " bytes, ", c.remaining(), " left")};
  }
  if (!strings) {
    kv->array_data = c.here();
    c.Skip(min_bytes);
    return std::nullopt;
  }
  kv->array_strings.reserve(kv->array_n);
  for (uint64_t i = 0; i < kv->array_n; ++i) {
    std::string_view s;
    if (auto p = ReadString(c, &s, absl::StrCat("array string ", i))) return p;
    kv->array_strings.push_back(s);
  }
  return std::nullopt;
}

Outcome ReadValue(Cursor& c, GgufKV* kv) {
  const uint64_t type_at = c.pos();
  uint32_t type = 0;
  if (auto p = ReadField(c, &type, "value type")) return p;
  if (!IsValueType(type)) return Problem{type_at, absl::StrCat("unknown value type ", type)};
  kv->type = static_cast<GgufType>(type);
  return kv->type == GgufType::kArray ? ReadArray(c, kv) : ReadScalar(c, kv);
}

// Reads one tensor info record after its name: shape, type, offset, and the
// derived byte size, with every llama.cpp check on them.
Outcome ReadTensorShapeTypeOffset(Cursor& c, GgufTensor* t) {
  const uint64_t dims_at = c.pos();
  uint32_t n_dims = 0;
  if (auto p = ReadField(c, &n_dims, "n_dims")) return p;
  if (n_dims > static_cast<uint32_t>(kGgufMaxDims)) {
    return Problem{dims_at, absl::StrCat("n_dims ", n_dims, " exceeds ", kGgufMaxDims)};
  }
  t->n_dims = static_cast<int>(n_dims);
  for (int j = 0; j < t->n_dims; ++j) {
    const uint64_t at = c.pos();
    if (auto p = ReadField(c, &t->ne[j], absl::StrCat("dimension ", j))) return p;
    if (t->ne[j] < 0) {
      return Problem{at, absl::StrCat("dimension ", j, " is ", t->ne[j], ", must be >= 0")};
    }
  }
  // Checked product, so a wrapped (even negative) count cannot pass (llama.cpp #27203).
  int64_t n_elements = 1;
  for (int j = 0; j < kGgufMaxDims; ++j) {
    if (__builtin_mul_overflow(n_elements, t->ne[j], &n_elements)) {
      return Problem{
          dims_at, absl::StrCat("element count of shape ", t->shape_string(), " overflows int64")};
    }
  }
  const uint64_t type_at = c.pos();
  if (auto p = ReadField(c, &t->type, "ggml type")) return p;
  const GgmlTypeInfo* info = ggml_type_info(t->type);
  if (info == nullptr) return Problem{type_at, absl::StrCat("unknown ggml type ", t->type)};
  if (t->ne[0] % info->block_size != 0) {
    return Problem{dims_at, absl::StrCat("row length ", t->ne[0], " is not a multiple of ",
                                         Av(info->name), "'s block size ", info->block_size)};
  }
  const uint64_t blocks = static_cast<uint64_t>(n_elements / info->block_size);
  if (__builtin_mul_overflow(blocks, uint64_t{info->type_size}, &t->nbytes)) {
    return Problem{type_at, absl::StrCat("byte size of ", blocks, " blocks of ", Av(info->name),
                                         " overflows 64 bits")};
  }
  return ReadField(c, &t->offset, "data offset");
}

}  // namespace

uint64_t gguf_scalar_bytes(GgufType type) {
  switch (type) {
    case GgufType::kUint8:
    case GgufType::kInt8:
    case GgufType::kBool:
      return 1;
    case GgufType::kUint16:
    case GgufType::kInt16:
      return 2;
    case GgufType::kUint32:
    case GgufType::kInt32:
    case GgufType::kFloat32:
      return 4;
    case GgufType::kUint64:
    case GgufType::kInt64:
    case GgufType::kFloat64:
      return 8;
    case GgufType::kString:
    case GgufType::kArray:
      return 0;
  }
  return 0;
}

std::string_view gguf_type_name(GgufType type) {
  switch (type) {
    case GgufType::kUint8:
      return "u8";
    case GgufType::kInt8:
      return "i8";
    case GgufType::kUint16:
      return "u16";
    case GgufType::kInt16:
      return "i16";
    case GgufType::kUint32:
      return "u32";
    case GgufType::kInt32:
      return "i32";
    case GgufType::kFloat32:
      return "f32";
    case GgufType::kBool:
      return "bool";
    case GgufType::kString:
      return "str";
    case GgufType::kArray:
      return "arr";
    case GgufType::kUint64:
      return "u64";
    case GgufType::kInt64:
      return "i64";
    case GgufType::kFloat64:
      return "f64";
  }
  return "unknown";
}

std::string GgufTensor::shape_string() const {
  return absl::StrCat("[", absl::StrJoin(ne, ne + n_dims, ", "), "]");
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  MG_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file, Map(path));
  MG_RETURN_IF_ERROR(file->OpenShards());
  return file;
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path,
                                                         const LoadOptions& options) {
  MG_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file, Open(path));
  MG_RETURN_IF_ERROR(file->Load(options));
  return file;
}

namespace {

// Reads and faults go this many bytes at a time, a progress call after each.
constexpr uint64_t kLoadChunkBytes = uint64_t{64} << 20;

double Gib(uint64_t bytes) { return static_cast<double>(bytes) / (1u << 30); }

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

uint8_t* GgufFile::data_begin() const {
  if (data_copy_ != nullptr) return static_cast<uint8_t*>(data_copy_);
  return const_cast<uint8_t*>(base_) + data_offset_;
}

absl::Status GgufFile::Load(const LoadOptions& options) {
  if (map_ == nullptr) return absl::OkStatus();  // bytes from memory (FromBytes)
  if (data_copy_ != nullptr || locked_) {
    return absl::FailedPreconditionError(absl::StrCat(path_, ": loaded already"));
  }
  const uint64_t total = total_data_bytes();
  LoadMode mode = options.mode;
  if (mode != LoadMode::kMap) {
    const uint64_t available =
        options.available_bytes != 0 ? options.available_bytes : HostMemoryAvailable();
    const bool fits = total + kHostMemoryRailBytes <= available;
    if (mode == LoadMode::kAuto) {
      mode = fits ? LoadMode::kRead : LoadMode::kMap;
    } else if (available != 0 && !fits) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "%s: reading its %.2f GiB of tensors into memory needs more than the %.2f GiB "
          "available less a 1 GiB rail; map the file instead",
          path_, Gib(total), Gib(available)));
    }
  }
  std::vector<GgufFile*> files = {this};
  for (const std::unique_ptr<GgufFile>& shard : shards_) files.push_back(shard.get());
  const auto start = std::chrono::steady_clock::now();
  uint64_t done = 0;
  for (GgufFile* f : files) {
    if (mode == LoadMode::kRead) {
      MG_RETURN_IF_ERROR(f->ReadData(&done, total, options, start));
    } else if (options.fault_in) {
      MG_RETURN_IF_ERROR(f->FaultIn(&done, total, options, start));
    }
  }
  if (options.lock) {
    for (GgufFile* f : files) {
      const uint64_t bytes = f->size_ - f->data_offset_;
      if (bytes == 0) continue;
      if (::mlock(f->data_begin(), bytes) != 0) {
        const int err = errno;
        struct rlimit limit = {};
        ::getrlimit(RLIMIT_MEMLOCK, &limit);
        const std::string limit_text =
            limit.rlim_cur == RLIM_INFINITY
                ? "unlimited"
                : absl::StrFormat("%.2f MiB", limit.rlim_cur / 1048576.0);
        return absl::ErrnoToStatus(
            err, absl::StrFormat("%s: cannot lock its %.2f GiB of tensors in memory "
                                 "(RLIMIT_MEMLOCK %s: raise it with ulimit -l)",
                                 f->path_, Gib(bytes), limit_text));
      }
      f->locked_ = true;
    }
  }
  if (mode == LoadMode::kRead) {
    // Every view of a tensor's bytes moves to its file's copy; the header's
    // views (keys, vocabulary) stay in the mapping, whose data pages are dropped.
    for (GgufFile* f : files) {
      f->load_mode_ = LoadMode::kRead;
      for (GgufTensor& t : f->tensors_) {
        const GgufFile& owner = f == this ? shard(t.shard) : *f;
        t.data = owner.data_begin() + t.offset;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status GgufFile::ReadData(uint64_t* done, uint64_t total, const LoadOptions& options,
                                std::chrono::steady_clock::time_point start) {
  const uint64_t bytes = size_ - data_offset_;
  if (bytes == 0) return absl::OkStatus();
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    return absl::ErrnoToStatus(err, absl::StrCat(path_, ": cannot open"));
  }
  void* copy = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (copy == MAP_FAILED) {
    const int err = errno;
    ::close(fd);
    return absl::ErrnoToStatus(
        err, absl::StrFormat("%s: cannot allocate %.2f GiB for its tensors", path_, Gib(bytes)));
  }
  // Fewer TLB misses where the kernel grants huge pages; nothing lost where not.
  ::madvise(copy, bytes, MADV_HUGEPAGE);
  uint8_t* to = static_cast<uint8_t*>(copy);
  for (uint64_t at = 0; at < bytes;) {
    const size_t want = static_cast<size_t>(std::min(kLoadChunkBytes, bytes - at));
    const ssize_t n = ::pread(fd, to + at, want, static_cast<off_t>(data_offset_ + at));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::munmap(copy, bytes);
      ::close(fd);
      if (n == 0) {
        return absl::DataLossError(
            absl::StrFormat("%s: ends at byte %d, inside its tensor data (%d bytes when opened)",
                            path_, data_offset_ + at, size_));
      }
      return absl::ErrnoToStatus(err,
                                 absl::StrCat(path_, ": cannot read at byte ", data_offset_ + at));
    }
    // The copy is what decode reads: the page cache's pages of it would be a
    // second model's worth of memory.
    ::posix_fadvise(fd, static_cast<off_t>(data_offset_ + at), n, POSIX_FADV_DONTNEED);
    at += static_cast<uint64_t>(n);
    *done += static_cast<uint64_t>(n);
    if (options.progress) options.progress(*done, total, SecondsSince(start));
  }
  ::close(fd);
  ::mprotect(copy, bytes, PROT_READ);
  data_copy_ = copy;
  return absl::OkStatus();
}

absl::Status GgufFile::FaultIn(uint64_t* done, uint64_t total, const LoadOptions& options,
                               std::chrono::steady_clock::time_point start) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  uint8_t* const base = static_cast<uint8_t*>(map_);
  // Whole pages from the one holding the first tensor byte to the file's end.
  for (uint64_t at = data_offset_ / page * page; at < size_;) {
    const uint64_t len = std::min(kLoadChunkBytes, size_ - at);
#ifdef MADV_POPULATE_READ
    const bool populated = ::madvise(base + at, len, MADV_POPULATE_READ) == 0;
    if (!populated && errno != EINVAL) {  // EINVAL: a kernel before 5.14
      const int err = errno;
      return absl::ErrnoToStatus(err, absl::StrCat(path_, ": cannot read at byte ", at));
    }
#else
    const bool populated = false;
#endif
    if (!populated) {
      uint8_t sum = 0;
      for (uint64_t p = 0; p < len; p += page)
        sum ^= *static_cast<volatile uint8_t*>(base + at + p);
      (void)sum;
    }
    const uint64_t counted = std::min(at + len, size_) - std::max(at, data_offset_);
    at += len;
    *done += counted;
    if (options.progress) options.progress(*done, total, SecondsSince(start));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Map(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    // ErrnoToStatus appends ": " and strerror's text itself.
    return absl::ErrnoToStatus(err, absl::StrCat(path, ": cannot open"));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::ErrnoToStatus(err, absl::StrCat(path, ": cannot stat"));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  auto file = std::unique_ptr<GgufFile>(new GgufFile());
  file->path_ = path;
  file->size_ = static_cast<uint64_t>(st.st_size);
  if (file->size_ > 0) {
    void* map = ::mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return absl::ErrnoToStatus(err, absl::StrCat(path, ": cannot map"));
    }
    file->map_ = map;
    file->base_ = static_cast<const uint8_t*>(map);
  }
  ::close(fd);
  if (absl::Status s = file->Parse(); !s.ok()) return s;
  return file;
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::FromBytes(std::string name,
                                                              absl::Span<const uint8_t> bytes) {
  auto file = std::unique_ptr<GgufFile>(new GgufFile());
  file->path_ = std::move(name);
  file->copy_.assign(bytes.begin(), bytes.end());
  file->base_ = file->copy_.data();
  file->size_ = file->copy_.size();
  if (absl::Status s = file->Parse(); !s.ok()) return s;
  return file;
}

GgufFile::~GgufFile() {
  if (data_copy_ != nullptr) ::munmap(data_copy_, size_ - data_offset_);
  if (map_ != nullptr) ::munmap(map_, size_);
}

absl::Status GgufFile::Parse() {
  auto header_error = [&](uint64_t at, std::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": header at byte ", at, ": ", Av(what)));
  };
  auto key_error = [&](std::string_view label, const Problem& p) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": key ", Av(label), " at byte ", p.at, ": ", p.what));
  };
  auto tensor_error = [&](std::string_view label, const Problem& p) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": tensor ", Av(label), " at byte ", p.at, ": ", p.what));
  };
  auto quoted = [](std::string_view name) { return absl::StrCat("'", Printable(name), "'"); };

  Cursor c(base_, size_);
  uint32_t magic = 0;
  if (!c.Read(&magic)) {
    return header_error(0, absl::StrCat("file is ", size_, " bytes, too short for the magic"));
  }
  if (magic != kGgufMagic) {
    return header_error(
        0, absl::StrCat("bad magic '",
                        Printable(std::string_view(reinterpret_cast<const char*>(base_), 4)),
                        "', expected 'GGUF'"));
  }
  if (!c.Read(&version_)) return header_error(4, "file ends inside the version");
  if (version_ == 0) return header_error(4, "version 0 is not a GGUF version");
  // A big-endian file's small version number reads with its low 16 bits zero.
  if ((version_ & 0xFFFF) == 0) {
    return header_error(4, absl::StrCat("big-endian GGUF is not supported (version reads as 0x",
                                        absl::Hex(version_, absl::kZeroPad8), ")"));
  }
  if (version_ == 1) return header_error(4, "GGUF v1 is not supported (only v2 and v3)");
  if (version_ > kMaxVersion) {
    return header_error(4, absl::StrCat("GGUF v", version_, " is newer than v", kMaxVersion));
  }

  // uint64 counts (the GGUF spec's), printed as such.
  uint64_t n_tensors = 0;
  uint64_t n_kv = 0;
  if (!c.Read(&n_tensors)) return header_error(8, "file ends inside n_tensors");
  if (!c.Read(&n_kv)) return header_error(16, "file ends inside n_kv");
  // Bounded by the smallest record, so no count can drive an allocation larger
  // than the file (CVE-2024-21836, CVE-2024-23605).
  if (n_tensors > c.remaining() / kMinTensorInfoBytes) {
    return header_error(8, absl::StrCat("n_tensors ", n_tensors, " does not fit in the ",
                                        c.remaining(), " bytes after the header"));
  }
  if (n_kv > c.remaining() / kMinKvBytes) {
    return header_error(16, absl::StrCat("n_kv ", n_kv, " does not fit in the ", c.remaining(),
                                         " bytes after the header"));
  }

  kvs_.reserve(static_cast<size_t>(n_kv));
  for (uint64_t i = 0; i < n_kv; ++i) {
    GgufKV kv;
    kv.offset = c.pos();
    std::string_view key;
    if (auto p = ReadString(c, &key, "key")) return key_error(absl::StrCat("#", i), *p);
    if (key.empty()) return key_error(absl::StrCat("#", i), {kv.offset, "key is empty"});
    kv.key = std::string(key);
    if (auto [it, inserted] = key_index_.emplace(key, kvs_.size()); !inserted) {
      return key_error(quoted(key), {kv.offset, absl::StrCat("duplicate key (first at byte ",
                                                             kvs_[it->second].offset, ")")});
    }
    if (auto p = ReadValue(c, &kv)) return key_error(quoted(key), *p);
    kvs_.push_back(std::move(kv));
  }

  if (const GgufKV* kv = FindKey(kAlignmentKey)) {
    if (kv->type != GgufType::kUint32) {
      return KeyError(*kv, absl::StrCat("must be u32, is ", Av(gguf_type_name(kv->type))));
    }
    if (kv->u64 == 0 || !std::has_single_bit(kv->u64)) {
      return KeyError(*kv, absl::StrCat("alignment ", kv->u64, " is not a power of two"));
    }
    if (kv->u64 > kMaxAlignment) {
      return KeyError(*kv,
                      absl::StrCat("alignment ", kv->u64, " exceeds the limit of ", kMaxAlignment));
    }
    alignment_ = kv->u64;
  }

  tensors_.reserve(static_cast<size_t>(n_tensors));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensor t;
    t.info_offset = c.pos();
    std::string_view name;
    if (auto p = ReadString(c, &name, "name")) return tensor_error(absl::StrCat("#", i), *p);
    if (name.size() > kMaxTensorNameBytes) {
      return tensor_error(quoted(name), {t.info_offset, absl::StrCat("name is ", name.size(),
                                                                     " bytes, ggml allows at most ",
                                                                     kMaxTensorNameBytes)});
    }
    t.name = std::string(name);
    if (auto [it, inserted] = tensor_index_.emplace(name, tensors_.size()); !inserted) {
      return tensor_error(quoted(name),
                          {t.info_offset, absl::StrCat("duplicate tensor name (first at byte ",
                                                       tensors_[it->second].info_offset, ")")});
    }
    if (auto p = ReadTensorShapeTypeOffset(c, &t)) return tensor_error(quoted(name), *p);
    tensors_.push_back(std::move(t));
  }

  // The data section starts at the next aligned offset (alignment <= 1 MiB and
  // the position <= the file size, so this cannot wrap).
  data_offset_ = n_tensors > 0 ? AlignUp(c.pos(), alignment_) : c.pos();
  if (data_offset_ > size_) {
    return header_error(c.pos(), absl::StrCat("data section would start at byte ", data_offset_,
                                              ", past the end of the file (", size_, " bytes)"));
  }

  // Offsets must be exactly the running aligned offset; every step is checked
  // for overflow (CVE-2025-53630, CVE-2026-27940) and against the file end.
  const uint64_t data_bytes = size_ - data_offset_;
  uint64_t expected = 0;
  for (GgufTensor& t : tensors_) {
    const std::string label = quoted(t.name);
    if (t.offset != expected) {
      return tensor_error(
          label, {t.info_offset, absl::StrCat("data offset ", t.offset, ", expected ", expected,
                                              " (alignment ", alignment_, ")")});
    }
    if (t.nbytes > UINT64_MAX - (alignment_ - 1)) {
      return tensor_error(
          label, {t.info_offset, absl::StrCat("byte size ", t.nbytes, " overflows when padded")});
    }
    const uint64_t padded = AlignUp(t.nbytes, alignment_);
    if (t.offset > data_bytes || t.nbytes > data_bytes - t.offset) {
      return tensor_error(
          label, {t.info_offset, absl::StrCat("data [", t.offset, ", +", t.nbytes,
                                              ") runs past the end of the file (data section is ",
                                              data_bytes, " bytes at byte ", data_offset_, ")")});
    }
    t.data = base_ + data_offset_ + t.offset;
    // expected <= data_bytes and padded < data_bytes + alignment: no wrap.
    expected += padded;
  }
  return absl::OkStatus();
}

const GgufKV* GgufFile::FindKey(std::string_view key) const {
  auto it = key_index_.find(key);
  return it == key_index_.end() ? nullptr : &kvs_[it->second];
}

const GgufTensor* GgufFile::FindTensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

absl::Status GgufFile::KeyError(const GgufKV& kv, std::string_view what) const {
  return absl::InvalidArgumentError(
      absl::StrCat(path_, ": key '", Printable(kv.key), "' at byte ", kv.offset, ": ", Av(what)));
}

absl::Status GgufFile::TensorError(const GgufTensor& t, std::string_view what) const {
  return absl::InvalidArgumentError(absl::StrCat(shard(t.shard).path_, ": tensor '",
                                                 Printable(t.name), "' at byte ", t.info_offset,
                                                 ": ", Av(what)));
}

uint64_t GgufFile::total_size() const {
  uint64_t bytes = size_;
  for (const std::unique_ptr<GgufFile>& s : shards_) bytes += s->size_;
  return bytes;
}

uint64_t GgufFile::total_data_bytes() const {
  uint64_t bytes = size_ - data_offset_;
  for (const std::unique_ptr<GgufFile>& s : shards_) bytes += s->size_ - s->data_offset_;
  return bytes;
}

namespace {

absl::Status MissingKey(const std::string& path, std::string_view key) {
  return absl::NotFoundError(absl::StrCat(path, ": key '", Printable(key), "': not found"));
}

std::string TypeDescription(const GgufKV& kv) {
  if (kv.type != GgufType::kArray) return std::string(gguf_type_name(kv.type));
  return absl::StrCat("array of ", Av(gguf_type_name(kv.array_type)));
}

// Element i of a numeric array, widened; the type has been checked by the caller.
template <typename T>
T ArrayElement(const GgufKV& kv, uint64_t i) {
  T v;
  std::memcpy(&v, kv.array_data + i * sizeof(T), sizeof(T));
  return v;
}

// A split.* value, of the type llama.cpp reads it as (llama_model_loader's get_key
// refuses any other): split.no and split.count u16, split.tensors.count i32.
absl::StatusOr<int64_t> SplitValue(const GgufFile& file, std::string_view key, GgufType type) {
  const GgufKV* kv = file.FindKey(key);
  if (kv == nullptr) return MissingKey(file.path(), key);
  if (kv->type != type) {
    return file.KeyError(*kv, absl::StrCat("is ", TypeDescription(*kv), ", expected ",
                                           Av(gguf_type_name(type)), " (as llama.cpp reads it)"));
  }
  return type == GgufType::kInt32 ? kv->i64 : static_cast<int64_t>(kv->u64);
}

}  // namespace

// As llama_model_loader's constructor (src/llama-model-loader.cpp): a file without
// split.count, or with 0 or 1 (gguf-split --merge writes 0), is the whole model.
// Otherwise it must be shard 1 (split.no 0; a later shard is refused, not followed
// back), the others are named as llama_get_list_splits names them (llama_split_prefix,
// llama_split_path), each must carry its own split.no, a tensor name may be in one shard
// only, and split.tensors.count must equal the tensors found. Beyond llama.cpp, each
// shard's split.count must equal shard 1's: gguf-split writes it in every shard.
absl::Status GgufFile::OpenShards() {
  if (FindKey(kSplitCountKey) == nullptr) return absl::OkStatus();
  MG_ASSIGN_OR_RETURN(const int64_t count, SplitValue(*this, kSplitCountKey, GgufType::kUint16));
  if (count <= 1) return absl::OkStatus();
  MG_ASSIGN_OR_RETURN(const int64_t no, SplitValue(*this, kSplitNoKey, GgufType::kUint16));
  const int n = static_cast<int>(count);
  if (no != 0) {
    std::string first;
    if (std::optional<std::string> prefix = SplitPrefix(path_, static_cast<int>(no), n)) {
      first = absl::StrCat(" (", SplitPath(*prefix, 0, n), ")");
    }
    return KeyError(*FindKey(kSplitNoKey),
                    absl::StrCat("this is shard ", no + 1, " of ", n,
                                 "; a split model is opened from its first shard", first));
  }
  const std::optional<std::string> prefix = SplitPrefix(path_, 0, n);
  if (!prefix.has_value()) {
    const std::string suffix = SplitPath("", 0, n);
    return KeyError(
        *FindKey(kSplitCountKey),
        absl::StrCat("the model is split in ", n, " shards, but the name does not end in ", suffix,
                     ", so the others cannot be found"));
  }
  for (int i = 1; i < n; ++i) {
    const std::string shard_path = SplitPath(*prefix, i, n);
    absl::StatusOr<std::unique_ptr<GgufFile>> opened = Map(shard_path);
    if (!opened.ok()) {
      return absl::Status(opened.status().code(), absl::StrCat(path_, ": shard ", i + 1, " of ", n,
                                                               ": ", opened.status().message()));
    }
    const GgufFile& other = **opened;
    const std::string of_this = absl::StrCat(" (shard ", i + 1, " of the ", n, " of ", path_, ")");
    MG_ASSIGN_OR_RETURN(const int64_t other_no, SplitValue(other, kSplitNoKey, GgufType::kUint16));
    if (other_no != i) {
      return other.KeyError(*other.FindKey(kSplitNoKey),
                            absl::StrCat("is ", other_no, ", expected ", i, of_this));
    }
    MG_ASSIGN_OR_RETURN(const int64_t other_count,
                        SplitValue(other, kSplitCountKey, GgufType::kUint16));
    if (other_count != count) {
      return other.KeyError(*other.FindKey(kSplitCountKey),
                            absl::StrCat("is ", other_count, ", expected ", n, of_this));
    }
    for (const GgufTensor& t : other.tensors_) {
      const std::string_view name = other.tensor_index_.find(t.name)->first;
      if (auto [it, inserted] = tensor_index_.emplace(name, tensors_.size()); !inserted) {
        const GgufTensor& first = tensors_[it->second];
        return other.TensorError(
            t, absl::StrCat("duplicate tensor name (also in ", shard(first.shard).path_,
                            " at byte ", first.info_offset, ")"));
      }
      tensors_.push_back(t);
      tensors_.back().shard = i;
    }
    shards_.push_back(std::move(*opened));
  }
  MG_ASSIGN_OR_RETURN(const int64_t n_tensors,
                      SplitValue(*this, kSplitTensorsCountKey, GgufType::kInt32));
  if (n_tensors < 0 || static_cast<uint64_t>(n_tensors) != tensors_.size()) {
    return KeyError(*FindKey(kSplitTensorsCountKey),
                    absl::StrCat("is ", n_tensors, ", but the ", n, " shards hold ",
                                 tensors_.size(), " tensors"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> GgufFile::GetUint(std::string_view key) const {
  const GgufKV* kv = FindKey(key);
  if (kv == nullptr) return MissingKey(path_, key);
  if (!IsIntegerType(kv->type)) {
    return KeyError(*kv, absl::StrCat("is ", TypeDescription(*kv), ", expected an integer"));
  }
  if (!IsSignedType(kv->type)) return kv->u64;
  if (kv->i64 < 0) return KeyError(*kv, absl::StrCat("value ", kv->i64, " is negative"));
  return static_cast<uint64_t>(kv->i64);
}

absl::StatusOr<int64_t> GgufFile::GetInt(std::string_view key) const {
  const GgufKV* kv = FindKey(key);
  if (kv == nullptr) return MissingKey(path_, key);
  if (!IsIntegerType(kv->type)) {
    return KeyError(*kv, absl::StrCat("is ", TypeDescription(*kv), ", expected an integer"));
  }
  if (IsSignedType(kv->type)) return kv->i64;
  if (kv->u64 > static_cast<uint64_t>(INT64_MAX)) {
    return KeyError(*kv, absl::StrCat("value ", kv->u64, " does not fit in int64"));
  }
  return static_cast<int64_t>(kv->u64);
}

absl::StatusOr<double> GgufFile::GetFloat(std::string_view key) const {
  const GgufKV* kv = FindKey(key);
  if (kv == nullptr) return MissingKey(path_, key);
  if (kv->type == GgufType::kFloat32 || kv->type == GgufType::kFloat64) return kv->f64;
  if (IsIntegerType(kv->type)) {
    return IsSignedType(kv->type) ? static_cast<double>(kv->i64) : static_cast<double>(kv->u64);
  }
  return KeyError(*kv, absl::StrCat("is ", TypeDescription(*kv), ", expected a number"));
}

absl::StatusOr<bool> GgufFile::GetBool(std::string_view key) const {
  const GgufKV* kv = FindKey(key);
  if (kv == nullptr) return MissingKey(path_, key);
  if (kv->type != GgufType::kBool) {
    return KeyError(*kv, absl::StrCat("is ", TypeDescription(*kv), ", expected bool"));
  }
  return kv->u64 != 0;
}

absl::StatusOr<std::string_view> GgufFile::GetString(std::string_view key) const {
  const GgufKV* kv = FindKey(key);
  if (kv == nullptr) return MissingKey(path_, key);
  if (kv->type != GgufType::kString) {
    return KeyError(*kv, absl::StrCat("is ", TypeDescription(*kv), ", expected str"));
  }
  return kv->str;
}

absl::StatusOr<std::vector<std::string_view>> GgufFile::GetStringArray(std::string_view key) const {
  const GgufKV* kv = FindKey(key);
  if (kv == nullptr) return MissingKey(path_, key);
  if (kv->type != GgufType::kArray || kv->array_type != GgufType::kString) {
    return KeyError(*kv, absl::StrCat("is ", TypeDescription(*kv), ", expected array of str"));
  }
  return kv->array_strings;
}

absl::StatusOr<std::vector<int64_t>> GgufFile::GetIntArray(std::string_view key) const {
  const GgufKV* kv = FindKey(key);
  if (kv == nullptr) return MissingKey(path_, key);
  // The element type decides the stride; it is checked before any element is
  // read (llama.cpp #26690).
  if (kv->type != GgufType::kArray || !IsIntegerType(kv->array_type)) {
    return KeyError(*kv,
                    absl::StrCat("is ", TypeDescription(*kv), ", expected an array of integers"));
  }
  std::vector<int64_t> out;
  out.reserve(kv->array_n);
  for (uint64_t i = 0; i < kv->array_n; ++i) {
    switch (kv->array_type) {
      case GgufType::kUint8:
        out.push_back(ArrayElement<uint8_t>(*kv, i));
        break;
      case GgufType::kInt8:
        out.push_back(ArrayElement<int8_t>(*kv, i));
        break;
      case GgufType::kUint16:
        out.push_back(ArrayElement<uint16_t>(*kv, i));
        break;
      case GgufType::kInt16:
        out.push_back(ArrayElement<int16_t>(*kv, i));
        break;
      case GgufType::kUint32:
        out.push_back(ArrayElement<uint32_t>(*kv, i));
        break;
      case GgufType::kInt32:
        out.push_back(ArrayElement<int32_t>(*kv, i));
        break;
      case GgufType::kInt64:
        out.push_back(ArrayElement<int64_t>(*kv, i));
        break;
      case GgufType::kUint64: {
        const uint64_t v = ArrayElement<uint64_t>(*kv, i);
        if (v > static_cast<uint64_t>(INT64_MAX)) {
          return KeyError(*kv, absl::StrCat("element ", i, " = ", v, " does not fit in int64"));
        }
        out.push_back(static_cast<int64_t>(v));
        break;
      }
      default:
        break;  // excluded by the type check above
    }
  }
  return out;
}

absl::StatusOr<std::vector<bool>> GgufFile::GetFlagArray(std::string_view key) const {
  const GgufKV* kv = FindKey(key);
  if (kv == nullptr) return MissingKey(path_, key);
  if (kv->type == GgufType::kArray && kv->array_type == GgufType::kBool) {
    std::vector<bool> out;
    out.reserve(kv->array_n);
    for (uint64_t i = 0; i < kv->array_n; ++i) out.push_back(ArrayElement<uint8_t>(*kv, i) != 0);
    return out;
  }
  if (kv->type != GgufType::kArray || !IsIntegerType(kv->array_type)) {
    return KeyError(*kv, absl::StrCat("is ", TypeDescription(*kv),
                                      ", expected an array of bools or integers"));
  }
  absl::StatusOr<std::vector<int64_t>> ints = GetIntArray(key);
  if (!ints.ok()) return ints.status();
  std::vector<bool> out;
  out.reserve(ints->size());
  for (int64_t v : *ints) out.push_back(v != 0);
  return out;
}

absl::StatusOr<std::vector<double>> GgufFile::GetFloatArray(std::string_view key) const {
  const GgufKV* kv = FindKey(key);
  if (kv == nullptr) return MissingKey(path_, key);
  if (kv->type != GgufType::kArray) {
    return KeyError(*kv, absl::StrCat("is ", TypeDescription(*kv), ", expected an array"));
  }
  if (kv->array_type == GgufType::kFloat32 || kv->array_type == GgufType::kFloat64) {
    std::vector<double> out;
    out.reserve(kv->array_n);
    for (uint64_t i = 0; i < kv->array_n; ++i) {
      out.push_back(kv->array_type == GgufType::kFloat32 ? ArrayElement<float>(*kv, i)
                                                         : ArrayElement<double>(*kv, i));
    }
    return out;
  }
  if (!IsIntegerType(kv->array_type)) {
    return KeyError(*kv,
                    absl::StrCat("is ", TypeDescription(*kv), ", expected an array of numbers"));
  }
  absl::StatusOr<std::vector<int64_t>> ints = GetIntArray(key);
  if (!ints.ok()) return ints.status();
  return std::vector<double>(ints->begin(), ints->end());
}

}  // namespace moegraph
