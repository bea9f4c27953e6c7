// The CUDA engine behind GateEngine. Every logit row comes from a readback
// outside the walk, so a gate that counts host syncs decodes with LogitRows::kNone.
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
    // The engine keeps only the last step's logits: decode each prefix of the
    // transcript for one token, which must be the token the full decode picked.
    std::vector<int32_t> prefix(prompt.begin(), prompt.end());
    for (size_t i = 0; i < out.tokens.size(); ++i) {
      MG_ASSIGN_OR_RETURN(const std::vector<int32_t> next, engine_->Generate(prefix, 1));
      if (next.size() != 1 || next[0] != out.tokens[i]) {
        return absl::InternalError(absl::StrFormat(
            "cuda engine: token %d of a decode was %d, but decoding its prefix again gave %d", i,
            out.tokens[i], next.empty() ? -1 : next[0]));
      }
      MG_ASSIGN_OR_RETURN(const std::vector<float> logits, engine_->LastLogits());
      out.logits.insert(out.logits.end(), logits.begin(), logits.end());
      prefix.push_back(out.tokens[i]);
    }
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
        MG_ASSIGN_OR_RETURN(std::unique_ptr<CudaEngine> engine,
                            CudaEngine::Create(model, store, options));
        return std::make_unique<CudaGateEngine>(std::move(engine));
      };
}

}  // namespace moegraph
