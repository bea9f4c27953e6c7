// The disk tier's reads: experts' blocks (gate, up, down: ExpertBlockLayout)
// read from the model's GGUF files (split files too), every slice of a batch
// in flight at once through io_uring (liburing; one pread after another
// where the kernel refuses a ring), with O_DIRECT where the filesystem allows
// it, so an expert that is not cached costs its bytes from the disk and no
// page cache; with O_DIRECT each slice's aligned range is read into a bounce
// buffer and copied out. The bytes are the file's, so a block read here
// equals ExpertStore's copy of it bit for bit.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "loader/model_config.h"
#include "loader/placement.h"

namespace moegraph {

// One block to read: layer's expert into block (layout.block_bytes).
struct BlockRead {
  int layer = 0;
  int expert = 0;
  const ExpertBlockLayout* layout = nullptr;
  uint8_t* block = nullptr;
};

class ExpertFileReader {
 public:
  // Opens every shard of model's file for reads; direct false reads through
  // the page cache, uring false one pread at a time. A filesystem that
  // refuses O_DIRECT (tmpfs) gets buffered reads and a kernel that refuses
  // io_uring preads; direct() and uring() say so. Errors name the file.
  static absl::StatusOr<std::unique_ptr<ExpertFileReader>> Open(const Model& model,
                                                                bool direct = true,
                                                                bool uring = true);
  ~ExpertFileReader();
  ExpertFileReader(const ExpertFileReader&) = delete;
  ExpertFileReader& operator=(const ExpertFileReader&) = delete;

  // The blocks (padding zeroed, as ExpertStore's), every slice in flight at
  // once (kQueueDepth at a time). Errors name the file and tensor: a failed
  // or short read, and a file whose size or modification time changed since
  // Open (checked before the reads).
  absl::Status ReadBlocks(absl::Span<const BlockRead> reads);
  absl::Status ReadBlock(int layer, int expert, const ExpertBlockLayout& layout, uint8_t* block) {
    const BlockRead one{layer, expert, &layout, block};
    return ReadBlocks({&one, 1});
  }

  // Slices in flight at most: a layer's misses at top-k 64, three slices each.
  static constexpr int kQueueDepth = 192;

  bool direct() const { return direct_; }
  bool uring() const { return ring_ != nullptr; }
  // Bytes read from the files so far (with O_DIRECT, the aligned ranges).
  uint64_t bytes_read() const { return bytes_read_; }
  uint64_t reads() const { return reads_; }

 private:
  struct Shard {
    std::string path;
    int fd = -1;
    uint64_t data_offset = 0;  // the data section's start in the file
    int64_t size = 0;          // at Open
    int64_t mtime_ns = 0;
  };
  // One slice: where it is in the file, where its bytes go, and the range
  // read for it (with O_DIRECT the aligned one, into the bounce buffer).
  struct Slice {
    const Shard* shard = nullptr;
    const GgufTensor* tensor = nullptr;
    uint64_t offset = 0;  // in the file
    size_t bytes = 0;
    uint8_t* dst = nullptr;
    uint64_t first = 0;    // the range read
    size_t span = 0;
    uint8_t* target = nullptr;
    size_t done = 0;       // bytes of the range read so far
  };
  struct Ring;
  ExpertFileReader() = default;
  absl::Status CheckUnchanged(const Shard& shard) const;
  // Reads what is left of slice's range with pread.
  absl::Status FinishWithPread(Slice& slice);
  absl::Status Failed(const Slice& slice, int error) const;
  // The slices of one batch (at most kQueueDepth) through the ring.
  absl::Status ReadThroughRing(absl::Span<Slice> slices);

  const Model* model_ = nullptr;
  std::vector<Shard> shards_;
  bool direct_ = false;
  std::unique_ptr<Ring> ring_;
  std::unique_ptr<uint8_t, void (*)(uint8_t*)> bounce_{nullptr, nullptr};
  size_t bounce_bytes_ = 0;
  std::vector<Slice> slices_;
  uint64_t bytes_read_ = 0;
  uint64_t reads_ = 0;
};

}  // namespace moegraph
