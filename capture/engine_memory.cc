// Where the CUDA engine's memory goes: the bytes the budget counts (dense
// weights, the policy's state, scratch, records), the slot pools and their
// policy state, the decode state carved from one allocation, and the uploads.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "capture/engine_impl.h"
#include "capture/walk_shape.h"
#include "loader/quant.h"
#include "loader/status_util.h"
#include "reference/ops.h"
#include "residency/budget.h"

namespace moegraph {
namespace {

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

// The dimensions of a head RoPE turns (n_rot 0: all of them).
int32_t RotatedDims(const ModelConfig& cfg) { return cfg.n_rot > 0 ? cfg.n_rot : cfg.head_dim; }

// The most ranks an expert pass has: k, and the shared expert's where it can
// ride the passes (SharedExpertInPasses: its FFN as wide as an expert's).
int32_t PassRanks(const ModelConfig& cfg) {
  return cfg.n_expert_used + (cfg.n_ff_shexp > 0 && cfg.n_ff_shexp == cfg.n_ff_exp ? 1 : 0);
}

// The step's tickets: its gate/up pairs are the experts' (PassRanks), the
// shared expert's and a leading dense layer's; the Gated DeltaNet's, one a
// value head.
int32_t StepTickets(const ModelConfig& cfg) {
  const int32_t pair_rows =
      std::max({cfg.n_ff_exp * PassRanks(cfg), cfg.n_ff_shexp, cfg.n_ff_dense});
  return std::max(step_tickets(cfg.n_embd, cfg.n_head, cfg.n_head_kv, pair_rows),
                  cfg.delta_net.n_v_heads);
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

}  // namespace

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

absl::StatusOr<DeviceMatrix> CudaEngine::Impl::UploadRouterAndGate(const GgufTensor* router,
                                                                   const GgufTensor* gate) {
  const WeightView view = weight_view(*router);
  DeviceMatrix m;
  m.type = view.type;
  m.cols = static_cast<int32_t>(view.cols);
  m.rows = static_cast<int32_t>(view.rows) + 1;
  m.row_bytes = view.row_bytes;
  MG_ASSIGN_OR_RETURN(CudaBuffer buffer,
                      CudaBuffer::Device(router->nbytes + gate->nbytes, router->name));
  MG_RETURN_IF_ERROR(Upload(buffer.as<void>(), router->data, router->nbytes, router->name));
  MG_RETURN_IF_ERROR(
      Upload(buffer.as<uint8_t>() + router->nbytes, gate->data, gate->nbytes, gate->name));
  dense_bytes += router->nbytes + gate->nbytes;
  m.data = buffer.as<void>();
  dense.push_back(std::move(buffer));
  return m;
}

absl::Status CudaEngine::Impl::UploadDense() {
  const Model& m = *model;
  shared_gate_in_router = SharedGateInRouter(m);
  MG_ASSIGN_OR_RETURN(token_embd, UploadMatrix(m.token_embd));
  MG_ASSIGN_OR_RETURN(output, UploadMatrix(m.output));
  MG_ASSIGN_OR_RETURN(output_norm, UploadVector(m.output_norm));
  for (const LayerTensors& lt : m.layers) {
    LayerWeights w;
    const bool gate_in_router = shared_gate_in_router[layers.size()];
    if (lt.delta_net.qkv != nullptr) {
      const LayerTensors::DeltaNet& d = lt.delta_net;
      MG_ASSIGN_OR_RETURN(w.delta_net.qkv, UploadMatrix(d.qkv));
      MG_ASSIGN_OR_RETURN(w.delta_net.gate, UploadMatrix(d.gate));
      MG_ASSIGN_OR_RETURN(w.delta_net.alpha, UploadMatrix(d.alpha));
      MG_ASSIGN_OR_RETURN(w.delta_net.beta, UploadMatrix(d.beta));
      MG_ASSIGN_OR_RETURN(w.delta_net.out, UploadMatrix(d.out));
      MG_ASSIGN_OR_RETURN(w.delta_net.conv, UploadVector(d.conv));
      MG_ASSIGN_OR_RETURN(w.delta_net.dt_bias, UploadVector(d.dt_bias));
      MG_ASSIGN_OR_RETURN(w.delta_net.ssm_a, UploadVector(d.a));
      MG_ASSIGN_OR_RETURN(w.delta_net.norm, UploadVector(d.norm));
    } else {
      MG_ASSIGN_OR_RETURN(w.wq, UploadMatrix(lt.wq));
      MG_ASSIGN_OR_RETURN(w.wk, UploadMatrix(lt.wk));
      MG_ASSIGN_OR_RETURN(w.wv, UploadMatrix(lt.wv));
      MG_ASSIGN_OR_RETURN(w.wo, UploadMatrix(lt.wo));
    }
    if (gate_in_router) {
      MG_ASSIGN_OR_RETURN(w.router_and_gate, UploadRouterAndGate(lt.router, lt.shexp_gate_inp));
      w.router = w.router_and_gate;
      w.router.rows -= 1;
      w.shexp_gate_inp = w.router_and_gate;
      w.shexp_gate_inp.rows = 1;
      w.shexp_gate_inp.data = static_cast<const uint8_t*>(w.router_and_gate.data) +
                              lt.router->nbytes;
    } else if (lt.router != nullptr) {
      MG_ASSIGN_OR_RETURN(w.router, UploadMatrix(lt.router));
    }
    if (lt.shexp_gate != nullptr) {
      MG_ASSIGN_OR_RETURN(w.shexp_gate, UploadMatrix(lt.shexp_gate));
      MG_ASSIGN_OR_RETURN(w.shexp_up, UploadMatrix(lt.shexp_up));
      MG_ASSIGN_OR_RETURN(w.shexp_down, UploadMatrix(lt.shexp_down));
    }
    if (lt.shexp_gate_inp != nullptr && !gate_in_router) {
      MG_ASSIGN_OR_RETURN(w.shexp_gate_inp, UploadMatrix(lt.shexp_gate_inp));
    }
    if (lt.ffn_gate != nullptr) {
      MG_ASSIGN_OR_RETURN(w.ffn_gate, UploadMatrix(lt.ffn_gate));
      MG_ASSIGN_OR_RETURN(w.ffn_up, UploadMatrix(lt.ffn_up));
      MG_ASSIGN_OR_RETURN(w.ffn_down, UploadMatrix(lt.ffn_down));
    }
    MG_ASSIGN_OR_RETURN(w.score_b, UploadVector(lt.score_b));
    MG_ASSIGN_OR_RETURN(w.attn_norm, UploadVector(lt.attn_norm));
    MG_ASSIGN_OR_RETURN(w.ffn_norm, UploadVector(lt.ffn_norm));
    MG_ASSIGN_OR_RETURN(w.q_norm, UploadVector(lt.q_norm));
    MG_ASSIGN_OR_RETURN(w.k_norm, UploadVector(lt.k_norm));
    MG_ASSIGN_OR_RETURN(w.bq, UploadVector(lt.bq));
    MG_ASSIGN_OR_RETURN(w.bk, UploadVector(lt.bk));
    MG_ASSIGN_OR_RETURN(w.bv, UploadVector(lt.bv));
    MG_ASSIGN_OR_RETURN(w.bo, UploadVector(lt.bo));
    MG_ASSIGN_OR_RETURN(w.sinks, UploadVector(lt.sinks));
    MG_ASSIGN_OR_RETURN(w.router_b, UploadVector(lt.router_b));
    MG_ASSIGN_OR_RETURN(w.gate_exps_b, UploadVector(lt.gate_exps_b));
    MG_ASSIGN_OR_RETURN(w.up_exps_b, UploadVector(lt.up_exps_b));
    MG_ASSIGN_OR_RETURN(w.down_exps_b, UploadVector(lt.down_exps_b));
    layers.push_back(w);
  }
  return absl::OkStatus();
}

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
    const LayerTensors::DeltaNet& d = lt.delta_net;
    for (const GgufTensor* t :
         {lt.wq, lt.wk, lt.wv, lt.wo, lt.router, lt.shexp_gate, lt.shexp_up, lt.shexp_down,
          lt.shexp_gate_inp, lt.ffn_gate, lt.ffn_up, lt.ffn_down, d.qkv, d.gate, d.alpha, d.beta,
          d.out}) {
      matrix(t);
    }
    for (const GgufTensor* t :
         {lt.attn_norm, lt.ffn_norm, lt.q_norm, lt.k_norm, lt.bq, lt.bk, lt.bv, lt.score_b, lt.bo,
          lt.sinks, lt.router_b, lt.gate_exps_b, lt.up_exps_b, lt.down_exps_b, d.conv, d.dt_bias,
          d.a, d.norm}) {
      vector(t);
    }
  }
  uint64_t total = 0;
  for (const auto& [t, b] : bytes) total += b;
  return total;
}

