// The disk tier's reads: experts' blocks (gate, up, down: ExpertBlockLayout)
// read from the model's GGUF files (split files too), every slice of a batch
// in flight at once through io_uring (liburing; one pread after another
// where the kernel refuses a ring), with O_DIRECT where the filesystem allows
// it, so an expert that is not cached costs its bytes from the disk and no
// page cache; with O_DIRECT each slice's aligned range is read into a bounce
// buffer and copied out. The bytes are the file's, so a block read here
// equals ExpertStore's copy of it bit for bit. Start/Arrive hand the blocks
// back as each one's reads complete, so a caller computes with the blocks it
// has while the others are read.
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
  // Starts reading the blocks and returns: Arrive hands them back. Where
  // their slices do not fit one ring (or there is no ring) they are read
  // before it returns, and arrive all at once. No blocks may be pending.
  absl::Status Start(absl::Span<const BlockRead> reads);
  // Waits until at least one started block is read whole (and copied out of
  // the bounce buffer) and appends the indices (into Start's reads) of those
  // read since the last call to `arrived`. Errors as ReadBlocks'; a block
  // whose read failed still arrives (its bytes are not the file's: the error
  // says so), so a caller waiting for it never hangs.
  absl::Status Arrive(std::vector<int>* arrived);
  // Started blocks not yet handed back by Arrive.
  int pending() const { return pending_; }
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
    int read = 0;          // its block: an index into Start's reads
    bool complete = false;  // its completion seen (read whole, or failed)
  };
  struct Ring;
  ExpertFileReader() = default;
  absl::Status CheckUnchanged(const Shard& shard) const;
  // Reads what is left of slice's range with pread.
  absl::Status FinishWithPread(Slice& slice);
  absl::Status Failed(const Slice& slice, int error) const;
  // Slice i's completion (res: the ring's result): short reads finished by
  // pread, its block handed back once its last slice is done.
  absl::Status Complete(size_t i, int res);
  // Block b's slices done: copied out of the bounce buffer, into ready_.
  void BlockDone(int b);

  const Model* model_ = nullptr;
  std::vector<Shard> shards_;
  bool direct_ = false;
  std::unique_ptr<Ring> ring_;
  std::unique_ptr<uint8_t, void (*)(uint8_t*)> bounce_{nullptr, nullptr};
  size_t bounce_bytes_ = 0;
  std::vector<Slice> slices_;
  std::vector<int> slices_left_;  // per started block: its slices not yet read
  std::vector<int> ready_;        // blocks read whole, not yet handed back
  int pending_ = 0;
  int in_ring_ = 0;               // slices submitted whose completions are not yet seen
  uint64_t bytes_read_ = 0;
  uint64_t reads_ = 0;
};

}  // namespace moegraph
