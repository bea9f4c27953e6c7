#include "capture/walk.h"

#include "absl/strings/str_cat.h"
#include "loader/check.h"
#include "loader/status_util.h"

namespace moegraph {
namespace {

struct OpInfo {
  StepOp op;
  std::string_view name;
  EntryKind kind;
  WalkStream stream;
};

constexpr OpInfo kOps[] = {
    {StepOp::kEmbed, "embed", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kQkv, "qkv", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kAttention, "attention", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kAttnOut, "attn_out", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kDeltaNetProj, "delta_net_proj", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kDeltaNetMix, "delta_net_mix", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kRouter, "router", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kResidencyStep, "residency_step", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kStageAllSlots, "stage_all_slots", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kHostReadSelection, "host_read_selection", EntryKind::kMemcpyD2H, WalkStream::kMain},
    {StepOp::kHostWaitSelection, "host_wait_selection", EntryKind::kHostSync, WalkStream::kMain},
    {StepOp::kHostPolicyStep, "host_policy_step", EntryKind::kHostWork, WalkStream::kMain},
    {StepOp::kHostWriteSlots, "host_write_slots", EntryKind::kMemcpyH2D, WalkStream::kMain},
    {StepOp::kForkRecord, "fork_record", EntryKind::kEventRecord, WalkStream::kMain},
    {StepOp::kForkWait, "fork_wait", EntryKind::kEventWait, WalkStream::kCopy},
    {StepOp::kStageCopy, "stage_copy", EntryKind::kKernel, WalkStream::kCopy},
    {StepOp::kHostStageCopy, "host_stage_copy", EntryKind::kMemcpyH2D, WalkStream::kCopy},
    {StepOp::kJoinRecord, "join_record", EntryKind::kEventRecord, WalkStream::kCopy},
    {StepOp::kJoinWait, "join_wait", EntryKind::kEventWait, WalkStream::kMain},
    {StepOp::kGateUpHits, "gate_up_hits", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kDownHits, "down_hits", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kGateUpMisses, "gate_up_misses", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kDownMisses, "down_misses", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kGateUpAll, "gate_up_all", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kDownAll, "down_all", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kGateUpReady, "gate_up_ready", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kDownReady, "down_ready", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kAttnOutRouter, "attn_out_router", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kExpertFfnAll, "expert_ffn_all", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kExpertFfnReady, "expert_ffn_ready", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kShexpGateUp, "shexp_gate_up", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kShexpDown, "shexp_down", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kShexpLogit, "shexp_logit", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kDenseGateUp, "dense_gate_up", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kDenseDown, "dense_down", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kLmHead, "lm_head", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kRecordLogits, "record_logits", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kSample, "sample", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kRoutingStepEnd, "routing_step_end", EntryKind::kKernel, WalkStream::kMain},
    {StepOp::kTokenCopy, "token_copy", EntryKind::kMemcpyD2H, WalkStream::kMain},
};

const OpInfo& Info(StepOp op) {
  const OpInfo& info = kOps[static_cast<size_t>(op)];
  MG_CHECK(info.op == op, "walk: kOps is out of order with StepOp");
  return info;
}

// Appends entries of one step to a walk.
class WalkWriter {
 public:
  WalkWriter(StepWalk& walk, const WalkBinder& bind) : walk_(walk), bind_(bind) {}

  void Add(StepOp op, int step, int layer = -1) { Add(op, StepOpStream(op), step, layer); }

  void Add(StepOp op, WalkStream stream, int step, int layer) {
    WalkEntry entry;
    entry.op = op;
    entry.kind = StepOpKind(op);
    entry.stream = stream;
    entry.step = step;
    entry.layer = layer;
    if (bind_) entry.enqueue = bind_(entry);
    walk_.entries.push_back(std::move(entry));
  }