namespace {

// The device arrays of a residency policy, for the budget: bytes per key (and
// per layer and table, a fixed part) and bytes per slot.
struct PolicyStateBytes {
  uint64_t fixed = 0;
  uint64_t per_slot = 0;
};

PolicyStateBytes PolicyBytes(ResidencyPolicy policy, const ModelConfig& cfg) {
  const uint64_t n_moe = static_cast<uint64_t>(cfg.n_moe_layer());
  const uint64_t keys = n_moe * static_cast<uint64_t>(cfg.n_expert);
  if (policy == ResidencyPolicy::kHazard) {
    // table, last_visit, frequency, long_frequency per key; visits per layer;
    // hits, trials and cost per cell; owner and a cached victim rank per slot.
    return {16 * keys + 4 * n_moe + 12 * kHazardCells, 12};
  }
  // table per key; n_protected and clock per pool (at most one per layer);
  // owner, stamp, seg and a cached victim rank per slot.
  return {4 * keys + 12 * n_moe, 21};
}

}  // namespace

absl::Status CudaEngine::Impl::PlanPools(uint64_t free_bytes, uint64_t dense, uint64_t kv_bytes,
                                         uint64_t scratch_bytes) {
  const std::vector<SizeClass>& classes = store->size_classes();
  const int n_layer = cfg.n_moe_layer();  // the layers with experts
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
  const MixerWidths widths(cfg);
  const size_t max_ctx = static_cast<size_t>(options.max_ctx);
  const size_t f = sizeof(float);
  const size_t n_layer = static_cast<size_t>(cfg.n_layer);
  const size_t kk = static_cast<size_t>(top_k);

  BufferLayout s;
  const size_t o_pos = s.Add(4), o_step = s.Add(4), o_sampled = s.Add(4);
  const size_t o_sampling = s.Add(sizeof(SamplingParams));
  const size_t o_prompt = s.Add((max_ctx + 1) * 4), o_out = s.Add(max_ctx * 4);
  const size_t o_x = s.Add(cfg.n_embd * f), o_h = s.Add(cfg.n_embd * f);
  const size_t o_q = s.Add(widths.q_rows * f), o_k = s.Add(kv_len * f);
  const size_t o_q_rope = s.Add(q_len * f), o_attn = s.Add(widths.mixer_out * f);
  const size_t o_dn = s.Add(widths.delta_net_inputs * f);
  const size_t o_router = s.Add((cfg.n_expert + 1) * f);  // + the shared gate's logit
  const size_t ranks = static_cast<size_t>(PassRanks(cfg));
  const size_t o_act = s.Add(ranks * cfg.n_ff_exp * f), o_eout = s.Add(ranks * cfg.n_embd * f);
  const size_t n_shexp = static_cast<size_t>(std::max(cfg.n_ff_shexp, 1));
  const size_t o_sa = s.Add(n_shexp * f);
  const size_t o_sout = s.Add(cfg.n_embd * f), o_slogit = s.Add(f);
  const size_t n_dense = static_cast<size_t>(std::max(cfg.n_ff_dense, 1));
  const size_t o_dense = s.Add(n_dense * f);
  const size_t o_logits = s.Add(static_cast<size_t>(cfg.n_vocab) * f);
  const size_t o_sample = s.Add(sample_scratch_bytes(cfg.n_vocab));
  const size_t o_counters = s.Add(sizeof(DeviceCounters));
  const size_t o_sel = s.Add(n_layer * kk * 4), o_w = s.Add(n_layer * kk * f);
  const size_t o_keys = s.Add(n_layer * kk * 4), o_sor = s.Add(n_layer * kk * 4);
  const size_t o_missed = s.Add(n_layer * kk), o_evicted = s.Add(n_layer * kk * 4);
  const size_t o_cursor = s.Add(16);  // the routing cursor, then the replay's step
  // The epilogues' tickets, then the stage copy's (k).
  const size_t o_tickets = s.Add((static_cast<size_t>(StepTickets(cfg)) + kk) * 4);
  // q8_1 blocks of a vector of n, or none (kNone).
  constexpr size_t kNone = SIZE_MAX;
  auto add_q8_1 = [&s](size_t n) {
    return n % QK8_1 == 0 ? s.Add(n / QK8_1 * sizeof(block_q8_1)) : kNone;
  };
  const size_t o_h_q = add_q8_1(cfg.n_embd);
  const size_t o_attn_q = q_len % QK8_1 == 0 ? add_q8_1(widths.mixer_out) : kNone;
  const size_t o_act_q = add_q8_1(ranks * cfg.n_ff_exp);
  const size_t o_sa_q = cfg.n_ff_shexp > 0 ? add_q8_1(cfg.n_ff_shexp) : kNone;
  const size_t o_dense_q = cfg.n_ff_dense > 0 ? add_q8_1(cfg.n_ff_dense) : kNone;

  MG_ASSIGN_OR_RETURN(state_buffer, CudaBuffer::Device(s.total, "the decode state"));
  MG_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(state_buffer.as<void>(), 0, s.total, main),
                                "clearing the decode state"));
  uint8_t* base = state_buffer.as<uint8_t>();
  auto at = [base](size_t offset) { return base + offset; };
  pos = reinterpret_cast<int32_t*>(at(o_pos));
  step = reinterpret_cast<int32_t*>(at(o_step));
  sampled = reinterpret_cast<int32_t*>(at(o_sampled));
  sampling = reinterpret_cast<SamplingParams*>(at(o_sampling));
  MG_RETURN_IF_ERROR(
      Upload(sampling, &options.sampling, sizeof(SamplingParams), "the sampling settings"));
  n_prompt = reinterpret_cast<int32_t*>(at(o_prompt));
  prompt = n_prompt + 1;
  out_tokens = reinterpret_cast<int32_t*>(at(o_out));
  x = reinterpret_cast<float*>(at(o_x));
  h = reinterpret_cast<float*>(at(o_h));
  q = reinterpret_cast<float*>(at(o_q));
  k = reinterpret_cast<float*>(at(o_k));
  q_rope = reinterpret_cast<float*>(at(o_q_rope));
  attn = reinterpret_cast<float*>(at(o_attn));
  const DeltaNetShape& dn = cfg.delta_net;
  dn_qkv = reinterpret_cast<float*>(at(o_dn));
  dn_z = dn_qkv + dn.conv_dim();
  dn_alpha = dn_z + dn.value_dim();
  dn_beta = dn_alpha + dn.n_v_heads;
  router_logits = reinterpret_cast<float*>(at(o_router));
  act = reinterpret_cast<float*>(at(o_act));
  expert_out = reinterpret_cast<float*>(at(o_eout));
  shexp_act = reinterpret_cast<float*>(at(o_sa));
  shexp_out = reinterpret_cast<float*>(at(o_sout));
  shexp_logit = reinterpret_cast<float*>(at(o_slogit));
  dense_act = reinterpret_cast<float*>(at(o_dense));
  logits = reinterpret_cast<float*>(at(o_logits));
  sample_scratch = at(o_sample);
  counters = reinterpret_cast<DeviceCounters*>(at(o_counters));
  routing_cursor = reinterpret_cast<int64_t*>(at(o_cursor));
  replay_step = routing_cursor + 1;
  tickets = reinterpret_cast<unsigned int*>(at(o_tickets));
  copy_tickets = tickets + StepTickets(cfg);
  auto q8_1_at = [&at](size_t offset) {
    return offset == kNone ? nullptr : reinterpret_cast<block_q8_1*>(at(offset));
  };
  h_q = q8_1_at(o_h_q);
  attn_q = q8_1_at(o_attn_q);
  act_q = cfg.n_ff_exp % QK8_1 == 0 ? q8_1_at(o_act_q) : nullptr;
  shexp_act_q = q8_1_at(o_sa_q);
  dense_act_q = q8_1_at(o_dense_q);

  // Each layer's K then V cache, of KvLayerRows rows (a windowed layer's ring).
  const size_t row_bytes = static_cast<size_t>(cfg.n_head_kv) * cfg.head_dim *
                           (options.kv_type == KvCacheType::kF16 ? 2 : 4);
  MG_ASSIGN_OR_RETURN(kv_buffer, CudaBuffer::Device(KvCacheBytes(cfg, options.max_ctx,
                                                                 options.kv_type, RingSlack()),
                                                    "the KV cache"));
  size_t kv_offset = 0;
  const size_t partial_floats = attention_partial_floats(cfg.n_head, cfg.head_dim, options.max_ctx);
  MG_ASSIGN_OR_RETURN(partial_buffer, CudaBuffer::Device(partial_floats * f, "attention partials"));
  partial = partial_buffer.as<float>();

  // RoPE's cosines and sines for every position a step reaches, made here once.
  const int32_t n_rot = RotatedDims(cfg);
  std::vector<float> cos_sin(rope_table_floats(n_rot, options.max_ctx));
  fill_rope_table(n_rot, cfg.rope_freq_base, YarnOf(cfg.rope_scaling, cfg.n_rot, cfg.rope_freq_base),
                  options.max_ctx, cos_sin.data());
  MG_ASSIGN_OR_RETURN(rope_buffer,
                      CudaBuffer::Device(cos_sin.size() * sizeof(float), "the RoPE table"));
  MG_RETURN_IF_ERROR(Upload(rope_buffer.as<void>(), cos_sin.data(),
                            cos_sin.size() * sizeof(float), "the RoPE table"));

  // Each Gated DeltaNet layer's conv state, then its delta state.
  const int64_t conv_floats = delta_net_conv_state_floats(dn.n_v_heads, dn.head_dim, dn.d_conv);
  const int64_t delta_floats = dn.delta_state_floats();
  MG_ASSIGN_OR_RETURN(recurrent_buffer,
                      CudaBuffer::Device(RecurrentBytes(cfg), "the Gated DeltaNet state"));
  MG_RETURN_IF_ERROR(
      CudaStatus(cudaMemsetAsync(recurrent_buffer.as<void>(), 0, recurrent_buffer.bytes(), main),
                 "clearing the Gated DeltaNet state"));
  float* next_state = recurrent_buffer.as<float>();

  rings = KvRingPositions(cfg, options.max_ctx, RingSlack());
  for (size_t l = 0; l < n_layer; ++l) {
    LayerExperts e;
    const int layer = static_cast<int>(l);
    if (cfg.moe_layer(layer)) {
      e.size_class = store->class_of(layer);
      const std::vector<int>& class_layers = pools[static_cast<size_t>(e.size_class)].info.layers;
      e.local_layer = static_cast<int>(std::find(class_layers.begin(), class_layers.end(), layer) -
                                       class_layers.begin());
      e.host_blocks = store_device_base + (store->block(layer, 0) - store->data());
    }
    e.selection = reinterpret_cast<int32_t*>(at(o_sel)) + l * kk;
    e.weights = reinterpret_cast<float*>(at(o_w)) + l * kk;
    e.selected_keys = reinterpret_cast<int32_t*>(at(o_keys)) + l * kk;
    e.slot_of_rank = reinterpret_cast<int32_t*>(at(o_sor)) + l * kk;
    e.missed = at(o_missed) + l * kk;
    e.evicted = reinterpret_cast<int32_t*>(at(o_evicted)) + l * kk;
    const int rows = KvLayerRows(cfg, layer, options.max_ctx, RingSlack());
    e.kv_rows = rows < options.max_ctx ? rows : 0;
    const size_t cache_bytes = static_cast<size_t>(rows) * row_bytes;
    e.k_cache = kv_buffer.as<uint8_t>() + kv_offset;
    e.v_cache = kv_buffer.as<uint8_t>() + kv_offset + cache_bytes;
    kv_offset += 2 * cache_bytes;
    if (!cfg.kv_layer(layer)) {
      e.conv_state = next_state;
      e.delta_state = next_state + conv_floats;
      next_state += conv_floats + delta_floats;
    }
    layer_experts.push_back(e);
  }
  // A dense layer's row of the routing record (the CPU backend's too).
  if (cfg.n_layer_dense_lead > 0) {
    const std::vector<int32_t> missing(static_cast<size_t>(cfg.n_layer_dense_lead) * kk,
                                       kMissingExpert);
    MG_RETURN_IF_ERROR(Upload(layer_experts[0].selection, missing.data(), missing.size() * 4,
                              "the dense layers' selection"));
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

uint64_t RecurrentBytes(const ModelConfig& cfg) {
  const DeltaNetShape& dn = cfg.delta_net;
  const uint64_t layers = static_cast<uint64_t>(cfg.n_layer - cfg.n_kv_layers());
  if (layers == 0) return 0;
  const uint64_t floats =
      static_cast<uint64_t>(delta_net_conv_state_floats(dn.n_v_heads, dn.head_dim, dn.d_conv)) +
      static_cast<uint64_t>(dn.delta_state_floats());
  return layers * floats * sizeof(float);
}

// Scratch bytes the budget sets aside: the decode state (epilogue tickets and
// the sampler's scratch included), attention partials and
// the slack of 256-byte alignment, as AllocateState lays them out.
uint64_t ScratchBytes(const ModelConfig& cfg, int max_ctx) {
  const uint64_t f = sizeof(float);
  const uint64_t q_len = static_cast<uint64_t>(cfg.n_head) * cfg.head_dim;
  const uint64_t kv_len = static_cast<uint64_t>(cfg.n_head_kv) * cfg.head_dim;
  const uint64_t kk = static_cast<uint64_t>(cfg.n_expert_used);
  const uint64_t ranks = static_cast<uint64_t>(PassRanks(cfg));
  const MixerWidths widths(cfg);
  const uint64_t floats = 3 * static_cast<uint64_t>(cfg.n_embd) + widths.q_rows + q_len +
                          widths.mixer_out + widths.delta_net_inputs + kv_len +
                          static_cast<uint64_t>(cfg.n_expert) + 1 + ranks * cfg.n_ff_exp +
                          ranks * cfg.n_embd + static_cast<uint64_t>(cfg.n_ff_shexp) + 1 +
                          static_cast<uint64_t>(cfg.n_ff_dense) +
                          static_cast<uint64_t>(cfg.n_vocab);
  const uint64_t per_layer = static_cast<uint64_t>(cfg.n_layer) * kk * (4 + 4 + 4 + 4 + 1 + 4);
  // The q8_1 blocks of h, attn, act and shexp_act: 36 bytes per 32 floats, at most.
  const uint64_t q8_1_bytes = (static_cast<uint64_t>(cfg.n_embd) + widths.mixer_out +
                               ranks * cfg.n_ff_exp +
                               cfg.n_ff_shexp + cfg.n_ff_dense) /
                              QK8_1 * sizeof(block_q8_1);
  const uint64_t ticket_bytes = (static_cast<uint64_t>(StepTickets(cfg)) + kk) * 4;
  const uint64_t rope_bytes = rope_table_floats(RotatedDims(cfg), max_ctx) * sizeof(float);
  return floats * f + (2 * static_cast<uint64_t>(max_ctx) + 1) * 4 + per_layer + q8_1_bytes +
         ticket_bytes + sample_scratch_bytes(cfg.n_vocab) +
         attention_partial_floats(cfg.n_head, cfg.head_dim, max_ctx) * f + rope_bytes + 72 * 256;
}

}  // namespace moegraph
