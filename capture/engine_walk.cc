// How the CUDA engine runs its walk: each entry bound to its launch (kernels,
// copies, events, the host arm's steps), and runs of S steps, eager or replayed
// from a graph captured once per S.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "capture/engine_impl.h"
#include "kernels/nn_math.h"
#include "loader/check.h"
#include "loader/status_util.h"
#include "reference/ops.h"
#include "residency/policy.h"

namespace moegraph {

WalkConfig CudaEngine::Impl::MakeWalkConfig(int steps) const {
  WalkConfig c =
      ModelWalkConfig(cfg, slot_mode, options.doors.split_passes, options.doors.chained_matvecs,
                      programmatic_launch);
  c.steps = steps;
  c.shared_expert_in_passes = shared_expert_in_passes;
  c.shared_gate_in_router = shared_gate_in_router;
  c.routing_step_end = options.routing_trace != nullptr || options.routing_record_steps > 0;
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

NormEpilogue CudaEngine::Impl::Norm(const float* weight) const {
  NormEpilogue norm;
  norm.weight = weight;
  norm.eps = cfg.rms_eps;
  norm.out = h;
  norm.out_q = h_q;
  return norm;
}

QkvRope CudaEngine::Impl::Rope(int layer, const int32_t* pos, float* q_out) const {
  const LayerWeights& w = layers[static_cast<size_t>(layer)];
  const LayerExperts& e = layer_experts[static_cast<size_t>(layer)];
  QkvRope rope;
  rope.pos = pos;
  rope.n_head = cfg.n_head;
  rope.n_head_kv = cfg.n_head_kv;
  rope.head_dim = cfg.head_dim;
  rope.n_rot = cfg.n_rot;
  rope.cos_sin = rope_buffer.as<float>();
  rope.rope_type = cfg.rope_type == RopeType::kNorm ? kRopeNorm : kRopeNeox;
  rope.use_norm = cfg.qk_norm || cfg.qk_norm_full;
  rope.norm.q_weight = w.q_norm;
  rope.norm.k_weight = w.k_norm;
  rope.norm.eps = cfg.rms_eps;
  rope.norm.full = cfg.qk_norm_full;  // olmoe: all of q (and k) at once, qwen3moe each head
  rope.q_out = q_out;
  rope.q_gated = cfg.mixer(layer) == LayerMixer::kGatedAttention;
  rope.kv_f16 = options.kv_type == KvCacheType::kF16;
  rope.k_cache = e.k_cache;
  rope.v_cache = e.v_cache;
  rope.kv_rows = e.kv_rows;
  return rope;
}

AttentionMask CudaEngine::Impl::Mask(int layer, const float* q_projection) const {
  AttentionMask mask;
  mask.window = cfg.swa_layer(layer) ? cfg.n_swa : 0;
  mask.sinks = layers[static_cast<size_t>(layer)].sinks;
  mask.kv_rows = layer_experts[static_cast<size_t>(layer)].kv_rows;
  if (cfg.mixer(layer) == LayerMixer::kGatedAttention) mask.gate = q_projection;
  return mask;
}

DeltaNetMixArgs CudaEngine::Impl::DeltaNetArgs(int layer, const float* qkv, const float* z,
                                               const float* alpha, const float* beta, float* out,
                                               block_q8_1* out_q) const {
  const LayerWeights::DeltaNet& w = layers[static_cast<size_t>(layer)].delta_net;
  const LayerExperts& e = layer_experts[static_cast<size_t>(layer)];
  DeltaNetMixArgs a;
  a.n_k_heads = cfg.delta_net.n_k_heads;
  a.n_v_heads = cfg.delta_net.n_v_heads;
  a.head_dim = cfg.delta_net.head_dim;
  a.d_conv = cfg.delta_net.d_conv;
  a.eps = cfg.rms_eps;
  a.conv_taps = w.conv;
  a.dt_bias = w.dt_bias;
  a.ssm_a = w.ssm_a;
  a.norm = w.norm;
  a.qkv = qkv;
  a.z = z;
  a.alpha = alpha;
  a.beta_logit = beta;
  a.conv_state = e.conv_state;
  a.delta_state = e.delta_state;
  a.out = out;
  a.out_q = out_q;
  a.tickets = tickets;
  return a;
}

ExpertBiases CudaEngine::Impl::Biases(int layer, const int32_t* experts) const {
  const LayerWeights& w = layers[static_cast<size_t>(layer)];
  ExpertBiases b;
  b.gate = w.gate_exps_b;
  b.up = w.up_exps_b;
  b.down = w.down_exps_b;
  if (b.gate != nullptr || b.up != nullptr || b.down != nullptr) b.experts = experts;
  return b;
}

RouterEpilogue CudaEngine::Impl::Router(int layer, int32_t* experts, float* weights) const {
  RouterEpilogue router;
  router.k = cfg.n_expert_used;
  router.norm_topk = cfg.norm_topk_prob;
  router.gating = RouterGatingOf(cfg.gating);
  router.logit_bias = layers[static_cast<size_t>(layer)].router_b;
  router.score_bias = layers[static_cast<size_t>(layer)].score_b;
  router.scale = cfg.expert_weights_scale;
  router.experts = experts;
  router.weights = weights;
  if (options.routing_trace != nullptr) {
    router.replay.ids = trace_ids.as<int32_t>();
    router.replay.weights = trace_weights.as<float>();
    router.replay.uniform_weight = 1.0f / static_cast<float>(cfg.n_expert_used);
    router.replay.n_layer = cfg.n_layer;
    router.replay.layer = layer;
    router.replay.step = replay_step;
  }
  return router;
}

std::function<cudaError_t()> CudaEngine::Impl::Bind(const WalkEntry& entry) {
  const int l = entry.layer;
  const int top_k = cfg.n_expert_used;
  cudaStream_t ms = main;
  cudaStream_t cs = copy;
  const LayerWeights* w = l >= 0 ? &layers[static_cast<size_t>(l)] : nullptr;
  const LayerExperts* e = l >= 0 ? &layer_experts[static_cast<size_t>(l)] : nullptr;
  const DevicePool* pool =
      l >= 0 && e->size_class >= 0 ? &pools[static_cast<size_t>(e->size_class)] : nullptr;
  const bool shexp = cfg.n_ff_shexp > 0;
  // After the last layer, output_norm (lm_head's input). A layer's attn_norm
  // is its projections' launch's (launch_qkv's input_norm), not the producer's.
  const NormEpilogue last_norm = l + 1 == cfg.n_layer ? Norm(output_norm) : NormEpilogue{};

  const ExpertBiases biases = l >= 0 && cfg.moe_layer(l) ? Biases(l, e->selection) : ExpertBiases{};
  // The resident arm's slots follow from the selection (no slot decision).
  ExpertRanks ranks;
  if (l >= 0 && cfg.moe_layer(l)) {
    ranks.k = top_k;
    if (slot_mode == SlotMode::kResident) {
      ranks.slot_of_rank = e->selection;
      ranks.first_slot = residency_key(e->local_layer, 0, cfg.n_expert);
    } else {
      ranks.slot_of_rank = e->slot_of_rank;
      ranks.missed = e->missed;
    }
    if (shared_expert_in_passes[static_cast<size_t>(l)]) {
      ranks.shared = {&w->shexp_gate, &w->shexp_up, &w->shexp_down};
    }
  }
  const GluAct glu_act = ExpertGlu();
  // The token mixer's output projection (attn_out): attention's, or a Gated
  // DeltaNet's ssm_out; both read attn.
  const DeviceMatrix* wo = l >= 0 && cfg.mixer(l) == LayerMixer::kDeltaNet ? &w->delta_net.out
                           : l >= 0                                      ? &w->wo
                                                                         : nullptr;
  auto gate_up = [=, this](ExpertPass pass) -> std::function<cudaError_t()> {
    return [=, this] {
      return launch_expert_gate_up(pool->slots.as<uint8_t>(), pool->layout, ranks, pass, biases,
                                   glu_act, h, h_q, act, act_q, counters, tickets, ms);
    };
  };
  auto down = [=, this](ExpertPass pass) -> std::function<cudaError_t()> {
    return [=, this] {
      return launch_expert_down(pool->slots.as<uint8_t>(), pool->layout, ranks, pass, biases, act,
                                act_q, expert_out, ms);
    };
  };
  // The last down pass ends the layer: the combine into x (then, after the
  // last layer, output_norm into h).
  auto combine_of = [&] {
    CombineEpilogue combine;
    combine.weights = e->weights;
    combine.shexp_out = shexp ? shexp_out : nullptr;
    if (shexp && cfg.shexp_gated) {
      combine.shexp_logit = shared_gate_in_router[static_cast<size_t>(l)]
                                ? router_logits + cfg.n_expert
                                : shexp_logit;
    }
    combine.residual = x;
    combine.norm = last_norm;
    return combine;
  };
  auto down_combine = [=, this](ExpertPass pass) -> std::function<cudaError_t()> {
    const CombineEpilogue combine = combine_of();
    return [=, this] {
      return launch_expert_down_combine(pool->slots.as<uint8_t>(), pool->layout, ranks, pass,
                                        biases, act, act_q, expert_out, combine, tickets, ms);
    };
  };

  // The router's top-k into the layer's selection; its last row the shared
  // expert's gate where that rides it.
  auto layer_router = [&] {
    RouterEpilogue router = Router(l, e->selection, e->weights);
    router.shared_gate_row = shared_gate_in_router[static_cast<size_t>(l)];
    return router;
  };
  // Both in one launch: the pair's rows, then down's and the combine.
  auto expert_ffn = [=, this](ExpertPass pass) -> std::function<cudaError_t()> {
    const CombineEpilogue combine = combine_of();
    return [=, this] {
      return launch_expert_ffn(pool->slots.as<uint8_t>(), pool->layout, ranks, pass, biases,
                               glu_act, h, h_q, act, act_q, expert_out, combine, counters,
                               tickets, ms);
    };
  };

  switch (entry.op) {
    case StepOp::kEmbed: {
      const StepStart start{prompt, n_prompt, sampled, step, pos};
      return [=, this] {
        return launch_embed_step(token_embd, start, x, ms);
      };
    }
    case StepOp::kQkv: {
      const QkvRope rope = Rope(l, pos, q_rope);
      return [=, this] {
        return launch_qkv(w->wq, w->wk, w->wv, x, nullptr, w->bq, w->bk, w->bv, q, k, nullptr,
                          &rope, Norm(w->attn_norm), tickets, ms);
      };
    }
    case StepOp::kAttention: {
      const float scale = 1.0f / std::sqrt(static_cast<float>(cfg.head_dim));
      const AttentionMask mask = Mask(l, q);
      return [=, this] {
        return launch_attention_decode(q_rope, e->k_cache, e->v_cache,
                                       options.kv_type == KvCacheType::kF16, pos, cfg.n_head,
                                       cfg.n_head_kv, cfg.head_dim, options.max_ctx, scale, mask,
                                       partial, tickets, attn, attn_q, ms);
      };
    }
    case StepOp::kAttnOut:
      return [=, this] {
        return launch_matvec_residual(*wo, attn, attn_q, w->bo, x, Norm(w->ffn_norm), tickets, ms);
      };
    case StepOp::kDeltaNetProj: {
      const LayerWeights::DeltaNet& d = w->delta_net;
      const std::array<Projection, 4> jobs = {Projection{&d.qkv, nullptr, dn_qkv},
                                              Projection{&d.gate, nullptr, dn_z},
                                              Projection{&d.alpha, nullptr, dn_alpha},
                                              Projection{&d.beta, nullptr, dn_beta}};
      return [=, this] {
        return launch_projections(jobs.data(), 4, x, nullptr, Norm(w->attn_norm), tickets, ms);
      };
    }
    case StepOp::kDeltaNetMix: {
      const DeltaNetMixArgs args = DeltaNetArgs(l, dn_qkv, dn_z, dn_alpha, dn_beta, attn, attn_q);
      return [=] { return launch_delta_net_mix(args, 1, ms); };
    }
    case StepOp::kRouter: {
      const RouterEpilogue router = layer_router();
      const DeviceMatrix* weights = router.shared_gate_row ? &w->router_and_gate : &w->router;
      return [=, this] {
        return launch_router(*weights, h, h_q, router_logits, router, tickets, ms);
      };
    }
    case StepOp::kAttnOutRouter: {
      const RouterEpilogue router = layer_router();
      const DeviceMatrix* weights = router.shared_gate_row ? &w->router_and_gate : &w->router;
      return [=, this] {
        return launch_matvec_residual_router(*wo, attn, attn_q, w->bo, x, Norm(w->ffn_norm),
                                             *weights, router_logits, router, counters, tickets,
                                             ms);
      };
    }
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
    case StepOp::kStageCopy: {
      cudaStream_t stream = entry.stream == WalkStream::kCopy ? cs : ms;
      return [=, this] {
        return launch_stage_copy(e->host_blocks, pool->layout, e->selection, e->slot_of_rank,
                                 e->missed, top_k, pool->slots.as<uint8_t>(), copy_tickets,
                                 counters, stream);
      };
    }
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
      return down_combine(ExpertPass::kMisses);
    case StepOp::kGateUpAll:
      return gate_up(ExpertPass::kAll);
    case StepOp::kDownAll:
      return down_combine(ExpertPass::kAll);
    case StepOp::kGateUpReady:
      return gate_up(ExpertPass::kReady);
    case StepOp::kDownReady:
      return down_combine(ExpertPass::kReady);
    case StepOp::kExpertFfnAll:
      return expert_ffn(ExpertPass::kAll);
    case StepOp::kExpertFfnReady:
      return expert_ffn(ExpertPass::kReady);
    case StepOp::kShexpGateUp:
      return [=, this] {
        return launch_matvec_swiglu(w->shexp_gate, w->shexp_up, h, h_q, shexp_act, shexp_act_q,
                                    tickets, ms);
      };
    case StepOp::kShexpDown:
      return [=, this] {
        return launch_matvec(w->shexp_down, shexp_act, shexp_act_q, nullptr, shexp_out, ms);
      };
    case StepOp::kShexpLogit:
      return
          [=, this] { return launch_matvec(w->shexp_gate_inp, h, h_q, nullptr, shexp_logit, ms); };
    case StepOp::kDenseGateUp:
      return [=, this] {
        return launch_matvec_swiglu(w->ffn_gate, w->ffn_up, h, h_q, dense_act, dense_act_q, tickets,
                                    ms);
      };
    case StepOp::kDenseDown:
      return [=, this] {
        return launch_matvec_residual(w->ffn_down, dense_act, dense_act_q, nullptr, x, last_norm,
                                      tickets, ms);
      };
    case StepOp::kLmHead:
      return [=, this] { return launch_matvec(output, h, h_q, nullptr, logits, ms); };
    case StepOp::kRecordLogits:
      return [=, this] {
        return launch_record_logits(logits, cfg.n_vocab, step, options.max_ctx,
                                    logits_record.as<float>(), ms);
      };
    case StepOp::kSample: {
      const StepEnd end{step, out_tokens, counters};
      return [=, this] {
        return launch_sample(logits, cfg.n_vocab, sampling, step, sample_scratch, tickets, sampled,
                             end, ms);
      };
    }
    case StepOp::kRoutingStepEnd:
      return [=, this] {
        return launch_routing_step_end(
            layer_experts[0].selection, cfg.n_layer * top_k, routing_record.as<int32_t>(),
            options.routing_record_steps, routing_cursor,
            options.routing_trace != nullptr ? options.routing_trace->n_steps : 0,
            options.routing_trace != nullptr ? replay_step : nullptr, ms);
      };
    case StepOp::kTokenCopy:
      return [=, this] {
        return cudaMemcpyAsync(token_host.as<int32_t>(), sampled, 4, cudaMemcpyDeviceToHost, ms);
      };
  }
  MG_CHECK(false, "CudaEngine: a walk op without a binding");
  return nullptr;
}

absl::StatusOr<int> CudaEngine::Impl::RunSteps(
    int count, const std::function<absl::StatusOr<bool>(int steps)>& after_launch) {
  const int per_launch = options.steps_per_launch;
  int run = 0;
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
      const cudaError_t err = LaunchWalk(walk_it->second, host, &failed);
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
    run += steps;
    if (after_launch != nullptr) {
      MG_ASSIGN_OR_RETURN(const bool go_on, after_launch(steps));
      if (!go_on) break;
    }
  }
  return run;
}

}  // namespace moegraph
