#include "capture/engine.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "loader/check.h"
#include "loader/quant.h"
#include "loader/status_util.h"
#include "reference/ops.h"
#include "residency/budget.h"

namespace moegraph {
namespace {

double Mib(uint64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Device memory (cudaMalloc) or pinned host memory (cudaHostAlloc), freed with it.
class CudaBuffer {
 public:
  CudaBuffer() = default;
  CudaBuffer(CudaBuffer&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(other.bytes_), pinned_(other.pinned_) {}
  CudaBuffer& operator=(CudaBuffer&& other) noexcept {
    if (this != &other) {
      Release();
      ptr_ = std::exchange(other.ptr_, nullptr);
      bytes_ = other.bytes_;
      pinned_ = other.pinned_;
    }
    return *this;
  }
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;
  ~CudaBuffer() { Release(); }

  // Errors name what the memory is for and its size.
  static absl::StatusOr<CudaBuffer> Device(size_t bytes, std::string_view what) {
    CudaBuffer out;
    out.bytes_ = bytes;
    const cudaError_t err = cudaMalloc(&out.ptr_, std::max<size_t>(bytes, 1));
    if (err != cudaSuccess) {
      out.ptr_ = nullptr;
      return CudaStatus(err, absl::StrFormat("cannot allocate %.2f MiB of GPU memory for %s",
                                             Mib(bytes), Av(what)));
    }
    return out;
  }
  static absl::StatusOr<CudaBuffer> Pinned(size_t bytes, std::string_view what) {
    CudaBuffer out;
    out.bytes_ = bytes;
    out.pinned_ = true;
    const cudaError_t err =
        cudaHostAlloc(&out.ptr_, std::max<size_t>(bytes, 1), cudaHostAllocPortable);
    if (err != cudaSuccess) {
      out.ptr_ = nullptr;
      return CudaStatus(
          err, absl::StrFormat("cannot allocate %.2f MiB of pinned host memory for %s", Mib(bytes),
                               Av(what)));
    }
    return out;
  }

  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void Release() {
    if (ptr_ == nullptr) return;
    if (pinned_) {
      cudaFreeHost(ptr_);
    } else {
      cudaFree(ptr_);
    }
    ptr_ = nullptr;
  }

  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  bool pinned_ = false;
};

// The expert store's memory: pinned and mapped, so the stage copy kernel reads
// it directly; portable, so any context may use it.
void* PinnedMappedAlloc(size_t bytes, void*) {
  void* ptr = nullptr;
  if (cudaHostAlloc(&ptr, bytes, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
    cudaGetLastError();  // the store reports the failure; later launches must not see it
    return nullptr;
  }
  return ptr;
}

void PinnedMappedFree(void* ptr, size_t, void*) { cudaFreeHost(ptr); }

// A store handed to an engine must hold this model's experts: the engine indexes
// it by the model's layers and experts and computes its blocks with the model's
// layouts.
absl::Status CheckStoreFits(const ExpertStore& store, const Model& model) {
  const ModelConfig& cfg = model.config;
  if (store.n_layer() != cfg.n_layer || store.n_expert() != cfg.n_expert) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cuda engine: the shared expert store holds %d layers of %d experts, the model %d of %d",
        store.n_layer(), store.n_expert(), cfg.n_layer, cfg.n_expert));
  }
  for (int layer = 0; layer < cfg.n_layer; ++layer) {
    if (!(store.layout(layer) == ExpertLayoutOf(model, layer))) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "cuda engine: the shared expert store lays out layer %d's experts unlike the model "
          "(a store of another model)",
          layer));
    }
  }
  return absl::OkStatus();
}

// The types launch_expert_gate_up / launch_expert_down compute.
bool ExpertTypeSupported(GgmlType type) {
  switch (type) {
    case GgmlType::kQ8_0:
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
    case GgmlType::kQ6_K:
    case GgmlType::kF16:
    case GgmlType::kBF16:
    case GgmlType::kF32:
      return true;
    default:
      return false;
  }
}

// Slots each size class gets: in proportion to its layers, the remainder to the
// first classes (as the CPU backend splits them).
std::vector<int32_t> SplitSlots(int64_t n_slots, const std::vector<SizeClass>& classes,
                                int n_layer) {
  std::vector<int32_t> split;
  int64_t given = 0;
  for (const SizeClass& c : classes) {
    split.push_back(
        static_cast<int32_t>(n_slots * static_cast<int64_t>(c.layers.size()) / n_layer));
    given += split.back();
  }
  for (size_t c = 0; given < n_slots; ++c, ++given) ++split[c];
  return split;
}

DeviceBlockLayout ToDeviceLayout(const ExpertBlockLayout& layout, const ModelConfig& cfg) {
  DeviceBlockLayout out;
  for (size_t p = 0; p < 3; ++p) {
    out.type[p] = layout.projections[p].type;
    out.offset[p] = layout.projections[p].offset;
    out.row_bytes[p] = layout.projections[p].row_bytes;
  }
  out.n_embd = cfg.n_embd;
  out.n_ff = cfg.n_ff_exp;
  out.block_bytes = layout.block_bytes;
  return out;
}

struct LayerWeights {
  DeviceMatrix wq, wk, wv, wo, router;
  DeviceMatrix shexp_gate, shexp_up, shexp_down, shexp_gate_inp;
  const float* attn_norm = nullptr;
  const float* ffn_norm = nullptr;
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  const float* bq = nullptr;
  const float* bk = nullptr;
  const float* bv = nullptr;
};

// Per-layer device pointers of one step's expert path.
struct LayerExperts {
  int size_class = 0;
  int local_layer = 0;                   // the layer's number inside its class
  const uint8_t* host_blocks = nullptr;  // device pointer of the layer's store blocks
  int32_t* selection = nullptr;          // [k]
  float* weights = nullptr;              // [k]
  int32_t* selected_keys = nullptr;      // [k]
  int32_t* slot_of_rank = nullptr;       // [k]
  uint8_t* missed = nullptr;             // [k]
  int32_t* evicted = nullptr;            // [k]
  float* k_cache = nullptr;              // [max_ctx][kv_len]
  float* v_cache = nullptr;
};

// The device copy of a policy's state arrays, field for field a
// ResidencySnapshot's (an array the policy does not keep stays unallocated),
// plus the hazard table's costs, which the step rebuilds from the counts.
struct DevicePolicyState {
  CudaBuffer table, owner, stamp, seg, n_protected, clock, last_visit, frequency, long_frequency,
      visits, cell_hits, cell_trials, cell_cost;
};

// Calls fn(host array, device buffer, what) for every array of a snapshot.
template <typename Fn>
absl::Status ForEachStateArray(ResidencySnapshot& host, DevicePolicyState& device, Fn&& fn) {
  MG_RETURN_IF_ERROR(fn(host.table, device.table, "the slot table"));
  MG_RETURN_IF_ERROR(fn(host.owner, device.owner, "the slot owners"));
  MG_RETURN_IF_ERROR(fn(host.stamp, device.stamp, "the slot stamps"));
  MG_RETURN_IF_ERROR(fn(host.seg, device.seg, "the slot segments"));
  MG_RETURN_IF_ERROR(fn(host.n_protected, device.n_protected, "the pool counts"));
  MG_RETURN_IF_ERROR(fn(host.clock, device.clock, "the pool clocks"));
  MG_RETURN_IF_ERROR(fn(host.last_visit, device.last_visit, "the keys' last visits"));
  MG_RETURN_IF_ERROR(fn(host.frequency, device.frequency, "the keys' frequencies"));
  MG_RETURN_IF_ERROR(
      fn(host.long_frequency, device.long_frequency, "the keys' long frequencies"));
  MG_RETURN_IF_ERROR(fn(host.visits, device.visits, "the layers' visits"));
  MG_RETURN_IF_ERROR(fn(host.cell_hits, device.cell_hits, "the hazard cell hits"));
  return fn(host.cell_trials, device.cell_trials, "the hazard cell trials");
}

struct DevicePool {
  SlotPoolInfo info;
  DeviceBlockLayout layout;
  CudaBuffer slots;
  // Policy arms only.
  DevicePolicyState policy_state;
  std::vector<ResidencyPool> pools;      // lru, slru: device pointers
  std::vector<HazardPool> hazard_pools;  // hazard
  CudaBuffer rank_cache;                 // a victim rank per slot of the largest pool
  std::vector<int32_t> pool_of_local_layer;
  ResidencyState state{};
  HazardState hazard{};
  std::optional<PolicyCache> host_cache;  // the host arm's policy state
};

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error for later calls
    return 0;
  }
  return count;
}

bool CudaDeviceIsEmulated() {
#if defined(MOEGRAPH_CUDA_EMULATOR)
  return true;
#else
  return false;
#endif
}

std::string NoCudaDeviceReason() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaSuccess) return absl::StrFormat("cudaGetDeviceCount reports %d devices", count);
  cudaGetLastError();
  return absl::StrFormat("cudaGetDeviceCount: %s (%s)", cudaGetErrorString(err),
                         cudaGetErrorName(err));
}

