// The CUDA engine: dense weights on the device, routed experts in pinned, mapped
// host memory (an ExpertStore), a fixed slot pool per size class on the device,
// and the decode step as one walk (capture/walk.h) run eagerly or replayed as a
// CUDA graph. Routing, hit/miss decisions and slot-table rewrites are kernels;
// nothing in a step reads back to the host but the final token copy (the host
// arm reads the selection back on purpose: it is the baseline).
//
// Options and counters mirror cpu/cpu_backend.h; the arm comes from the
// doors (capture/doors.h). A prompt runs in ubatches of -ub tokens (the
// batched prefill, capture/engine_prefill.cc: GEMMs, experts grouped by
// expert, the slot tables read and never written), then each generated token
// is one T=1 step. With MOEGRAPH_PREFILL=steps (or an option that records
// every step) the prompt is T=1 steps too: the step's embed reads the next token
// from a device array of prompt ids while the device step counter is inside
// the prompt, then the previous step's sample.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "capture/doors.h"
#include "capture/graph.h"
#include "capture/walk.h"
#include "cpu/cpu_backend.h"
#include "kernels/kernels.h"
#include "loader/model_config.h"
#include "loader/placement.h"
#include "reference/oracle.h"
#include "residency/cache.h"
#include "residency/policy_cache.h"

namespace moegraph {

// Devices the CUDA runtime sees; 0 when there is none or no driver.
int CudaDeviceCount();
// True in the emulated tree (-DMOEGRAPH_EMULATE=ON): the device is the CPU
// emulator (docs/EMULATOR.md), so its speeds are not a GPU's.
bool CudaDeviceIsEmulated();
// Why CudaDeviceCount() is 0, in the runtime's words: no device, no driver, or
// a driver older than the runtime this was built with.
std::string NoCudaDeviceReason();

// Pinned, mapped, portable host memory (cudaHostAlloc), the memory an engine's
// expert store must live in: the stage copy kernel reads it through its device
// address, from any context. alloc returns nullptr on failure (or without a device).
HostAllocator CudaPinnedAllocator();

struct CudaEngineOptions {
  int max_ctx = 0;  // KV cache positions (steps per Generate)
  KvCacheType kv_type = KvCacheType::kF16;  // the KV cache's elements (--kv-type)
  // Slots over all size classes; 0: auto (the budget decides). Classes share
  // them in proportion to their layer counts, as on the CPU backend.
  int32_t n_slots = 0;
  PoolMode pool_mode = PoolMode::kGlobal;
  Doors doors;  // arm, policy, protected share, split passes
  // S: steps captured in one graph (or run as one eager walk); the host waits
  // once per S steps.
  int steps_per_launch = 1;
  // -ub: prompt tokens per ubatch of the batched prefill (MOEGRAPH_PREFILL);
  // capped at max_ctx.
  int ubatch = 512;
  // --swa-full: a windowed layer's KV cache keeps all max_ctx positions.
  // Otherwise it is a ring of n_swa + ubatch rows (KvLayerRows) where that is
  // fewer, as llama.cpp's SWA cache; a Generate that keeps fewer positions than
  // were written, further back than the ring reaches, feeds the kept ones
  // again from position 0 (HostCounters::ring_refills).
  bool swa_full = false;
  // After every launch, copy the step's selection to the host (one more sync per
  // step; steps_per_launch must be 1). For the table-equality gate.
  bool record_routing = false;
  // Routing replay (moegraph bench --routing-trace): the trace goes to device
  // memory once and each router's epilogue puts its row over the layer's
  // selection (RoutingReplay, kernels/moe_math.h), no readback, no launch; steps past its end wrap around. Null: the
  // router decides. Checked with CheckRoutingTrace; must outlive the engine.
  const RoutingTrace* routing_trace = nullptr;
  // > 0: every step's selection is written on the device into a buffer of this
  // many steps, copied to the host once by ReadRoutingRecord.
  int64_t routing_record_steps = 0;
  // Every step's logits kept on the device ([max_ctx][n_vocab], one more kernel
  // per step), for ReadLogitsRecord: a gate's per-step logits in one readback.
  bool record_logits = false;
  // How each token is picked (the sampling kernel, kernels/sample_math.h's
  // decision; the default is greedy) until CudaEngine::SetSampling.
  SamplingParams sampling;
  uint64_t rail_bytes = uint64_t{512} << 20;  // GPU memory the budget leaves free
  // Engines that will hold their pools at the same time (moegraph bench's arms
  // with --slots auto): auto takes an even share of the free memory, so each of
  // them fits (BudgetInputs::sharing_engines).
  int32_t sharing_engines = 1;
};

class CudaEngine {
 public:
  // model and its file must outlive the engine. Errors: no device, an expert type
  // the kernels do not compute (names the tensor), too little GPU memory (names
  // the shortfall), a bad --slots, --ctx or --steps-per-launch, contradictory doors.
  // The engine pins a store of model's experts of its own.
  static absl::StatusOr<std::unique_ptr<CudaEngine>> Create(
      const Model& model, const CudaEngineOptions& options,
      const LoadProgressFn& progress = nullptr);
  // The same on experts pinned once for many engines (every arm of a bench, the
  // gates of a run): each engine holds a reference, so the store lives as long
  // as its last user. experts comes from PinExperts (or ExpertStore::Create with
  // CudaPinnedAllocator) for this model; also an error: a store whose layers or
  // block layouts differ from model's, or one not in pinned, mapped memory.
  static absl::StatusOr<std::unique_ptr<CudaEngine>> Create(
      const Model& model, std::shared_ptr<const ExpertStore> experts,
      const CudaEngineOptions& options);
  // Model's routed experts in pinned, mapped host memory, for Create above.
  // Errors: no device, a failed allocation (names the size), as ExpertStore::Create.
  static absl::StatusOr<std::shared_ptr<const ExpertStore>> PinExperts(
      const Model& model, const LoadProgressFn& progress = nullptr);
  ~CudaEngine();
  CudaEngine(const CudaEngine&) = delete;
  CudaEngine& operator=(const CudaEngine&) = delete;

