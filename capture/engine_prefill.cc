// The batched prefill (issue 20): a prompt in ubatches of up to -ub tokens,
// each layer once per ubatch. Dense projections are GEMMs through cuBLASLt
// (kernels/gemm.h; a quantized weight is dequantized to f16 into one tile
// first, as ggml-cuda's cuBLAS path does); norms, RoPE and the KV append run
// per row with the decode step's helpers; attention reads the cache split by
// split as the decode step does. The ubatch's routing is read back once per
// layer and planned on the host (residency/prefill_plan.h): each routed
// expert's tokens are gathered, its gate, up and down run as GEMMs over just
// those rows, from its slot where it is resident, else from a staging buffer
// of a two-buffer ring the copy stream fills (expert i + 1 copies while
// expert i computes). The outputs are combined per token in rank order.
//
// Prefill reads the slot tables and writes nothing a policy keeps: no
// admission, eviction or stamp, so the decode set survives any prompt.
// Only the last token's logits are computed; the token sampled from them ends
// the prompt as the T=1 path's last prompt step would.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "capture/engine_impl.h"
#include "kernels/dequant.h"
#include "residency/prefill_plan.h"

namespace moegraph {
namespace {

// Offsets of the prefill's buffers, laid out once for the budget and once for
// the allocation.
struct PrefillLayout : BufferLayout {
  size_t positions, x, h, h16, q, k, v, q_rope, attn, attn16, delta_net, router_logits, selection,
      weights, entries, xg, xg16, gate, up, act, act16, yg, expert_out, shexp_out, shexp_logit,
      tile, ring0, ring1;
};

int32_t UbatchOf(const CudaEngineOptions& options) {
  return std::max(1, std::min(options.ubatch, options.max_ctx));
}

// The largest block of any layer's experts: one ring buffer.
size_t LargestBlock(const Model& m) {
  size_t largest = 0;
  for (int l = m.config.n_layer_dense_lead; l < m.config.n_layer; ++l) {
    largest = std::max(largest, ExpertLayoutOf(m, l).block_bytes);
  }
  return largest;
}

PrefillLayout LayOut(const Model& m, const CudaEngineOptions& options) {
  const ModelConfig& cfg = m.config;
  const size_t t = static_cast<size_t>(UbatchOf(options));
  const size_t f = sizeof(float), hf = sizeof(uint16_t);
  const size_t embd = static_cast<size_t>(cfg.n_embd);
  const size_t q_len = static_cast<size_t>(cfg.n_head) * cfg.head_dim;
  const size_t kv_len = static_cast<size_t>(cfg.n_head_kv) * cfg.head_dim;
  const size_t kk = static_cast<size_t>(cfg.n_expert_used);
  const size_t ff = static_cast<size_t>(std::max({cfg.n_ff_exp, cfg.n_ff_shexp, cfg.n_ff_dense}));
  const MixerWidths widths(cfg);
  // The tile holds any one weight matrix of a layer, f16 (a Gated DeltaNet's
  // widest are its qkv and its ssm_out, value_dim x n_embd).
  const size_t tile = std::max({widths.q_rows * embd, widths.mixer_out * embd, kv_len * embd,
                                static_cast<size_t>(cfg.n_expert) * embd, ff * embd,
                                static_cast<size_t>(cfg.delta_net.conv_dim()) * embd});
  PrefillLayout p;
  p.positions = p.Add(static_cast<size_t>(options.max_ctx) * 4);
  p.x = p.Add(t * embd * f);
  p.h = p.Add(t * embd * f);
  p.h16 = p.Add(t * embd * hf);
  p.q = p.Add(t * widths.q_rows * f);
  p.k = p.Add(t * kv_len * f);
  p.v = p.Add(t * kv_len * f);
  p.q_rope = p.Add(t * q_len * f);
  p.attn = p.Add(t * widths.mixer_out * f);
  p.attn16 = p.Add(t * widths.mixer_out * hf);
  p.delta_net = p.Add(t * widths.delta_net_inputs * f);
  p.router_logits = p.Add(t * static_cast<size_t>(cfg.n_expert) * f);
  p.selection = p.Add(t * kk * 4);
  p.weights = p.Add(t * kk * f);
  p.entries = p.Add(t * kk * 4);
  p.xg = p.Add(t * embd * f);
  p.xg16 = p.Add(t * embd * hf);
  p.gate = p.Add(t * ff * f);
  p.up = p.Add(t * ff * f);
  p.act = p.Add(t * ff * f);
  p.act16 = p.Add(t * ff * hf);
  p.yg = p.Add(t * embd * f);
  p.expert_out = p.Add(t * kk * embd * f);
  p.shexp_out = p.Add(t * embd * f);
  p.shexp_logit = p.Add(t * f);
  p.tile = p.Add(tile * hf);
  const size_t ring_buffer = LargestBlock(m);
  p.ring0 = p.Add(ring_buffer);
  p.ring1 = p.Add(ring_buffer);
  return p;
}

absl::Status GemmStatus(cublasStatus_t status, std::string_view what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat("cuBLASLt (", GemmRunner::StatusName(status), ") in ", Av(what)));
}

// Projection proj of the expert block at base, as launch_matvec reads it.
DeviceMatrix ProjectionOf(const DeviceBlockLayout& layout, const uint8_t* base, int proj) {
  DeviceMatrix w;
  w.data = base + layout.offset[proj];
  w.type = layout.type[proj];
  w.rows = proj == 2 ? layout.n_embd : layout.n_ff;
  w.cols = proj == 2 ? layout.n_ff : layout.n_embd;
  w.row_bytes = layout.row_bytes[proj];
  return w;
}

}  // namespace