HostAllocator CudaPinnedAllocator() { return {&PinnedMappedAlloc, &PinnedMappedFree, nullptr}; }

struct CudaEngine::Impl {
  ~Impl();

  // experts: a shared store, or null to pin one of the engine's own.
  absl::Status Init(const Model& model, const CudaEngineOptions& options,
                    std::shared_ptr<const ExpertStore> experts, const LoadProgressFn& progress);
  absl::Status UploadDense();
  absl::StatusOr<DeviceMatrix> UploadMatrix(const GgufTensor* t);
  absl::StatusOr<const float*> UploadVector(const GgufTensor* t);
  absl::Status PlanPools(uint64_t free_bytes, uint64_t dense_bytes, uint64_t kv_bytes,
                         uint64_t scratch_bytes);
  absl::Status AllocatePools();
  absl::Status AllocateState();
  absl::Status AllocateRecords();
  absl::Status Upload(void* dst, const void* src, size_t bytes, std::string_view what);
  absl::Status Download(void* dst, const void* src, size_t bytes, std::string_view what);

  WalkConfig MakeWalkConfig(int steps) const;
  std::function<cudaError_t()> Bind(const WalkEntry& entry);
  cudaError_t HostPolicyStep(int layer);
  cudaError_t HostStageCopy(int layer);
  absl::Status RunSteps(int count);
  absl::Status Sync(std::string_view what);

  const Model* model = nullptr;
  ModelConfig cfg;
  CudaEngineOptions options;
  Arm arm = Arm::kGraph;
  SlotMode slot_mode = SlotMode::kDevicePolicy;
  std::string banner;
  HostCounters host;
  EngineCounters host_expert;  // the host arm's policy tallies
  std::vector<int32_t> routing;

  cudaStream_t main = nullptr;
  cudaStream_t copy = nullptr;
  std::vector<cudaEvent_t> fork_events, join_events;  // per layer

  std::shared_ptr<const ExpertStore> store;  // maybe shared with other engines
  const uint8_t* store_device_base = nullptr;

  // Dense weights, each tensor once (a tied lm_head reuses token_embd).
  std::vector<CudaBuffer> dense;
  std::map<const GgufTensor*, const void*> uploaded;
  uint64_t dense_bytes = 0;
  DeviceMatrix token_embd, output;
  const float* output_norm = nullptr;
  std::vector<LayerWeights> layers;

  std::vector<DevicePool> pools;
  std::vector<SlotPoolInfo> pool_infos;

  // Decode state.
  CudaBuffer state_buffer;  // every small per-step buffer, carved below
  CudaBuffer kv_buffer;
  CudaBuffer partial_buffer;
  int32_t* token = nullptr;
  int32_t* pos = nullptr;
  int32_t* step = nullptr;
  int32_t* sampled = nullptr;
  int32_t* n_prompt = nullptr;    // [1 + max_ctx]: the prompt's length, then its ids
  int32_t* prompt = nullptr;      // n_prompt + 1
  int32_t* out_tokens = nullptr;  // [max_ctx]
  float* x = nullptr;
  float* h = nullptr;
  float* q = nullptr;
  float* k = nullptr;
  float* v = nullptr;
  float* attn = nullptr;
  float* block_out = nullptr;
  float* router_logits = nullptr;
  float* act = nullptr;         // [k][n_ff_exp]
  float* expert_out = nullptr;  // [k][n_embd]
  float* shexp_gate_out = nullptr;
  float* shexp_up_out = nullptr;
  float* shexp_act = nullptr;
  float* shexp_out = nullptr;
  float* shexp_logit = nullptr;
  float* logits = nullptr;
  DeviceCounters* counters = nullptr;
  float* partial = nullptr;
  std::vector<LayerExperts> layer_experts;
  // Routing replay and record: the trace ([n_steps][n_layer][k] ids, -1 for a
  // missing row; f32 weights or none), the record buffer and their step cursor.
  CudaBuffer trace_ids, trace_weights, routing_record;
  CudaBuffer logits_record;  // [max_ctx][n_vocab] with record_logits
  int64_t* routing_cursor = nullptr;

  // Pinned host memory: the token copy and the host arm's per-layer staging.
  CudaBuffer token_host;
  CudaBuffer selection_host, slot_of_rank_host, missed_host;  // [n_layer][k]

  std::map<int, StepWalk> walks;    // by steps per walk
  std::map<int, StepGraph> graphs;  // by steps per graph
};

CudaEngine::Impl::~Impl() {
  if (main != nullptr) cudaStreamSynchronize(main);
  if (copy != nullptr) cudaStreamSynchronize(copy);
  graphs.clear();
  for (cudaEvent_t e : fork_events) cudaEventDestroy(e);
  for (cudaEvent_t e : join_events) cudaEventDestroy(e);
  if (main != nullptr) cudaStreamDestroy(main);
  if (copy != nullptr) cudaStreamDestroy(copy);
}

absl::Status CudaEngine::Impl::Upload(void* dst, const void* src, size_t bytes,
                                      std::string_view what) {
  // On main, so every later launch is ordered after it; a pageable source is
  // staged before the call returns, so it may go away afterwards.
  ++host.h2d_memcpys;
  return CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, main),
                    absl::StrCat("upload of ", Av(what)));
}

absl::Status CudaEngine::Impl::Download(void* dst, const void* src, size_t bytes,
                                        std::string_view what) {
  // After everything enqueued on main; the host waits for it.
  MG_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, main),
                                absl::StrCat("readback of ", Av(what))));
  return Sync(absl::StrCat("readback of ", Av(what)));
}

absl::Status CudaEngine::Impl::Sync(std::string_view what) {
  ++host.host_syncs;
  return CudaStatus(cudaStreamSynchronize(main), what);
}

absl::StatusOr<DeviceMatrix> CudaEngine::Impl::UploadMatrix(const GgufTensor* t) {
  const WeightView view = weight_view(*t);
  DeviceMatrix m;
  m.type = view.type;
  m.cols = static_cast<int32_t>(view.cols);
  m.rows = static_cast<int32_t>(view.rows);
  m.row_bytes = view.row_bytes;
  if (auto it = uploaded.find(t); it != uploaded.end()) {
    m.data = it->second;
    return m;
  }
  MG_ASSIGN_OR_RETURN(CudaBuffer buffer, CudaBuffer::Device(t->nbytes, t->name));
  MG_RETURN_IF_ERROR(Upload(buffer.as<void>(), t->data, t->nbytes, t->name));
  dense_bytes += t->nbytes;
  m.data = buffer.as<void>();
  uploaded[t] = m.data;
  dense.push_back(std::move(buffer));
  return m;
}

absl::StatusOr<const float*> CudaEngine::Impl::UploadVector(const GgufTensor* t) {
  if (t == nullptr) return nullptr;
  // Norm weights and biases are f32 on the device whatever the file stores.
  const std::vector<float> values = TensorToFloat(*t);
  const size_t bytes = values.size() * sizeof(float);
  MG_ASSIGN_OR_RETURN(CudaBuffer buffer, CudaBuffer::Device(bytes, t->name));
  MG_RETURN_IF_ERROR(Upload(buffer.as<void>(), values.data(), bytes, t->name));
  dense_bytes += bytes;
  const float* out = buffer.as<float>();
  dense.push_back(std::move(buffer));
  return out;
}

absl::Status CudaEngine::Impl::UploadDense() {
  const Model& m = *model;
  MG_ASSIGN_OR_RETURN(token_embd, UploadMatrix(m.token_embd));
  MG_ASSIGN_OR_RETURN(output, UploadMatrix(m.output));
  MG_ASSIGN_OR_RETURN(output_norm, UploadVector(m.output_norm));
  for (const LayerTensors& lt : m.layers) {
    LayerWeights w;
    MG_ASSIGN_OR_RETURN(w.wq, UploadMatrix(lt.wq));
    MG_ASSIGN_OR_RETURN(w.wk, UploadMatrix(lt.wk));
    MG_ASSIGN_OR_RETURN(w.wv, UploadMatrix(lt.wv));
    MG_ASSIGN_OR_RETURN(w.wo, UploadMatrix(lt.wo));
    MG_ASSIGN_OR_RETURN(w.router, UploadMatrix(lt.router));
    if (lt.shexp_gate != nullptr) {
      MG_ASSIGN_OR_RETURN(w.shexp_gate, UploadMatrix(lt.shexp_gate));
      MG_ASSIGN_OR_RETURN(w.shexp_up, UploadMatrix(lt.shexp_up));
      MG_ASSIGN_OR_RETURN(w.shexp_down, UploadMatrix(lt.shexp_down));
      MG_ASSIGN_OR_RETURN(w.shexp_gate_inp, UploadMatrix(lt.shexp_gate_inp));
    }
    MG_ASSIGN_OR_RETURN(w.attn_norm, UploadVector(lt.attn_norm));
    MG_ASSIGN_OR_RETURN(w.ffn_norm, UploadVector(lt.ffn_norm));
    MG_ASSIGN_OR_RETURN(w.q_norm, UploadVector(lt.q_norm));
    MG_ASSIGN_OR_RETURN(w.k_norm, UploadVector(lt.k_norm));
    MG_ASSIGN_OR_RETURN(w.bq, UploadVector(lt.bq));
    MG_ASSIGN_OR_RETURN(w.bk, UploadVector(lt.bk));
    MG_ASSIGN_OR_RETURN(w.bv, UploadVector(lt.bv));
    layers.push_back(w);
  }
  return absl::OkStatus();
}

