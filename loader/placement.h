// Expert placement: every routed expert of every layer repacked into one block
// (gate, up, down, in the file's own quant layout, as opaque bytes), all blocks in
// one host allocation. A block is the unit the residency cache moves: one copy
// stages one expert into a slot, and the slot pools are arrays of blocks.
//
// Layers whose blocks have the same layout share a size class; a pool serves one
// class, so a model whose layers differ in expert types pads nothing to the
// largest block.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "loader/host_memory.h"
#include "loader/model_config.h"

namespace moegraph {

// Alignment of every projection inside a block and of the block size. The GPU's
// 16-byte vector copies need 16; 256 is what cudaMalloc guarantees, so a slot
// address is as aligned as any device buffer, every projection starts on its own
// 32-byte sectors and 128-byte lines (no line is shared by two projections), and
// the padding (under 256 bytes per projection) is nothing next to a block of
// hundreds of KiB.
inline constexpr size_t kBlockAlignment = 256;

struct ProjectionLayout {
  GgmlType type = GgmlType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  size_t row_bytes = 0;
  size_t offset = 0;  // from the block start, a multiple of kBlockAlignment

  size_t bytes() const { return static_cast<size_t>(rows) * row_bytes; }
  bool operator==(const ProjectionLayout&) const = default;
};

struct ExpertBlockLayout {
  std::array<ProjectionLayout, 3> projections;  // indexed by ExpertProj
  size_t block_bytes = 0;  // projections plus padding, a multiple of kBlockAlignment

  const ProjectionLayout& operator[](ExpertProj proj) const {
    return projections[static_cast<size_t>(proj)];
  }
  bool operator==(const ExpertBlockLayout&) const = default;
};

// The tensor a projection of one expert is a slice of (merged ffn_*_exps) or
// is (legacy per-expert tensors).
const GgufTensor* ExpertTensor(const Model& model, int layer, ExpertProj proj, int expert);

// The block layout of layer's experts, from expert 0's projections.
ExpertBlockLayout ExpertLayoutOf(const Model& model, int layer);

// A projection inside a block (a store block or a slot holding a copy of one) as
// a matrix the reference matmul computes through.
WeightView ProjectionView(const ExpertBlockLayout& layout, ExpertProj proj, const uint8_t* block);

// MoE layers that share a block layout (a dense layer is in no class).
struct SizeClass {
  ExpertBlockLayout layout;
  size_t block_bytes = 0;
  std::vector<int> layers;  // ascending
};

// Where the store's memory comes from. The default is an aligned host
// allocation; the CUDA engine passes pinned, mapped memory (cudaHostAlloc) so the
// device can copy from it directly. alloc returns nullptr on failure.
struct HostAllocator {
  void* (*alloc)(size_t bytes, void* context) = nullptr;
  void (*free)(void* ptr, size_t bytes, void* context) = nullptr;
  void* context = nullptr;
};

// 4096-byte aligned memory from the C++ heap (page aligned, so it can be pinned
// later with cudaHostRegister).
HostAllocator AlignedHostAllocator();

// The store reports its copying through a LoadProgressFn (loader/gguf.h).

class ExpertStore {
 public:
  // Allocates total_bytes() through allocator and copies every (layer, expert)
  // block from model's bytes (merged ffn_*_exps slices and legacy per-expert
  // tensors alike). Errors: an expert whose projections differ in type from the
  // layer's expert 0 (legacy tensors; names the tensor), and a failed allocation
  // (names the size). model is only read during Create.
  static absl::StatusOr<ExpertStore> Create(const Model& model,
                                            const HostAllocator& allocator = AlignedHostAllocator(),
                                            const LoadProgressFn& progress = nullptr);
  // The layouts and classes alone, no blocks (data() null, block() not to be
  // called): the disk tier's store, whose blocks are read from the file
  // (loader/expert_file.h). Errors as Create's.
  static absl::StatusOr<ExpertStore> Layouts(const Model& model);

  ~ExpertStore();
  ExpertStore(ExpertStore&& other) noexcept;
  ExpertStore& operator=(ExpertStore&& other) noexcept;
  ExpertStore(const ExpertStore&) = delete;
  ExpertStore& operator=(const ExpertStore&) = delete;

  int n_layer() const { return static_cast<int>(class_of_layer_.size()); }
  const uint8_t* data() const { return data_; }  // the allocation: every block within it
  int n_expert() const { return n_expert_; }
  // Block, layout and class of an MoE layer's expert (a dense layer has none).
  const uint8_t* block(int layer, int expert) const;
  const ExpertBlockLayout& layout(int layer) const { return classes_[class_of(layer)].layout; }
  size_t block_bytes(int layer) const { return classes_[class_of(layer)].block_bytes; }
  int class_of(int layer) const { return class_of_layer_[static_cast<size_t>(layer)]; }
  const std::vector<SizeClass>& size_classes() const { return classes_; }
  size_t total_bytes() const { return total_bytes_; }

 private:
  ExpertStore() = default;
  void Release();

  HostAllocator allocator_;
  uint8_t* data_ = nullptr;
  size_t total_bytes_ = 0;
  int n_expert_ = 0;
  std::vector<SizeClass> classes_;
  std::vector<int> class_of_layer_;   // -1 for a dense layer
  std::vector<size_t> layer_offset_;  // start of the layer's expert 0 block
};

}  // namespace moegraph
