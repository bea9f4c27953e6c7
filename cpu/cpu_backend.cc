#include "cpu/cpu_backend.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <new>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "loader/check.h"
#include "loader/host_memory.h"
#include "loader/quant.h"
#include "loader/status_util.h"
#include "reference/ops.h"
#include "residency/drop_cold.h"
#include "residency/policy.h"

namespace moegraph {
namespace {

// The slots: anonymous pages (page-aligned; slots start on block boundaries,
// kBlockAlignment), huge where the kernel grants them, faulted in here
// (MADV_POPULATE_WRITE, Linux 5.14; later kernels fault them as used): a
// pool the disk tier fills is gigabytes, and its first fill paid a fault
// and a page clear per 4 KiB page in the middle of decoding (on this VM a
// 5.4 GiB pool's first 20 tokens waited 52 s on reads that way, 5 s with
// the pool faulted in first).
struct SlotUnmap {
  size_t bytes = 0;
  void operator()(uint8_t* p) const { ::munmap(p, bytes); }
};
using SlotBuffer = std::unique_ptr<uint8_t, SlotUnmap>;

SlotBuffer MapSlots(size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return SlotBuffer(nullptr, SlotUnmap{});
  ::madvise(p, bytes, MADV_HUGEPAGE);
  ::madvise(p, bytes, MADV_POPULATE_WRITE);
  return SlotBuffer(static_cast<uint8_t*>(p), SlotUnmap{bytes});
}


// --slots auto: every expert, or as many slots of the largest block as fit in
// the host memory available less the rail; at least top-k per size class.
absl::StatusOr<int32_t> AutoSlots(const CpuBackendOptions& options,
                                  const std::vector<SizeClass>& classes, int32_t n_keys,
                                  int32_t k) {
  const uint64_t available =
      options.host_available_bytes != 0 ? options.host_available_bytes : HostMemoryAvailable();
  if (available == 0) return n_keys;
  size_t largest_block = 0;
  for (const SizeClass& c : classes) largest_block = std::max(largest_block, c.block_bytes);
  const uint64_t fit =
      available > kHostMemoryRailBytes ? (available - kHostMemoryRailBytes) / largest_block : 0;
  const uint64_t needed = static_cast<uint64_t>(k) * classes.size();
  if (fit < needed) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "--slots auto: %.2f MiB of host memory available, less a 1 GiB rail, holds %d slots of "
        "%.2f MiB, fewer than --top-k %d per size class (%d)",
        available / 1048576.0, fit, largest_block / 1048576.0, k, needed));
  }
  return static_cast<int32_t>(std::min<uint64_t>(fit, static_cast<uint64_t>(n_keys)));
}

// Slots each size class gets: in proportion to its layers, the remainder to the
// first classes. With every expert fitting (N = MoE layers * n_expert) each
// class gets exactly its own experts.
std::vector<int32_t> SplitSlots(int32_t n_slots, const std::vector<SizeClass>& classes,
                                int n_layer) {
  std::vector<int32_t> split;
  int32_t given = 0;
  for (const SizeClass& c : classes) {
    split.push_back(static_cast<int32_t>(static_cast<int64_t>(n_slots) *
                                         static_cast<int64_t>(c.layers.size()) / n_layer));
    given += split.back();
  }
  for (size_t c = 0; given < n_slots; ++c, ++given) ++split[c];
  return split;
}

}  // namespace

absl::Status CheckRoutingTrace(const RoutingTrace& trace, const ModelConfig& config) {
  if (trace.n_layer != config.n_layer) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the trace has %d layers, the model %d", trace.n_layer, config.n_layer));
  }
  if (trace.k != config.n_expert_used) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the trace selects top-%d, the model top-%d", trace.k, config.n_expert_used));
  }
  if (trace.n_steps < 1) return absl::InvalidArgumentError("the trace has no steps");
  for (size_t i = 0; i < trace.ids.size(); ++i) {
    if (trace.ids[i] != kMissingExpert && trace.ids[i] >= config.n_expert) {
      const size_t row = i / static_cast<size_t>(trace.k);
      return absl::InvalidArgumentError(absl::StrFormat(
          "step %d layer %d selects expert %d, but the model has %d experts",
          row / static_cast<size_t>(trace.n_layer), row % static_cast<size_t>(trace.n_layer),
          trace.ids[i], config.n_expert));
    }
  }
  return absl::OkStatus();
}

