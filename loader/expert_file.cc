#include "loader/expert_file.h"

#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "loader/check.h"
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

std::unique_ptr<uint8_t, void (*)(uint8_t*)> AllocAligned(size_t bytes) {
  return {static_cast<uint8_t*>(::operator new(bytes, std::align_val_t(kDirectAlignment))),
          &FreeAligned};
}

int64_t MtimeNs(const struct stat& st) {
  return int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
}

}  // namespace

struct ExpertFileReader::Ring {
  io_uring ring{};
  bool initialized = false;
  ~Ring() {
    if (initialized) io_uring_queue_exit(&ring);
  }
};

ExpertFileReader::~ExpertFileReader() {
  ring_.reset();
  for (const Shard& s : shards_) {
    if (s.fd >= 0) ::close(s.fd);
  }
}

absl::StatusOr<std::unique_ptr<ExpertFileReader>> ExpertFileReader::Open(const Model& model,
                                                                         bool direct,
                                                                         bool uring) {
  std::unique_ptr<ExpertFileReader> r(new ExpertFileReader());
  r->model_ = &model;
  r->direct_ = direct;
  const GgufFile& file = *model.file;
  const auto open_shard = [](Shard& s, bool with_direct) -> absl::Status {
    if (s.fd >= 0) ::close(s.fd);
    s.fd = ::open(s.path.c_str(), O_RDONLY | O_CLOEXEC | (with_direct ? O_DIRECT : 0));
    if (s.fd < 0) {
      return absl::NotFoundError(
          absl::StrFormat("%s: cannot open for expert reads: %s", s.path, std::strerror(errno)));
    }
    return absl::OkStatus();
  };
  for (int i = 0; i < file.shard_count(); ++i) {
    Shard s;
    s.path = file.shard(i).path();
    s.data_offset = file.shard(i).data_offset();
    absl::Status opened = open_shard(s, r->direct_);
    if (!opened.ok() && r->direct_ && errno == EINVAL) {  // the filesystem refuses O_DIRECT
      r->direct_ = false;
      for (Shard& earlier : r->shards_) MG_RETURN_IF_ERROR(open_shard(earlier, false));
      opened = open_shard(s, false);
    }
    MG_RETURN_IF_ERROR(opened);
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
    r->bounce_ = AllocAligned(kDirectAlignment);
    r->bounce_bytes_ = kDirectAlignment;
    if (::pread(r->shards_.front().fd, r->bounce_.get(), kDirectAlignment, 0) < 0 &&
        errno == EINVAL) {
      r->direct_ = false;
      for (Shard& s : r->shards_) MG_RETURN_IF_ERROR(open_shard(s, false));
    }
  }
  if (uring) {
    auto ring = std::make_unique<Ring>();
    // A kernel or sandbox without io_uring: one pread after another.
    ring->initialized = io_uring_queue_init(kQueueDepth, &ring->ring, 0) == 0;
    if (ring->initialized) r->ring_ = std::move(ring);
  }
  return r;
}

absl::Status ExpertFileReader::CheckUnchanged(const Shard& shard) const {
  struct stat st{};
  if (::fstat(shard.fd, &st) != 0 || st.st_size != shard.size || MtimeNs(st) != shard.mtime_ns) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: the file changed since it was opened (size %d, now %d): its experts would not be "
        "the model's",
        shard.path, shard.size, static_cast<int64_t>(st.st_size)));
  }
  return absl::OkStatus();
}

absl::Status ExpertFileReader::Failed(const Slice& slice, int error) const {
  return absl::DataLossError(absl::StrFormat(
      "%s: tensor '%s': reading %d bytes at byte %d: %s", slice.shard->path, slice.tensor->name,
      slice.bytes, slice.offset,
      error != 0 ? std::strerror(error) : "the file ends first (truncated?)"));
}