namespace {

// Bytes of the dense tensors as the device will hold them (before any upload),
// for the budget.
uint64_t DenseBytes(const Model& m) {
  std::map<const GgufTensor*, uint64_t> bytes;
  auto matrix = [&](const GgufTensor* t) {
    if (t != nullptr) bytes[t] = t->nbytes;
  };
  auto vector = [&](const GgufTensor* t) {
    if (t != nullptr) bytes[t] = static_cast<uint64_t>(t->n_elements()) * sizeof(float);
  };
  matrix(m.token_embd);
  matrix(m.output);
  vector(m.output_norm);
  for (const LayerTensors& lt : m.layers) {
    for (const GgufTensor* t : {lt.wq, lt.wk, lt.wv, lt.wo, lt.router, lt.shexp_gate, lt.shexp_up,
                                lt.shexp_down, lt.shexp_gate_inp}) {
      matrix(t);
    }
    for (const GgufTensor* t :
         {lt.attn_norm, lt.ffn_norm, lt.q_norm, lt.k_norm, lt.bq, lt.bk, lt.bv}) {
      vector(t);
    }
  }
  uint64_t total = 0;
  for (const auto& [t, b] : bytes) total += b;
  return total;
}

// The device arrays of a residency policy, for the budget: bytes per key (and
// per layer and table, a fixed part) and bytes per slot.
struct PolicyStateBytes {
  uint64_t fixed = 0;
  uint64_t per_slot = 0;
};

PolicyStateBytes PolicyBytes(ResidencyPolicy policy, const ModelConfig& cfg) {
  const uint64_t keys = static_cast<uint64_t>(cfg.n_layer) * static_cast<uint64_t>(cfg.n_expert);
  if (policy == ResidencyPolicy::kHazard) {
    // table, last_visit, frequency, long_frequency per key; visits per layer;
    // hits, trials and cost per cell; owner and a cached victim rank per slot.
    return {16 * keys + 4 * static_cast<uint64_t>(cfg.n_layer) + 12 * kHazardCells, 12};
  }
  // table per key; n_protected and clock per pool (at most one per layer);
  // owner, stamp, seg and a cached victim rank per slot.
  return {4 * keys + 12 * static_cast<uint64_t>(cfg.n_layer), 21};
}

// Layout of the small per-step buffers in one allocation, each 256-byte aligned.
struct StateLayout {
  size_t total = 0;
  size_t Add(size_t bytes) {
    const size_t at = total;
    total += (bytes + 255) / 256 * 256;
    return at;
  }
};

}  // namespace