uint64_t PrefillBytes(const Model& m, const CudaEngineOptions& options) {
  return options.doors.batched_prefill ? LayOut(m, options).total : 0;
}

bool CudaEngine::Impl::BatchedPrefill() const {
  return prefill.ubatch > 0 && !options.record_routing &&
         options.routing_record_steps == 0 && !options.record_logits &&
         options.routing_trace == nullptr;
}

absl::Status CudaEngine::Impl::AllocatePrefill() {
  if (!options.doors.batched_prefill) return absl::OkStatus();
  PrefillState& p = prefill;
  // Without the library the prompts run as steps, and the banner says why.
  if (const cublasStatus_t status = p.gemm.Init(&p.unavailable);
      status != CUBLAS_STATUS_SUCCESS) {
    if (p.unavailable.empty()) return GemmStatus(status, "cublasLtCreate");
    return absl::OkStatus();
  }
  p.ubatch = UbatchOf(options);
  const PrefillLayout layout = LayOut(*model, options);
  MG_ASSIGN_OR_RETURN(p.device, CudaBuffer::Device(layout.total, "the prefill's ubatch"));
  uint8_t* base = p.device.as<uint8_t>();
  auto f32 = [base](size_t offset) { return reinterpret_cast<float*>(base + offset); };
  auto f16 = [base](size_t offset) { return reinterpret_cast<uint16_t*>(base + offset); };
  auto i32 = [base](size_t offset) { return reinterpret_cast<int32_t*>(base + offset); };
  int32_t* positions = i32(layout.positions);
  p.positions = positions;
  p.x = f32(layout.x);
  p.h = f32(layout.h);
  p.h16 = f16(layout.h16);
  p.q = f32(layout.q);
  p.k = f32(layout.k);
  p.v = f32(layout.v);
  p.q_rope = f32(layout.q_rope);
  p.attn = f32(layout.attn);
  p.attn16 = f16(layout.attn16);
  const DeltaNetShape& dn = cfg.delta_net;
  const int64_t ub = p.ubatch;
  p.dn_qkv = f32(layout.delta_net);
  p.dn_z = p.dn_qkv + ub * dn.conv_dim();
  p.dn_alpha = p.dn_z + ub * dn.value_dim();
  p.dn_beta = p.dn_alpha + ub * dn.n_v_heads;
  p.router_logits = f32(layout.router_logits);
  p.selection = i32(layout.selection);
  p.weights = f32(layout.weights);
  p.entries = i32(layout.entries);
  p.xg = f32(layout.xg);
  p.xg16 = f16(layout.xg16);
  p.gate = f32(layout.gate);
  p.up = f32(layout.up);
  p.act = f32(layout.act);
  p.act16 = f16(layout.act16);
  p.yg = f32(layout.yg);
  p.expert_out = f32(layout.expert_out);
  p.shexp_out = f32(layout.shexp_out);
  p.shexp_logit = f32(layout.shexp_logit);
  p.tile = f16(layout.tile);
  p.ring[0] = base + layout.ring0;
  p.ring[1] = base + layout.ring1;

  const size_t rows = static_cast<size_t>(p.ubatch) * cfg.n_expert_used;
  MG_ASSIGN_OR_RETURN(
      p.host, CudaBuffer::Pinned((2 * rows + cfg.n_expert) * 4, "the prefill's routing readback"));
  p.selection_host = p.host.as<int32_t>();
  p.entries_host = p.selection_host + rows;
  p.table_host = p.entries_host + rows;

  std::vector<int32_t> ids(static_cast<size_t>(options.max_ctx));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
  MG_RETURN_IF_ERROR(Upload(positions, ids.data(), ids.size() * 4, "the prefill's positions"));
  for (int b = 0; b < 2; ++b) {
    MG_RETURN_IF_ERROR(
        CudaStatus(cudaEventCreateWithFlags(&p.ring_ready[b], cudaEventDisableTiming),
                   "creating a ring event"));
    MG_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&p.ring_free[b], cudaEventDisableTiming),
                                  "creating a ring event"));
  }
  // The copy stream of a streamed expert waits for the main stream's last use
  // of its buffer; before any, there is none.
  for (int b = 0; b < 2; ++b) {
    MG_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(p.ring_free[b], main), "recording a ring event"));
  }
  return Sync("allocating the prefill");
}

