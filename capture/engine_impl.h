// The CUDA engine's private state, shared by its three source files:
// engine.cc (the public API and Init), engine_memory.cc (what the budget counts,
// the slot pools, the decode state and the uploads) and engine_walk.cc (each walk
// entry bound to its launch, eager runs and graph replays). Include nowhere else.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "capture/engine.h"
#include "kernels/gemm.h"
#include "loader/status_util.h"

namespace moegraph {

inline double Mib(uint64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }
inline double Gib(uint64_t bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0);
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

// Buffers carved from one allocation, each 256-byte aligned: Add returns a
// buffer's offset, total is the allocation's size.
struct BufferLayout {
  size_t total = 0;
  size_t Add(size_t bytes) {
    const size_t at = total;
    total += (bytes + 255) / 256 * 256;
    return at;
  }
};

struct LayerWeights {
  DeviceMatrix wq, wk, wv, wo, router;
  DeviceMatrix shexp_gate, shexp_up, shexp_down, shexp_gate_inp;
  // Where the router computes the shared expert's gate (SharedGateInRouter):
  // router's rows and then shexp_gate_inp's in one buffer, which those two view.
  DeviceMatrix router_and_gate;
  DeviceMatrix ffn_gate, ffn_up, ffn_down;  // a leading dense layer's FFN (glm4moe)
  const float* score_b = nullptr;           // glm4moe's exp_probs_b
  const float* attn_norm = nullptr;
  const float* ffn_norm = nullptr;
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  const float* bq = nullptr;
  const float* bk = nullptr;
  const float* bv = nullptr;
  // gpt-oss: the output bias, the sinks, the router's bias and the experts'
  // biases ([n_expert][n_ff], down [n_expert][n_embd]; all of them on the
  // device, as the dense tensors are).
  const float* bo = nullptr;
  const float* sinks = nullptr;
  const float* router_b = nullptr;
  const float* gate_exps_b = nullptr;
  const float* up_exps_b = nullptr;
  const float* down_exps_b = nullptr;
  // A Gated DeltaNet layer's mixer (qwen35moe), in place of wq .. wo.
  struct DeltaNet {
    DeviceMatrix qkv, gate, alpha, beta, out;
    const float* conv = nullptr;
    const float* dt_bias = nullptr;
    const float* ssm_a = nullptr;
    const float* norm = nullptr;
  } delta_net;
};

// Per-layer device pointers of one step's expert path (a dense layer has its
// KV cache and a selection of kMissingExpert ids, which the routing record
// copies, and no class).
struct LayerExperts {
  int size_class = -1;
  int local_layer = -1;                  // the layer's number inside its class
  const uint8_t* host_blocks = nullptr;  // device pointer of the layer's store blocks
  int32_t* selection = nullptr;          // [k]
  float* weights = nullptr;              // [k]
  int32_t* selected_keys = nullptr;      // [k]
  int32_t* slot_of_rank = nullptr;       // [k]
  uint8_t* missed = nullptr;             // [k]
  int32_t* evicted = nullptr;            // [k]
  void* k_cache = nullptr;               // [max_ctx][kv_len], CudaEngineOptions::kv_type
  void* v_cache = nullptr;
  int32_t kv_rows = 0;  // a windowed layer's ring: [kv_rows][kv_len] (0: max_ctx rows)
  // A Gated DeltaNet layer's state in place of a KV cache (DeltaNetMixArgs).
  float* conv_state = nullptr;
  float* delta_state = nullptr;
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
  MG_RETURN_IF_ERROR(fn(host.long_frequency, device.long_frequency, "the keys' long frequencies"));
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

// A prompt's ubatches on the device (engine_prefill.cc): rows of up to
// `ubatch` tokens in buffers carved from one allocation, the weight tile a
// quantized matrix is dequantized into for its GEMM, and the ring of two
// staging buffers that streamed experts are copied into.
struct PrefillState {
  int32_t ubatch = 0;       // rows per ubatch: -ub, at most --ctx; 0: prompts run as steps
  std::string unavailable;  // why the door's batched prefill cannot run (no cuBLASLt)
  CudaBuffer device;
  CudaBuffer host;                     // pinned: the routing readback and a layer's plan
  const int32_t* positions = nullptr;  // [max_ctx]: 0, 1, ...; a ubatch's are positions + p0
  float* x = nullptr;                  // the residual stream, [ubatch][n_embd]
  float* h = nullptr;                  // a norm's rows, and as f16
  uint16_t* h16 = nullptr;
  float *q = nullptr, *k = nullptr, *v = nullptr, *q_rope = nullptr;
  float* attn = nullptr;  // the token mixer's output (attention's or a Gated DeltaNet's)
  uint16_t* attn16 = nullptr;
  // A Gated DeltaNet's projections: [ubatch][conv_dim], [ubatch][value_dim],
  // [ubatch][n_v_heads] twice.
  float *dn_qkv = nullptr, *dn_z = nullptr, *dn_alpha = nullptr, *dn_beta = nullptr;
  float* router_logits = nullptr;  // [ubatch][n_expert]
  int32_t* selection = nullptr;    // [ubatch][k]
  float* weights = nullptr;        // [ubatch][k]
  int32_t* entries = nullptr;      // the plan's token * k + rank, grouped by expert
  float* xg = nullptr;             // an expert's (or the shared expert's) rows
  uint16_t* xg16 = nullptr;
  float *gate = nullptr, *up = nullptr, *act = nullptr, *yg = nullptr;
  uint16_t* act16 = nullptr;
  float* expert_out = nullptr;  // [ubatch * k][n_embd], by (token, rank)
  float* shexp_out = nullptr;
  float* shexp_logit = nullptr;
  uint16_t* tile = nullptr;
  uint8_t* ring[2] = {nullptr, nullptr};
  int32_t* selection_host = nullptr;               // [ubatch][k]
  int32_t* entries_host = nullptr;                 // [ubatch * k]
  int32_t* table_host = nullptr;                   // [n_expert]: a layer's slot table
  cudaEvent_t ring_ready[2] = {nullptr, nullptr};  // a ring buffer's copy is done
  cudaEvent_t ring_free[2] = {nullptr, nullptr};   // its expert's last GEMM is done
  GemmRunner gemm;
};

// The token mixers' vector widths: q's rows (each head's query and gate with
// gated attention), the mixer's output (attention's, or a Gated DeltaNet's
// value_dim where that is more) and a Gated DeltaNet's four projections
// (conv_dim + value_dim + 2 n_v_heads; 0 without such layers).
struct MixerWidths {
  size_t q_rows = 0, mixer_out = 0, delta_net_inputs = 0;
  explicit MixerWidths(const ModelConfig& cfg) {
    const size_t q_len = static_cast<size_t>(cfg.n_head) * static_cast<size_t>(cfg.head_dim);
    bool gated = false, delta_net = false;
    for (int il = 0; il < cfg.n_layer; ++il) {
      gated |= cfg.mixer(il) == LayerMixer::kGatedAttention;
      delta_net |= cfg.mixer(il) == LayerMixer::kDeltaNet;
    }
    const DeltaNetShape& dn = cfg.delta_net;
    q_rows = gated ? 2 * q_len : q_len;
    mixer_out = delta_net ? std::max(q_len, static_cast<size_t>(dn.value_dim())) : q_len;
    delta_net_inputs =
        delta_net ? static_cast<size_t>(dn.conv_dim() + dn.value_dim() + 2 * dn.n_v_heads) : 0;
  }
};

// Bytes the budget counts before anything is allocated (engine_memory.cc).
uint64_t DenseBytes(const Model& m);
uint64_t RecordBytes(const CudaEngineOptions& options, const ModelConfig& cfg);
uint64_t ScratchBytes(const ModelConfig& cfg, int max_ctx);
// The device bytes of one sequence's Gated DeltaNet state (every such layer's
// conv and delta state, DeltaNetMixArgs' layout); 0 without such layers.
uint64_t RecurrentBytes(const ModelConfig& cfg);
// The prefill's device bytes (engine_prefill.cc): 0 when prompts run as steps.
uint64_t PrefillBytes(const Model& m, const CudaEngineOptions& options);

struct CudaEngine::Impl {
  ~Impl();