absl::Status CudaEngine::Impl::PlanPools(uint64_t free_bytes, uint64_t dense, uint64_t kv_bytes,
                                         uint64_t scratch_bytes) {
  const std::vector<SizeClass>& classes = store->size_classes();
  const int n_layer = cfg.n_layer;
  const int n_expert = cfg.n_expert;
  const int top_k = cfg.n_expert_used;
  const int64_t total_experts = static_cast<int64_t>(n_layer) * n_expert;
  size_t largest_block = 0;
  for (const SizeClass& c : classes) largest_block = std::max(largest_block, c.block_bytes);

  BudgetInputs in;
  in.free_vram_bytes = free_bytes;
  in.dense_bytes = dense;
  in.kv_bytes = kv_bytes;
  in.scratch_bytes = scratch_bytes;
  in.rail_bytes = options.rail_bytes;
  // Classes share the pool: budgeting every slot at the largest block never over-commits.
  in.block_bytes = largest_block;
  in.total_experts = total_experts;
  in.k = top_k;
  std::vector<int32_t> split;
  if (slot_mode == SlotMode::kResident) {
    // Every block is allocated at its own class's size: the mean block (rounded
    // up) budgets the store's bytes exactly, where the largest would refuse a
    // mixed-quant model that fits.
    in.block_bytes = (store->total_bytes() + static_cast<uint64_t>(total_experts) - 1) /
                     static_cast<uint64_t>(total_experts);
    in.requested_slots = total_experts;
    MG_ASSIGN_OR_RETURN(const SlotBudget budget, PlanSlots(in));
    if (budget.slots < total_experts) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "--arm resident needs all %d experts on the GPU (%.2f MiB) but only %d slots fit: %s",
          total_experts, Mib(store->total_bytes()), budget.slots, budget.banner));
    }
    absl::StrAppend(&banner, "\n", budget.banner);
    for (const SizeClass& c : classes) {
      split.push_back(static_cast<int32_t>(c.layers.size()) * n_expert);
    }
  } else if (slot_mode == SlotMode::kStageAll) {
    in.requested_slots = static_cast<int64_t>(top_k) * static_cast<int64_t>(classes.size());
    in.requested_slots = std::min(in.requested_slots, total_experts);
    MG_ASSIGN_OR_RETURN(const SlotBudget budget, PlanSlots(in));
    if (budget.slots < in.requested_slots) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("not enough GPU memory for %d scratch slots of %.2f MiB: %s",
                          in.requested_slots, Mib(largest_block), budget.banner));
    }
    absl::StrAppend(&banner, "\nslots: ", top_k, " scratch slots per size class (",
                    "MOEGRAPH_MOE_CACHE=0 stages every selected expert)");
    split.assign(classes.size(), top_k);
  } else {
    // A policy's slot also holds its per-slot state, and its per-key arrays sit
    // beside the pool.
    const PolicyStateBytes policy_bytes = PolicyBytes(options.doors.policy, cfg);
    in.block_bytes += policy_bytes.per_slot;
    in.scratch_bytes += policy_bytes.fixed;
    in.requested_slots = options.n_slots;
    in.sharing_engines = options.sharing_engines;
    MG_ASSIGN_OR_RETURN(const SlotBudget budget, PlanSlots(in));
    absl::StrAppend(&banner, "\n", budget.banner);
    if (!budget.warning.empty()) absl::StrAppend(&banner, "\nwarning: ", budget.warning);
    split = SplitSlots(budget.slots, classes, n_layer);
  }

  for (size_t c = 0; c < classes.size(); ++c) {
    DevicePool pool;
    pool.info.block_bytes = classes[c].block_bytes;
    pool.info.layers = classes[c].layers;
    pool.info.n_slots = split[c];
    pool.layout = ToDeviceLayout(classes[c].layout, cfg);
    if (slot_mode == SlotMode::kDevicePolicy || slot_mode == SlotMode::kHostPolicy) {
      if (classes.size() > 1 && split[c] < top_k) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "--slots %d leaves size class %d (%d of %d layers) %d slot(s), fewer than --top-k %d",
            options.n_slots, c, classes[c].layers.size(), n_layer, split[c], top_k));
      }
      CacheConfig config;
      config.n_layer = static_cast<int32_t>(classes[c].layers.size());
      config.n_expert = n_expert;
      config.k = top_k;
      config.n_slots = split[c];
      config.protected_frac = options.doors.protected_frac;
      config.pool_mode = options.pool_mode;
      MG_ASSIGN_OR_RETURN(PolicyCache cache, PolicyCache::Create(options.doors.policy, config));
      pool.info.n_slots = cache.config().n_slots;
      pool.host_cache.emplace(std::move(cache));
    }
    pools.push_back(std::move(pool));
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::Impl::AllocatePools() {
  for (size_t c = 0; c < pools.size(); ++c) {
    DevicePool& pool = pools[c];
    MG_ASSIGN_OR_RETURN(
        pool.slots, CudaBuffer::Device(pool.info.pool_bytes(), absl::StrFormat("slot pool %d", c)));
    if (slot_mode == SlotMode::kResident) {
      // Slot local_layer * n_expert + e holds expert e: one copy per layer.
      const size_t layer_bytes = pool.info.block_bytes * static_cast<size_t>(cfg.n_expert);
      for (size_t i = 0; i < pool.info.layers.size(); ++i) {
        MG_RETURN_IF_ERROR(Upload(pool.slots.as<uint8_t>() + i * layer_bytes,
                                  store->block(pool.info.layers[i], 0), layer_bytes,
                                  "resident experts"));
      }
    }
    if (slot_mode != SlotMode::kDevicePolicy) continue;
    // The device policy state starts as the host cache's initial arrays.
    const PolicyCache& cache = *pool.host_cache;
    ResidencySnapshot initial = cache.Snapshot();
    DevicePolicyState& d = pool.policy_state;
    MG_RETURN_IF_ERROR(ForEachStateArray(
        initial, d, [&](const auto& host, CudaBuffer& buffer, std::string_view what) {
          if (host.empty()) return absl::OkStatus();
          const size_t bytes = host.size() * sizeof(host[0]);
          MG_ASSIGN_OR_RETURN(buffer, CudaBuffer::Device(bytes, what));
          return Upload(buffer.as<void>(), host.data(), bytes, what);
        }));
    if (const ResidencyCache* slru = cache.slru_cache()) {
      pool.state = {d.table.as<int32_t>(), d.owner.as<int32_t>(), d.stamp.as<uint64_t>(),
                    d.seg.as<uint8_t>(), cfg.n_expert};
      for (size_t i = 0; i < slru->pools().size(); ++i) {
        const ResidencyPool& p = slru->pools()[i];
        pool.pools.push_back({p.slot_begin, p.n_slots, p.protected_cap,
                              d.n_protected.as<int32_t>() + i, d.clock.as<uint64_t>() + i});
      }
    } else if (const HazardCache* hazard = cache.hazard_cache()) {
      const std::vector<float>& cost = hazard->cell_cost();
      MG_ASSIGN_OR_RETURN(d.cell_cost, CudaBuffer::Device(cost.size() * 4, "the hazard costs"));
      MG_RETURN_IF_ERROR(
          Upload(d.cell_cost.as<void>(), cost.data(), cost.size() * 4, "the hazard costs"));
      pool.hazard = {.table = d.table.as<int32_t>(),
                     .owner = d.owner.as<int32_t>(),
                     .last_visit = d.last_visit.as<int32_t>(),
                     .frequency = d.frequency.as<uint32_t>(),
                     .long_frequency = d.long_frequency.as<uint32_t>(),
                     .visits = d.visits.as<int32_t>(),
                     .cell_hits = d.cell_hits.as<uint32_t>(),
                     .cell_trials = d.cell_trials.as<uint32_t>(),
                     .cell_cost = d.cell_cost.as<float>(),
                     .n_layer = cache.config().n_layer,
                     .n_expert = cfg.n_expert,
                     .k = cfg.n_expert_used};
      pool.hazard_pools = hazard->pools();
    }
    int32_t largest = 0;
    for (const SlotRange& range : cache.slot_ranges()) largest = std::max(largest, range.n_slots);
    MG_ASSIGN_OR_RETURN(pool.rank_cache,
                        CudaBuffer::Device(static_cast<size_t>(largest) * 8, "the victim ranks"));
    for (size_t i = 0; i < pool.info.layers.size(); ++i) {
      pool.pool_of_local_layer.push_back(cache.pool_of_layer(static_cast<int32_t>(i)));
    }
    // The device arms keep no host copy of the policy state.
    pool.host_cache.reset();
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::Impl::AllocateState() {
  const int top_k = cfg.n_expert_used;
  const size_t q_len = static_cast<size_t>(cfg.n_head) * cfg.head_dim;
  const size_t kv_len = static_cast<size_t>(cfg.n_head_kv) * cfg.head_dim;
  const size_t max_ctx = static_cast<size_t>(options.max_ctx);
  const size_t f = sizeof(float);
  const size_t n_layer = static_cast<size_t>(cfg.n_layer);
  const size_t kk = static_cast<size_t>(top_k);

  StateLayout s;
  const size_t o_token = s.Add(4), o_pos = s.Add(4), o_step = s.Add(4), o_sampled = s.Add(4);
  const size_t o_prompt = s.Add((max_ctx + 1) * 4), o_out = s.Add(max_ctx * 4);
  const size_t o_x = s.Add(cfg.n_embd * f), o_h = s.Add(cfg.n_embd * f);
  const size_t o_q = s.Add(q_len * f), o_k = s.Add(kv_len * f), o_v = s.Add(kv_len * f);
  const size_t o_attn = s.Add(q_len * f), o_block = s.Add(cfg.n_embd * f);
  const size_t o_router = s.Add(cfg.n_expert * f);
  const size_t o_act = s.Add(kk * cfg.n_ff_exp * f), o_eout = s.Add(kk * cfg.n_embd * f);
  const size_t n_shexp = static_cast<size_t>(std::max(cfg.n_ff_shexp, 1));
  const size_t o_sg = s.Add(n_shexp * f), o_su = s.Add(n_shexp * f), o_sa = s.Add(n_shexp * f);
  const size_t o_sout = s.Add(cfg.n_embd * f), o_slogit = s.Add(f);
  const size_t o_logits = s.Add(static_cast<size_t>(cfg.n_vocab) * f);
  const size_t o_counters = s.Add(sizeof(DeviceCounters));
  const size_t o_sel = s.Add(n_layer * kk * 4), o_w = s.Add(n_layer * kk * f);
  const size_t o_keys = s.Add(n_layer * kk * 4), o_sor = s.Add(n_layer * kk * 4);
  const size_t o_missed = s.Add(n_layer * kk), o_evicted = s.Add(n_layer * kk * 4);
  const size_t o_cursor = s.Add(8);

  MG_ASSIGN_OR_RETURN(state_buffer, CudaBuffer::Device(s.total, "the decode state"));
  MG_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(state_buffer.as<void>(), 0, s.total, main),
                                "clearing the decode state"));
  uint8_t* base = state_buffer.as<uint8_t>();
  auto at = [base](size_t offset) { return base + offset; };
  token = reinterpret_cast<int32_t*>(at(o_token));
  pos = reinterpret_cast<int32_t*>(at(o_pos));
  step = reinterpret_cast<int32_t*>(at(o_step));
  sampled = reinterpret_cast<int32_t*>(at(o_sampled));
  n_prompt = reinterpret_cast<int32_t*>(at(o_prompt));
  prompt = n_prompt + 1;
  out_tokens = reinterpret_cast<int32_t*>(at(o_out));
  x = reinterpret_cast<float*>(at(o_x));
  h = reinterpret_cast<float*>(at(o_h));
  q = reinterpret_cast<float*>(at(o_q));
  k = reinterpret_cast<float*>(at(o_k));
  v = reinterpret_cast<float*>(at(o_v));
  attn = reinterpret_cast<float*>(at(o_attn));
  block_out = reinterpret_cast<float*>(at(o_block));
  router_logits = reinterpret_cast<float*>(at(o_router));
  act = reinterpret_cast<float*>(at(o_act));
  expert_out = reinterpret_cast<float*>(at(o_eout));
  shexp_gate_out = reinterpret_cast<float*>(at(o_sg));
  shexp_up_out = reinterpret_cast<float*>(at(o_su));
  shexp_act = reinterpret_cast<float*>(at(o_sa));
  shexp_out = reinterpret_cast<float*>(at(o_sout));
  shexp_logit = reinterpret_cast<float*>(at(o_slogit));
  logits = reinterpret_cast<float*>(at(o_logits));
  counters = reinterpret_cast<DeviceCounters*>(at(o_counters));
  routing_cursor = reinterpret_cast<int64_t*>(at(o_cursor));

  const size_t cache_floats = max_ctx * kv_len;
  MG_ASSIGN_OR_RETURN(kv_buffer,
                      CudaBuffer::Device(2 * n_layer * cache_floats * f, "the KV cache"));
  const size_t partial_floats = attention_partial_floats(cfg.n_head, cfg.head_dim, options.max_ctx);
  MG_ASSIGN_OR_RETURN(partial_buffer, CudaBuffer::Device(partial_floats * f, "attention partials"));
  partial = partial_buffer.as<float>();

  for (size_t l = 0; l < n_layer; ++l) {
    LayerExperts e;
    const int layer = static_cast<int>(l);
    e.size_class = store->class_of(layer);
    const std::vector<int>& class_layers = pools[static_cast<size_t>(e.size_class)].info.layers;
    e.local_layer = static_cast<int>(std::find(class_layers.begin(), class_layers.end(), layer) -
                                     class_layers.begin());
    e.host_blocks = store_device_base + (store->block(layer, 0) - store->block(0, 0));
    e.selection = reinterpret_cast<int32_t*>(at(o_sel)) + l * kk;
    e.weights = reinterpret_cast<float*>(at(o_w)) + l * kk;
    e.selected_keys = reinterpret_cast<int32_t*>(at(o_keys)) + l * kk;
    e.slot_of_rank = reinterpret_cast<int32_t*>(at(o_sor)) + l * kk;
    e.missed = at(o_missed) + l * kk;
    e.evicted = reinterpret_cast<int32_t*>(at(o_evicted)) + l * kk;
    e.k_cache = kv_buffer.as<float>() + (2 * l) * cache_floats;
    e.v_cache = kv_buffer.as<float>() + (2 * l + 1) * cache_floats;
    layer_experts.push_back(e);
  }

  MG_RETURN_IF_ERROR(AllocateRecords());
  MG_ASSIGN_OR_RETURN(token_host, CudaBuffer::Pinned(4, "the token copy"));
  if (slot_mode == SlotMode::kHostPolicy) {
    MG_ASSIGN_OR_RETURN(selection_host, CudaBuffer::Pinned(n_layer * kk * 4, "host selection"));
    MG_ASSIGN_OR_RETURN(slot_of_rank_host, CudaBuffer::Pinned(n_layer * kk * 4, "host slots"));
    MG_ASSIGN_OR_RETURN(missed_host, CudaBuffer::Pinned(n_layer * kk, "host miss flags"));
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::Impl::AllocateRecords() {
  const size_t row = static_cast<size_t>(cfg.n_layer) * static_cast<size_t>(cfg.n_expert_used);
  if (options.routing_trace != nullptr) {
    const RoutingTrace& trace = *options.routing_trace;
    std::vector<int32_t> ids(trace.ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      ids[i] = trace.ids[i] == kMissingExpert ? -1 : static_cast<int32_t>(trace.ids[i]);
    }
    MG_ASSIGN_OR_RETURN(trace_ids, CudaBuffer::Device(ids.size() * 4, "the routing trace"));
    MG_RETURN_IF_ERROR(Upload(trace_ids.as<void>(), ids.data(), ids.size() * 4, "routing trace"));
    if (!trace.weights.empty()) {
      std::vector<float> weights(trace.weights.size());
      for (size_t i = 0; i < weights.size(); ++i) weights[i] = f16_to_f32(trace.weights[i]);
      MG_ASSIGN_OR_RETURN(trace_weights,
                          CudaBuffer::Device(weights.size() * 4, "the routing trace's weights"));
      MG_RETURN_IF_ERROR(Upload(trace_weights.as<void>(), weights.data(), weights.size() * 4,
                                "routing trace weights"));
    }
  }
  if (options.record_logits) {
    MG_ASSIGN_OR_RETURN(logits_record,
                        CudaBuffer::Device(static_cast<size_t>(options.max_ctx) *
                                               static_cast<size_t>(cfg.n_vocab) * sizeof(float),
                                           "the logits record"));
  }
  if (options.routing_record_steps > 0) {
    MG_ASSIGN_OR_RETURN(
        routing_record,
        CudaBuffer::Device(static_cast<size_t>(options.routing_record_steps) * row * 4,
                           "the routing record"));
  }
  return absl::OkStatus();
}

namespace {

// Device bytes of the routing trace and of the routing and logits records.
uint64_t RecordBytes(const CudaEngineOptions& options, const ModelConfig& cfg) {
  uint64_t bytes = 0;
  if (options.routing_trace != nullptr) {
    bytes += options.routing_trace->ids.size() * 4 + options.routing_trace->weights.size() * 4;
  }
  if (options.record_logits) {
    bytes += static_cast<uint64_t>(options.max_ctx) * static_cast<uint64_t>(cfg.n_vocab) * 4;
  }
  return bytes + static_cast<uint64_t>(std::max<int64_t>(options.routing_record_steps, 0)) *
                     static_cast<uint64_t>(cfg.n_layer) * cfg.n_expert_used * 4;
}

// Scratch bytes the budget sets aside: the decode state, attention partials and
// the slack of 256-byte alignment, as AllocateState lays them out.
uint64_t ScratchBytes(const ModelConfig& cfg, int max_ctx) {
  const uint64_t f = sizeof(float);
  const uint64_t q_len = static_cast<uint64_t>(cfg.n_head) * cfg.head_dim;
  const uint64_t kv_len = static_cast<uint64_t>(cfg.n_head_kv) * cfg.head_dim;
  const uint64_t kk = static_cast<uint64_t>(cfg.n_expert_used);
  const uint64_t floats = 4 * static_cast<uint64_t>(cfg.n_embd) + 2 * q_len + 2 * kv_len +
                          static_cast<uint64_t>(cfg.n_expert) + kk * cfg.n_ff_exp +
                          kk * cfg.n_embd + 3 * static_cast<uint64_t>(cfg.n_ff_shexp) + 1 +
                          static_cast<uint64_t>(cfg.n_vocab);
  const uint64_t per_layer = static_cast<uint64_t>(cfg.n_layer) * kk * (4 + 4 + 4 + 4 + 1 + 4);
  return floats * f + (2 * static_cast<uint64_t>(max_ctx) + 1) * 4 + per_layer +
         attention_partial_floats(cfg.n_head, cfg.head_dim, max_ctx) * f + 64 * 256;
}

}  // namespace

absl::Status CudaEngine::Impl::Init(const Model& m, const CudaEngineOptions& opts,
                                    std::shared_ptr<const ExpertStore> experts,
                                    const LoadProgressFn& progress) {
  model = &m;
  cfg = m.config;
  options = opts;
  if (options.max_ctx < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--ctx %d: the context must hold at least one token", options.max_ctx));
  }
  if (options.steps_per_launch < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--steps-per-launch %d must be at least 1", options.steps_per_launch));
  }
  if (options.n_slots < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--slots %d must be auto (0) or at least --top-k %d", options.n_slots, cfg.n_expert_used));
  }
  if (options.record_routing && options.steps_per_launch != 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "recording the routing reads it back after every step: --steps-per-launch %d must be 1",
        options.steps_per_launch));
  }
  if (options.routing_record_steps < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "routing record of %d steps must not be negative", options.routing_record_steps));
  }
  if (options.routing_trace != nullptr) {
    MG_RETURN_IF_ERROR(CheckRoutingTrace(*options.routing_trace, cfg));
  }
  const Doors& d = options.doors;
  if (d.residency == ResidencyMode::kHost && d.graph) {
    return absl::InvalidArgumentError(
        "MOEGRAPH_RESIDENCY=host runs eager only: set MOEGRAPH_GRAPH=0 (or use --arm host)");
  }
  if (d.residency == ResidencyMode::kHost && !d.moe_cache) {
    return absl::InvalidArgumentError(
        "MOEGRAPH_RESIDENCY=host and MOEGRAPH_MOE_CACHE=0 contradict each other");
  }
  if (!d.moe_cache) {
    arm = Arm::kStage;
    slot_mode = SlotMode::kStageAll;
  } else if (d.residency == ResidencyMode::kHost) {
    arm = Arm::kHost;
    slot_mode = SlotMode::kHostPolicy;
  } else if (d.resident) {
    arm = Arm::kResident;
    slot_mode = SlotMode::kResident;
  } else {
    arm = d.graph ? Arm::kGraph : Arm::kEager;
  }

  for (int layer = 0; layer < cfg.n_layer; ++layer) {
    for (ExpertProj proj : {ExpertProj::kGate, ExpertProj::kUp, ExpertProj::kDown}) {
      const WeightView w = m.expert(layer, proj, 0);
      if (ExpertTypeSupported(w.type)) continue;
      const LayerTensors& lt = m.layers[static_cast<size_t>(layer)];
      const GgufTensor* t = proj == ExpertProj::kGate ? lt.gate_exps
                            : proj == ExpertProj::kUp ? lt.up_exps
                                                      : lt.down_exps;
      if (t == nullptr) {
        const auto& legacy = proj == ExpertProj::kGate ? lt.gate_legacy
                             : proj == ExpertProj::kUp ? lt.up_legacy
                                                       : lt.down_legacy;
        t = legacy.front();
      }
      return m.file->TensorError(
          *t, absl::StrFormat("the CUDA expert kernels do not compute type %s (they take q8_0, "
                              "q4_K, q5_K, q6_K, f16, bf16, f32)",
                              ggml_type_name(t->type)));
    }
  }
  if (experts != nullptr) MG_RETURN_IF_ERROR(CheckStoreFits(*experts, m));

  const int count = CudaDeviceCount();
  if (count < 1) {
    return absl::FailedPreconditionError("--backend cuda: no CUDA device is available");
  }
  MG_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(0), "cudaSetDevice(0)"));
  cudaDeviceProp prop{};
  MG_RETURN_IF_ERROR(CudaStatus(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties"));
  MG_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&main, cudaStreamNonBlocking),
                                "creating the main stream"));
  MG_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking),
                                "creating the copy stream"));
  for (int l = 0; l < cfg.n_layer; ++l) {
    cudaEvent_t f = nullptr;
    cudaEvent_t j = nullptr;
    MG_RETURN_IF_ERROR(
        CudaStatus(cudaEventCreateWithFlags(&f, cudaEventDisableTiming), "creating a fork event"));
    fork_events.push_back(f);
    MG_RETURN_IF_ERROR(
        CudaStatus(cudaEventCreateWithFlags(&j, cudaEventDisableTiming), "creating a join event"));
    join_events.push_back(j);
  }
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  MG_RETURN_IF_ERROR(CudaStatus(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo"));

  if (experts == nullptr) {
    MG_ASSIGN_OR_RETURN(experts, PinExperts(m, progress));
  }
  store = std::move(experts);
  void* device_base = nullptr;
  const cudaError_t mapped =
      cudaHostGetDevicePointer(&device_base, const_cast<uint8_t*>(store->block(0, 0)), 0);
  if (mapped != cudaSuccess) {
    cudaGetLastError();  // not sticky: keep it from failing the next kernel launch
    return CudaStatus(mapped,
                      "cudaHostGetDevicePointer of the expert store (it must be pinned, mapped "
                      "host memory: CudaEngine::PinExperts)");
  }
  store_device_base = static_cast<const uint8_t*>(device_base);

  const uint64_t kv_bytes = 2ull * static_cast<uint64_t>(cfg.n_layer) *
                            static_cast<uint64_t>(options.max_ctx) * cfg.n_head_kv * cfg.head_dim *
                            sizeof(float);
  banner = absl::StrFormat("backend cuda: %s (%.1f GiB), arm %s, %s%s, steps per launch %d",
                           prop.name, total_bytes / 1073741824.0, Av(ArmName(arm)),
                           DescribePolicy(d.policy, d.protected_frac),
                           d.split_passes ? "" : ", one expert pass", options.steps_per_launch);
  MG_RETURN_IF_ERROR(
      PlanPools(free_bytes, DenseBytes(m), kv_bytes,
                ScratchBytes(cfg, options.max_ctx) + RecordBytes(options, cfg)));
  MG_RETURN_IF_ERROR(UploadDense());
  MG_RETURN_IF_ERROR(AllocatePools());
  MG_RETURN_IF_ERROR(AllocateState());
  for (size_t c = 0; c < pools.size(); ++c) {
    const SlotPoolInfo& p = pools[c].info;
    pool_infos.push_back(p);
    absl::StrAppendFormat(&banner, "\nclass %d: %d layers, %d slots x %.3f MiB = %.2f MiB", c,
                          p.layers.size(), p.n_slots, Mib(p.block_bytes), Mib(p.pool_bytes()));
  }
  absl::StrAppendFormat(&banner, "\ndense %.2f MiB, KV %.2f MiB, experts %.2f MiB pinned",
                        Mib(dense_bytes), Mib(kv_bytes), Mib(store->total_bytes()));
  return Sync("uploading the model");
}

WalkConfig CudaEngine::Impl::MakeWalkConfig(int steps) const {
  WalkConfig c;
  c.n_layer = cfg.n_layer;
  c.steps = steps;
  c.slot_mode = slot_mode;
  c.split_passes = options.doors.split_passes;
  c.qk_norm = cfg.qk_norm || cfg.qk_norm_full;
  c.shared_expert = cfg.n_ff_shexp > 0;
  c.trace_routing = options.routing_trace != nullptr;
  c.routing_step_end = c.trace_routing || options.routing_record_steps > 0;
  c.record_logits = options.record_logits;
  return c;
}

cudaError_t CudaEngine::Impl::HostPolicyStep(int layer) {
  const LayerExperts& e = layer_experts[static_cast<size_t>(layer)];
  DevicePool& pool = pools[static_cast<size_t>(e.size_class)];
  const size_t kk = static_cast<size_t>(cfg.n_expert_used);
  const int32_t* selection = selection_host.as<int32_t>() + layer * kk;
  const LayerStep& result = pool.host_cache->Step(e.local_layer, selection);
  host_expert.hits += static_cast<uint64_t>(result.outcome.n_hits);
  host_expert.misses += static_cast<uint64_t>(result.outcome.n_misses);
  host_expert.evictions += static_cast<uint64_t>(result.outcome.n_evictions);
  std::copy(result.slot_of_rank.begin(), result.slot_of_rank.end(),
            slot_of_rank_host.as<int32_t>() + layer * kk);
  std::copy(result.missed.begin(), result.missed.end(), missed_host.as<uint8_t>() + layer * kk);
  return cudaSuccess;
}

cudaError_t CudaEngine::Impl::HostStageCopy(int layer) {
  const LayerExperts& e = layer_experts[static_cast<size_t>(layer)];
  const DevicePool& pool = pools[static_cast<size_t>(e.size_class)];
  const size_t kk = static_cast<size_t>(cfg.n_expert_used);
  const int32_t* selection = selection_host.as<int32_t>() + layer * kk;
  const int32_t* slot_of_rank = slot_of_rank_host.as<int32_t>() + layer * kk;
  const uint8_t* missed = missed_host.as<uint8_t>() + layer * kk;
  for (size_t r = 0; r < kk; ++r) {
    if (missed[r] == 0) continue;
    uint8_t* dst =
        pool.slots.as<uint8_t>() + static_cast<size_t>(slot_of_rank[r]) * pool.info.block_bytes;
    ++host.h2d_memcpys;
    host_expert.bytes_staged += pool.info.block_bytes;
    const cudaError_t err = cudaMemcpyAsync(dst, store->block(layer, selection[r]),
                                            pool.info.block_bytes, cudaMemcpyHostToDevice, copy);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

std::function<cudaError_t()> CudaEngine::Impl::Bind(const WalkEntry& entry) {
  const int l = entry.layer;
  const int n_embd = cfg.n_embd;
  const int top_k = cfg.n_expert_used;
  const float eps = cfg.rms_eps;
  const int q_len = cfg.n_head * cfg.head_dim;
  const int kv_len = cfg.n_head_kv * cfg.head_dim;
  const int rope_type = cfg.rope_type == RopeType::kNorm ? 0 : 1;
  const float freq_base = cfg.rope_freq_base;
  cudaStream_t ms = main;
  cudaStream_t cs = copy;
  const LayerWeights* w = l >= 0 ? &layers[static_cast<size_t>(l)] : nullptr;
  const LayerExperts* e = l >= 0 ? &layer_experts[static_cast<size_t>(l)] : nullptr;
  const DevicePool* pool = l >= 0 ? &pools[static_cast<size_t>(e->size_class)] : nullptr;
  const bool shexp = cfg.n_ff_shexp > 0;

  auto gate_up = [=, this](ExpertPass pass) -> std::function<cudaError_t()> {
    return [=, this] {
      return launch_expert_gate_up(pool->slots.as<uint8_t>(), pool->layout, e->slot_of_rank,
                                   e->missed, top_k, pass, h, act, counters, ms);
    };
  };
  auto down = [=, this](ExpertPass pass) -> std::function<cudaError_t()> {
    return [=, this] {
      return launch_expert_down(pool->slots.as<uint8_t>(), pool->layout, e->slot_of_rank, e->missed,
                                top_k, pass, act, expert_out, ms);
    };
  };

  switch (entry.op) {
    case StepOp::kBeginStep:
      return [=, this] {
        return launch_begin_step(prompt, n_prompt, sampled, step, token, pos, ms);
      };
    case StepOp::kEmbed:
      return [=, this] { return launch_embed(token_embd, token, x, ms); };
    case StepOp::kAttnNorm:
      return [=, this] { return launch_rmsnorm(x, w->attn_norm, h, 1, n_embd, eps, ms); };
    case StepOp::kQ:
      return [=, this] { return launch_matvec(w->wq, h, w->bq, q, ms); };
    case StepOp::kK:
      return [=, this] { return launch_matvec(w->wk, h, w->bk, k, ms); };
    case StepOp::kV:
      return [=, this] { return launch_matvec(w->wv, h, w->bv, v, ms); };
    case StepOp::kQNorm: {
      // olmoe normalises all of q (and k) at once, qwen3moe each head.
      const int rows = cfg.qk_norm_full ? 1 : cfg.n_head;
      return [=, this] { return launch_rmsnorm(q, w->q_norm, q, rows, q_len / rows, eps, ms); };
    }
    case StepOp::kKNorm: {
      const int rows = cfg.qk_norm_full ? 1 : cfg.n_head_kv;
      return [=, this] { return launch_rmsnorm(k, w->k_norm, k, rows, kv_len / rows, eps, ms); };
    }
    case StepOp::kRopeQ:
      return [=, this] {
        return launch_rope(q, cfg.n_head, cfg.head_dim, pos, freq_base, rope_type, ms);
      };
    case StepOp::kRopeK:
      return [=, this] {
        return launch_rope(k, cfg.n_head_kv, cfg.head_dim, pos, freq_base, rope_type, ms);
      };
    case StepOp::kKvAppend:
      return [=, this] { return launch_kv_append(k, v, e->k_cache, e->v_cache, pos, kv_len, ms); };
    case StepOp::kAttention: {
      const float scale = 1.0f / std::sqrt(static_cast<float>(cfg.head_dim));
      return [=, this] {
        return launch_attention_decode(q, e->k_cache, e->v_cache, pos, cfg.n_head, cfg.n_head_kv,
                                       cfg.head_dim, options.max_ctx, scale, partial, attn, ms);
      };
    }
    case StepOp::kAttnOut:
      return [=, this] { return launch_matvec(w->wo, attn, nullptr, block_out, ms); };
    case StepOp::kAttnResidual:
    case StepOp::kFfnResidual:
      return [=, this] { return launch_add(x, block_out, n_embd, ms); };
    case StepOp::kFfnNorm:
      return [=, this] { return launch_rmsnorm(x, w->ffn_norm, h, 1, n_embd, eps, ms); };
    case StepOp::kRouter:
      return [=, this] { return launch_matvec(w->router, h, nullptr, router_logits, ms); };
    case StepOp::kRouterTopk:
      return [=, this] {
        return launch_router_topk(router_logits, cfg.n_expert, top_k, cfg.norm_topk_prob,
                                  e->selection, e->weights, ms);
      };
    case StepOp::kTraceRouting:
      return [=, this, n_steps = options.routing_trace->n_steps] {
        return launch_trace_routing(trace_ids.as<int32_t>(), trace_weights.as<float>(), n_steps,
                                    cfg.n_layer, l, top_k, routing_cursor, e->selection,
                                    e->weights, ms);
      };
    case StepOp::kResidencyStep: {
      const size_t pool_index =
          static_cast<size_t>(pool->pool_of_local_layer[static_cast<size_t>(e->local_layer)]);
      if (options.doors.policy == ResidencyPolicy::kHazard) {
        const HazardPool hp = pool->hazard_pools[pool_index];
        return [=, this] {
          return launch_hazard_step(pool->hazard, hp, e->local_layer, e->selection, top_k,
                                    e->selected_keys, e->slot_of_rank, e->missed, e->evicted,
                                    pool->rank_cache.as<uint64_t>(), counters, ms);
        };
      }
      const ResidencyPool rp = pool->pools[pool_index];
      return [=, this] {
        return launch_residency_step(pool->state, rp, e->local_layer, e->selection, top_k,
                                     e->selected_keys, e->slot_of_rank, e->missed, e->evicted,
                                     pool->rank_cache.as<uint64_t>(), counters, ms);
      };
    }
    case StepOp::kResidentSlots:
      return [=, this] {
        return launch_resident_slots(e->local_layer, cfg.n_expert, e->selection, top_k,
                                     e->slot_of_rank, e->missed, ms);
      };
    case StepOp::kStageAllSlots:
      return [=] { return launch_stage_all_slots(top_k, e->slot_of_rank, e->missed, ms); };
    case StepOp::kHostReadSelection:
      return [=, this] {
        return cudaMemcpyAsync(selection_host.as<int32_t>() + l * top_k, e->selection,
                               static_cast<size_t>(top_k) * 4, cudaMemcpyDeviceToHost, ms);
      };
    case StepOp::kHostWaitSelection:
      return [=, this] {
        ++host.host_syncs;
        return cudaStreamSynchronize(ms);
      };
    case StepOp::kHostPolicyStep:
      return [=, this] { return HostPolicyStep(l); };
    case StepOp::kHostWriteSlots:
      return [=, this] {
        host.h2d_memcpys += 2;
        const cudaError_t err =
            cudaMemcpyAsync(e->slot_of_rank, slot_of_rank_host.as<int32_t>() + l * top_k,
                            static_cast<size_t>(top_k) * 4, cudaMemcpyHostToDevice, ms);
        if (err != cudaSuccess) return err;
        return cudaMemcpyAsync(e->missed, missed_host.as<uint8_t>() + l * top_k,
                               static_cast<size_t>(top_k), cudaMemcpyHostToDevice, ms);
      };
    case StepOp::kForkRecord:
      return [=, this] { return cudaEventRecord(fork_events[static_cast<size_t>(l)], ms); };
    case StepOp::kForkWait:
      return [=, this] { return cudaStreamWaitEvent(cs, fork_events[static_cast<size_t>(l)], 0); };
    case StepOp::kStageCopy:
      return [=, this] {
        return launch_stage_copy(e->host_blocks, pool->layout, e->selection, e->slot_of_rank,
                                 e->missed, top_k, pool->slots.as<uint8_t>(), counters, cs);
      };
    case StepOp::kHostStageCopy:
      return [=, this] { return HostStageCopy(l); };
    case StepOp::kJoinRecord:
      return [=, this] { return cudaEventRecord(join_events[static_cast<size_t>(l)], cs); };
    case StepOp::kJoinWait:
      return [=, this] { return cudaStreamWaitEvent(ms, join_events[static_cast<size_t>(l)], 0); };
    case StepOp::kGateUpHits:
      return gate_up(ExpertPass::kHits);
    case StepOp::kDownHits:
      return down(ExpertPass::kHits);
    case StepOp::kGateUpMisses:
      return gate_up(ExpertPass::kMisses);
    case StepOp::kDownMisses:
      return down(ExpertPass::kMisses);
    case StepOp::kGateUpAll:
      return gate_up(ExpertPass::kAll);
    case StepOp::kDownAll:
      return down(ExpertPass::kAll);
    case StepOp::kShexpGate:
      return [=, this] { return launch_matvec(w->shexp_gate, h, nullptr, shexp_gate_out, ms); };
    case StepOp::kShexpUp:
      return [=, this] { return launch_matvec(w->shexp_up, h, nullptr, shexp_up_out, ms); };
    case StepOp::kShexpSwiglu:
      return [=, this] {
        return launch_swiglu(shexp_gate_out, shexp_up_out, shexp_act, cfg.n_ff_shexp, ms);
      };
    case StepOp::kShexpDown:
      return [=, this] { return launch_matvec(w->shexp_down, shexp_act, nullptr, shexp_out, ms); };
    case StepOp::kShexpLogit:
      return [=, this] { return launch_matvec(w->shexp_gate_inp, h, nullptr, shexp_logit, ms); };
    case StepOp::kCombine:
      return [=, this] {
        return launch_combine(expert_out, e->weights, top_k, n_embd, shexp ? shexp_out : nullptr,
                              shexp ? shexp_logit : nullptr, block_out, ms);
      };
    case StepOp::kOutputNorm:
      return [=, this] { return launch_rmsnorm(x, output_norm, h, 1, n_embd, eps, ms); };
    case StepOp::kLmHead:
      return [=, this] { return launch_matvec(output, h, nullptr, logits, ms); };
    case StepOp::kRecordLogits:
      return [=, this] {
        return launch_record_logits(logits, cfg.n_vocab, step, options.max_ctx,
                                    logits_record.as<float>(), ms);
      };
    case StepOp::kArgmax:
      return [=, this] { return launch_argmax(logits, cfg.n_vocab, sampled, ms); };
    case StepOp::kRoutingStepEnd:
      return [=, this] {
        return launch_routing_step_end(layer_experts[0].selection, cfg.n_layer * top_k,
                                       routing_record.as<int32_t>(), options.routing_record_steps,
                                       routing_cursor, ms);
      };
    case StepOp::kEndStep:
      return [=, this] { return launch_end_step(sampled, step, out_tokens, counters, ms); };
    case StepOp::kTokenCopy:
      return [=, this] {
        return cudaMemcpyAsync(token_host.as<int32_t>(), sampled, 4, cudaMemcpyDeviceToHost, ms);
      };
  }
  MG_CHECK(false, "CudaEngine: a walk op without a binding");
  return nullptr;
}

absl::Status CudaEngine::Impl::RunSteps(int count) {
  const int per_launch = options.steps_per_launch;
  const bool use_graph = options.doors.graph && slot_mode != SlotMode::kHostPolicy;
  while (count > 0) {
    const int steps = std::min(per_launch, count);
    auto walk_it = walks.find(steps);
    if (walk_it == walks.end()) {
      walk_it = walks
                    .emplace(steps, BuildWalk(MakeWalkConfig(steps),
                                              [this](const WalkEntry& e) { return Bind(e); }))
                    .first;
    }
    if (use_graph) {
      auto graph_it = graphs.find(steps);
      if (graph_it == graphs.end()) {
        MG_ASSIGN_OR_RETURN(StepGraph graph, StepGraph::Capture(walk_it->second, main, host));
        graph_it = graphs.emplace(steps, std::move(graph)).first;
      }
      MG_RETURN_IF_ERROR(graph_it->second.Launch(main, host));
    } else {
      size_t failed = 0;
      const cudaError_t err = RunWalk(walk_it->second, &failed);
      if (err != cudaSuccess) {
        return CudaStatus(
            err, absl::StrCat("eager walk: ", EntryLabel(walk_it->second.entries[failed])));
      }
      host.eager_steps += static_cast<uint64_t>(steps);
    }
    MG_RETURN_IF_ERROR(Sync("decode step"));
    if (options.record_routing) {
      const size_t n = static_cast<size_t>(cfg.n_layer) * static_cast<size_t>(cfg.n_expert_used);
      const size_t at = routing.size();
      routing.resize(at + n);
      MG_RETURN_IF_ERROR(
          Download(routing.data() + at, layer_experts[0].selection, n * 4, "the routing"));
    }
    count -= steps;
  }
  return absl::OkStatus();
}

CudaEngine::CudaEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaEngine::~CudaEngine() = default;

absl::StatusOr<std::unique_ptr<CudaEngine>> CudaEngine::Create(const Model& model,
                                                               const CudaEngineOptions& options,
                                                               const LoadProgressFn& progress) {
  auto impl = std::make_unique<Impl>();
  MG_RETURN_IF_ERROR(impl->Init(model, options, nullptr, progress));
  return std::unique_ptr<CudaEngine>(new CudaEngine(std::move(impl)));
}

absl::StatusOr<std::unique_ptr<CudaEngine>> CudaEngine::Create(
    const Model& model, std::shared_ptr<const ExpertStore> experts,
    const CudaEngineOptions& options) {
  MG_CHECK(experts != nullptr, "CudaEngine::Create: a shared expert store must not be null");
  auto impl = std::make_unique<Impl>();
  MG_RETURN_IF_ERROR(impl->Init(model, options, std::move(experts), nullptr));
  return std::unique_ptr<CudaEngine>(new CudaEngine(std::move(impl)));
}

absl::StatusOr<std::shared_ptr<const ExpertStore>> CudaEngine::PinExperts(
    const Model& model, const LoadProgressFn& progress) {
  if (CudaDeviceCount() < 1) {
    return absl::FailedPreconditionError("--backend cuda: no CUDA device is available");
  }
  // The device the engines run on, so the mapping is made in its context.
  MG_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(0), "cudaSetDevice(0)"));
  MG_ASSIGN_OR_RETURN(ExpertStore store,
                      ExpertStore::Create(model, CudaPinnedAllocator(), progress));
  return std::make_shared<const ExpertStore>(std::move(store));
}

absl::StatusOr<std::vector<int32_t>> CudaEngine::Generate(absl::Span<const int32_t> prompt,
                                                          int n_predict, GenerateStats* stats) {
  Impl& s = *impl_;
  if (prompt.empty()) return absl::InvalidArgumentError("cuda engine: Generate needs a prompt");
  if (n_predict < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cuda engine: n_predict %d must not be negative", n_predict));
  }
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= s.cfg.n_vocab) {
      return absl::InvalidArgumentError(
          absl::StrFormat("cuda engine: token %d at index %d is outside the vocabulary [0, %d)",
                          prompt[i], i, s.cfg.n_vocab));
    }
  }
  const int n_prompt = static_cast<int>(prompt.size());
  const int decode_steps = n_predict > 0 ? n_predict - 1 : 0;
  if (n_prompt + decode_steps > s.options.max_ctx) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "cuda engine: %d prompt tokens and %d generated exceed the context size %d (--ctx)",
        n_prompt, n_predict, s.options.max_ctx));
  }
  GenerateStats local;
  GenerateStats& st = stats != nullptr ? *stats : local;
  st = GenerateStats();

  // The length and the ids in one upload, so every walk and graph serves any prompt.
  std::vector<int32_t> length_and_ids;
  length_and_ids.reserve(prompt.size() + 1);
  length_and_ids.push_back(n_prompt);
  length_and_ids.insert(length_and_ids.end(), prompt.begin(), prompt.end());
  MG_RETURN_IF_ERROR(s.Upload(s.n_prompt, length_and_ids.data(), length_and_ids.size() * 4,
                              "the prompt"));
  MG_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(s.step, 0, sizeof(int32_t), s.main),
                                "resetting the step counter"));

  auto start = std::chrono::steady_clock::now();
  MG_RETURN_IF_ERROR(s.RunSteps(n_prompt));
  st.prompt_tokens = n_prompt;
  st.prompt_seconds = SecondsSince(start);
  std::vector<int32_t> out;
  if (n_predict == 0) return out;
  start = std::chrono::steady_clock::now();
  MG_RETURN_IF_ERROR(s.RunSteps(decode_steps));
  st.decode_steps = decode_steps;
  st.decode_seconds = SecondsSince(start);
  out.resize(static_cast<size_t>(n_predict));
  MG_RETURN_IF_ERROR(s.Download(out.data(), s.out_tokens + (n_prompt - 1),
                                out.size() * sizeof(int32_t), "the generated tokens"));
  return out;
}