absl::Status CudaEngine::Impl::Project(const DeviceMatrix& w, const float* x, const uint16_t* x16,
                                       int rows, float* y, bool accumulate, std::string_view what) {
  PrefillState& p = prefill;
  if (w.type == GgmlType::kF32) {
    return GemmStatus(
        p.gemm.Multiply(GemmType::kF32, w.data, w.rows, w.cols, x, rows, y, accumulate, main),
        what);
  }
  const int64_t n = static_cast<int64_t>(w.rows) * w.cols;
  if (w.row_bytes != ggml_row_size(w.type, w.cols)) {
    return absl::InternalError(absl::StrCat(Av(what), ": rows are not packed"));
  }
  const void* weights = w.data;
  if (w.type != GgmlType::kF16) {
    MG_RETURN_IF_ERROR(CudaStatus(launch_dequantize_f16(w.type, w.data, p.tile, n, main),
                                  absl::StrCat("dequantizing ", Av(what))));
    weights = p.tile;
  }
  return GemmStatus(
      p.gemm.Multiply(GemmType::kF16, weights, w.rows, w.cols, x16, rows, y, accumulate, main),
      what);
}

absl::Status CudaEngine::Impl::ReadLayerSlots(int layer) {
  const LayerExperts& e = layer_experts[static_cast<size_t>(layer)];
  DevicePool& pool = pools[static_cast<size_t>(e.size_class)];
  int32_t* out = prefill.table_host;
  const int32_t first = residency_key(e.local_layer, 0, cfg.n_expert);
  switch (slot_mode) {
    case SlotMode::kDevicePolicy:
      // Enqueued after the routing's readback: one wait for both.
      return CudaStatus(
          cudaMemcpyAsync(out, pool.policy_state.table.as<int32_t>() + first,
                          static_cast<size_t>(cfg.n_expert) * 4, cudaMemcpyDeviceToHost, main),
          "readback of the slot table");
    case SlotMode::kHostPolicy:
      std::copy_n(pool.host_cache->table().begin() + first, cfg.n_expert, out);
      return absl::OkStatus();
    case SlotMode::kResident:
      for (int32_t x = 0; x < cfg.n_expert; ++x) out[x] = first + x;
      return absl::OkStatus();
    case SlotMode::kStageAll:
      std::fill_n(out, cfg.n_expert, kNoSlot);
      return absl::OkStatus();
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::Impl::PrefillExperts(int layer, int rows) {
  PrefillState& p = prefill;
  const LayerWeights& w = layers[static_cast<size_t>(layer)];
  const LayerExperts& e = layer_experts[static_cast<size_t>(layer)];
  const DevicePool& pool = pools[static_cast<size_t>(e.size_class)];
  const int32_t top_k = cfg.n_expert_used;
  const int32_t embd = cfg.n_embd;
  const std::string name = absl::StrCat("prefill layer ", layer);

  MG_RETURN_IF_ERROR(
      Project(w.router, p.h, p.h16, rows, p.router_logits, false, absl::StrCat(name, " router")));
  MG_RETURN_IF_ERROR(
      CudaStatus(launch_router_topk_rows(p.router_logits, cfg.n_expert, rows,
                                         Router(layer, p.selection, p.weights), main),
                 absl::StrCat(name, " top-k")));
  const size_t n_sel = static_cast<size_t>(rows) * top_k;
  MG_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(p.selection_host, p.selection, n_sel * 4, cudaMemcpyDeviceToHost, main),
      "readback of the prefill's routing"));
  MG_RETURN_IF_ERROR(ReadLayerSlots(layer));
  // The shared expert runs while the host plans.
  const bool shexp = cfg.n_ff_shexp > 0;
  if (shexp) {
    const int64_t n_act = static_cast<int64_t>(rows) * cfg.n_ff_shexp;
    MG_RETURN_IF_ERROR(Project(w.shexp_gate, p.h, p.h16, rows, p.gate, false,
                               absl::StrCat(name, " shared expert gate")));
    MG_RETURN_IF_ERROR(Project(w.shexp_up, p.h, p.h16, rows, p.up, false,
                               absl::StrCat(name, " shared expert up")));
    MG_RETURN_IF_ERROR(
        CudaStatus(launch_swiglu_rows(p.gate, p.up, n_act, GluAct::kSilu, p.act, p.act16, main),
                   absl::StrCat(name, " shared expert swiglu")));
    MG_RETURN_IF_ERROR(Project(w.shexp_down, p.act, p.act16, rows, p.shexp_out, false,
                               absl::StrCat(name, " shared expert down")));
    if (cfg.shexp_gated) {
      MG_RETURN_IF_ERROR(Project(w.shexp_gate_inp, p.h, p.h16, rows, p.shexp_logit, false,
                                 absl::StrCat(name, " shared expert gate logit")));
    }
  }
  MG_RETURN_IF_ERROR(Sync("readback of the prefill's routing"));

  MG_ASSIGN_OR_RETURN(
      const PrefillLayerPlan plan,
      PlanPrefillLayer(absl::MakeConstSpan(p.selection_host, n_sel), top_k,
                       absl::MakeConstSpan(p.table_host, static_cast<size_t>(cfg.n_expert)), 2,
                       pool.info.block_bytes));
  std::copy(plan.entries.begin(), plan.entries.end(), p.entries_host);
  ++host.h2d_memcpys;
  MG_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(p.entries, p.entries_host, n_sel * 4, cudaMemcpyHostToDevice, main),
      "upload of the prefill's plan"));
  const DeviceBlockLayout& layout = pool.layout;
  const GluAct glu_act = ExpertGlu();
  for (const PrefillGroup& g : plan.groups) {
    const uint8_t* block = nullptr;
    const bool streamed = g.slot == kNoSlot;
    if (streamed) {
      const int b = g.ring_buffer;
      MG_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(copy, p.ring_free[b], 0), "ring wait"));
      ++host.h2d_memcpys;
      ++host.prefill_experts_streamed;
      host.prefill_bytes_streamed += pool.info.block_bytes;
      MG_RETURN_IF_ERROR(
          CudaStatus(cudaMemcpyAsync(p.ring[b], store->block(layer, g.expert),
                                     pool.info.block_bytes, cudaMemcpyHostToDevice, copy),
                     absl::StrCat(name, " streaming expert ", g.expert)));
      MG_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(p.ring_ready[b], copy), "ring record"));
      MG_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(main, p.ring_ready[b], 0), "ring wait"));
      block = p.ring[b];
    } else {
      ++host.prefill_experts_in_place;
      block = pool.slots.as<uint8_t>() + static_cast<size_t>(g.slot) * pool.info.block_bytes;
    }
    const std::string expert = absl::StrCat(name, " expert ", g.expert);
    const int32_t* entries = p.entries + g.first;
    MG_RETURN_IF_ERROR(CudaStatus(
        launch_gather_rows(p.h, p.h16, embd, entries, g.count, top_k, p.xg, p.xg16, main),
        absl::StrCat(expert, " gather")));
    // Projection proj of the expert into out, over its bias's rows where it has one.
    auto project = [&](int proj, const float* bias, const float* x, const uint16_t* x16, float* out,
                       const char* what) -> absl::Status {
      const DeviceMatrix m = ProjectionOf(layout, block, proj);
      if (bias != nullptr) {
        MG_RETURN_IF_ERROR(
            CudaStatus(launch_fill_rows(bias + static_cast<int64_t>(g.expert) * m.rows, m.rows,
                                        g.count, out, main),
                       absl::StrCat(expert, " ", what, " bias")));
      }
      return Project(m, x, x16, g.count, out, bias != nullptr, absl::StrCat(expert, " ", what));
    };
    MG_RETURN_IF_ERROR(project(0, w.gate_exps_b, p.xg, p.xg16, p.gate, "gate"));
    MG_RETURN_IF_ERROR(project(1, w.up_exps_b, p.xg, p.xg16, p.up, "up"));
    MG_RETURN_IF_ERROR(
        CudaStatus(launch_swiglu_rows(p.gate, p.up, static_cast<int64_t>(g.count) * layout.n_ff,
                                      glu_act, p.act, p.act16, main),
                   absl::StrCat(expert, " swiglu")));
    MG_RETURN_IF_ERROR(project(2, w.down_exps_b, p.act, p.act16, p.yg, "down"));
    if (streamed) {
      MG_RETURN_IF_ERROR(
          CudaStatus(cudaEventRecord(p.ring_free[g.ring_buffer], main), "ring record"));
    }
    MG_RETURN_IF_ERROR(
        CudaStatus(launch_scatter_rows(p.yg, embd, entries, g.count, p.expert_out, main),
                   absl::StrCat(expert, " scatter")));
  }
  return CudaStatus(
      launch_combine_rows(p.expert_out, p.weights, top_k, embd, rows, shexp ? p.shexp_out : nullptr,
                          shexp && cfg.shexp_gated ? p.shexp_logit : nullptr, p.x, main),
      absl::StrCat(name, " combine"));
}