  // experts: a shared store, or null to pin one of the engine's own.
  absl::Status Init(const Model& model, const CudaEngineOptions& options,
                    std::shared_ptr<const ExpertStore> experts, const LoadProgressFn& progress);
  absl::Status UploadDense();
  absl::StatusOr<DeviceMatrix> UploadMatrix(const GgufTensor* t);
  // The router's rows and then the shared gate's row in one buffer.
  absl::StatusOr<DeviceMatrix> UploadRouterAndGate(const GgufTensor* router,
                                                   const GgufTensor* gate);
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
  // An RMSNorm by weight into h and h_q, run as an op's epilogue.
  NormEpilogue Norm(const float* weight) const;
  // Layer's QK-norm, RoPE at *pos and KV append, q into q_out: the decode
  // step's qkv epilogue and the prefill's rows.
  QkvRope Rope(int layer, const int32_t* pos, float* q_out) const;
  // Layer's top-k into experts and weights: the decode router's epilogue and
  // the prefill's rows.
  RouterEpilogue Router(int layer, int32_t* experts, float* weights) const;
  // Layer's window, sinks and KV ring, for the decode step's attention and the
  // prefill's; a gated layer's output gate read from q_projection (its rows).
  AttentionMask Mask(int layer, const float* q_projection) const;
  // Layer's Gated DeltaNet over `tokens` rows of its projections, into out
  // (and out_q) and its state.
  DeltaNetMixArgs DeltaNetArgs(int layer, const float* qkv, const float* z, const float* alpha,
                               const float* beta, float* out, block_q8_1* out_q) const;
  // Whether a Generate from position start keeps the Gated DeltaNet state:
  // there is none, it starts anew (0), or the state is at start (every
  // position fed so far). Otherwise the kept positions are fed again from 0.
  bool StateResumesAt(int start) const {
    return recurrent_buffer.bytes() == 0 || start == 0 || start == static_cast<int>(fed.size());
  }
  // KvLayerRows's ring slack: the ubatch, or none (-1) with swa_full.
  int RingSlack() const { return options.swa_full ? -1 : options.ubatch; }
  // Layer's expert biases for the ranks' experts (none where the file has none).
  ExpertBiases Biases(int layer, const int32_t* experts) const;
  // The routed experts' activation.
  GluAct ExpertGlu() const {
    return cfg.expert_act == ExpertAct::kSwigluOai ? GluAct::kSwigluOai : GluAct::kSilu;
  }
  cudaError_t HostPolicyStep(int layer);
  cudaError_t HostStageCopy(int layer);
  // Runs count steps in launches of at most S; after each launch (and its sync),
  // after_launch(steps it ran) may stop the run by returning false. Returns the
  // steps run.
  absl::StatusOr<int> RunSteps(
      int count, const std::function<absl::StatusOr<bool>(int steps)>& after_launch = nullptr);
  absl::Status Sync(std::string_view what);

