// The CPU backend behind GateEngine. Of the doors, the cache, the policy and its
// protected share mean something on the host; graph, residency mode and split
// passes have no CPU counterpart and are ignored.
#include <map>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "gates/engines.h"
#include "loader/placement.h"
#include "loader/status_util.h"
#include "reference/ops.h"

namespace moegraph {
namespace {

using StoreMap = std::map<const Model*, std::unique_ptr<ExpertStore>>;

class CpuGateEngine final : public GateEngine {
 public:
  CpuGateEngine(std::shared_ptr<const StoreMap> stores, std::unique_ptr<CpuBackend> backend)
      : stores_(std::move(stores)), backend_(std::move(backend)) {}

  absl::StatusOr<Transcript> Decode(absl::Span<const int32_t> prompt, int n_predict,
                                    LogitRows rows) override {
    backend_->Reset();
    Transcript out;
    MG_ASSIGN_OR_RETURN(std::vector<float> logits, backend_->Forward(prompt));
    const size_t n_vocab = logits.size() / prompt.size();
    logits.erase(logits.begin(), logits.end() - static_cast<ptrdiff_t>(n_vocab));
    for (int i = 0; i < n_predict; ++i) {
      out.tokens.push_back(ArgMax(logits));
      if (rows == LogitRows::kEvery || (rows == LogitRows::kLast && i == n_predict - 1)) {
        out.logits.insert(out.logits.end(), logits.begin(), logits.end());
      }
      if (i + 1 < n_predict) {
        MG_ASSIGN_OR_RETURN(logits, backend_->Forward({out.tokens.back()}));
      }
    }
    return out;
  }

  absl::StatusOr<CounterSnapshot> Snapshot() override { return SnapshotOf(backend_->counters()); }
  const std::vector<int32_t>& routing() const override { return backend_->routing(); }
  const std::vector<SlotPoolInfo>& pools() const override { return backend_->pools(); }

  absl::StatusOr<ResidencySnapshot> Residency(int size_class) override {
    if (size_class < 0 || size_class >= static_cast<int>(backend_->pools().size())) {
      return absl::OutOfRangeError(
          absl::StrFormat("size class %d of %d", size_class, backend_->pools().size()));
    }
    const PolicyCache* cache = backend_->cache(size_class);
    if (cache == nullptr) {
      return absl::FailedPreconditionError(
          "backend cpu: no residency state with the cache off (MOEGRAPH_MOE_CACHE=0)");
    }
    return cache->Snapshot();
  }

 private:
  // The backend reads its store: declared first, so destroyed after the backend.
  std::shared_ptr<const StoreMap> stores_;
  std::unique_ptr<CpuBackend> backend_;
};

CpuBackendOptions OptionsOf(const ArmSpec& spec) {
  CpuBackendOptions options;
  options.max_ctx = spec.max_ctx;
  options.n_slots = spec.n_slots;
  options.resident = spec.doors.resident;
  options.policy = spec.doors.policy;
  options.protected_frac = spec.doors.protected_frac;
  options.cache = spec.doors.moe_cache;
  return options;
}

}  // namespace

EngineFactory CpuEngineFactory() {
  // A store is a copy of every expert: made once per model, shared by the
  // factory's copies and kept alive by every engine that reads it.
  auto stores = std::make_shared<StoreMap>();
  return [stores](const Model& model,
                  const ArmSpec& spec) -> absl::StatusOr<std::unique_ptr<GateEngine>> {
    std::unique_ptr<ExpertStore>& store = (*stores)[&model];
    if (store == nullptr && !spec.doors.resident) {  // resident reads the file in place
      MG_ASSIGN_OR_RETURN(ExpertStore created, ExpertStore::Create(model));
      store = std::make_unique<ExpertStore>(std::move(created));
    }
    MG_ASSIGN_OR_RETURN(std::unique_ptr<CpuBackend> backend,
                        CpuBackend::Create(model, store.get(), OptionsOf(spec)));
    return std::make_unique<CpuGateEngine>(stores, std::move(backend));
  };
}

}  // namespace moegraph