absl::Status CudaEngine::Impl::PrefillDenseFfn(int layer, int rows) {
  PrefillState& p = prefill;
  const LayerWeights& w = layers[static_cast<size_t>(layer)];
  const std::string name = absl::StrCat("prefill layer ", layer, " dense FFN");
  MG_RETURN_IF_ERROR(
      Project(w.ffn_gate, p.h, p.h16, rows, p.gate, false, absl::StrCat(name, " gate")));
  MG_RETURN_IF_ERROR(Project(w.ffn_up, p.h, p.h16, rows, p.up, false, absl::StrCat(name, " up")));
  MG_RETURN_IF_ERROR(
      CudaStatus(launch_swiglu_rows(p.gate, p.up, static_cast<int64_t>(rows) * cfg.n_ff_dense,
                                    GluAct::kSilu, p.act, p.act16, main),
                 absl::StrCat(name, " swiglu")));
  return Project(w.ffn_down, p.act, p.act16, rows, p.x, true, absl::StrCat(name, " down"));
}

absl::Status CudaEngine::Impl::PrefillUbatch(int p0, int rows) {
  PrefillState& p = prefill;
  const int32_t embd = cfg.n_embd;
  MG_RETURN_IF_ERROR(
      CudaStatus(launch_embed_rows(token_embd, prompt + p0, rows, p.x, main), "prefill embedding"));
  for (int l = 0; l < cfg.n_layer; ++l) {
    const LayerWeights& w = layers[static_cast<size_t>(l)];
    const std::string name = absl::StrCat("prefill layer ", l);
    MG_RETURN_IF_ERROR(
        CudaStatus(launch_rmsnorm_rows(p.x, w.attn_norm, embd, rows, cfg.rms_eps, p.h, p.h16, main),
                   absl::StrCat(name, " attn_norm")));
    if (cfg.mixer(l) == LayerMixer::kDeltaNet) {
      MG_RETURN_IF_ERROR(PrefillDeltaNet(l, rows));
    } else {
      MG_RETURN_IF_ERROR(PrefillAttention(l, p0, rows));
    }
    MG_RETURN_IF_ERROR(
        CudaStatus(launch_rmsnorm_rows(p.x, w.ffn_norm, embd, rows, cfg.rms_eps, p.h, p.h16, main),
                   absl::StrCat(name, " ffn_norm")));
    if (cfg.moe_layer(l)) {
      MG_RETURN_IF_ERROR(PrefillExperts(l, rows));
    } else {
      MG_RETURN_IF_ERROR(PrefillDenseFfn(l, rows));
    }
  }
  ++host.prefill_ubatches;
  host.prefill_tokens += static_cast<uint64_t>(rows);
  return absl::OkStatus();
}

