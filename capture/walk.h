// The decode step as data: an ordered list of launches on two streams (main and
// copy) with fork/join events, built once per configuration. Eager mode runs the
// entries in order; graph mode runs the same entries inside a stream capture.
// Nothing in an entry depends on the token: every per-step value lives in device
// memory, so the list (and the graph captured from it) is never patched.
//
// Per MoE layer (device residency, the default one pass, chained launches):
//   main: qkv attention attn_out_router residency_step [shexp_*] stage_copy
//         expert_ffn_ready
// (with MOEGRAPH_CHAIN=0: attn_out router in place of attn_out_router, and
// the pass is two launches, gate_up_ready down_ready; likewise
// expert_ffn_all or gate_up_all down_all below; the walks below are the
// unchained ones).
// (a Gated DeltaNet layer, qwen35moe's: delta_net_proj delta_net_mix attn_out
// in place of qkv attention attn_out; its state stays in device memory).
// The stage copy runs on the main stream just before the pass: the pass's
// blocks start while it copies (programmatic launch: the copy's blocks are
// all running before any of the pass's starts, so a block waiting for a
// miss cannot keep the copy from the SMs), hit ranks at once, a missed rank's
// blocks once its flag says its expert is in its slot (kernels/copy_ready.cuh).
// With split passes (MOEGRAPH_SPLIT_PASSES=1, and the host arm) the misses
// copy on the copy stream between a fork and a join:
//   main: ... residency_step fork_record
//   copy:                    fork_wait stage_copy join_record
//   main: gate_up_hits down_hits [shexp_*] join_wait gate_up_misses down_misses
// What used to be launches of their own are epilogues of the op before them
// (kernels/epilogue.cuh): embed starts the step (its token and position);
// qkv (or the DeltaNet's projections) runs its layer's attn_norm in its first
// blocks, then each head's QK-norm, RoPE and KV append; attention merges its splits; attn_out adds into
// the residual stream and runs ffn_norm; router its top-k; the last down pass
// (down_misses, down_all, or the fused pass's down blocks) combines the ranks into the residual stream
// (after the last layer, then runs output_norm).
// (Routing replay or record adds routing_step_end after sample; the replay
// itself is the router's epilogue.)
// A leading dense layer (glm4moe) has dense_gate_up dense_down after attn_out
// instead, the down adding into the residual.
// Arms change only the slot decision (none on the resident arm, whose passes
// find each expert in the slot its key names; stage_all_slots; or the host
// arm's readback, host step and host copies) and which passes run (the
// host arm's copies join before its one pass, expert_ffn_all).
// Steps end with lm_head [record_logits] sample, whose last block also ends
// the step (the token into out_tokens, the step counter advanced); after the
// last of S steps the token leaves through one device-to-host copy.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <cuda_runtime_api.h>

#include "loader/model_config.h"