  // The batched prefill (engine_prefill.cc). Whether prompts run in ubatches:
  // the door, and no option that records every step.
  bool BatchedPrefill() const;
  absl::Status AllocatePrefill();
  // Positions [first, first + count) from the prompt ids already on the
  // device, in ubatches; then the last one's logits, the token sampled from
  // them (at step first + count - 1, as the T=1 path) into out_tokens and
  // token_host, and the step counter at first + count.
  absl::Status Prefill(int first, int count);
  absl::Status PrefillUbatch(int p0, int rows);
  // A layer's token mixer over the ubatch's normed rows, its output projection
  // added into x: attention (the KV append, then the causal attention) or a
  // Gated DeltaNet (its projections, the mixer through the state in token order).
  absl::Status PrefillAttention(int layer, int p0, int rows);
  absl::Status PrefillDeltaNet(int layer, int rows);
  absl::Status PrefillExperts(int layer, int rows);
  // A leading dense layer's FFN over the ubatch's normed rows, added into x.
  absl::Status PrefillDenseFfn(int layer, int rows);
  // y (rows x w.rows) = x w^T, or += with accumulate: f32 GEMM for an f32
  // weight (x), else f16 (x16), a quantized weight dequantized into the tile.
  absl::Status Project(const DeviceMatrix& w, const float* x, const uint16_t* x16, int rows,
                       float* y, bool accumulate, std::string_view what);
  // The layer's slot table (expert -> slot or kNoSlot) into table_host.
  absl::Status ReadLayerSlots(int layer);

