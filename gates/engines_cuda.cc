// The CUDA engine behind GateEngine. Logit rows come from a readback outside the
// walk, so a gate that counts host syncs decodes with LogitRows::kNone.
#include <map>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "gates/engines.h"
#include "loader/status_util.h"

namespace moegraph {
namespace {

class CudaGateEngine final : public GateEngine {
 public:
  explicit CudaGateEngine(std::unique_ptr<CudaEngine> engine) : engine_(std::move(engine)) {}

  absl::StatusOr<Transcript> Decode(absl::Span<const int32_t> prompt, int n_predict,
                                    LogitRows rows) override {
    Transcript out;
    MG_ASSIGN_OR_RETURN(out.tokens, engine_->Generate(prompt, n_predict));
    if (rows == LogitRows::kLast && n_predict > 0) {
      MG_ASSIGN_OR_RETURN(out.logits, engine_->LastLogits());
    }
    if (rows != LogitRows::kEvery) return out;
    // Token i was picked by the logits of step (prompt length - 1 + i).
    MG_ASSIGN_OR_RETURN(out.logits,
                        engine_->ReadLogitsRecord(static_cast<int>(prompt.size()) - 1, n_predict));
    return out;
  }

  absl::StatusOr<CounterSnapshot> Snapshot() override {
    const HostCounters host_begin = engine_->host_counters();
    MG_ASSIGN_OR_RETURN(const EngineCounters engine, engine_->ReadCounters());
    MG_ASSIGN_OR_RETURN(const DeviceCounters device, engine_->ReadDeviceCounters());
    return SnapshotOf(engine, device, host_begin, engine_->host_counters());
  }
  const std::vector<int32_t>& routing() const override { return engine_->routing(); }
  const std::vector<SlotPoolInfo>& pools() const override { return engine_->pools(); }
  absl::StatusOr<ResidencySnapshot> Residency(int size_class) override {
    return engine_->ReadResidency(size_class);
  }

 private:
  std::unique_ptr<CudaEngine> engine_;
};

}  // namespace

EngineFactory CudaEngineFactory() {
  // The experts are pinned once per model for every engine of the run (each
  // would otherwise pin a copy of its own); an engine keeps its store alive.
  auto stores = std::make_shared<std::map<const Model*, std::shared_ptr<const ExpertStore>>>();
  return
      [stores](const Model& model,
               const ArmSpec& spec) -> absl::StatusOr<std::unique_ptr<GateEngine>> {
        std::shared_ptr<const ExpertStore>& store = (*stores)[&model];
        if (store == nullptr) {
          MG_ASSIGN_OR_RETURN(store, CudaEngine::PinExperts(model));
        }
        CudaEngineOptions options;
        options.max_ctx = spec.max_ctx;
        options.n_slots = spec.n_slots;
        options.doors = spec.doors;
        options.steps_per_launch = spec.steps_per_launch;
        options.record_routing = spec.record_routing;
        options.record_logits = spec.record_logits;
        MG_ASSIGN_OR_RETURN(std::unique_ptr<CudaEngine> engine,
                            CudaEngine::Create(model, store, options));
        return std::make_unique<CudaGateEngine>(std::move(engine));
      };
}

}  // namespace moegraph
