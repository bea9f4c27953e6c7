#include "capture/walk_shape.h"

#include <iterator>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kernels/launch_geometry.h"
#include "kernels/mmvq_math.h"
#include "kernels/moe_math.h"
#include "loader/check.h"
#include "loader/status_util.h"

namespace moegraph {
namespace {

// A weight matrix as the header gives it; for an expert, one expert's slice.
struct Matrix {
  std::string name;  // the tensor's, for errors
  GgmlType type = GgmlType::kF32;
  int64_t rows = 0, cols = 0;
  uint64_t bytes = 0;
};

Matrix Of(const std::string& name, const WeightView& v) {
  return {name, v.type, v.rows, v.cols, static_cast<uint64_t>(v.rows) * v.row_bytes};
}
Matrix Of(const GgufTensor* t) { return Of(t->name, weight_view(*t)); }

std::string TypeName(GgmlType type) { return ggml_type_name(static_cast<uint32_t>(type)); }

// What launch_matvec (and the rest of kernels/matvec.cu) refuses, named.
absl::Status MatvecTakes(const Matrix& m) {
  if (grouped_matvec_supports(m.type, m.cols)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s: the CUDA matvec does not take %s rows of %d", m.name, TypeName(m.type), m.cols));
}

// The one expert of layer's projection, merged or legacy storage alike.
Matrix Expert(const Model& model, int layer, ExpertProj proj) {
  const LayerTensors& l = model.layers[static_cast<size_t>(layer)];
  const GgufTensor* merged = proj == ExpertProj::kGate ? l.gate_exps
                             : proj == ExpertProj::kUp ? l.up_exps
                                                       : l.down_exps;
  const auto& legacy = proj == ExpertProj::kGate ? l.gate_legacy
                        : proj == ExpertProj::kUp ? l.up_legacy
                                                  : l.down_legacy;
  return Of(merged != nullptr ? merged->name : legacy[0]->name, model.expert(layer, proj, 0));
}

class Shaper {
 public:
  Shaper(const Model& model, const WalkShapeOptions& options, const WalkConfig& walk)
      : model_(model), c_(model.config), options_(options), walk_(walk) {}

  absl::StatusOr<WalkLaunch> Launch(const WalkEntry& e) const {
    const LayerTensors* l =
        e.layer >= 0 ? &model_.layers[static_cast<size_t>(e.layer)] : nullptr;
    const int32_t k = c_.n_expert_used;
    // The expert passes' ranks: k, and the shared expert where it rides them
    // (ShapeWalk sets both per-layer lists).
    const int32_t pass_ranks =
        k + (e.layer >= 0 && walk_.shared_expert_in_passes[static_cast<size_t>(e.layer)] ? 1 : 0);
    switch (e.op) {
      case StepOp::kEmbed: {
        // One row of the table per token.
        WalkLaunch launch = Plain(e, "embed_kernel", embed_launch_geometry());
        launch.weight_bytes = weight_view(*model_.token_embd).row_bytes;
        return launch;
      }
      case StepOp::kQkv:
        return Projections(e, {Of(l->wq), Of(l->wk), Of(l->wv)});
      case StepOp::kAttention: {
        WalkLaunch launch =
            Plain(e, "attention_split_kernel",
                  attention_decode_launch_geometry(c_.n_head, c_.n_head_kv, options_.max_ctx));
        launch.instance = options_.kv_type == KvCacheType::kF16 ? "f16" : "f32";
        return launch;
      }
      case StepOp::kAttnOut:
        return Matvec(e, Of(c_.mixer(e.layer) == LayerMixer::kDeltaNet ? l->delta_net.out : l->wo));
      case StepOp::kDeltaNetProj:
        return Projections(e, {Of(l->delta_net.qkv), Of(l->delta_net.gate),
                               Of(l->delta_net.alpha), Of(l->delta_net.beta)});
      case StepOp::kDeltaNetMix:
        return Plain(e, "delta_net_mix_kernel",
                     delta_net_mix_launch_geometry(c_.delta_net.n_v_heads,
                                                   c_.delta_net.head_dim));
      case StepOp::kRouter:
        return Matvec(e, Router(e.layer));
      case StepOp::kAttnOutRouter:
        return Chain(e, Of(c_.mixer(e.layer) == LayerMixer::kDeltaNet ? l->delta_net.out : l->wo),
                     1, Router(e.layer));
      case StepOp::kResidencyStep:
        return Doors{}.policy == ResidencyPolicy::kHazard
                   ? Plain(e, "hazard_step_kernel", hazard_step_launch_geometry())
                   : Plain(e, "residency_step_kernel", residency_step_launch_geometry());
      case StepOp::kStageAllSlots:
        return Plain(e, "stage_all_slots_kernel", rank_threads_launch_geometry());
      // Copies from host memory over PCIe: no weight bytes from device memory.
      case StepOp::kStageCopy:
        return Plain(e, "stage_copy_kernel", stage_copy_launch_geometry(k));
      // Each pass's grid covers all its ranks; a block whose rank is in another
      // pass exits, so a split pass reads at most the experts counted here.
      case StepOp::kGateUpHits:
      case StepOp::kGateUpMisses:
      case StepOp::kGateUpAll:
      case StepOp::kGateUpReady:
        return Pair(e, Expert(model_, e.layer, ExpertProj::kGate),
                    Expert(model_, e.layer, ExpertProj::kUp), pass_ranks);
      case StepOp::kDownHits:
      case StepOp::kDownMisses:
      case StepOp::kDownAll:
      case StepOp::kDownReady:
        return Matvec(e, Expert(model_, e.layer, ExpertProj::kDown), pass_ranks);
      case StepOp::kExpertFfnAll:
      case StepOp::kExpertFfnReady: {
        const Matrix gate = Expert(model_, e.layer, ExpertProj::kGate);
        const Matrix up = Expert(model_, e.layer, ExpertProj::kUp);
        MG_RETURN_IF_ERROR(Pair(e, gate, up, pass_ranks).status());
        return Chain(e, gate, 2, Expert(model_, e.layer, ExpertProj::kDown), pass_ranks,
                     up.bytes);
      }
      case StepOp::kShexpGateUp:
        return Pair(e, Of(l->shexp_gate), Of(l->shexp_up), 1);
      case StepOp::kShexpDown:
        return Matvec(e, Of(l->shexp_down));
      case StepOp::kShexpLogit:
        return Matvec(e, Of(l->shexp_gate_inp));
      case StepOp::kDenseGateUp:
        return Pair(e, Of(l->ffn_gate), Of(l->ffn_up), 1);
      case StepOp::kDenseDown:
        return Matvec(e, Of(l->ffn_down));
      case StepOp::kLmHead:
        return Matvec(e, Of(model_.output));
      case StepOp::kRecordLogits:
        return Plain(e, "record_logits_kernel", record_logits_launch_geometry(c_.n_vocab));
      case StepOp::kSample:
        return Plain(e, "sample_kernel", sample_launch_geometry(c_.n_vocab));
      case StepOp::kRoutingStepEnd:
        return Plain(e, "routing_step_end_kernel", routing_step_end_launch_geometry());
      // Not kernels (ShapeWalk passes only kernel entries).
      case StepOp::kHostReadSelection:
      case StepOp::kHostWaitSelection:
      case StepOp::kHostPolicyStep:
      case StepOp::kHostWriteSlots:
      case StepOp::kForkRecord:
      case StepOp::kForkWait:
      case StepOp::kHostStageCopy:
      case StepOp::kJoinRecord:
      case StepOp::kJoinWait:
      case StepOp::kTokenCopy:
        break;
    }
    MG_CHECK(false, "ShapeWalk: a kernel op without a shape");
    return absl::InternalError("unreachable");
  }

 private:
  static WalkLaunch Plain(const WalkEntry& e, const char* kernel, const LaunchGeometry& g) {
    WalkLaunch launch;
    launch.layer = e.layer;
    launch.op = e.op;
    launch.kernel = kernel;
    launch.grid = g.grid;
    launch.block = g.block;
    return launch;
  }

  // ranks copies of m (the experts of a pass), one grouped_matvec_kernel.
  static absl::StatusOr<WalkLaunch> Matvec(const WalkEntry& e, const Matrix& m,
                                           int32_t ranks = 1) {
    MG_RETURN_IF_ERROR(MatvecTakes(m));
    WalkLaunch launch = Plain(e, "grouped_matvec_kernel",
                              matvec_launch_geometry(m.type, m.rows, m.cols, ranks));
    launch.instance = TypeName(m.type);
    launch.weight_bytes = m.bytes * static_cast<uint64_t>(ranks);
    return launch;
  }

  // A gate/up pair: one launch on gate's geometry, both matrices read.
  static absl::StatusOr<WalkLaunch> Pair(const WalkEntry& e, const Matrix& gate, const Matrix& up,
                                         int32_t ranks) {
    if (gate.type != up.type || gate.rows != up.rows || gate.cols != up.cols) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s (%s, %d x %d) and %s (%s, %d x %d): the CUDA gate/up pair takes one type and shape",
          gate.name, TypeName(gate.type), gate.rows, gate.cols, up.name, TypeName(up.type), up.rows,
          up.cols));
    }
    MG_ASSIGN_OR_RETURN(WalkLaunch launch, Matvec(e, gate, ranks));
    launch.weight_bytes += up.bytes * static_cast<uint64_t>(ranks);
    return launch;
  }

