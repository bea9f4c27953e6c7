// The disk tier (loader/expert_file.h, CpuBackendOptions::disk): every block
// read from the file equals the store's copy of it, with O_DIRECT and
// through the page cache, through io_uring and by pread, one at a time and in
// batches, from merged and per-expert tensors and from split files; the CPU backend reading its misses from disk gives the resident
// run's tokens and logits bit for bit at every budget, policy and thread
// count, its disk counters moving; a file changed under it is an error
// naming it, never wrong weights.
#include "loader/expert_file.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cpu/cpu_backend.h"
#include "loader/fixture.h"
#include "loader/gguf.h"
#include "loader/gguf_split.h"
#include "loader/placement.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::TempPath;

// A fixture written to a file and opened from it, as a user's model is.
struct OnDisk {
  std::string path;
  std::unique_ptr<GgufFile> file;
  Model model;
  ~OnDisk() { std::remove(path.c_str()); }
};

std::unique_ptr<OnDisk> Write(const FixtureSpec& spec, const std::string& name) {
  auto d = std::make_unique<OnDisk>();
  d->path = TempPath(name);
  const absl::Status written = WriteFixture(spec, d->path);
  EXPECT_TRUE(written.ok()) << written;
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(d->path);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return nullptr;
  d->file = *std::move(file);
  absl::StatusOr<Model> model = LoadModel(*d->file);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return nullptr;
  d->model = *std::move(model);
  return d;
}

FixtureSpec Spec() {
  FixtureSpec spec;
  spec.n_layer = 3;
  spec.n_expert = 16;
  spec.n_expert_used = 4;
  spec.n_embd = 256;
  spec.n_ff_exp = 256;
  spec.n_vocab = 128;
  spec.expert_type = GgmlType::kQ4_K;
  spec.dense_type = GgmlType::kQ8_0;
  spec.router_skew = 1.0f;
  spec.seed = 3;
  return spec;
}

// Every block of model read by a reader equals ExpertStore's copy, read one
// at a time and all in one batch (more slices than the ring's depth).
void ExpectBlocksEqualTheStores(const Model& model, bool direct, bool uring,
                                const std::string& what) {
  absl::StatusOr<ExpertStore> store = ExpertStore::Create(model);
  ASSERT_TRUE(store.ok()) << store.status();
  absl::StatusOr<std::unique_ptr<ExpertFileReader>> reader =
      ExpertFileReader::Open(model, direct, uring);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->uring(), uring) << what;  // this kernel allows io_uring
  std::vector<BlockRead> batch;
  std::vector<std::vector<uint8_t>> blocks;
  for (int layer = model.config.n_layer_dense_lead; layer < model.config.n_layer; ++layer) {
    std::vector<uint8_t> block(store->block_bytes(layer), 0xAB);
    for (int e = 0; e < model.config.n_expert; ++e) {
      ASSERT_TRUE((*reader)->ReadBlock(layer, e, store->layout(layer), block.data()).ok());
      ASSERT_EQ(std::memcmp(block.data(), store->block(layer, e), block.size()), 0)
          << what << ": layer " << layer << " expert " << e;
      blocks.emplace_back(store->block_bytes(layer), 0xCD);
    }
  }
  size_t i = 0;
  for (int layer = model.config.n_layer_dense_lead; layer < model.config.n_layer; ++layer) {
    for (int e = 0; e < model.config.n_expert; ++e) {
      batch.push_back({layer, e, &store->layout(layer), blocks[i++].data()});
    }
  }
  ASSERT_TRUE((*reader)->ReadBlocks(batch).ok()) << what;
  for (const BlockRead& b : batch) {
    ASSERT_EQ(std::memcmp(b.block, store->block(b.layer, b.expert), store->block_bytes(b.layer)),
              0)
        << what << " batched: layer " << b.layer << " expert " << b.expert;
  }
  EXPECT_EQ((*reader)->reads(), 2 * 3 * static_cast<uint64_t>(batch.size())) << what;
  EXPECT_GE((*reader)->bytes_read(), store->total_bytes()) << what;
}