absl::Status CudaEngine::Impl::PrefillDeltaNet(int layer, int rows) {
  PrefillState& p = prefill;
  const LayerWeights::DeltaNet& w = layers[static_cast<size_t>(layer)].delta_net;
  const std::string name = absl::StrCat("prefill layer ", layer);
  struct Input {
    const DeviceMatrix& w;
    float* out;
    const char* what;
  };
  for (const Input& m : {Input{w.qkv, p.dn_qkv, " attn_qkv"}, Input{w.gate, p.dn_z, " attn_gate"},
                         Input{w.alpha, p.dn_alpha, " ssm_alpha"},
                         Input{w.beta, p.dn_beta, " ssm_beta"}}) {
    MG_RETURN_IF_ERROR(Project(m.w, p.h, p.h16, rows, m.out, false, absl::StrCat(name, m.what)));
  }
  // The ubatch's tokens in order, through the state (the fused op's algorithm).
  MG_RETURN_IF_ERROR(CudaStatus(
      launch_delta_net_mix(
          DeltaNetArgs(layer, p.dn_qkv, p.dn_z, p.dn_alpha, p.dn_beta, p.attn, nullptr), rows,
          main),
      absl::StrCat(name, " Gated DeltaNet")));
  const int64_t n = static_cast<int64_t>(rows) * cfg.delta_net.value_dim();
  MG_RETURN_IF_ERROR(CudaStatus(launch_to_f16(p.attn, n, p.attn16, main),
                                absl::StrCat(name, " Gated DeltaNet to f16")));
  return Project(w.out, p.attn, p.attn16, rows, p.x, true, absl::StrCat(name, " ssm_out"));
}