absl::StatusOr<std::vector<float>> CudaEngine::LastLogits() {
  std::vector<float> out(static_cast<size_t>(impl_->cfg.n_vocab));
  MG_RETURN_IF_ERROR(
      impl_->Download(out.data(), impl_->logits, out.size() * sizeof(float), "the logits"));
  return out;
}

absl::StatusOr<DeviceCounters> CudaEngine::ReadDeviceCounters() {
  DeviceCounters out{};
  MG_RETURN_IF_ERROR(
      impl_->Download(&out, impl_->counters, sizeof(DeviceCounters), "the device counters"));
  return out;
}

absl::StatusOr<EngineCounters> CudaEngine::ReadCounters() {
  MG_ASSIGN_OR_RETURN(const DeviceCounters d, ReadDeviceCounters());
  EngineCounters out;
  out.steps = d.steps;
  const uint64_t computed = d.pass_a_experts + d.pass_b_experts;
  switch (impl_->slot_mode) {
    case SlotMode::kDevicePolicy:
      out.hits = d.hits;
      out.misses = d.misses;
      out.evictions = d.evictions;
      out.bytes_staged = d.bytes_staged;
      break;
    case SlotMode::kHostPolicy:
      out.hits = impl_->host_expert.hits;
      out.misses = impl_->host_expert.misses;
      out.evictions = impl_->host_expert.evictions;
      out.bytes_staged = impl_->host_expert.bytes_staged;
      break;
    case SlotMode::kStageAll:
      out.misses = computed;
      out.bytes_staged = d.bytes_staged;
      break;
    case SlotMode::kResident:
      out.hits = computed;
      break;
  }
  return out;
}