 private:
  StepWalk& walk_;
  const WalkBinder& bind_;
};

// The layer's token mixer, ending in its output projection's residual add
// (with_router: and the MoE router chained to it, chained_matvecs).
void AddMixer(const WalkConfig& c, WalkWriter& w, int step, int layer, bool with_router) {
  const bool delta_net = !c.mixers.empty() &&
                         c.mixers[static_cast<size_t>(layer)] == LayerMixer::kDeltaNet;
  w.Add(delta_net ? StepOp::kDeltaNetProj : StepOp::kQkv, step, layer);
  w.Add(delta_net ? StepOp::kDeltaNetMix : StepOp::kAttention, step, layer);
  w.Add(with_router ? StepOp::kAttnOutRouter : StepOp::kAttnOut, step, layer);
}

bool LayerFlag(const std::vector<bool>& flags, int layer) {
  return !flags.empty() && flags[static_cast<size_t>(layer)];
}

// The shared expert's own launches: its gate/up and down unless it rides the
// expert passes, its gate logit unless the router computes it.
void AddSharedExpert(const WalkConfig& c, WalkWriter& w, int step, int layer) {
  if (!c.shared_expert) return;
  if (!LayerFlag(c.shared_expert_in_passes, layer)) {
    w.Add(StepOp::kShexpGateUp, step, layer);
    w.Add(StepOp::kShexpDown, step, layer);
  }
  if (c.shared_expert_gated && !LayerFlag(c.shared_gate_in_router, layer)) {
    w.Add(StepOp::kShexpLogit, step, layer);
  }
}

// The one expert pass over every rank: gate/up and down, or both in one
// launch (chained_matvecs); ready: right after the stage copy, missed ranks waiting
// for their flags.
void AddOnePass(const WalkConfig& c, WalkWriter& w, int step, int layer, bool ready) {
  if (c.chained_matvecs) {
    w.Add(ready ? StepOp::kExpertFfnReady : StepOp::kExpertFfnAll, step, layer);
    return;
  }
  w.Add(ready ? StepOp::kGateUpReady : StepOp::kGateUpAll, step, layer);
  w.Add(ready ? StepOp::kDownReady : StepOp::kDownAll, step, layer);
}

void AddMoe(const WalkConfig& c, WalkWriter& w, int step, int layer) {
  if (!c.chained_matvecs) w.Add(StepOp::kRouter, step, layer);
  if (c.slot_mode == SlotMode::kResident) {
    // Nothing to copy, so nothing to overlap: one pass over every rank, each
    // found in the slot its key names (no slot decision).
    AddSharedExpert(c, w, step, layer);
    AddOnePass(c, w, step, layer, /*ready=*/false);
  } else {
    if (c.slot_mode == SlotMode::kHostPolicy) {
      for (StepOp op : {StepOp::kHostReadSelection, StepOp::kHostWaitSelection,
                        StepOp::kHostPolicyStep, StepOp::kHostWriteSlots}) {
        w.Add(op, step, layer);
      }
    } else {
      w.Add(c.slot_mode == SlotMode::kStageAll ? StepOp::kStageAllSlots : StepOp::kResidencyStep,
            step, layer);
    }
    if (OnePassWaitsForCopies(c)) {
      AddSharedExpert(c, w, step, layer);
      w.Add(StepOp::kStageCopy, WalkStream::kMain, step, layer);
      AddOnePass(c, w, step, layer, /*ready=*/true);
      return;
    }
    w.Add(StepOp::kForkRecord, step, layer);
    w.Add(StepOp::kForkWait, step, layer);
    w.Add(c.slot_mode == SlotMode::kHostPolicy ? StepOp::kHostStageCopy : StepOp::kStageCopy,
          step, layer);
    w.Add(StepOp::kJoinRecord, step, layer);
    // Stage-all misses every rank: a hits pass would have nothing to do.
    const bool split = c.split_passes && c.slot_mode != SlotMode::kStageAll;
    if (split) {
      w.Add(StepOp::kGateUpHits, step, layer);
      w.Add(StepOp::kDownHits, step, layer);
    }
    AddSharedExpert(c, w, step, layer);
    w.Add(StepOp::kJoinWait, step, layer);
    if (split) {
      w.Add(StepOp::kGateUpMisses, step, layer);
      w.Add(StepOp::kDownMisses, step, layer);
    } else {
      AddOnePass(c, w, step, layer, /*ready=*/false);
    }
  }
}

}  // namespace

WalkConfig ModelWalkConfig(const ModelConfig& cfg, SlotMode slot_mode, bool split_passes,
                           bool chained_matvecs, bool programmatic_launch) {
  WalkConfig c;
  c.n_layer = cfg.n_layer;
  c.slot_mode = slot_mode;
  c.split_passes = split_passes;
  c.chained_matvecs = chained_matvecs;
  c.programmatic_launch = programmatic_launch;
  c.shared_expert = cfg.n_ff_shexp > 0;
  c.shared_expert_gated = cfg.shexp_gated;
  c.n_dense_lead = cfg.n_layer_dense_lead;
  c.mixers = cfg.mixers;
  return c;
}

bool OnePassWaitsForCopies(const WalkConfig& config) {
  return !config.split_passes &&
         (config.slot_mode == SlotMode::kDevicePolicy || config.slot_mode == SlotMode::kStageAll);
}

std::string_view StepOpName(StepOp op) { return Info(op).name; }
EntryKind StepOpKind(StepOp op) { return Info(op).kind; }
WalkStream StepOpStream(StepOp op) { return Info(op).stream; }
int StepOpLaunches(StepOp op) { return StepOpKind(op) == EntryKind::kKernel ? 1 : 0; }

std::string EntryLabel(const WalkEntry& entry) {
  if (entry.layer < 0) return absl::StrCat("step ", entry.step, " ", Av(StepOpName(entry.op)));
  return absl::StrCat("step ", entry.step, " layer ", entry.layer, " ", Av(StepOpName(entry.op)));
}

StepWalk BuildWalk(const WalkConfig& config, const WalkBinder& bind) {
  MG_CHECK(config.n_layer > 0 && config.steps > 0, "BuildWalk: no layers or no steps");
  MG_CHECK(config.mixers.empty() || static_cast<int>(config.mixers.size()) == config.n_layer,
           "BuildWalk: a mixer list not of n_layer");
  for (const std::vector<bool>* flags :
       {&config.shared_expert_in_passes, &config.shared_gate_in_router}) {
    MG_CHECK(flags->empty() || static_cast<int>(flags->size()) == config.n_layer,
             "BuildWalk: a per-layer shared-expert list not of n_layer");
  }
  StepWalk walk;
  walk.config = config;
  WalkWriter w(walk, bind);
  for (int step = 0; step < config.steps; ++step) {
    w.Add(StepOp::kEmbed, step);
    for (int layer = 0; layer < config.n_layer; ++layer) {
      AddMixer(config, w, step, layer,
               /*with_router=*/config.chained_matvecs && layer >= config.n_dense_lead);
      if (layer < config.n_dense_lead) {
        w.Add(StepOp::kDenseGateUp, step, layer);
        w.Add(StepOp::kDenseDown, step, layer);
      } else {
        AddMoe(config, w, step, layer);
      }
    }
    w.Add(StepOp::kLmHead, step);
    if (config.record_logits) w.Add(StepOp::kRecordLogits, step);
    w.Add(StepOp::kSample, step);
    if (config.routing_step_end) w.Add(StepOp::kRoutingStepEnd, step);
  }
  w.Add(StepOp::kTokenCopy, config.steps - 1);
  return walk;
}

int KernelsInLayer(const StepWalk& walk, int layer) {
  int n = 0;
  for (const WalkEntry& entry : walk.entries) {
    if (entry.step == 0 && entry.layer == layer) n += StepOpLaunches(entry.op);
  }
  return n;
}

cudaError_t RunWalk(const StepWalk& walk, size_t* failed_entry) {
  for (size_t i = 0; i < walk.entries.size(); ++i) {
    const WalkEntry& entry = walk.entries[i];
    MG_CHECK(static_cast<bool>(entry.enqueue), "RunWalk: an entry without a callable");
    const cudaError_t err = entry.enqueue();
    if (err != cudaSuccess) {
      if (failed_entry != nullptr) *failed_entry = i;
      return err;
    }
  }
  return cudaSuccess;
}

}  // namespace moegraph