  // The router's matrix, with the shared expert's gate row where it rides it.
  Matrix Router(int layer) const {
    Matrix router = Of(model_.layers[static_cast<size_t>(layer)].router);
    if (walk_.shared_gate_in_router[static_cast<size_t>(layer)]) {
      router.rows += 1;
      router.bytes += Of(model_.layers[static_cast<size_t>(layer)].shexp_gate_inp).bytes;
    }
    return router;
  }

  // first (on its geometry; first_extra: a pair's second matrix's bytes) then
  // second, over ranks, in one chained_matvec_kernel launch
  // (launch_expert_ffn, launch_matvec_residual_router).
  static absl::StatusOr<WalkLaunch> Chain(const WalkEntry& e, const Matrix& first, int first_m,
                                          const Matrix& second, int32_t ranks = 1,
                                          uint64_t first_extra = 0) {
    MG_RETURN_IF_ERROR(MatvecTakes(first));
    MG_RETURN_IF_ERROR(MatvecTakes(second));
    WalkLaunch launch =
        Plain(e, "chained_matvec_kernel",
              chained_matvec_launch_geometry(first.type, first.rows, first.cols, second.type,
                                             second.rows, second.cols, ranks));
    launch.instance = absl::StrCat(first_m == 2 ? "pair " : "", TypeName(first.type), ", ",
                                   TypeName(second.type));
    launch.weight_bytes = (first.bytes + first_extra + second.bytes) * static_cast<uint64_t>(ranks);
    return launch;
  }