const HostCounters& CudaEngine::host_counters() const { return impl_->host; }

absl::StatusOr<ResidencySnapshot> CudaEngine::ReadResidency(int size_class) {
  Impl& s = *impl_;
  if (size_class < 0 || size_class >= static_cast<int>(s.pools.size())) {
    return absl::OutOfRangeError(
        absl::StrFormat("size class %d of %d", size_class, s.pools.size()));
  }
  DevicePool& pool = s.pools[static_cast<size_t>(size_class)];
  if (pool.host_cache.has_value()) return pool.host_cache->Snapshot();
  if (s.slot_mode != SlotMode::kDevicePolicy) {
    return absl::FailedPreconditionError(
        absl::StrFormat("the %s arm keeps no residency state", Av(ArmName(s.arm))));
  }
  ResidencySnapshot out;
  MG_RETURN_IF_ERROR(ForEachStateArray(
      out, pool.policy_state, [&](auto& host, const CudaBuffer& buffer, std::string_view what) {
        if (buffer.as<void>() == nullptr) return absl::OkStatus();
        host.resize(buffer.bytes() / sizeof(host[0]));
        return s.Download(host.data(), buffer.as<void>(), buffer.bytes(), what);
      }));
  return out;
}

Arm CudaEngine::arm() const { return impl_->arm; }
const ExpertStore& CudaEngine::experts() const { return *impl_->store; }
const std::vector<SlotPoolInfo>& CudaEngine::pools() const { return impl_->pool_infos; }
const std::string& CudaEngine::banner() const { return impl_->banner; }
const std::vector<int32_t>& CudaEngine::routing() const { return impl_->routing; }
absl::StatusOr<std::vector<int32_t>> CudaEngine::ReadRoutingRecord() {
  Impl& s = *impl_;
  int64_t steps = 0;
  MG_RETURN_IF_ERROR(s.Download(&steps, s.routing_cursor, sizeof(steps), "the routing cursor"));
  if (steps > s.options.routing_record_steps) {
    return absl::FailedPreconditionError(
        absl::StrFormat("the routing record holds %d steps but %d ran",
                        s.options.routing_record_steps, steps));
  }
  std::vector<int32_t> out(static_cast<size_t>(steps) * static_cast<size_t>(s.cfg.n_layer) *
                           static_cast<size_t>(s.cfg.n_expert_used));
  if (!out.empty()) {
    MG_RETURN_IF_ERROR(s.Download(out.data(), s.routing_record.as<void>(), out.size() * 4,
                                  "the routing record"));
  }
  return out;
}

absl::StatusOr<std::vector<float>> CudaEngine::ReadLogitsRecord(int first_step, int n_steps) {
  Impl& s = *impl_;
  if (!s.options.record_logits) {
    return absl::FailedPreconditionError("the engine keeps no logits record (record_logits)");
  }
  if (first_step < 0 || n_steps < 0 || first_step + n_steps > s.options.max_ctx) {
    return absl::OutOfRangeError(absl::StrFormat(
        "logits of steps [%d, %d) are outside the record's %d steps (--ctx)", first_step,
        first_step + n_steps, s.options.max_ctx));
  }
  const size_t row = static_cast<size_t>(s.cfg.n_vocab);
  std::vector<float> out(static_cast<size_t>(n_steps) * row);
  if (!out.empty()) {
    MG_RETURN_IF_ERROR(s.Download(out.data(),
                                  s.logits_record.as<float>() + static_cast<size_t>(first_step) * row,
                                  out.size() * sizeof(float), "the logits record"));
  }
  return out;
}

StepWalk CudaEngine::Walk() const { return BuildWalk(impl_->MakeWalkConfig(1)); }

}  // namespace moegraph