TEST(ExpertFileTest, EveryBlockReadFromTheFileIsTheStoresCopy) {
  FixtureSpec wide = Spec();
  wide.n_expert = 32;
  std::unique_ptr<OnDisk> merged = Write(wide, "expert-file-merged.gguf");
  ASSERT_NE(merged, nullptr);
  FixtureSpec legacy = Spec();
  legacy.arch = Arch::kMixtral;
  legacy.legacy_experts = true;
  legacy.n_expert = 8;
  legacy.n_expert_used = 2;
  legacy.expert_type = GgmlType::kQ8_0;
  std::unique_ptr<OnDisk> per_expert = Write(legacy, "expert-file-legacy.gguf");
  ASSERT_NE(per_expert, nullptr);
  FixtureSpec glm = Spec();
  glm.arch = Arch::kGlm4Moe;
  std::unique_ptr<OnDisk> dense_lead = Write(glm, "expert-file-glm.gguf");
  ASSERT_NE(dense_lead, nullptr);
  ASSERT_GT(3 * merged->model.config.n_moe_layer() * merged->model.config.n_expert,
            ExpertFileReader::kQueueDepth);  // the batch takes more than one ring's worth
  for (const bool direct : {true, false}) {
    for (const bool uring : {true, false}) {
      ExpectBlocksEqualTheStores(merged->model, direct, uring, "merged");
      ExpectBlocksEqualTheStores(per_expert->model, direct, uring, "legacy");
      ExpectBlocksEqualTheStores(dense_lead->model, direct, uring, "glm4moe");
    }
  }
}