  // Matrices of one input in one qkv_kernel launch (launch_qkv,
  // launch_projections), after the layer's attn_norm blocks.
  static absl::StatusOr<WalkLaunch> Projections(const WalkEntry& e, const std::vector<Matrix>& m) {
    std::vector<GgmlType> types;
    std::vector<int64_t> rows;
    std::vector<std::string> names;
    uint64_t bytes = 0;
    for (const Matrix& j : m) {
      MG_RETURN_IF_ERROR(MatvecTakes(j));
      // mxfp4 is left out of qkv_kernel's switch (qkv_supports_type).
      if (j.type == GgmlType::kMXFP4 || j.cols != m[0].cols) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: qkv_kernel does not take %s rows of %d", j.name, TypeName(j.type), j.cols));
      }
      types.push_back(j.type);
      rows.push_back(j.rows);
      names.push_back(TypeName(j.type));
      bytes += j.bytes;
    }
    WalkLaunch launch =
        Plain(e, "qkv_kernel",
              qkv_launch_geometry(types.data(), rows.data(), static_cast<int>(m.size()),
                                  m[0].cols, /*input_norm=*/true));
    launch.instance = absl::StrJoin(names, ", ");
    launch.weight_bytes = bytes;
    return launch;
  }

  const Model& model_;
  const ModelConfig& c_;
  const WalkShapeOptions& options_;
  const WalkConfig& walk_;
};