  const Model* model = nullptr;
  ModelConfig cfg;
  CudaEngineOptions options;
  Arm arm = Arm::kGraph;
  SlotMode slot_mode = SlotMode::kDevicePolicy;
  // MOEGRAPH_PDL on a device that has it (compute capability 9.0 and later).
  bool programmatic_launch = false;
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
  // Per layer: its shared expert is rank k of the expert passes
  // (SharedExpertInPasses, capture/walk_shape.h).
  std::vector<bool> shared_expert_in_passes;
  std::vector<bool> shared_gate_in_router;  // per layer (SharedGateInRouter)

  std::vector<DevicePool> pools;
  std::vector<SlotPoolInfo> pool_infos;

  // Decode state.
  CudaBuffer state_buffer;  // every small per-step buffer, carved below
  CudaBuffer kv_buffer;
  CudaBuffer partial_buffer;
  CudaBuffer rope_buffer;  // fill_rope_table's cosines and sines, max_ctx positions
  int32_t* pos = nullptr;
  int32_t* step = nullptr;
  int32_t* sampled = nullptr;
  SamplingParams* sampling = nullptr;  // what kSample reads (CudaEngine::SetSampling writes it)
  int32_t* n_prompt = nullptr;    // [1 + max_ctx]: the prompt's length, then its ids
  int32_t* prompt = nullptr;      // n_prompt + 1
  int32_t* out_tokens = nullptr;  // [max_ctx]
  // The ids fed at positions 0.. (the prompts and every generated token but
  // the last), and the positions the windowed layers' rings hold.
  std::vector<int32_t> fed;
  KvRingPositions rings;
  float* x = nullptr;
  float* h = nullptr;
  float* q = nullptr;
  float* k = nullptr;
  float* q_rope = nullptr;  // q after QK-norm and RoPE, what attention reads
  float* attn = nullptr;  // the token mixer's output (attention's or a Gated DeltaNet's)
  float* router_logits = nullptr;
  // A Gated DeltaNet layer's projections of the step's token.
  float *dn_qkv = nullptr, *dn_z = nullptr, *dn_alpha = nullptr, *dn_beta = nullptr;
  // Every Gated DeltaNet layer's state (LayerExperts::conv_state,
  // delta_state), zeroed when a sequence starts at position 0.
  CudaBuffer recurrent_buffer;
  float* act = nullptr;         // [PassRanks][n_ff_exp]
  // q8_1 blocks of h, attn, act ([PassRanks][n_ff_exp / 32]) and shexp_act, written by
  // their producers for the quantized matvecs; null where a length is not a
  // multiple of 32 (then only element-type matrices read that vector).
  block_q8_1* h_q = nullptr;
  block_q8_1* attn_q = nullptr;
  block_q8_1* act_q = nullptr;
  block_q8_1* shexp_act_q = nullptr;
  float* expert_out = nullptr;  // [PassRanks][n_embd]
  float* shexp_act = nullptr;
  float* shexp_out = nullptr;
  float* shexp_logit = nullptr;
  float* dense_act = nullptr;  // [n_ff_dense]: a dense layer's silu(gate) * up
  block_q8_1* dense_act_q = nullptr;
  float* logits = nullptr;
  void* sample_scratch = nullptr;  // launch_sample's blocks' argmax and candidates
  DeviceCounters* counters = nullptr;
  float* partial = nullptr;
  unsigned int* tickets = nullptr;  // the epilogues' counters (kernels/kernels.h), zeroed
  unsigned int* copy_tickets = nullptr;  // the stage copy's, [k], zeroed
  std::vector<LayerExperts> layer_experts;
  // Routing replay and record: the trace ([n_steps][n_layer][k] ids, -1 for a
  // missing row; f32 weights or none), the record buffer and their step cursor.
  CudaBuffer trace_ids, trace_weights, routing_record;
  CudaBuffer logits_record;  // [max_ctx][n_vocab] with record_logits
  int64_t* routing_cursor = nullptr;
  int64_t* replay_step = nullptr;  // the cursor mod the trace's steps (RoutingReplay)

  // Pinned host memory: the token copy and the host arm's per-layer staging.
  CudaBuffer token_host;
  CudaBuffer selection_host, slot_of_rank_host, missed_host;  // [n_layer][k]

  PrefillState prefill;

  std::map<int, StepWalk> walks;    // by steps per walk
  std::map<int, StepGraph> graphs;  // by steps per graph
};

}  // namespace moegraph