namespace moegraph {

enum class WalkStream { kMain, kCopy };

enum class EntryKind {
  kKernel,       // a launcher of kernels/kernels.h
  kEventRecord,  // cudaEventRecord
  kEventWait,    // cudaStreamWaitEvent
  kMemcpyD2H,    // device to pinned host
  kMemcpyH2D,    // pinned host to device
  kHostSync,     // the host waits for a stream
  kHostWork,     // host code between launches (the host arm's policy step)
};

enum class StepOp {
  kEmbed,  // also starts the step: its token and position (StepStart)
  kQkv,
  kAttention,
  kAttnOut,  // the token mixer's output projection (attention's or a Gated DeltaNet's)
  // A Gated DeltaNet layer's mixer in place of qkv and attention: its four
  // input projections in one launch, then the conv, the delta rule and the
  // gated norm (kernels/kernels.h: launch_delta_net_mix).
  kDeltaNetProj,
  kDeltaNetMix,
  kRouter,
  // The slot decision, one per arm.
  kResidencyStep,
  kStageAllSlots,
  kHostReadSelection,  // host arm: selection to pinned host memory
  kHostWaitSelection,  // host arm: the per-layer sync
  kHostPolicyStep,     // host arm: ResidencyCache::Step
  kHostWriteSlots,     // host arm: slot_of_rank and missed to the device
  // Misses, on the copy stream between the fork and the join.
  kForkRecord,
  kForkWait,
  kStageCopy,
  kHostStageCopy,  // host arm: cudaMemcpyAsync per missed block
  kJoinRecord,
  kJoinWait,
  // Expert passes (the same launchers for every pass; the last down combines).
  kGateUpHits,
  kDownHits,
  kGateUpMisses,
  kDownMisses,
  kGateUpAll,
  kDownAll,
  kGateUpReady,  // every rank, right after the stage copy on the main stream
  kDownReady,
  // Chained launches (MOEGRAPH_CHAIN, on by default): a MoE layer's attn_out
  // and router in one (launch_matvec_residual_router); the one pass's gate/up
  // and down in one (launch_expert_ffn), All's or Ready's.
  kAttnOutRouter,
  kExpertFfnAll,
  kExpertFfnReady,
  // The shared expert, overlapping the copies; its logit for qwen2moe's gate.
  kShexpGateUp,
  kShexpDown,
  kShexpLogit,
  // A leading dense layer's FFN.
  kDenseGateUp,
  kDenseDown,
  kLmHead,
  kRecordLogits,    // logits kept per step on the device (CudaEngineOptions::record_logits)
  kSample,          // the next token: the argmax, or a draw (CudaEngine::SetSampling)
  kRoutingStepEnd,  // routing replay or record: record the step's selection, advance the cursor
  kTokenCopy,
};

std::string_view StepOpName(StepOp op);  // "router", "stage_copy", ...
EntryKind StepOpKind(StepOp op);
WalkStream StepOpStream(StepOp op);
// Kernels one entry of op launches: 0 for events, copies and host work, else 1.
int StepOpLaunches(StepOp op);

// How the slots of a step's selection are decided.
enum class SlotMode {
  kDevicePolicy,  // residency_step on the device (graph and eager arms)
  kResident,      // every expert resident in the slot its key names, no copies
  kStageAll,      // stage-every-token: k scratch slots, every expert copied
  kHostPolicy,    // host arm: readback, host ResidencyCache, cudaMemcpyAsync
};

struct WalkConfig {
  int n_layer = 0;
  int steps = 1;  // S: consecutive steps in one walk (one host wait per walk)
  SlotMode slot_mode = SlotMode::kDevicePolicy;
  // Hits before the join, misses after it (the copy on the copy stream);
  // false: one pass, missed ranks waiting for their copy (the host arm: one
  // pass after the join).
  bool split_passes = false;
  // Chained launches (MOEGRAPH_CHAIN): in a MoE layer attn_out_router in
  // place of attn_out and router, and expert_ffn_all or expert_ffn_ready in
  // place of the one pass's gate_up_* down_*.
  bool chained_matvecs = false;
  // Kernels launched with programmatic dependent launch (MOEGRAPH_PDL, sm_90+).
  bool programmatic_launch = false;
  bool shared_expert = false;        // qwen2moe, glm4moe, qwen35moe
  bool shared_expert_gated = false;  // qwen2moe, qwen35moe: shexp_logit
  // Per layer (empty: none): the shared expert rides the expert passes as one
  // more rank (ExpertRanks::shared, capture/walk_shape.h's
  // SharedExpertInPasses), with no shexp_gate_up or shexp_down of its own.
  std::vector<bool> shared_expert_in_passes;
  // Per layer (empty: none): the shared expert's gate logit is the router's
  // last row (RouterEpilogue::shared_gate_row, SharedGateInRouter), with no
  // shexp_logit of its own.
  std::vector<bool> shared_gate_in_router;
  // Each layer's token mixer (empty: attention everywhere); a Gated DeltaNet
  // layer has delta_net_proj delta_net_mix in place of qkv attention.
  std::vector<LayerMixer> mixers;
  int n_dense_lead = 0;              // glm4moe: leading layers with a dense FFN
  // Routing replay and record (moegraph bench): routing_step_end after each
  // sample.
  bool routing_step_end = false;
  // record_logits after each lm_head.
  bool record_logits = false;
};

// One step's walk of a model on an arm (slot mode) with the doors that shape it:
// what the CUDA engine runs, and what `moegraph inspect --walk` describes
// (capture/walk_shape.h).
WalkConfig ModelWalkConfig(const ModelConfig& cfg, SlotMode slot_mode, bool split_passes,
                           bool chained_matvecs, bool programmatic_launch);

// Whether the cached arms' expert pass is the one pass after the stage copy on
// the main stream (kGateUpReady, kDownReady): the device arms without split
// passes. The host arm copies with cudaMemcpyAsync, which sets no flags.
bool OnePassWaitsForCopies(const WalkConfig& config);

// One launch. `enqueue` is supplied by the engine; a walk built without a binder
// (for tests of its shape) has none.
struct WalkEntry {
  StepOp op = StepOp::kEmbed;
  EntryKind kind = EntryKind::kKernel;
  WalkStream stream = WalkStream::kMain;
  int step = 0;    // 0 .. steps-1
  int layer = -1;  // -1 outside the layers
  std::function<cudaError_t()> enqueue;
};

// "step 1 layer 3 router" (no layer part outside the layers).
std::string EntryLabel(const WalkEntry& entry);

// Makes the callable of one entry (its op, step and layer are set).
using WalkBinder = std::function<std::function<cudaError_t()>(const WalkEntry& entry)>;

struct StepWalk {
  WalkConfig config;
  std::vector<WalkEntry> entries;
};

// Kernels `layer` launches in the first step of walk, on both streams (the
// kernel nodes a captured graph has for it).
int KernelsInLayer(const StepWalk& walk, int layer);

// The walk of config, every entry bound by bind (null: no callables).
StepWalk BuildWalk(const WalkConfig& config, const WalkBinder& bind = nullptr);

// Runs the entries in order; stops at the first error and reports it with the
// entry's index through failed_entry (when not null).
cudaError_t RunWalk(const StepWalk& walk, size_t* failed_entry = nullptr);

}  // namespace moegraph
