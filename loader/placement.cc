#include "loader/placement.h"

#include <chrono>
#include <cstring>
#include <new>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_format.h"
#include "loader/check.h"
#include "loader/status_util.h"

namespace moegraph {
namespace {

constexpr ExpertProj kProjections[] = {ExpertProj::kGate, ExpertProj::kUp, ExpertProj::kDown};
constexpr std::align_val_t kHostAlignment{4096};

size_t AlignUp(size_t n, size_t alignment) { return (n + alignment - 1) / alignment * alignment; }

void* AlignedAlloc(size_t bytes, void*) {
  return ::operator new(bytes, kHostAlignment, std::nothrow);
}

void AlignedFree(void* ptr, size_t, void*) { ::operator delete(ptr, kHostAlignment); }

bool SameMatrix(const WeightView& v, const ProjectionLayout& p) {
  return v.type == p.type && v.rows == p.rows && v.cols == p.cols && v.row_bytes == p.row_bytes;
}

}  // namespace

const GgufTensor* ExpertTensor(const Model& model, int layer, ExpertProj proj, int expert) {
  const LayerTensors& l = model.layers[static_cast<size_t>(layer)];
  switch (proj) {
    case ExpertProj::kGate:
      return l.gate_exps != nullptr ? l.gate_exps : l.gate_legacy[static_cast<size_t>(expert)];
    case ExpertProj::kUp:
      return l.up_exps != nullptr ? l.up_exps : l.up_legacy[static_cast<size_t>(expert)];
    case ExpertProj::kDown:
      return l.down_exps != nullptr ? l.down_exps : l.down_legacy[static_cast<size_t>(expert)];
  }
  return nullptr;
}

ExpertBlockLayout ExpertLayoutOf(const Model& model, int layer) {
  ExpertBlockLayout layout;
  size_t offset = 0;
  for (ExpertProj proj : kProjections) {
    const WeightView v = model.expert(layer, proj, 0);
    ProjectionLayout& p = layout.projections[static_cast<size_t>(proj)];
    p.type = v.type;
    p.rows = v.rows;
    p.cols = v.cols;
    p.row_bytes = v.row_bytes;
    p.offset = offset;
    offset = AlignUp(offset + p.bytes(), kBlockAlignment);
  }
  layout.block_bytes = offset;
  return layout;
}

WeightView ProjectionView(const ExpertBlockLayout& layout, ExpertProj proj, const uint8_t* block) {
  const ProjectionLayout& p = layout[proj];
  WeightView v;
  v.data = block + p.offset;
  v.type = p.type;
  v.cols = p.cols;
  v.rows = p.rows;
  v.row_bytes = p.row_bytes;
  return v;
}

HostAllocator AlignedHostAllocator() { return HostAllocator{&AlignedAlloc, &AlignedFree, nullptr}; }

absl::StatusOr<ExpertStore> ExpertStore::Layouts(const Model& model) {
  const int n_layer = model.config.n_layer;
  const int n_expert = model.config.n_expert;
  ExpertStore store;
  store.n_expert_ = n_expert;
  store.class_of_layer_.resize(static_cast<size_t>(n_layer));
  store.layer_offset_.resize(static_cast<size_t>(n_layer));
  for (int layer = 0; layer < n_layer; ++layer) {
    if (!model.config.moe_layer(layer)) {
      store.class_of_layer_[static_cast<size_t>(layer)] = -1;
      continue;
    }
    const ExpertBlockLayout layout = ExpertLayoutOf(model, layer);
    for (int e = 1; e < n_expert; ++e) {
      for (ExpertProj proj : kProjections) {
        if (SameMatrix(model.expert(layer, proj, e), layout[proj])) continue;
        const GgufTensor* t = ExpertTensor(model, layer, proj, e);
        const GgufTensor* first = ExpertTensor(model, layer, proj, 0);
        return model.file->TensorError(
            *t, absl::StrFormat("expert %d of layer %d is stored as %s but expert 0 (%s) as %s; "
                                "one layer's experts must share a type to share a block layout",
                                e, layer, ggml_type_name(t->type), first->name,
                                ggml_type_name(first->type)));
      }
    }
    size_t cls = 0;
    while (cls < store.classes_.size() && !(store.classes_[cls].layout == layout)) ++cls;
    if (cls == store.classes_.size()) store.classes_.push_back({layout, layout.block_bytes, {}});
    store.classes_[cls].layers.push_back(layer);
    store.class_of_layer_[static_cast<size_t>(layer)] = static_cast<int>(cls);
    store.layer_offset_[static_cast<size_t>(layer)] = store.total_bytes_;
    store.total_bytes_ += layout.block_bytes * static_cast<size_t>(n_expert);
  }
  return store;
}

absl::StatusOr<ExpertStore> ExpertStore::Create(const Model& model,
                                                const HostAllocator& allocator,
                                                const LoadProgressFn& progress) {
  MG_CHECK(allocator.alloc != nullptr && allocator.free != nullptr,
           "ExpertStore: allocator without alloc or free");
  MG_ASSIGN_OR_RETURN(ExpertStore store, Layouts(model));
  const int n_layer = model.config.n_layer;
  const int n_expert = model.config.n_expert;
  store.data_ = static_cast<uint8_t*>(allocator.alloc(store.total_bytes_, allocator.context));
  if (store.data_ == nullptr) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%s: cannot allocate %d bytes (%.1f MiB) of host memory for the experts",
        model.file->path(), store.total_bytes_, store.total_bytes_ / 1048576.0));
  }
  store.allocator_ = allocator;

  const auto start = std::chrono::steady_clock::now();
  uint64_t done = 0;
  for (int layer = model.config.n_layer_dense_lead; layer < n_layer; ++layer) {
    const ExpertBlockLayout& layout = store.layout(layer);
    for (int e = 0; e < n_expert; ++e) {
      uint8_t* block = store.data_ + store.layer_offset_[static_cast<size_t>(layer)] +
                       static_cast<size_t>(e) * layout.block_bytes;
      // Padding is zeroed so a block's bytes (and any checksum of them) are deterministic.
      size_t end = 0;
      for (ExpertProj proj : kProjections) {
        const ProjectionLayout& p = layout[proj];
        std::memset(block + end, 0, p.offset - end);
        std::memcpy(block + p.offset, model.expert(layer, proj, e).data, p.bytes());
        end = p.offset + p.bytes();
      }
      std::memset(block + end, 0, layout.block_bytes - end);
      done += layout.block_bytes;
      if (progress) {
        progress(done, store.total_bytes_,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
    }
  }
  return store;
}

ExpertStore::~ExpertStore() { Release(); }

ExpertStore::ExpertStore(ExpertStore&& other) noexcept { *this = std::move(other); }

ExpertStore& ExpertStore::operator=(ExpertStore&& other) noexcept {
  if (this == &other) return *this;
  Release();
  allocator_ = other.allocator_;
  data_ = std::exchange(other.data_, nullptr);
  total_bytes_ = std::exchange(other.total_bytes_, 0);
  n_expert_ = other.n_expert_;
  classes_ = std::move(other.classes_);
  class_of_layer_ = std::move(other.class_of_layer_);
  layer_offset_ = std::move(other.layer_offset_);
  return *this;
}

void ExpertStore::Release() {
  if (data_ != nullptr) allocator_.free(data_, total_bytes_, allocator_.context);
  data_ = nullptr;
}

const uint8_t* ExpertStore::block(int layer, int expert) const {
  MG_CHECK(
      layer >= 0 && layer < n_layer() && class_of(layer) >= 0 && expert >= 0 && expert < n_expert_,
      "ExpertStore::block: layer, MoE layer or expert out of range");
  MG_CHECK(data_ != nullptr, "ExpertStore::block: a Layouts store holds no blocks");
  return data_ + layer_offset_[static_cast<size_t>(layer)] +
         static_cast<size_t>(expert) * block_bytes(layer);
}

}  // namespace moegraph