absl::Status CudaEngine::Impl::PrefillAttention(int l, int p0, int rows) {
  PrefillState& p = prefill;
  const LayerWeights& w = layers[static_cast<size_t>(l)];
  const LayerExperts& e = layer_experts[static_cast<size_t>(l)];
  const std::string name = absl::StrCat("prefill layer ", l);
  const int32_t embd = cfg.n_embd;
  const int64_t q_len = static_cast<int64_t>(cfg.n_head) * cfg.head_dim;
  const int64_t kv_len = static_cast<int64_t>(cfg.n_head_kv) * cfg.head_dim;
  const bool kv_f16 = options.kv_type == KvCacheType::kF16;
  const float scale = 1.0f / std::sqrt(static_cast<float>(cfg.head_dim));
  const int32_t* pos0 = p.positions + p0;
  struct Qkv {
    const DeviceMatrix& w;
    const float* bias;
    float* out;
    int64_t len;
    const char* what;
  };
  for (const Qkv& m : {Qkv{w.wq, w.bq, p.q, w.wq.rows, " q"}, Qkv{w.wk, w.bk, p.k, kv_len, " k"},
                       Qkv{w.wv, w.bv, p.v, kv_len, " v"}}) {
    if (m.bias != nullptr) {
      MG_RETURN_IF_ERROR(
          CudaStatus(launch_fill_rows(m.bias, static_cast<int32_t>(m.len), rows, m.out, main),
                     absl::StrCat(name, m.what, " bias")));
    }
    MG_RETURN_IF_ERROR(
        Project(m.w, p.h, p.h16, rows, m.out, m.bias != nullptr, absl::StrCat(name, m.what)));
  }
  const QkvRope rope = Rope(l, pos0, p.q_rope);
  MG_RETURN_IF_ERROR(CudaStatus(launch_rope_append_rows(p.q, p.k, p.v, rows, rope, main),
                                absl::StrCat(name, " rope and KV append")));
  MG_RETURN_IF_ERROR(CudaStatus(
      launch_attention_prefill(p.q_rope, e.k_cache, e.v_cache, kv_f16, pos0, rows, cfg.n_head,
                               cfg.n_head_kv, cfg.head_dim, scale, Mask(l, p.q), p.attn, main),
      absl::StrCat(name, " attention")));
  MG_RETURN_IF_ERROR(CudaStatus(launch_to_f16(p.attn, rows * q_len, p.attn16, main),
                                absl::StrCat(name, " attention to f16")));
  MG_RETURN_IF_ERROR(
      Project(w.wo, p.attn, p.attn16, rows, p.x, true, absl::StrCat(name, " attn_output")));
  if (w.bo != nullptr) {
    MG_RETURN_IF_ERROR(CudaStatus(launch_add_rows(w.bo, embd, rows, p.x, main),
                                  absl::StrCat(name, " attn_output bias")));
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::Impl::Prefill(int first, int count) {
  const int end = first + count;
  int last_rows = 0;
  for (int p0 = first; p0 < end; p0 += prefill.ubatch) {
    last_rows = std::min(prefill.ubatch, end - p0);
    MG_RETURN_IF_ERROR(PrefillUbatch(p0, last_rows));
  }
  // The last token's logits, through the decode step's output_norm and lm_head.
  const float* last_x = prefill.x + static_cast<int64_t>(last_rows - 1) * cfg.n_embd;
  MG_RETURN_IF_ERROR(
      CudaStatus(launch_rmsnorm_row(last_x, cfg.n_embd, Norm(output_norm), main), "output_norm"));
  MG_RETURN_IF_ERROR(
      CudaStatus(launch_matvec(output, h, h_q, nullptr, logits, main), "prefill lm_head"));
  // The sample at step end - 1 (its draw), then the step counter at end: the
  // decode graph's next embed feeds the sampled token at position end.
  const int32_t last_step = end - 1;
  MG_RETURN_IF_ERROR(Upload(step, &last_step, 4, "the step counter"));
  MG_RETURN_IF_ERROR(CudaStatus(
      launch_sample(logits, cfg.n_vocab, sampling, step, sample_scratch, tickets, sampled,
                    StepEnd{}, main),
      "prefill sample"));
  MG_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(out_tokens + last_step, sampled, 4, cudaMemcpyDeviceToDevice, main),
      "the prompt's token"));
  MG_RETURN_IF_ERROR(Upload(step, &end, 4, "the step counter"));
  return Download(token_host.as<int32_t>(), sampled, 4, "the prompt's token");
}

}  // namespace moegraph