// The expert provider of the forward pass: the residency step, the stage copies
// and the slot views, one size class pool each.
class CpuBackend::SlotExperts final : public ExpertProvider {
 public:
  struct Pool {
    SlotPoolInfo info;
    std::optional<PolicyCache> cache;  // empty with the cache off
    SlotBuffer slots;

    uint8_t* slot(int32_t index) const {
      MG_CHECK(index >= 0 && index < info.n_slots, "CpuBackend: slot out of range");
      return slots.get() + static_cast<size_t>(index) * info.block_bytes;
    }
  };

  // store null: resident, every expert read in place from model's file.
  SlotExperts(const Model& model, const ExpertStore* store, ExpertFileReader* disk, int k,
              const RoutingTrace* routing_trace, double drop_strength, bool drop_in_prompts)
      : model_(model),
        store_(store),
        disk_(disk),
        drop_strength_(drop_strength),
        drop_in_prompts_(drop_in_prompts),
        k_(k),
        routing_trace_(routing_trace) {
    drops_.resize(static_cast<size_t>(model.config.n_layer));
    local_layer_.resize(static_cast<size_t>(model.config.n_layer));
    batch_rows_.resize(static_cast<size_t>(model.config.n_layer));
    provided_rows_.resize(static_cast<size_t>(model.config.n_layer));
  }