TEST(ExpertFileTest, SplitFilesAreReadFromTheShardHoldingEachTensor) {
  std::unique_ptr<OnDisk> whole = Write(Spec(), "expert-file-split-src.gguf");
  ASSERT_NE(whole, nullptr);
  SplitOptions options;
  options.max_tensors = 7;
  absl::StatusOr<std::vector<std::vector<size_t>>> plan = PlanSplit(*whole->file, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::string prefix = TempPath("expert-file-split");
  absl::StatusOr<std::vector<std::string>> paths = WriteSplit(*whole->file, *plan, prefix);
  ASSERT_TRUE(paths.ok()) << paths.status();
  ASSERT_GE(paths->size(), 3u);
  {
    absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(paths->front());
    ASSERT_TRUE(file.ok()) << file.status();
    absl::StatusOr<Model> model = LoadModel(**file);
    ASSERT_TRUE(model.ok()) << model.status();
    ExpectBlocksEqualTheStores(*model, true, true, "split");
  }
  for (const std::string& p : *paths) std::remove(p.c_str());
}

// Logits of a fixed token sequence, fed one token a step, and the counters after.
struct Decoded {
  std::vector<float> logits;
  EngineCounters counters;
};

Decoded Decode(CpuBackend& backend) {
  const std::vector<int32_t> tokens = {5, 17, 3, 99, 42, 7, 7, 64, 1, 120, 33, 8, 15, 90};
  Decoded run;
  for (const int32_t t : tokens) {
    absl::StatusOr<std::vector<float>> step = backend.Forward({t});
    EXPECT_TRUE(step.ok()) << step.status();
    if (!step.ok()) break;
    run.logits.insert(run.logits.end(), step->begin(), step->end());
  }
  run.counters = backend.counters();
  return run;
}

TEST(ExpertFileTest, TheDiskTierGivesTheResidentRunsLogitsAtEveryBudgetPolicyAndThreadCount) {
  std::unique_ptr<OnDisk> d = Write(Spec(), "expert-file-backend.gguf");
  ASSERT_NE(d, nullptr);
  const Model& model = d->model;
  CpuBackendOptions resident_options;
  resident_options.max_ctx = 32;
  resident_options.resident = true;
  absl::StatusOr<std::unique_ptr<CpuBackend>> resident =
      CpuBackend::Create(model, nullptr, resident_options);
  ASSERT_TRUE(resident.ok()) << resident.status();
  const Decoded want = Decode(**resident);
  ASSERT_FALSE(want.logits.empty());

  absl::StatusOr<ExpertStore> layouts = ExpertStore::Layouts(model);
  ASSERT_TRUE(layouts.ok()) << layouts.status();
  EXPECT_EQ(layouts->data(), nullptr);  // no block is held in memory
  const int working_set = model.config.n_moe_layer() * model.config.n_expert_used;
  const int all = model.config.n_moe_layer() * model.config.n_expert;
  for (const int slots : {working_set, (working_set + all) / 2, all}) {
    for (const ResidencyPolicy policy :
         {ResidencyPolicy::kHazard, ResidencyPolicy::kLru, ResidencyPolicy::kSlru}) {
      for (const int threads : {1, 2}) {
        absl::StatusOr<std::unique_ptr<ExpertFileReader>> reader = ExpertFileReader::Open(model);
        ASSERT_TRUE(reader.ok()) << reader.status();
        CpuBackendOptions options;
        options.max_ctx = 32;
        options.n_slots = slots;
        options.policy = policy;
        options.fast.threads = threads;
        options.disk = reader->get();
        absl::StatusOr<std::unique_ptr<CpuBackend>> backend =
            CpuBackend::Create(model, &*layouts, options);
        ASSERT_TRUE(backend.ok()) << backend.status();
        const Decoded got = Decode(**backend);
        const std::string at = "slots " + std::to_string(slots) + ", policy " +
                               std::to_string(static_cast<int>(policy)) + ", threads " +
                               std::to_string(threads);
        ASSERT_EQ(got.logits.size(), want.logits.size()) << at;
        EXPECT_EQ(std::memcmp(got.logits.data(), want.logits.data(),
                              want.logits.size() * sizeof(float)),
                  0)
            << at;
        // Every miss was a read from the file, of at least its block's bytes.
        EXPECT_GT(got.counters.misses, 0u) << at;
        EXPECT_EQ(got.counters.disk_reads, got.counters.misses) << at;
        EXPECT_GE(got.counters.disk_bytes, got.counters.bytes_staged / 2) << at;
        EXPECT_EQ((*reader)->reads(), 3 * got.counters.disk_reads) << at;
        if (slots == working_set) {
          EXPECT_GT(got.counters.evictions, 0u) << at;
        }
      }
    }
  }
}

TEST(ExpertFileTest, AFileChangedUnderTheEngineIsAnErrorNamingItNeverWrongWeights) {
  std::unique_ptr<OnDisk> d = Write(Spec(), "expert-file-changed.gguf");
  ASSERT_NE(d, nullptr);
  const Model& model = d->model;
  absl::StatusOr<ExpertStore> layouts = ExpertStore::Layouts(model);
  ASSERT_TRUE(layouts.ok());
  absl::StatusOr<std::unique_ptr<ExpertFileReader>> reader = ExpertFileReader::Open(model);
  ASSERT_TRUE(reader.ok()) << reader.status();
  CpuBackendOptions options;
  options.max_ctx = 32;
  options.n_slots = model.config.n_moe_layer() * model.config.n_expert_used;
  options.disk = reader->get();
  absl::StatusOr<std::unique_ptr<CpuBackend>> backend =
      CpuBackend::Create(model, &*layouts, options);
  ASSERT_TRUE(backend.ok()) << backend.status();
  ASSERT_TRUE((*backend)->Forward({5}).ok());
  const int fed = (*backend)->n_past();

  // A new modification time, the bytes the same: the file is not trusted.
  const timespec times[2] = {{0, UTIME_OMIT}, {12345, 0}};
  ASSERT_EQ(utimensat(AT_FDCWD, d->path.c_str(), times, 0), 0);
  std::vector<uint8_t> block(layouts->block_bytes(0));
  const absl::Status changed = (*reader)->ReadBlock(0, 1, layouts->layout(0), block.data());
  EXPECT_FALSE(changed.ok());
  EXPECT_TRUE(testing_util::Contains(changed.message(), d->path));
  EXPECT_TRUE(testing_util::Contains(changed.message(), "changed since it was opened"));
  // The backend's next miss fails the step, which is dropped.
  absl::Status step = absl::OkStatus();
  for (int32_t t = 0; t < 64 && step.ok(); ++t) step = (*backend)->Forward({t}).status();
  EXPECT_FALSE(step.ok());
  EXPECT_TRUE(testing_util::Contains(step.message(), d->path)) << step;
  EXPECT_GE((*backend)->n_past(), fed);

  // Truncated: a fresh reader fails the read past the end, naming the tensor.
  ASSERT_EQ(truncate(d->path.c_str(), static_cast<off_t>(d->file->data_offset() + 64)), 0);
  absl::StatusOr<std::unique_ptr<ExpertFileReader>> fresh = ExpertFileReader::Open(model, false);
  ASSERT_TRUE(fresh.ok());
  const absl::Status short_read = (*fresh)->ReadBlock(0, 3, layouts->layout(0), block.data());
  EXPECT_FALSE(short_read.ok());
  EXPECT_TRUE(testing_util::Contains(short_read.message(), "blk.0.ffn_")) << short_read;
  EXPECT_TRUE(testing_util::Contains(short_read.message(), "truncated")) << short_read;
}

}  // namespace
}  // namespace moegraph