absl::Status ExpertFileReader::FinishWithPread(Slice& slice) {
  // The file's end may fall inside an aligned range: what is needed is up to offset + bytes.
  const size_t needed = static_cast<size_t>(slice.offset + slice.bytes - slice.first);
  while (slice.done < needed) {
    const ssize_t n = ::pread(slice.shard->fd, slice.target + slice.done, slice.span - slice.done,
                              static_cast<off_t>(slice.first + slice.done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Failed(slice, n < 0 ? errno : 0);
    slice.done += static_cast<size_t>(n);
    bytes_read_ += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::Status ExpertFileReader::Complete(size_t i, int res) {
  Slice& slice = slices_[i];
  slice.complete = true;
  absl::Status status;
  if (res < 0) {
    status = Failed(slice, -res);
  } else {
    slice.done = static_cast<size_t>(res);
    bytes_read_ += static_cast<uint64_t>(res);
    status = FinishWithPread(slice);  // a short read's rest; nothing where it is whole
  }
  if (--slices_left_[static_cast<size_t>(slice.read)] == 0) BlockDone(slice.read);
  return status;
}

void ExpertFileReader::BlockDone(int b) {
  if (direct_) {  // its three slices, in Start's order
    for (size_t i = 3 * static_cast<size_t>(b); i < 3 * static_cast<size_t>(b) + 3; ++i) {
      const Slice& s = slices_[i];
      std::memcpy(s.dst, s.target + (s.offset - s.first), s.bytes);
    }
  }
  ready_.push_back(b);
}

absl::Status ExpertFileReader::Start(absl::Span<const BlockRead> reads) {
  MG_CHECK(pending_ == 0, "ExpertFileReader: Start with blocks still pending");
  slices_.clear();
  ready_.clear();
  slices_left_.assign(reads.size(), 3);
  size_t bounce_needed = 0;
  for (size_t b = 0; b < reads.size(); ++b) {
    const BlockRead& read = reads[b];
    size_t end = 0;
    for (const ExpertProj proj : {ExpertProj::kGate, ExpertProj::kUp, ExpertProj::kDown}) {
      const ProjectionLayout& p = (*read.layout)[proj];
      Slice s;
      s.tensor = ExpertTensor(*model_, read.layer, proj, read.expert);
      s.shard = &shards_[static_cast<size_t>(s.tensor->shard)];
      // The slice's place in its tensor, from the binding's pointers (nothing is read there).
      const uint64_t in_tensor =
          static_cast<uint64_t>(model_->expert(read.layer, proj, read.expert).data - s.tensor->data);
      s.offset = s.shard->data_offset + s.tensor->offset + in_tensor;
      s.bytes = p.bytes();
      s.dst = read.block + p.offset;
      s.first = direct_ ? AlignDown(s.offset) : s.offset;
      s.span = static_cast<size_t>((direct_ ? AlignUp(s.offset + s.bytes) : s.offset + s.bytes) -
                                   s.first);
      s.read = static_cast<int>(b);
      bounce_needed += direct_ ? s.span : 0;
      slices_.push_back(s);
      std::memset(read.block + end, 0, p.offset - end);
      end = p.offset + p.bytes();
    }
    std::memset(read.block + end, 0, read.layout->block_bytes - end);
  }
  for (const Shard& shard : shards_) MG_RETURN_IF_ERROR(CheckUnchanged(shard));
  if (bounce_bytes_ < bounce_needed) {
    bounce_ = AllocAligned(bounce_needed);
    bounce_bytes_ = bounce_needed;
  }
  size_t at = 0;
  for (Slice& s : slices_) {
    s.target = direct_ ? bounce_.get() + at : s.dst;
    at += direct_ ? s.span : 0;
  }
  reads_ += slices_.size();
  pending_ = static_cast<int>(reads.size());
  // One ring's worth in flight, the caller computing meanwhile; else (or
  // what the ring refused) read here, one pread after another.
  size_t submitted = 0;
  if (ring_ != nullptr && slices_.size() <= static_cast<size_t>(kQueueDepth)) {
    io_uring* ring = &ring_->ring;
    for (size_t i = 0; i < slices_.size(); ++i) {
      io_uring_sqe* sqe = io_uring_get_sqe(ring);
      io_uring_prep_read(sqe, slices_[i].shard->fd, slices_[i].target,
                         static_cast<unsigned>(slices_[i].span), slices_[i].first);
      io_uring_sqe_set_data64(sqe, i);
    }
    const int n = io_uring_submit(ring);
    submitted = n < 0 ? 0 : static_cast<size_t>(n);
  }
  in_ring_ = static_cast<int>(submitted);
  absl::Status status;
  for (size_t i = submitted; i < slices_.size(); ++i) {
    absl::Status done = Complete(i, 0);
    if (status.ok()) status = std::move(done);
  }
  return status;
}

absl::Status ExpertFileReader::Arrive(std::vector<int>* arrived) {
  absl::Status status;
  if (ready_.empty() && in_ring_ > 0) {
    io_uring* ring = &ring_->ring;
    // Wait for one completion, then take every one already there.
    io_uring_cqe* cqe = nullptr;
    int waited = io_uring_wait_cqe(ring, &cqe);
    while (waited == -EINTR) waited = io_uring_wait_cqe(ring, &cqe);
    while (waited == 0) {
      const size_t i = io_uring_cqe_get_data64(cqe);
      const int res = cqe->res;
      io_uring_cqe_seen(ring, cqe);
      --in_ring_;
      absl::Status done = Complete(i, res);
      if (status.ok()) status = std::move(done);
      if (in_ring_ == 0) break;
      waited = io_uring_peek_cqe(ring, &cqe);
    }
    if (waited < 0 && waited != -EAGAIN && ready_.empty()) {
      // The ring failed: the slices still in it are read here.
      if (status.ok()) {
        status = absl::InternalError(absl::StrFormat("io_uring: %s", std::strerror(-waited)));
      }
      for (size_t i = 0; i < slices_.size(); ++i) {
        if (slices_[i].complete) continue;
        absl::Status done = Complete(i, 0);
        if (status.ok()) status = std::move(done);
      }
      in_ring_ = 0;
    }
  }
  arrived->insert(arrived->end(), ready_.begin(), ready_.end());
  pending_ -= static_cast<int>(ready_.size());
  ready_.clear();
  return status;
}

absl::Status ExpertFileReader::ReadBlocks(absl::Span<const BlockRead> reads) {
  // At most one ring's worth of slices in flight at a time.
  constexpr size_t kBlocksPerStart = kQueueDepth / 3;
  absl::Status status;
  std::vector<int> arrived;
  for (size_t first = 0; first < reads.size(); first += kBlocksPerStart) {
    absl::Status started = Start(reads.subspan(first, kBlocksPerStart));
    if (status.ok()) status = std::move(started);
    while (pending_ > 0) {
      absl::Status done = Arrive(&arrived);
      if (status.ok()) status = std::move(done);
    }
  }
  return status;
}

}  // namespace moegraph