  absl::Status AddPools(const CpuBackendOptions& options) {
    const std::vector<SizeClass>& classes = store_->size_classes();
    const int n_layer = model_.config.n_moe_layer();
    int32_t requested = options.n_slots;
    if (requested == 0) {
      requested = n_layer * store_->n_expert();
      if (options.cache) {
        MG_ASSIGN_OR_RETURN(requested, AutoSlots(options, classes, requested, k_));
      }
    }
    const std::vector<int32_t> split = SplitSlots(requested, classes, n_layer);
    for (size_t c = 0; c < classes.size(); ++c) {
      Pool pool;
      pool.info.block_bytes = classes[c].block_bytes;
      pool.info.layers = classes[c].layers;
      for (size_t i = 0; i < classes[c].layers.size(); ++i) {
        local_layer_[static_cast<size_t>(classes[c].layers[i])] = static_cast<int32_t>(i);
      }
      if (options.cache) {
        // One class: PolicyCache::Create names the shortfall itself.
        if (classes.size() > 1 && split[c] < k_) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "--slots %d leaves size class %d (%d of %d layers) %d slot(s), fewer than --top-k %d",
              requested, c, classes[c].layers.size(), n_layer, split[c], k_));
        }
        CacheConfig config;
        config.n_layer = static_cast<int32_t>(classes[c].layers.size());
        config.n_expert = store_->n_expert();
        config.k = k_;
        config.n_slots = split[c];
        config.protected_frac = options.protected_frac;
        config.pool_mode = options.pool_mode;
        MG_ASSIGN_OR_RETURN(PolicyCache cache, PolicyCache::Create(options.policy, config));
        pool.info.n_slots = cache.config().n_slots;
        pool.cache.emplace(std::move(cache));
      } else {
        pool.info.n_slots = k_;
      }
      const size_t bytes = pool.info.pool_bytes();
      pool.slots = MapSlots(bytes);
      if (pool.slots == nullptr) {
        return absl::ResourceExhaustedError(absl::StrFormat(
            "--slots: cannot allocate the slot pool of size class %d (%d slots x %d bytes)", c,
            pool.info.n_slots, pool.info.block_bytes));
      }
      pools_.push_back(std::move(pool));
    }
    return absl::OkStatus();
  }

  void Provide(int layer, absl::Span<const int32_t> experts,
               absl::Span<ExpertWeights> weights) override {
    ProvideStart(layer, experts, weights);
    std::vector<int> ranks;
    while (std::find(rank_pending_.begin(), rank_pending_.end(), true) != rank_pending_.end()) {
      Arrive(&ranks);
    }
  }

  // The views at once; a miss read from the disk tier is pending until its
  // block is read whole (its reads run while the caller computes the others).
  void ProvideStart(int layer, absl::Span<const int32_t> experts,
                    absl::Span<ExpertWeights> weights) override {
    rank_pending_.assign(static_cast<size_t>(k_), false);
    rank_blocks_.assign(static_cast<size_t>(k_), nullptr);
    MG_CHECK(static_cast<int>(experts.size()) == k_ && weights.size() == experts.size(),
             "CpuBackend: k experts and k views per provide");
    // A step's record has a row per layer: the dense layers' (which route
    // nothing) are kMissingExpert. A batch's rows come layer by layer.
    const size_t n_layer = static_cast<size_t>(model_.config.n_layer);
    const uint64_t batch_row = provided_rows_[static_cast<size_t>(layer)]++;
    const size_t row_step = counters_.steps + batch_row;
    if (routing_.size() < (row_step + 1) * n_layer * k_) {
      routing_.resize((row_step + 1) * n_layer * k_, kMissingExpert);
    }
    std::copy(experts.begin(), experts.end(),
              routing_.begin() + static_cast<std::ptrdiff_t>((row_step * n_layer + layer) * k_));
    if (store_ == nullptr) {
      for (int r = 0; r < k_; ++r) {
        weights[r] = {model_.expert(layer, ExpertProj::kGate, experts[r]),
                      model_.expert(layer, ExpertProj::kUp, experts[r]),
                      model_.expert(layer, ExpertProj::kDown, experts[r])};
      }
      counters_.hits += static_cast<uint64_t>(k_);
      return;
    }
    // Ranks Route dropped take no slot; their views are rank 0's (kept
    // always), which their zero weight multiplies away.
    const std::vector<uint8_t>& drops = drops_[static_cast<size_t>(layer)];
    const auto dropped = [&](int r) {
      return (batch_row + 1) * k_ <= drops.size() && drops[batch_row * k_ + r] != 0;
    };
    step_ids_.assign(experts.begin(), experts.end());
    for (int r = 0; r < k_; ++r) {
      if (dropped(r)) step_ids_[r] = kNoExpert;
    }
    Pool& pool = pools_[static_cast<size_t>(store_->class_of(layer))];
    if (pool.cache.has_value()) {
      const LayerStep& step =
          pool.cache->Step(local_layer_[static_cast<size_t>(layer)], step_ids_.data());
      counters_.hits += static_cast<uint64_t>(step.outcome.n_hits);
      counters_.evictions += static_cast<uint64_t>(step.outcome.n_evictions);
      misses_.clear();
      for (int r = 0; r < k_; ++r) {
        if (step.missed[r]) misses_.push_back({layer, experts[r], &store_->layout(layer),
                                               pool.slot(step.slot_of_rank[r])});
      }
      Stage(pool);
      for (int r = 0; r < k_; ++r) {
        SetRank(r, pool, step.slot_of_rank[dropped(r) ? 0 : r], layer, weights);
      }
    } else {
      misses_.clear();
      for (int r = 0; r < k_; ++r) {
        if (!dropped(r)) {
          misses_.push_back({layer, experts[r], &store_->layout(layer), pool.slot(r)});
        }
      }
      Stage(pool);
      for (int r = 0; r < k_; ++r) SetRank(r, pool, dropped(r) ? 0 : r, layer, weights);
    }
  }

  bool Pending(int rank) const override { return rank_pending_[static_cast<size_t>(rank)]; }

  // The disk tier's next blocks, and the ranks they complete.
  void Arrive(std::vector<int>* ranks) override {
    const auto start = std::chrono::steady_clock::now();
    arrived_.clear();
    if (disk_ != nullptr && disk_->pending() > 0) {
      const uint64_t before = disk_->bytes_read();
      absl::Status read = disk_->Arrive(&arrived_);
      if (!read.ok() && read_error_.ok()) read_error_ = std::move(read);
      counters_.disk_bytes += disk_->bytes_read() - before;
    }
    for (const int i : arrived_) being_read_[static_cast<size_t>(i)] = false;
    for (int r = 0; r < k_; ++r) {
      if (rank_pending_[r] && !IsBeingRead(rank_blocks_[r])) {
        rank_pending_[r] = false;
        ranks->push_back(r);
      }
    }
    counters_.stage_ns += static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                    std::chrono::steady_clock::now() - start)
                                                    .count());
  }

  // Routing replay: the step being computed is the count of steps done so far,
  // plus the row's place in its batch (rows come in order, once per layer).
  void Route(int layer, absl::Span<const float> /*probs*/, absl::Span<int32_t> experts,
             absl::Span<double> weights) override {
    const uint64_t batch_row = batch_rows_[static_cast<size_t>(layer)]++;
    if (routing_trace_ != nullptr) {
      const RoutingTrace& trace = *routing_trace_;
      const int64_t step = static_cast<int64_t>((counters_.steps + batch_row) %
                                                static_cast<uint64_t>(trace.n_steps));
      if (trace.present(step, layer)) {
        const size_t row = trace.row_offset(step, layer);
        for (int r = 0; r < k_; ++r) {
          experts[r] = trace.ids[row + r];
          weights[r] = trace.weights.empty() ? 1.0 / k_ : f16_to_f32(trace.weights[row + r]);
        }
      }
    }
    DropCold(layer, batch_row, experts, weights);
  }

  // A prompt's rows keep their experts unless drop_in_prompts.
  void SetInPrompt(bool in_prompt) { in_prompt_ = in_prompt; }

  // Resident, or every pool holds all of its class's experts: nothing is ever
  // evicted.
  bool ViewsOutliveCalls() const override {
    for (const Pool& pool : pools_) {
      if (!pool.cache.has_value() ||
          pool.info.n_slots < static_cast<int32_t>(pool.info.layers.size()) * store_->n_expert()) {
        return false;
      }
    }
    return true;
  }

  // A forward call done: its rows are steps (a Truncate's refed ones too).
  void CountSteps() {
    for (std::vector<uint8_t>& d : drops_) d.clear();
    counters_.steps += provided_rows_[static_cast<size_t>(model_.config.n_layer_dense_lead)];
    std::fill(batch_rows_.begin(), batch_rows_.end(), 0);
    std::fill(provided_rows_.begin(), provided_rows_.end(), 0);
  }
  const EngineCounters& counters() const { return counters_; }
  // The first failed disk read since the last call (then cleared): the step
  // it served computed with a block that is not the expert's.
  absl::Status TakeReadError() { return std::exchange(read_error_, absl::OkStatus()); }
  const std::vector<Pool>& pools() const { return pools_; }
  const std::vector<int32_t>& routing() const { return routing_; }

 private:
  // The layer's misses (misses_) into their slots: from the disk tier all
  // started at once (being_read_ until Arrive hands them back), else copied
  // from the store. stage_ns: the time spent here and waiting in Arrive.
  void Stage(const Pool& pool) {
    being_read_.assign(misses_.size(), false);
    if (misses_.empty()) return;
    const auto start = std::chrono::steady_clock::now();
    if (disk_ != nullptr) {
      const uint64_t before = disk_->bytes_read();
      absl::Status read = disk_->Start(misses_);
      if (!read.ok() && read_error_.ok()) read_error_ = std::move(read);
      // Blocks the reader holds arrive through Arrive; none where Start failed first.
      if (disk_->pending() > 0) std::fill(being_read_.begin(), being_read_.end(), true);
      counters_.disk_bytes += disk_->bytes_read() - before;
      counters_.disk_reads += misses_.size();
    } else {
      for (const BlockRead& miss : misses_) {
        std::memcpy(miss.block, store_->block(miss.layer, miss.expert), pool.info.block_bytes);
      }
    }
    const auto elapsed = std::chrono::steady_clock::now() - start;
    counters_.stage_ns += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed).count());
    counters_.misses += misses_.size();
    counters_.bytes_staged += pool.info.block_bytes * misses_.size();
  }

  // Rank r's views: the block of slot in pool, pending while it is being read.
  void SetRank(int r, const Pool& pool, int32_t slot, int layer,
               absl::Span<ExpertWeights> weights) {
    weights[r] = SlotWeights(pool, slot, layer);
    rank_blocks_[static_cast<size_t>(r)] = pool.slot(slot);
    rank_pending_[static_cast<size_t>(r)] = IsBeingRead(pool.slot(slot));
  }

  bool IsBeingRead(const uint8_t* block) const {
    for (size_t i = 0; i < misses_.size(); ++i) {
      if (being_read_[i] && misses_[i].block == block) return true;
    }
    return false;
  }

  // --drop-cold-experts: the row's ranks drop_routing drops get weight 0 and
  // are marked for Provide, which neither looks them up nor reads them.
  void DropCold(int layer, uint64_t batch_row, absl::Span<const int32_t> experts,
                absl::Span<double> weights) {
    if (drop_strength_ <= 0 || store_ == nullptr || (in_prompt_ && !drop_in_prompts_)) return;
    const Pool& pool = pools_[static_cast<size_t>(store_->class_of(layer))];
    std::vector<uint8_t>& drops = drops_[static_cast<size_t>(layer)];
    drops.resize((batch_row + 1) * k_, 0);
    for (int r = 0; r < k_; ++r) {
      const bool resident =
          pool.cache.has_value() &&
          pool.cache->table()[static_cast<size_t>(residency_key(
              local_layer_[static_cast<size_t>(layer)], experts[r], store_->n_expert()))] !=
              kNoSlot;
      if (!drop_routing(r, k_, weights[r], drop_strength_, resident)) continue;
      drops[batch_row * k_ + r] = 1;
      ++counters_.dropped;
      counters_.dropped_weight += weights[r];
      weights[r] = 0.0;
    }
  }

  ExpertWeights SlotWeights(const Pool& pool, int32_t slot, int layer) const {
    const ExpertBlockLayout& layout = store_->layout(layer);
    const uint8_t* block = pool.slot(slot);
    return {ProjectionView(layout, ExpertProj::kGate, block),
            ProjectionView(layout, ExpertProj::kUp, block),
            ProjectionView(layout, ExpertProj::kDown, block)};
  }

  const Model& model_;
  const ExpertStore* store_;  // null: resident
  ExpertFileReader* const disk_;  // null: misses copy from the store's memory
  absl::Status read_error_;
  std::vector<BlockRead> misses_;  // the layer being provided: its misses and their slots
  std::vector<bool> being_read_;   // per miss: started on the disk, not yet arrived
  std::vector<int> arrived_;       // Arrive's: the misses the reader handed back
  std::vector<const uint8_t*> rank_blocks_;  // the row's ranks' blocks
  std::vector<bool> rank_pending_;           // per rank: its block is being read
  double drop_strength_ = 0;      // --drop-cold-experts F; 0: off
  bool drop_in_prompts_ = false;
  bool in_prompt_ = false;
  std::vector<std::vector<uint8_t>> drops_;  // per layer: the batch's rows x k, 1 = dropped
  std::vector<int32_t> step_ids_;            // a row's ids for the cache step (kNoExpert: dropped)
  const int k_;
  const RoutingTrace* routing_trace_;
  std::vector<int32_t> local_layer_;  // model layer -> its number in its class's cache
  std::vector<uint64_t> batch_rows_;  // per layer: rows routed so far in this batch
  std::vector<uint64_t> provided_rows_;  // per layer: rows provided so far in this batch
  std::vector<Pool> pools_;
  EngineCounters counters_;
  std::vector<int32_t> routing_;
};

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(const Model& model,
                                                               const ExpertStore* store,
                                                               const CpuBackendOptions& options) {
  MG_CHECK(options.resident || store != nullptr, "CpuBackend: no expert store and not resident");
  if (options.resident) store = nullptr;
  MG_CHECK(store == nullptr || (store->n_layer() == model.config.n_layer &&
                                store->n_expert() == model.config.n_expert),
           "CpuBackend: the expert store was built from another model");
  if (options.n_slots < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--slots %d must be auto (0) or at least --top-k %d", options.n_slots,
        model.config.n_expert_used));
  }
  if (options.routing_trace != nullptr) {
    MG_RETURN_IF_ERROR(CheckRoutingTrace(*options.routing_trace, model.config));
  }
  std::unique_ptr<CpuBackend> backend(new CpuBackend());
  backend->model_ = &model;
  backend->max_ctx_ = options.max_ctx;
  MG_CHECK(store == nullptr || options.disk != nullptr || store->data() != nullptr,
           "CpuBackend: a store without blocks needs the disk tier");
  if (options.drop_cold < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--drop-cold-experts %g must not be negative (0: off)", options.drop_cold));
  }
  backend->experts_ = std::make_unique<SlotExperts>(
      model, store, store == nullptr ? nullptr : options.disk, model.config.n_expert_used,
      options.routing_trace, options.drop_cold, options.drop_in_prompts);
  if (store != nullptr) MG_RETURN_IF_ERROR(backend->experts_->AddPools(options));
  for (const SlotExperts::Pool& pool : backend->experts_->pools()) {
    backend->pools_.push_back(pool.info);
  }
  backend->oracle_arithmetic_ = options.oracle_arithmetic;
  if (options.oracle_arithmetic) {
    MG_ASSIGN_OR_RETURN(backend->oracle_,
                        Oracle::Create(model, options.max_ctx, backend->experts_.get()));
    backend->kv_bytes_ = KvCacheBytes(model.config, options.max_ctx, KvCacheType::kF32);
  } else {
    // Token by token, a ubatch is one token (and a windowed layer's ring n_swa + 1 rows).
    CpuForwardOptions fast = options.fast;
    if (!backend->BatchesPrompts()) fast.ubatch = 1;
    MG_ASSIGN_OR_RETURN(backend->oracle_,
                        CreateCpuForward(model, options.max_ctx, backend->experts_.get(), fast));
    backend->kv_bytes_ =
        KvCacheBytes(model.config, options.max_ctx, fast.kv_type, fast.ring_slack());
  }
  return backend;
}

