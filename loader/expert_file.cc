#include "loader/expert_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "loader/gguf.h"
#include "loader/status_util.h"

namespace moegraph {
namespace {

// O_DIRECT's alignment of offsets, lengths and buffers (the logical block
// size is at most this on the filesystems it runs on).
constexpr size_t kDirectAlignment = 4096;

uint64_t AlignDown(uint64_t n) { return n / kDirectAlignment * kDirectAlignment; }
uint64_t AlignUp(uint64_t n) { return AlignDown(n + kDirectAlignment - 1); }

void FreeAligned(uint8_t* p) { ::operator delete(p, std::align_val_t(kDirectAlignment)); }

int64_t MtimeNs(const struct stat& st) {
  return int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
}

}  // namespace

ExpertFileReader::~ExpertFileReader() {
  for (const Shard& s : shards_) {
    if (s.fd >= 0) ::close(s.fd);
  }
}

absl::StatusOr<std::unique_ptr<ExpertFileReader>> ExpertFileReader::Open(const Model& model,
                                                                         bool direct) {
  std::unique_ptr<ExpertFileReader> r(new ExpertFileReader());
  r->model_ = &model;
  r->direct_ = direct;
  const GgufFile& file = *model.file;
  for (int i = 0; i < file.shard_count(); ++i) {
    Shard s;
    s.path = file.shard(i).path();
    s.data_offset = file.shard(i).data_offset();
    s.fd = ::open(s.path.c_str(), O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
    if (s.fd < 0 && direct && errno == EINVAL) {  // the filesystem refuses O_DIRECT
      r->direct_ = false;
      s.fd = ::open(s.path.c_str(), O_RDONLY | O_CLOEXEC);
    }
    if (s.fd < 0) {
      return absl::NotFoundError(
          absl::StrFormat("%s: cannot open for expert reads: %s", s.path, std::strerror(errno)));
    }
    struct stat st{};
    if (::fstat(s.fd, &st) != 0) {
      const int error = errno;
      ::close(s.fd);
      return absl::InternalError(absl::StrFormat("%s: %s", s.path, std::strerror(error)));
    }
    s.size = st.st_size;
    s.mtime_ns = MtimeNs(st);
    r->shards_.push_back(s);
  }
  if (r->direct_) {
    // Some filesystems open with O_DIRECT and refuse the reads: try one.
    r->bounce_ = {static_cast<uint8_t*>(
                      ::operator new(kDirectAlignment, std::align_val_t(kDirectAlignment))),
                  &FreeAligned};
    r->bounce_bytes_ = kDirectAlignment;
    const Shard& first = r->shards_.front();
    if (::pread(first.fd, r->bounce_.get(), kDirectAlignment, 0) < 0 && errno == EINVAL) {
      r->direct_ = false;
      for (Shard& s : r->shards_) {
        ::close(s.fd);
        s.fd = ::open(s.path.c_str(), O_RDONLY | O_CLOEXEC);
        if (s.fd < 0) {
          return absl::NotFoundError(absl::StrFormat("%s: cannot open for expert reads: %s",
                                                     s.path, std::strerror(errno)));
        }
      }
    }
  }
  return r;
}

absl::Status ExpertFileReader::ReadRange(const Shard& shard, const GgufTensor& tensor,
                                         uint64_t offset, size_t bytes, uint8_t* dst) {
  // With O_DIRECT the aligned range around the slice, through the bounce buffer.
  const uint64_t first = direct_ ? AlignDown(offset) : offset;
  const uint64_t last = direct_ ? AlignUp(offset + bytes) : offset + bytes;
  const size_t span = static_cast<size_t>(last - first);
  uint8_t* target = dst;
  if (direct_) {
    if (bounce_bytes_ < span) {
      bounce_ = {static_cast<uint8_t*>(::operator new(span, std::align_val_t(kDirectAlignment))),
                 &FreeAligned};
      bounce_bytes_ = span;
    }
    target = bounce_.get();
  }
  // The file's end may fall inside the aligned range: what is needed is up to offset + bytes.
  const size_t needed = static_cast<size_t>(offset + bytes - first);
  size_t done = 0;
  while (done < needed) {
    const ssize_t n = ::pread(shard.fd, target + done, span - done, static_cast<off_t>(first + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::DataLossError(absl::StrFormat(
          "%s: tensor '%s': reading %d bytes at byte %d: %s", shard.path, tensor.name, bytes,
          offset, n < 0 ? std::strerror(errno) : "the file ends first (truncated?)"));
    }
    done += static_cast<size_t>(n);
    bytes_read_ += static_cast<uint64_t>(n);
  }
  ++reads_;
  if (direct_) std::memcpy(dst, target + (offset - first), bytes);
  return absl::OkStatus();
}

absl::Status ExpertFileReader::ReadBlock(int layer, int expert, const ExpertBlockLayout& layout,
                                         uint8_t* block) {
  size_t end = 0;
  for (const ExpertProj proj : {ExpertProj::kGate, ExpertProj::kUp, ExpertProj::kDown}) {
    const ProjectionLayout& p = layout[proj];
    const GgufTensor& tensor = *ExpertTensor(*model_, layer, proj, expert);
    const Shard& shard = shards_[static_cast<size_t>(tensor.shard)];
    struct stat st{};
    if (::fstat(shard.fd, &st) != 0 || st.st_size != shard.size || MtimeNs(st) != shard.mtime_ns) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: the file changed since it was opened (size %d, now %d): its experts would not "
          "be the model's",
          shard.path, shard.size, static_cast<int64_t>(st.st_size)));
    }
    // The slice's place in its tensor, from the binding's pointers (nothing is read there).
    const uint64_t in_tensor =
        static_cast<uint64_t>(model_->expert(layer, proj, expert).data - tensor.data);
    const uint64_t offset = shard.data_offset + tensor.offset + in_tensor;
    std::memset(block + end, 0, p.offset - end);
    MG_RETURN_IF_ERROR(ReadRange(shard, tensor, offset, p.bytes(), block + p.offset));
    end = p.offset + p.bytes();
  }
  std::memset(block + end, 0, layout.block_bytes - end);
  return absl::OkStatus();
}

}  // namespace moegraph
