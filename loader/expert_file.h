// The disk tier's reads: an expert's block (gate, up, down: ExpertBlockLayout)
// read from the model's GGUF files (split files too) with pread, with
// O_DIRECT where the filesystem allows it, so an expert that is not cached
// costs its bytes from the disk and no page cache; the slices' unaligned
// heads and tails go through an aligned bounce buffer. The bytes are the
// file's, so a block read here equals ExpertStore's copy of it bit for bit.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "loader/model_config.h"
#include "loader/placement.h"

namespace moegraph {

class ExpertFileReader {
 public:
  // Opens every shard of model's file for reads; direct false reads through
  // the page cache. A filesystem that refuses O_DIRECT (tmpfs) gets buffered
  // reads, and direct() says so. Errors name the file.
  static absl::StatusOr<std::unique_ptr<ExpertFileReader>> Open(const Model& model,
                                                                bool direct = true);
  ~ExpertFileReader();
  ExpertFileReader(const ExpertFileReader&) = delete;
  ExpertFileReader& operator=(const ExpertFileReader&) = delete;

  // layer's expert into block (layout's block_bytes; padding zeroed, as
  // ExpertStore's). Errors name the file and tensor: a failed or short read,
  // and a file whose size or modification time changed since Open.
  absl::Status ReadBlock(int layer, int expert, const ExpertBlockLayout& layout, uint8_t* block);

  bool direct() const { return direct_; }
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
  ExpertFileReader() = default;
  absl::Status ReadRange(const Shard& shard, const GgufTensor& tensor, uint64_t offset,
                         size_t bytes, uint8_t* dst);

  const Model* model_ = nullptr;
  std::vector<Shard> shards_;
  bool direct_ = false;
  std::unique_ptr<uint8_t, void (*)(uint8_t*)> bounce_{nullptr, nullptr};
  size_t bounce_bytes_ = 0;
  uint64_t bytes_read_ = 0;
  uint64_t reads_ = 0;
};

}  // namespace moegraph
