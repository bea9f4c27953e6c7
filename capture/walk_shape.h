// The launches of one decode step at a model file's shape, without a device and
// without reading a weight (`moegraph inspect --walk`): for each kernel entry of
// the walk the CUDA engine would build (capture/walk.h), the kernel it
// launches, its grid and block as the launcher computes them
// (kernels/launch_geometry.h, kernels/mmvq_math.h) and the weight bytes it
// reads per token. tests/walk_shape_test.cc holds the rows to the launches the
// engine makes under the emulator; tests/walk_bandwidth_test.py holds them, at the
// Qwen3-30B-A3B shape, to the occupancy and bytes in flight a matvec needs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "capture/doors.h"
#include "capture/walk.h"
#include "loader/model_config.h"

namespace moegraph {

struct WalkShapeOptions {
  // kResident, or kGraph: the device policy with every door at its default.
  Arm arm = Arm::kGraph;
  int32_t slots = 0;  // the graph arm's --slots; 0: auto. Grids do not depend on it.
  int max_ctx = 4096;  // --ctx: the attention's splits
  KvCacheType kv_type = KvCacheType::kF16;
};

struct WalkLaunch {
  int layer = -1;  // -1 outside the layers
  StepOp op = StepOp::kEmbed;
  std::string kernel;  // the __global__ function
  // What picks its code: grouped_matvec_kernel's weight type,
  // attention_split_kernel's KV element (f16, f32); qkv_kernel's weight
  // types and chained_matvec_kernel's (its first launch's, "pair q4_K" for a
  // gate/up pair, and its second's; a block-uniform switch); else empty.
  std::string instance;
  dim3 grid;
  dim3 block;
  uint64_t weight_bytes = 0;  // bytes of weight tensors the launch reads per token
};

// "grouped_matvec_kernel<q4_K>", "qkv_kernel (q4_K, q4_K, q6_K)", "sample_kernel".
std::string KernelLabel(const WalkLaunch& launch);

struct WalkShape {
  StepWalk walk;  // one step, no callables: what the launches follow
  std::vector<WalkLaunch> launches;  // its kernel entries, in walk order
};

// Whether the CUDA engine takes config's Gated DeltaNet layers, if it has any
// (delta_net_mix_supports); the error names the keys: the engine's and inspect's.
absl::Status CheckDeltaNetShape(const ModelConfig& config);

// Whether the CUDA router's top-k takes config's experts and top-k
// (router_topk_fits, kernels/moe_math.h); the error names the keys.
absl::Status CheckRouterShape(const ModelConfig& config);

// Per layer, whether its shared expert rides the CUDA expert passes as rank k
// (ExpertRanks::shared): a MoE layer whose shared gate, up and down have its
// routed experts' types and shapes, and no expert biases. Then its gate/up and
// down are no launches of their own (2 kernel nodes fewer a layer). The engine
// and inspect --walk both decide by it.
std::vector<bool> SharedExpertInPasses(const Model& model);

// Per layer, whether the router's launch computes the shared expert's gate
// logit as its last row (RouterEpilogue::shared_gate_row): a gate of the
// router's type and row length (both f32 in llama-quantize's files, which never
// quantize ffn_gate_inp tensors). One kernel node fewer a layer.
std::vector<bool> SharedGateInRouter(const Model& model);

// Errors name the flag (--arm, --slots, --ctx, --kv-type) or the tensor a
// kernel does not take, as the engine would refuse it.
absl::StatusOr<WalkShape> ShapeWalk(const Model& model, const WalkShapeOptions& options);

// A markdown table `layer | kernel | grid | block | weight bytes` (grid and
// block as x,y,z), then the kernel nodes of each layer and the step's totals.
std::string FormatWalkShape(const WalkShape& shape);

}  // namespace moegraph
