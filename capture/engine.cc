#include "capture/engine.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "capture/engine_impl.h"
#include "capture/walk_shape.h"
#include "loader/check.h"
#include "loader/status_util.h"

namespace moegraph {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

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
absl::Status CheckSampling(const SamplingParams& p) {
  if (sampling_params_valid(p)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "sampling --temp %g --top-k %d --top-p %g --min-p %g: out of range (temp >= 0, top-k >= "
      "0, 0 < top-p <= 1, 0 <= min-p <= 1)",
      p.temperature, p.top_k, p.top_p, p.min_p));
}

absl::Status CheckStoreFits(const ExpertStore& store, const Model& model) {
  const ModelConfig& cfg = model.config;
  if (store.n_layer() != cfg.n_layer || store.n_expert() != cfg.n_expert) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cuda engine: the shared expert store holds %d layers of %d experts, the model %d of %d",
        store.n_layer(), store.n_expert(), cfg.n_layer, cfg.n_expert));
  }
  for (int layer = cfg.n_layer_dense_lead; layer < cfg.n_layer; ++layer) {
    if (!(store.layout(layer) == ExpertLayoutOf(model, layer))) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "cuda engine: the shared expert store lays out layer %d's experts unlike the model "
          "(a store of another model)",
          layer));
    }
  }
  return absl::OkStatus();
}

// A matrix the CUDA matvec cannot compute: the file and tensor, and what it takes.
absl::Status UnsupportedMatrix(const Model& m, const GgufTensor& t) {
  return m.file->TensorError(
      t, absl::StrFormat("the CUDA matvec does not compute type %s with rows of %d here (it "
                         "takes q8_0, q4_0, q4_1, q5_0, q5_1, q2_K, q3_K, q4_K, q5_K, q6_K, "
                         "iq4_nl, iq4_xs and, outside the attention's q, k and v, mxfp4 in "
                         "whole blocks, f32 rows of a multiple of 4 and f16, bf16 rows of a "
                         "multiple of 8)",
                         ggml_type_name(t.type), t.ne[0]));
}

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