bool SameView(const WeightView& a, const WeightView& b) {
  return a.type == b.type && a.rows == b.rows && a.cols == b.cols && a.row_bytes == b.row_bytes;
}

// What the engine refuses of the options, by flag, before it allocates.
absl::Status CheckOptions(const ModelConfig& c, const WalkShapeOptions& o) {
  if (o.arm != Arm::kResident && o.arm != Arm::kGraph) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--arm ", Av(ArmName(o.arm)), ": inspect --walk shows the resident and graph arms"));
  }
  if (o.slots < 0 || (o.slots > 0 && o.slots < c.n_expert_used)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--slots %d must be auto (0) or at least the model's top-k %d", o.slots, c.n_expert_used));
  }
  if (o.arm == Arm::kResident && o.slots != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--slots %d: the resident arm holds every expert (%d), no slot count",
                        o.slots, c.n_moe_layer() * c.n_expert));
  }
  if (o.max_ctx < 1 ||
      attention_decode_launch_geometry(c.n_head, c.n_head_kv, o.max_ctx).grid.y > 65535) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--ctx %d: the attention takes 1 to %d positions", o.max_ctx,
        65535 * kAttentionSplitPositions));
  }
  if (c.head_dim > 256 || c.n_head % c.n_head_kv != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the CUDA attention takes a head_dim of at most 256 and whole GQA groups (this model: "
        "%d, %d heads over %d)",
        c.head_dim, c.n_head, c.n_head_kv));
  }
  if (o.kv_type == KvCacheType::kF16 && c.head_dim % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--kv-type f16: the CUDA attention reads an f16 cache in 8-element loads and this "
        "model's head_dim is %d",
        c.head_dim));
  }
  MG_RETURN_IF_ERROR(CheckDeltaNetShape(c));
  return CheckRouterShape(c);
}

std::string Dims(const dim3& d) { return absl::StrCat(d.x, ",", d.y, ",", d.z); }

}  // namespace

std::vector<bool> SharedExpertInPasses(const Model& model) {
  const ModelConfig& c = model.config;
  std::vector<bool> in_passes(static_cast<size_t>(c.n_layer), false);
  for (int l = 0; l < c.n_layer; ++l) {
    const LayerTensors& t = model.layers[static_cast<size_t>(l)];
    if (!c.moe_layer(l) || t.shexp_gate == nullptr || t.shexp_up == nullptr ||
        t.shexp_down == nullptr || t.gate_exps_b != nullptr || t.up_exps_b != nullptr ||
        t.down_exps_b != nullptr) {
      continue;
    }
    in_passes[static_cast<size_t>(l)] =
        SameView(weight_view(*t.shexp_gate), model.expert(l, ExpertProj::kGate, 0)) &&
        SameView(weight_view(*t.shexp_up), model.expert(l, ExpertProj::kUp, 0)) &&
        SameView(weight_view(*t.shexp_down), model.expert(l, ExpertProj::kDown, 0));
  }
  return in_passes;
}

std::vector<bool> SharedGateInRouter(const Model& model) {
  const ModelConfig& c = model.config;
  std::vector<bool> in_router(static_cast<size_t>(c.n_layer), false);
  for (int l = 0; l < c.n_layer; ++l) {
    const LayerTensors& t = model.layers[static_cast<size_t>(l)];
    if (t.router == nullptr || t.shexp_gate_inp == nullptr) continue;
    const WeightView router = weight_view(*t.router), gate = weight_view(*t.shexp_gate_inp);
    in_router[static_cast<size_t>(l)] = gate.rows == 1 && router.type == gate.type &&
                                        router.cols == gate.cols &&
                                        router.row_bytes == gate.row_bytes;
  }
  return in_router;
}