CpuBackend::~CpuBackend() = default;

absl::StatusOr<std::vector<float>> CpuBackend::Forward(absl::Span<const int32_t> tokens) {
  return Run(tokens, /*all_logits=*/true);
}

absl::StatusOr<std::vector<float>> CpuBackend::ForwardLast(absl::Span<const int32_t> tokens) {
  return Run(tokens, /*all_logits=*/false);
}

absl::StatusOr<std::vector<float>> CpuBackend::Run(absl::Span<const int32_t> tokens,
                                                   bool all_logits) {
  if (tokens.empty()) {
    return absl::InvalidArgumentError("cpu backend: Forward needs at least one token");
  }
  // Checked up front so that a bad batch leaves no step half done.
  const int n_vocab = model_->config.n_vocab;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= n_vocab) {
      return absl::InvalidArgumentError(
          absl::StrFormat("cpu backend: token %d at index %d is outside the vocabulary [0, %d)",
                          tokens[i], i, n_vocab));
    }
  }
  if (tokens.size() > static_cast<size_t>(max_ctx_ - n_past())) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("cpu backend: %d cached + %d new tokens exceed the context size %d",
                        n_past(), tokens.size(), max_ctx_));
  }
  // The fast path feeds a batch itself, in ubatches of one token where the
  // slots are fewer than the experts (so its state checkpoints see the call).
  // A failed disk read: the positions fed with it are dropped again.
  const int start = n_past();
  experts_->SetInPrompt(tokens.size() > 1);
  const auto read_failed = [&]() {
    absl::Status error = experts_->TakeReadError();
    if (!error.ok()) oracle_->Truncate(start);
    return error;
  };
  if (experts_->ViewsOutliveCalls() || !oracle_arithmetic_) {
    absl::StatusOr<std::vector<float>> logits =
        all_logits ? oracle_->Forward(tokens) : oracle_->ForwardLast(tokens);
    experts_->CountSteps();
    MG_RETURN_IF_ERROR(read_failed());
    return logits;
  }
  std::vector<float> logits;
  for (size_t i = 0; i < tokens.size(); ++i) {
    MG_ASSIGN_OR_RETURN(std::vector<float> step, oracle_->Forward({tokens[i]}));
    experts_->CountSteps();
    MG_RETURN_IF_ERROR(read_failed());
    if (all_logits || i + 1 == tokens.size()) logits.insert(logits.end(), step.begin(), step.end());
  }
  return logits;
}

int CpuBackend::n_past() const { return oracle_->n_past(); }

void CpuBackend::Truncate(int n_keep) { oracle_->Truncate(n_keep); }

int CpuBackend::ResumePosition(int n_keep) const { return oracle_->ResumePosition(n_keep); }

bool CpuBackend::BatchesPrompts() const { return experts_->ViewsOutliveCalls(); }

const EngineCounters& CpuBackend::counters() const { return experts_->counters(); }

const std::vector<SlotPoolInfo>& CpuBackend::pools() const { return pools_; }

const PolicyCache* CpuBackend::cache(int size_class) const {
  const SlotExperts::Pool& pool = experts_->pools()[static_cast<size_t>(size_class)];
  return pool.cache.has_value() ? &*pool.cache : nullptr;
}

const uint8_t* CpuBackend::slot_block(int size_class, int32_t slot) const {
  return experts_->pools()[static_cast<size_t>(size_class)].slot(slot);
}

const std::vector<int32_t>& CpuBackend::routing() const { return experts_->routing(); }

}  // namespace moegraph