CudaEngine::Impl::~Impl() {
  if (main != nullptr) cudaStreamSynchronize(main);
  if (copy != nullptr) cudaStreamSynchronize(copy);
  graphs.clear();
  for (cudaEvent_t e : fork_events) cudaEventDestroy(e);
  for (cudaEvent_t e : join_events) cudaEventDestroy(e);
  for (cudaEvent_t e :
       {prefill.ring_ready[0], prefill.ring_ready[1], prefill.ring_free[0], prefill.ring_free[1]}) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  if (main != nullptr) cudaStreamDestroy(main);
  if (copy != nullptr) cudaStreamDestroy(copy);
}

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
  if (options.ubatch < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("-ub %d: a ubatch needs at least 1 token", options.ubatch));
  }
  if (options.steps_per_launch < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--steps-per-launch %d must be at least 1", options.steps_per_launch));
  }
  if (options.n_slots < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--slots %d must be auto (0) or at least --top-k %d", options.n_slots, cfg.n_expert_used));
  }
  MG_RETURN_IF_ERROR(CheckSampling(options.sampling));
  // The attention kernel holds a group's q in shared memory.
  if (cfg.head_dim > 256) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the CUDA attention takes a head_dim of at most 256 (this model's is %d)",
        m.file->path(), cfg.head_dim));
  }
  // The f16 cache is read 8 elements (16 bytes) at a time.
  if (options.kv_type == KvCacheType::kF16 && cfg.head_dim % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the CUDA attention reads an f16 KV cache in 8-element loads and this model's "
        "head_dim is %d: give --kv-type f32",
        m.file->path(), cfg.head_dim));
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

  for (absl::Status shape : {CheckDeltaNetShape(cfg), CheckRouterShape(cfg)}) {
    if (!shape.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(m.file->path(), ": ", shape.message()));
    }
  }
  for (const LayerTensors& lt : m.layers) {
    const LayerTensors::DeltaNet& dn = lt.delta_net;
    for (const GgufTensor* t : {lt.wq, lt.wk, lt.wv, dn.qkv, dn.gate, dn.alpha, dn.beta}) {
      if (t != nullptr && !qkv_supports_type(t->ggml_type(), static_cast<int32_t>(t->ne[0]))) {
        return UnsupportedMatrix(m, *t);
      }
    }
    for (const GgufTensor* t : {lt.wo, lt.router, lt.shexp_gate, lt.shexp_up, lt.shexp_down,
                                lt.shexp_gate_inp, lt.ffn_gate, lt.ffn_up, lt.ffn_down, dn.out}) {
      if (t != nullptr && !matvec_supports_type(t->ggml_type(), static_cast<int32_t>(t->ne[0]))) {
        return UnsupportedMatrix(m, *t);
      }
    }
    // The shared expert's gate/up pair runs in one kernel of one type.
    if (lt.shexp_gate != nullptr && lt.shexp_up != nullptr &&
        lt.shexp_gate->ggml_type() != lt.shexp_up->ggml_type()) {
      return m.file->TensorError(*lt.shexp_up,
                                 "the CUDA shared expert needs gate and up of one type");
    }
    if (lt.ffn_gate != nullptr && lt.ffn_gate->ggml_type() != lt.ffn_up->ggml_type()) {
      return m.file->TensorError(*lt.ffn_up, "the CUDA dense FFN needs gate and up of one type");
    }
  }
  if (!matvec_supports_type(m.output->ggml_type(), static_cast<int32_t>(m.output->ne[0]))) {
    return UnsupportedMatrix(m, *m.output);
  }
  for (int layer = cfg.n_layer_dense_lead; layer < cfg.n_layer; ++layer) {
    // The gate/up pass reads both with one kernel.
    if (m.expert(layer, ExpertProj::kGate, 0).type != m.expert(layer, ExpertProj::kUp, 0).type) {
      const LayerTensors& lt = m.layers[static_cast<size_t>(layer)];
      const GgufTensor* up = lt.up_exps != nullptr ? lt.up_exps : lt.up_legacy.front();
      return m.file->TensorError(
          *up, "the CUDA expert pass needs the gate and up experts of one type");
    }
    for (ExpertProj proj : {ExpertProj::kGate, ExpertProj::kUp, ExpertProj::kDown}) {
      const WeightView w = m.expert(layer, proj, 0);
      if (matvec_supports_type(w.type, static_cast<int32_t>(w.cols))) continue;
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
      return UnsupportedMatrix(m, *t);
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
  programmatic_launch = options.doors.programmatic_launch && prop.major >= 9;
  // The copy stream outranks the main one, so the hits pass cannot starve the
  // miss copies it overlaps (the graph keeps these priorities per node).
  int least_priority = 0, greatest_priority = 0;
  MG_RETURN_IF_ERROR(
      CudaStatus(cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority),
                 "cudaDeviceGetStreamPriorityRange"));
  MG_RETURN_IF_ERROR(
      CudaStatus(cudaStreamCreateWithPriority(&main, cudaStreamNonBlocking, least_priority),
                 "creating the main stream"));
  MG_RETURN_IF_ERROR(
      CudaStatus(cudaStreamCreateWithPriority(&copy, cudaStreamNonBlocking, greatest_priority),
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

  // The context's memory, before the experts are pinned: the dense weights, the
  // KV cache and the scratch must fit beside the rail, whatever the slots get.
  // A Gated DeltaNet's state sits beside the KV cache: the budget counts both.
  const uint64_t state_bytes = RecurrentBytes(cfg);
  const uint64_t kv_bytes =
      KvCacheBytes(cfg, options.max_ctx, options.kv_type, RingSlack()) + state_bytes;
  const int kv_elem = options.kv_type == KvCacheType::kF16 ? 2 : 4;
  int ring_layers = 0, ring_rows = 0;  // the windowed layers' rings, where smaller
  for (int il = 0; il < cfg.n_layer; ++il) {
    const int rows = KvLayerRows(cfg, il, options.max_ctx, RingSlack());
    if (rows < options.max_ctx) {
      ++ring_layers;
      ring_rows = rows;
    }
  }
  const std::string rings =
      ring_layers > 0 ? absl::StrFormat(" (%d windowed layers %d rows)", ring_layers, ring_rows)
                      : "";
  const uint64_t dense = DenseBytes(m);
  const uint64_t prefill_bytes = PrefillBytes(m, options);
  const uint64_t scratch =
      ScratchBytes(cfg, options.max_ctx) + RecordBytes(options, cfg) + prefill_bytes;
  if (dense + kv_bytes + scratch + options.rail_bytes > free_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "--ctx %d: the GPU needs %.2f GiB before any expert slot (dense weights %.2f GiB, KV "
        "cache %.2f GiB = 2 x %d layers x %d positions%s x %d KV heads x %d x %d bytes,%s scratch "
        "%.2f GiB, rail %.2f GiB) and %.2f GiB of its memory is free; a smaller --ctx fits",
        options.max_ctx, Gib(dense + kv_bytes + scratch + options.rail_bytes), Gib(dense),
        Gib(kv_bytes - state_bytes), cfg.n_kv_layers(), options.max_ctx, rings, cfg.n_head_kv,
        cfg.head_dim, kv_elem,
        state_bytes > 0 ? absl::StrFormat(" Gated DeltaNet state %.2f GiB,", Gib(state_bytes))
                        : std::string(),
        Gib(scratch), Gib(options.rail_bytes), Gib(free_bytes)));
  }
  if (experts == nullptr) {
    MG_ASSIGN_OR_RETURN(experts, PinExperts(m, progress));
  }
  store = std::move(experts);
  void* device_base = nullptr;
  const cudaError_t mapped =
      cudaHostGetDevicePointer(&device_base, const_cast<uint8_t*>(store->data()), 0);
  if (mapped != cudaSuccess) {
    cudaGetLastError();  // not sticky: keep it from failing the next kernel launch
    return CudaStatus(mapped,
                      "cudaHostGetDevicePointer of the expert store (it must be pinned, mapped "
                      "host memory: CudaEngine::PinExperts)");
  }
  store_device_base = static_cast<const uint8_t*>(device_base);

  banner = absl::StrFormat("backend cuda: %s (%.1f GiB), arm %s, %s%s, steps per launch %d",
                           prop.name, total_bytes / 1073741824.0, Av(ArmName(arm)),
                           DescribePolicy(d.policy, d.protected_frac),
                           d.split_passes ? ", split expert passes" : "", options.steps_per_launch);
  MG_RETURN_IF_ERROR(PlanPools(free_bytes, dense, kv_bytes, scratch));
  MG_RETURN_IF_ERROR(UploadDense());
  MG_RETURN_IF_ERROR(AllocatePools());
  MG_RETURN_IF_ERROR(AllocateState());
  MG_RETURN_IF_ERROR(AllocatePrefill());
  // The pools' layouts are the file's experts' (ExpertLayoutOf), so where the
  // file says the shared expert rides the passes it fits their slots (the
  // expert launchers check it again: shared_expert_fits_slots).
  shared_expert_in_passes = SharedExpertInPasses(m);
  for (size_t c = 0; c < pools.size(); ++c) {
    const SlotPoolInfo& p = pools[c].info;
    pool_infos.push_back(p);
    absl::StrAppendFormat(&banner, "\nclass %d: %d layers, %d slots x %.3f MiB = %.2f MiB", c,
                          p.layers.size(), p.n_slots, Mib(p.block_bytes), Mib(p.pool_bytes()));
  }
  absl::StrAppendFormat(&banner, "\ndense %.2f MiB, KV %.2f MiB (%s)%s, experts %.2f MiB pinned",
                        Mib(dense_bytes), Mib(kv_bytes - state_bytes),
                        options.kv_type == KvCacheType::kF16 ? "f16" : "f32",
                        state_bytes > 0
                            ? absl::StrFormat(", Gated DeltaNet state %.2f MiB", Mib(state_bytes))
                            : std::string(),
                        Mib(store->total_bytes()));
  if (!prefill.unavailable.empty()) {
    absl::StrAppendFormat(&banner,
                          "\nwarning: prompts run as T=1 steps: cuBLASLt cannot be opened (%s); "
                          "put its lib folder on LD_LIBRARY_PATH for the batched prefill",
                          prefill.unavailable);
  } else if (options.doors.batched_prefill) {
    absl::StrAppendFormat(&banner,
                          "\nprefill: ubatches of %d tokens, %.2f MiB of scratch (the ring: 2 x "
                          "%.3f MiB)",
                          prefill.ubatch, Mib(prefill_bytes),
                          Mib(static_cast<uint64_t>(prefill.ring[1] - prefill.ring[0])));
  }
  return Sync("uploading the model");
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
                                                          int n_predict, GenerateStats* stats,
                                                          const TokenSink& sink, int start) {
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
  if (start < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cuda engine: start position %d must not be negative", start));
  }
  if (start > static_cast<int>(s.fed.size())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cuda engine: start position %d is past the %d positions fed", start, s.fed.size()));
  }
  // A windowed layer's ring that no longer holds the keys below start, or a
  // Gated DeltaNet state that is not at start: the kept positions are fed
  // again from 0 (they are the ids this engine was fed).
  std::vector<int32_t> refed;
  if (!s.rings.Holds(start) || !s.StateResumesAt(start)) {
    ++(s.rings.Holds(start) ? s.host.state_refills : s.host.ring_refills);
    refed.assign(s.fed.begin(), s.fed.begin() + start);
    refed.insert(refed.end(), prompt.begin(), prompt.end());
    prompt = refed;
    start = 0;
  }
  // A new sequence's state starts at zero.
  if (start == 0 && s.recurrent_buffer.bytes() > 0) {
    MG_RETURN_IF_ERROR(CudaStatus(
        cudaMemsetAsync(s.recurrent_buffer.as<void>(), 0, s.recurrent_buffer.bytes(), s.main),
        "clearing the Gated DeltaNet state"));
  }
  // Steps run positions [start, n_prompt + decode_steps): the prompt buffer
  // holds ids by position, so the length counts the kept positions too.
  const int n_prompt = start + static_cast<int>(prompt.size());
  const int decode_steps = n_predict > 0 ? n_predict - 1 : 0;
  if (n_prompt + decode_steps > s.options.max_ctx) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "cuda engine: %d kept positions, %d prompt tokens and %d generated exceed the context "
        "size %d (--ctx)",
        start, prompt.size(), n_predict, s.options.max_ctx));
  }
  GenerateStats local;
  GenerateStats& st = stats != nullptr ? *stats : local;
  st = GenerateStats();

  // The length, then the ids at their positions, so every walk and graph
  // serves any prompt; the step counter starts at `start`. From position 0 the
  // length and the ids are one upload (the gates count one per prompt).
  if (start == 0) {
    std::vector<int32_t> length_and_ids;
    length_and_ids.reserve(prompt.size() + 1);
    length_and_ids.push_back(n_prompt);
    length_and_ids.insert(length_and_ids.end(), prompt.begin(), prompt.end());
    MG_RETURN_IF_ERROR(s.Upload(s.n_prompt, length_and_ids.data(),
                                length_and_ids.size() * sizeof(int32_t), "the prompt"));
    MG_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(s.step, 0, sizeof(int32_t), s.main),
                                  "resetting the step counter"));
  } else {
    MG_RETURN_IF_ERROR(s.Upload(s.n_prompt, &n_prompt, sizeof(int32_t), "the prompt's length"));
    MG_RETURN_IF_ERROR(
        s.Upload(s.prompt + start, prompt.data(), prompt.size() * sizeof(int32_t), "the prompt"));
    MG_RETURN_IF_ERROR(s.Upload(s.step, &start, sizeof(int32_t), "the step counter"));
  }

  s.fed.resize(static_cast<size_t>(start));
  s.fed.insert(s.fed.end(), prompt.begin(), prompt.end());
  s.rings.Wrote(start, n_prompt);
  auto clock = std::chrono::steady_clock::now();
  if (s.BatchedPrefill()) {
    MG_RETURN_IF_ERROR(s.Prefill(start, static_cast<int>(prompt.size())));
  } else {
    MG_RETURN_IF_ERROR(s.RunSteps(static_cast<int>(prompt.size())).status());
    s.host.prompt_steps += prompt.size();
  }
  st.prompt_tokens = static_cast<int>(prompt.size());
  st.prompt_seconds = SecondsSince(clock);
  std::vector<int32_t> out;
  if (n_predict == 0) return out;
  clock = std::chrono::steady_clock::now();
  if (sink == nullptr) {
    s.rings.Wrote(n_prompt, n_prompt + decode_steps);
    MG_RETURN_IF_ERROR(s.RunSteps(decode_steps).status());
    st.decode_steps = decode_steps;
    st.decode_seconds = SecondsSince(clock);
    out.resize(static_cast<size_t>(n_predict));
    MG_RETURN_IF_ERROR(s.Download(out.data(), s.out_tokens + (n_prompt - 1),
                                  out.size() * sizeof(int32_t), "the generated tokens"));
    s.fed.insert(s.fed.end(), out.begin(), out.end() - 1);
    return out;
  }
  // Streaming: generated token j is out_tokens[n_prompt - 1 + j]; the walk's
  // token copy already holds a launch's last one, so S = 1 reads nothing more.
  out.push_back(*s.token_host.as<int32_t>());
  if (!sink(out.back())) return out;
  MG_ASSIGN_OR_RETURN(
      st.decode_steps, s.RunSteps(decode_steps, [&](int steps) -> absl::StatusOr<bool> {
        std::vector<int32_t> fresh(static_cast<size_t>(steps), *s.token_host.as<int32_t>());
        if (steps > 1) {
          MG_RETURN_IF_ERROR(s.Download(fresh.data(), s.out_tokens + (n_prompt - 1) + out.size(),
                                        fresh.size() * sizeof(int32_t), "the generated tokens"));
        }
        for (const int32_t token : fresh) {
          out.push_back(token);
          if (!sink(token)) return false;
        }
        return true;
      }));
  st.decode_seconds = SecondsSince(clock);
  s.rings.Wrote(n_prompt, n_prompt + st.decode_steps);
  const int fed_back = std::min(static_cast<int>(out.size()), st.decode_steps);
  s.fed.insert(s.fed.end(), out.begin(), out.begin() + fed_back);
  return out;
}

absl::Status CudaEngine::SetSampling(const SamplingParams& sampling) {
  MG_RETURN_IF_ERROR(CheckSampling(sampling));
  MG_RETURN_IF_ERROR(
      impl_->Upload(impl_->sampling, &sampling, sizeof(SamplingParams), "the sampling settings"));
  impl_->options.sampling = sampling;
  return absl::OkStatus();
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

const SamplingParams& CudaEngine::sampling() const { return impl_->options.sampling; }
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

int CudaEngine::ResumePosition(int start) const {
  const Impl& s = *impl_;
  if (start < 0 || start > static_cast<int>(s.fed.size())) return 0;
  return s.rings.Holds(start) && s.StateResumesAt(start) ? start : 0;
}

StepWalk CudaEngine::Walk() const { return BuildWalk(impl_->MakeWalkConfig(1)); }

}  // namespace moegraph