absl::Status CheckDeltaNetShape(const ModelConfig& c) {
  const DeltaNetShape& dn = c.delta_net;
  if (c.n_kv_layers() == c.n_layer ||
      delta_net_mix_supports(dn.n_k_heads, dn.n_v_heads, dn.head_dim, dn.d_conv)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "the CUDA Gated DeltaNet takes ssm.state_size a multiple of 32 up to %d, ssm.conv_kernel "
      "2 to %d and ssm.time_step_rank a multiple of ssm.group_count (this model: %d, %d, %d "
      "value heads over %d)",
      kDeltaNetMaxHeadDim, kDeltaNetMaxConv, dn.head_dim, dn.d_conv, dn.n_v_heads,
      dn.n_k_heads));
}

absl::Status CheckRouterShape(const ModelConfig& c) {
  if (c.n_expert == 0 || router_topk_fits(c.n_expert, c.n_expert_used)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "the CUDA router takes expert_count at most %d, expert_used_count at most %d, and "
      "expert_used_count x ceil(expert_count / %d) at most %d (this model: %d experts, top-%d)",
      kMaxRouterExperts, kMaxTopK, kRouterThreads, kRouterThreads, c.n_expert, c.n_expert_used));
}

std::string KernelLabel(const WalkLaunch& launch) {
  if (launch.instance.empty()) return launch.kernel;
  // qkv_kernel and chained_matvec_kernel take their types from a switch per
  // block.
  if (launch.kernel == "qkv_kernel" || launch.kernel == "chained_matvec_kernel") {
    return absl::StrCat(launch.kernel, " (", launch.instance, ")");
  }
  return absl::StrCat(launch.kernel, "<", launch.instance, ">");
}

absl::StatusOr<WalkShape> ShapeWalk(const Model& model, const WalkShapeOptions& options) {
  const ModelConfig& c = model.config;
  MG_RETURN_IF_ERROR(CheckOptions(c, options));
  // The walk the engine runs for one step of the arm, its doors at their defaults.
  const Doors doors;
  WalkShape shape;
  WalkConfig config = ModelWalkConfig(
      c, options.arm == Arm::kResident ? SlotMode::kResident : SlotMode::kDevicePolicy,
      doors.split_passes, doors.chained_matvecs, doors.programmatic_launch);
  config.shared_expert_in_passes = SharedExpertInPasses(model);
  config.shared_gate_in_router = SharedGateInRouter(model);
  shape.walk = BuildWalk(config);
  const Shaper shaper(model, options, shape.walk.config);
  for (const WalkEntry& entry : shape.walk.entries) {
    if (entry.kind != EntryKind::kKernel) continue;
    MG_ASSIGN_OR_RETURN(WalkLaunch launch, shaper.Launch(entry));
    shape.launches.push_back(std::move(launch));
  }
  return shape;
}

std::string FormatWalkShape(const WalkShape& shape) {
  std::string out =
      "| layer | kernel | grid | block | weight bytes |\n| --- | --- | --- | --- | ---: |\n";
  uint64_t bytes = 0;
  std::map<int, int> nodes;  // per layer
  for (const WalkLaunch& l : shape.launches) {
    absl::StrAppend(&out, "| ", l.layer < 0 ? "-" : absl::StrCat(l.layer), " | ", KernelLabel(l),
                    " | ", Dims(l.grid), " | ", Dims(l.block), " | ", l.weight_bytes, " |\n");
    bytes += l.weight_bytes;
    if (l.layer >= 0) ++nodes[l.layer];
  }
  // Runs of layers with the same count, one line each.
  absl::StrAppend(&out, "\nkernel nodes per layer:\n");
  for (auto it = nodes.begin(); it != nodes.end();) {
    auto end = it;
    while (std::next(end) != nodes.end() && std::next(end)->second == it->second) ++end;
    const std::string layers = it == end ? absl::StrCat("layer ", it->first)
                                         : absl::StrCat("layers ", it->first, "-", end->first);
    absl::StrAppend(&out, "  ", layers, ": ", it->second, "\n");
    it = std::next(end);
  }
  absl::StrAppendFormat(&out, "step: %d kernel launches, %d weight bytes (%.2f MiB)\n",
                        shape.launches.size(), bytes, bytes / (1024.0 * 1024.0));
  return out;
}

}  // namespace moegraph