  // Decode from position `start`: the prompt (batched or as T=1 steps), then n_predict
  // tokens picked by sampling() (the draw for position p counted p, so
  // the tokens equal Oracle::Generate's for equal logits), each fed back but
  // the last. The KV cache below `start` is kept from earlier calls (a chat's
  // next turn prefills only its own tokens); start 0 begins anew, a Gated
  // DeltaNet's state at zero (ResumePosition: when the state or a ring cannot
  // resume at start, the kept positions are fed again). Residency
  // state and counters carry over from earlier calls; the KV cache restarts.
  // With a sink, each token goes to it after the launch that made it (one more
  // readback per launch when S > 1), and no launch follows the token it stopped
  // at; the tokens up to that one are returned.
  absl::StatusOr<std::vector<int32_t>> Generate(absl::Span<const int32_t> prompt, int n_predict,
                                                GenerateStats* stats = nullptr,
                                                const TokenSink& sink = nullptr, int start = 0);

  // Where a Generate from `start` resumes: start itself, or 0 where the
  // kept positions would be fed again (a windowed layer's ring or a Gated
  // DeltaNet state that no longer holds them; HostCounters::ring_refills,
  // state_refills), as Oracle::ResumePosition says for the CPU backend.
  int ResumePosition(int start) const;

  // The sampling of later Generate calls (an OpenAI request's own settings): one
  // upload to the buffer the captured sampling kernel reads, so the graphs stay.
  // Errors: settings out of range (names them), a failed upload.
  absl::Status SetSampling(const SamplingParams& sampling);
  // The settings Generate samples with now.
  const SamplingParams& sampling() const;

  // Logits of the last step run (one readback, outside any walk).
  absl::StatusOr<std::vector<float>> LastLogits();
  // The kernels' counters (one readback).
  absl::StatusOr<DeviceCounters> ReadDeviceCounters();
  // The expert path's counters as the CPU backend reports them. Policy arms:
  // from the residency kernel (the host arm: from its host steps); stage: every
  // computed expert was staged; resident: every computed expert was a hit.
  absl::StatusOr<EngineCounters> ReadCounters();
  const HostCounters& host_counters() const;
  // A size class's residency state (the device's arrays, or the host arm's
  // cache); an error in the resident and stage arms.
  absl::StatusOr<ResidencySnapshot> ReadResidency(int size_class);

  Arm arm() const;
  // The pinned store the engine reads its experts from (its own or shared).
  const ExpertStore& experts() const;
  // One per size class, indexed like the store's size_classes().
  const std::vector<SlotPoolInfo>& pools() const;
  // Lines for the start-up banner: the device, the arm and the slot arithmetic.
  const std::string& banner() const;
  // With record_routing: k ids in router rank order per (step, layer), at
  // [(step * n_layer + layer) * k, ... + k), over every Generate so far.
  const std::vector<int32_t>& routing() const;
  // With routing_record_steps: every step run so far, laid out as routing(), in
  // one readback. An error when more steps ran than the buffer holds.
  absl::StatusOr<std::vector<int32_t>> ReadRoutingRecord();
  // With record_logits: the logits of steps [first_step, first_step + n_steps)
  // of the last Generate (step i ran position i; generated token j was picked
  // by step n_prompt - 1 + j), rows of n_vocab, in one readback.
  absl::StatusOr<std::vector<float>> ReadLogitsRecord(int first_step, int n_steps);
  // The walk of one step as the engine runs it (S = 1).
  StepWalk Walk() const;

 private:
  struct Impl;
  explicit CudaEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moegraph
