// Split GGUF models (loader/gguf_split.h): a fixture split into 3 shards, by WriteSplit
// and by `moegraph gguf-split`, opens as the same tensors (names, types, shapes, bytes)
// and decodes the same greedy tokens as the whole file; the shards are laid out as
// llama.cpp's gguf-split writes them; shard sets llama.cpp refuses (a later shard given,
// a missing shard, a tensor in two shards, a wrong split.no, split.count or
// split.tensors.count) are refused naming the file at fault.
#include "loader/gguf_split.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "loader/fixture.h"
#include "loader/gguf.h"
#include "loader/gguf_writer.h"
#include "loader/model_config.h"
#include "reference/oracle.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::Contains;
using testing_util::IdsAfter;
using testing_util::ProcessResult;
using testing_util::RunProcess;
using testing_util::TempPath;

constexpr int kShardTensors = 10;  // the fixture's 27 tensors: shards of 10, 10 and 7

// A folder of the test temp folder, removed with everything in it at scope exit.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& name) : path_(TempPath(name)) {
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() { std::filesystem::remove_all(path_); }
  std::string Path(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

class GgufSplitTest : public testing_util::FixtureFileTest {
 protected:
  static void SetUpTestSuite() {
    FixtureSpec spec;
    spec.arch = Arch::kQwen3Moe;
    spec.n_expert = 4;
    spec.router_skew = 1.0f;
    spec.seed = 21;
    WriteSuiteFixture(spec, "gguf_split_whole.gguf");
  }

  static std::unique_ptr<GgufFile> OpenOrFail(const std::string& path) {
    absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
    EXPECT_TRUE(file.ok()) << file.status();
    return file.ok() ? std::move(*file) : nullptr;
  }

  // The fixture split by WriteSplit into kShardTensors-tensor shards under prefix.
  static std::vector<std::string> SplitFixture(const std::string& prefix) {
    std::unique_ptr<GgufFile> whole = OpenOrFail(fixture_path());
    if (whole == nullptr) return {};
    SplitOptions options;
    options.max_tensors = kShardTensors;
    absl::StatusOr<std::vector<std::vector<size_t>>> plan = PlanSplit(*whole, options);
    EXPECT_TRUE(plan.ok()) << plan.status();
    if (!plan.ok()) return {};
    absl::StatusOr<std::vector<std::string>> paths = WriteSplit(*whole, *plan, prefix);
    EXPECT_TRUE(paths.ok()) << paths.status();
    return paths.ok() ? *paths : std::vector<std::string>();
  }

  static std::vector<int32_t> Greedy(const GgufFile& file) {
    absl::StatusOr<Model> model = LoadModel(file);
    EXPECT_TRUE(model.ok()) << model.status();
    if (!model.ok()) return {};
    absl::StatusOr<std::unique_ptr<Oracle>> oracle = Oracle::Create(*model, 16);
    EXPECT_TRUE(oracle.ok()) << oracle.status();
    if (!oracle.ok()) return {};
    absl::StatusOr<std::vector<int32_t>> ids = (*oracle)->Generate({1, 2, 3}, 8);
    EXPECT_TRUE(ids.ok()) << ids.status();
    return ids.ok() ? *ids : std::vector<int32_t>();
  }
};

// Same names in the same order, types, shapes and bytes.
void ExpectSameTensors(const GgufFile& want, const GgufFile& got) {
  ASSERT_EQ(got.tensors().size(), want.tensors().size());
  for (size_t i = 0; i < want.tensors().size(); ++i) {
    const GgufTensor& a = want.tensors()[i];
    const GgufTensor& b = got.tensors()[i];
    EXPECT_EQ(b.name, a.name);
    EXPECT_EQ(b.type, a.type) << a.name;
    EXPECT_EQ(b.shape_string(), a.shape_string()) << a.name;
    ASSERT_EQ(b.nbytes, a.nbytes) << a.name;
    EXPECT_EQ(std::memcmp(b.data, a.data, a.nbytes), 0) << a.name;
    EXPECT_EQ(got.FindTensor(a.name), &b) << a.name;
  }
}

TEST_F(GgufSplitTest, ThreeShardsOpenAsTheWholeFilesTensorsAndDecodeItsTokens) {
  ScratchDir dir("split_three");
  const std::vector<std::string> paths = SplitFixture(dir.Path("model"));
  ASSERT_EQ(paths.size(), 3u);
  EXPECT_EQ(paths[0], dir.Path("model-00001-of-00003.gguf"));
  EXPECT_EQ(paths[2], dir.Path("model-00003-of-00003.gguf"));
  std::unique_ptr<GgufFile> whole = OpenOrFail(fixture_path());
  std::unique_ptr<GgufFile> split = OpenOrFail(paths[0]);
  ASSERT_NE(whole, nullptr);
  ASSERT_NE(split, nullptr);
  ASSERT_EQ(whole->tensors().size(), 27u);
  ExpectSameTensors(*whole, *split);

  // Each tensor's data lies in its own shard's mapping, 10, 10 and 7 of them.
  ASSERT_EQ(split->shard_count(), 3);
  std::vector<int> per_shard(3, 0);
  uint64_t total = 0;
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(split->shard(s).path(), paths[s]);
    EXPECT_EQ(split->shard(s).file_size(), std::filesystem::file_size(paths[s]));
    total += split->shard(s).file_size();
  }
  for (const GgufTensor& t : split->tensors()) {
    ASSERT_GE(t.shard, 0);
    ASSERT_LT(t.shard, 3);
    ++per_shard[t.shard];
    const GgufFile& holder = split->shard(t.shard);
    const uint8_t* base = holder.tensors().front().data - holder.tensors().front().offset;
    EXPECT_EQ(t.data, base + t.offset) << t.name;
  }
  EXPECT_EQ(per_shard, (std::vector<int>{10, 10, 7}));
  EXPECT_EQ(split->total_size(), total);
  EXPECT_EQ(whole->total_size(), whole->file_size());

  const std::vector<int32_t> want = Greedy(*whole);
  ASSERT_EQ(want.size(), 8u);
  EXPECT_EQ(Greedy(*split), want);

  // Read into memory (--load-mode none), every shard's bytes move to its copy.
  LoadOptions read;
  read.mode = LoadMode::kRead;
  absl::StatusOr<std::unique_ptr<GgufFile>> copied = GgufFile::Open(paths[0], read);
  ASSERT_TRUE(copied.ok()) << copied.status();
  ExpectSameTensors(*whole, **copied);
  for (int s = 0; s < 3; ++s) EXPECT_EQ((*copied)->shard(s).load_mode(), LoadMode::kRead) << s;
  EXPECT_EQ(Greedy(**copied), want);
}

// tools/gguf-split/gguf-split.cpp: shard 1 holds the input's keys in order, then split.no,
// split.tensors.count and split.count (set last, so appended last); the other shards only
// those three; every shard is GGUF v3 at the default alignment.
TEST_F(GgufSplitTest, ShardsCarryTheKeysGgufSplitWrites) {
  ScratchDir dir("split_keys");
  const std::vector<std::string> paths = SplitFixture(dir.Path("model"));
  ASSERT_EQ(paths.size(), 3u);
  std::unique_ptr<GgufFile> whole = OpenOrFail(fixture_path());
  ASSERT_NE(whole, nullptr);
  for (int s = 0; s < 3; ++s) {
    absl::StatusOr<std::unique_ptr<GgufFile>> read = GgufFile::FromBytes(paths[s], [&] {
      const std::string bytes = testing_util::ReadFileToString(paths[s]);
      return std::vector<uint8_t>(bytes.begin(), bytes.end());
    }());
    ASSERT_TRUE(read.ok()) << read.status();
    const GgufFile& shard = **read;
    EXPECT_EQ(shard.version(), 3u);
    EXPECT_EQ(shard.alignment(), kGgufDefaultAlignment);
    std::vector<std::string> want_keys;
    if (s == 0) {
      for (const GgufKV& kv : whole->kvs()) want_keys.push_back(kv.key);
    }
    want_keys.insert(want_keys.end(), {kSplitNoKey, kSplitTensorsCountKey, kSplitCountKey});
    std::vector<std::string> keys;
    for (const GgufKV& kv : shard.kvs()) keys.push_back(kv.key);
    EXPECT_EQ(keys, want_keys) << paths[s];
    EXPECT_EQ(shard.FindKey(kSplitNoKey)->type, GgufType::kUint16);
    EXPECT_EQ(shard.FindKey(kSplitNoKey)->u64, static_cast<uint64_t>(s));
    EXPECT_EQ(shard.FindKey(kSplitCountKey)->type, GgufType::kUint16);
    EXPECT_EQ(shard.FindKey(kSplitCountKey)->u64, 3u);
    EXPECT_EQ(shard.FindKey(kSplitTensorsCountKey)->type, GgufType::kInt32);
    EXPECT_EQ(shard.FindKey(kSplitTensorsCountKey)->i64, 27);
    // Tensor i of shard s is tensor 10 s + i of the input.
    for (size_t i = 0; i < shard.tensors().size(); ++i) {
      EXPECT_EQ(shard.tensors()[i].name, whole->tensors()[kShardTensors * s + i].name);
    }
    if (s == 0) {
      for (const GgufKV& kv : whole->kvs()) {
        EXPECT_EQ(shard.FindKey(kv.key)->type, kv.type) << kv.key;
      }
      EXPECT_EQ(*shard.GetString("general.architecture"), "qwen3moe");
      EXPECT_EQ(*shard.GetStringArray("tokenizer.ggml.tokens"),
                *whole->GetStringArray("tokenizer.ggml.tokens"));
    }
  }
}

TEST_F(GgufSplitTest, SizeModeStartsAShardBeforeTheTensorThatWouldPassTheLimit) {
  std::unique_ptr<GgufFile> whole = OpenOrFail(fixture_path());
  ASSERT_NE(whole, nullptr);
  uint64_t largest = 0;
  for (const GgufTensor& t : whole->tensors()) largest = std::max(largest, t.nbytes);
  SplitOptions options;
  options.max_bytes = 2 * ((largest + 31) / 32 * 32);
  absl::StatusOr<std::vector<std::vector<size_t>>> plan = PlanSplit(*whole, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_GT(plan->size(), 1u);
  size_t next = 0;
  for (size_t s = 0; s < plan->size(); ++s) {
    uint64_t bytes = 0;
    ASSERT_FALSE((*plan)[s].empty());
    for (size_t i : (*plan)[s]) {
      EXPECT_EQ(i, next++);
      bytes += (whole->tensors()[i].nbytes + 31) / 32 * 32;
    }
    EXPECT_LE(bytes, options.max_bytes) << "shard " << s;
    // The next shard's first tensor did not fit in this one.
    if (s + 1 < plan->size()) {
      const uint64_t first = whole->tensors()[(*plan)[s + 1][0]].nbytes;
      EXPECT_GT(bytes + (first + 31) / 32 * 32, options.max_bytes) << "shard " << s;
    }
  }
  EXPECT_EQ(next, whole->tensors().size());

  options.max_bytes = 32;  // below the largest tensor: a shard would be empty
  absl::StatusOr<std::vector<std::vector<size_t>>> refused = PlanSplit(*whole, options);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(Contains(refused.status().message(), "no tensors"));

  options = SplitOptions();
  options.no_tensor_first_split = true;
  options.max_tensors = 20;
  plan = PlanSplit(*whole, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->size(), 3u);
  EXPECT_TRUE((*plan)[0].empty());
  EXPECT_EQ((*plan)[1].size(), 20u);
  EXPECT_EQ((*plan)[2].size(), 7u);
}

// llama_model_loader refuses a later shard: "model must be loaded with the first split".
TEST_F(GgufSplitTest, ALaterShardIsRefusedNamingTheFirst) {
  ScratchDir dir("split_later");
  const std::vector<std::string> paths = SplitFixture(dir.Path("model"));
  ASSERT_EQ(paths.size(), 3u);
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(paths[1]);
  ASSERT_FALSE(file.ok());
  EXPECT_TRUE(Contains(file.status().message(), paths[1] + ": key 'split.no'"));
  EXPECT_TRUE(Contains(file.status().message(), "shard 2 of 3"));
  EXPECT_TRUE(Contains(file.status().message(), "(" + paths[0] + ")"));
}

TEST_F(GgufSplitTest, AMissingShardIsRefusedNamingItsPath) {
  ScratchDir dir("split_missing");
  const std::vector<std::string> paths = SplitFixture(dir.Path("model"));
  ASSERT_EQ(paths.size(), 3u);
  ASSERT_TRUE(std::filesystem::remove(paths[2]));
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(paths[0]);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound) << file.status();
  EXPECT_TRUE(Contains(file.status().message(), paths[0] + ": shard 3 of 3: " + paths[2]));
}

// Shard 1 renamed: its siblings cannot be named (llama_split_prefix fails).
TEST_F(GgufSplitTest, AFirstShardWithoutTheSplitNameIsRefused) {
  ScratchDir dir("split_renamed");
  const std::vector<std::string> paths = SplitFixture(dir.Path("model"));
  ASSERT_EQ(paths.size(), 3u);
  const std::string renamed = dir.Path("model.gguf");
  std::filesystem::rename(paths[0], renamed);
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(renamed);
  ASSERT_FALSE(file.ok());
  EXPECT_TRUE(Contains(file.status().message(), renamed + ": key 'split.count'"));
  EXPECT_TRUE(Contains(file.status().message(), "-00001-of-00003.gguf"));
}

// Shard sets written by hand: each shard's split keys and tensors as given.
struct ShardSpec {
  int no;
  int count;
  int tensors_count;
  std::vector<std::string> tensors;
  GgufType count_type = GgufType::kUint16;
};

void WriteShard(const std::string& path, const ShardSpec& spec) {
  GgufWriter w;
  if (spec.count_type == GgufType::kUint16) {
    w.SetUint16(kSplitCountKey, static_cast<uint16_t>(spec.count));
  } else {
    w.SetUint32(kSplitCountKey, static_cast<uint32_t>(spec.count));
  }
  w.SetUint16(kSplitNoKey, static_cast<uint16_t>(spec.no));
  w.SetInt32(kSplitTensorsCountKey, spec.tensors_count);
  for (const std::string& name : spec.tensors) {
    w.AddTensor(name, GgmlType::kF32, {8}, std::vector<uint8_t>(32, 1));
  }
  ASSERT_TRUE(w.WriteFile(path).ok()) << path;
}

// The error opening shard 1 of the set, written under dir as set-0000N-of-0000M.gguf.
absl::Status OpenSet(const ScratchDir& dir, const std::vector<ShardSpec>& shards,
                     std::vector<std::string>* paths) {
  for (size_t i = 0; i < shards.size(); ++i) {
    paths->push_back(SplitPath(dir.Path("set"), static_cast<int>(i), shards[0].count));
    WriteShard(paths->back(), shards[i]);
  }
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(paths->front());
  return file.ok() ? absl::OkStatus() : file.status();
}

TEST(GgufSplitSetTest, AWellFormedHandWrittenSetOpens) {
  ScratchDir dir("set_good");
  std::vector<std::string> paths;
  const absl::Status s =
      OpenSet(dir, {{0, 3, 4, {"a", "b"}}, {1, 3, 4, {"c"}}, {2, 3, 4, {"d"}}}, &paths);
  EXPECT_TRUE(s.ok()) << s;
}

TEST(GgufSplitSetTest, ATensorInTwoShardsIsRefusedNamingBothFiles) {
  ScratchDir dir("set_duplicate");
  std::vector<std::string> paths;
  const absl::Status s =
      OpenSet(dir, {{0, 3, 4, {"a", "b"}}, {1, 3, 4, {"c"}}, {2, 3, 4, {"b"}}}, &paths);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(Contains(s.message(), paths[2] + ": tensor 'b' at byte"));
  EXPECT_TRUE(Contains(s.message(), "duplicate tensor name (also in " + paths[0]));
}

TEST(GgufSplitSetTest, AShardWithAnotherSplitCountIsRefusedNamingIt) {
  ScratchDir dir("set_count");
  std::vector<std::string> paths;
  const absl::Status s =
      OpenSet(dir, {{0, 3, 4, {"a", "b"}}, {1, 4, 4, {"c"}}, {2, 3, 4, {"d"}}}, &paths);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(Contains(s.message(), paths[1] + ": key 'split.count'"));
  EXPECT_TRUE(Contains(s.message(), "is 4, expected 3"));
}

TEST(GgufSplitSetTest, AShardWithAnotherSplitNoIsRefusedNamingIt) {
  ScratchDir dir("set_no");
  std::vector<std::string> paths;
  const absl::Status s =
      OpenSet(dir, {{0, 3, 4, {"a", "b"}}, {1, 3, 4, {"c"}}, {1, 3, 4, {"d"}}}, &paths);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(Contains(s.message(), paths[2] + ": key 'split.no'"));
  EXPECT_TRUE(Contains(s.message(), "is 1, expected 2"));
}

TEST(GgufSplitSetTest, AWrongTensorsCountIsRefusedNamingShardOne) {
  ScratchDir dir("set_tensors");
  std::vector<std::string> paths;
  const absl::Status s =
      OpenSet(dir, {{0, 3, 5, {"a", "b"}}, {1, 3, 5, {"c"}}, {2, 3, 5, {"d"}}}, &paths);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(Contains(s.message(), paths[0] + ": key 'split.tensors.count'"));
  EXPECT_TRUE(Contains(s.message(), "is 5, but the 3 shards hold 4 tensors"));
}

// llama.cpp reads split.count as u16 and refuses another type.
TEST(GgufSplitSetTest, ASplitCountOfAnotherTypeIsRefused) {
  ScratchDir dir("set_type");
  std::vector<std::string> paths;
  ShardSpec first = {0, 2, 2, {"a"}};
  first.count_type = GgufType::kUint32;
  const absl::Status s = OpenSet(dir, {first, {1, 2, 2, {"b"}}}, &paths);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(Contains(s.message(), paths[0] + ": key 'split.count'"));
  EXPECT_TRUE(Contains(s.message(), "is u32, expected u16"));
}

// gguf-split --merge writes split.count 0; 1 is a model in one shard: either is the
// whole model, whatever the file is called.
TEST(GgufSplitSetTest, ASplitCountOfZeroOrOneIsOneFile) {
  ScratchDir dir("set_one");
  for (int count : {0, 1}) {
    const std::string path = dir.Path("merged.gguf");
    WriteShard(path, {0, count, 2, {"a", "b"}});
    absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_EQ((*file)->shard_count(), 1);
    EXPECT_EQ((*file)->tensors().size(), 2u);
  }
}

TEST_F(GgufSplitTest, TensorErrorsNameTheShardHoldingTheTensor) {
  ScratchDir dir("split_errors");
  const std::vector<std::string> paths = SplitFixture(dir.Path("model"));
  ASSERT_EQ(paths.size(), 3u);
  std::unique_ptr<GgufFile> split = OpenOrFail(paths[0]);
  ASSERT_NE(split, nullptr);
  const GgufTensor& last = split->tensors().back();
  ASSERT_EQ(last.shard, 2);
  EXPECT_EQ(split->TensorError(last, "bad").message(),
            paths[2] + ": tensor '" + last.name + "' at byte " + std::to_string(last.info_offset) +
                ": bad");
  const GgufTensor& first = split->tensors().front();
  EXPECT_TRUE(Contains(split->TensorError(first, "bad").message(), paths[0] + ": tensor '"));
}

// `moegraph gguf-split` then `moegraph run` on shard 1: the whole file's tokens; a split
// model split again (into 2) is still the whole model.
TEST_F(GgufSplitTest, CliSplitsAndRunsTheShardsLikeTheWholeFile) {
  ScratchDir dir("split_cli");
  const std::string prefix = dir.Path("cli");
  const ProcessResult split =
      RunProcess({MOEGRAPH_BIN, "gguf-split", "--split-max-tensors", "10", fixture_path(), prefix});
  ASSERT_EQ(split.exit_code, 0) << split.err;
  EXPECT_TRUE(Contains(split.out, "n_split: 3"));
  EXPECT_TRUE(Contains(split.out, "split 00003: n_tensors = 7"));
  EXPECT_TRUE(Contains(split.out, "wrote " + prefix + "-00002-of-00003.gguf"));
  EXPECT_TRUE(Contains(split.out, "3 shards, 27 tensors"));

  auto run = [](const std::string& model) {
    return RunProcess(
        {MOEGRAPH_BIN, "run", "-m", model, "--tokens", "1,2,3", "-n", "8", "--backend", "cpu"});
  };
  const ProcessResult whole = run(fixture_path());
  const ProcessResult shards = run(prefix + "-00001-of-00003.gguf");
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  ASSERT_EQ(shards.exit_code, 0) << shards.err;
  ASSERT_EQ(IdsAfter(whole.out, "generated").size(), 8u) << whole.out;
  EXPECT_EQ(IdsAfter(shards.out, "generated"), IdsAfter(whole.out, "generated"));

  const ProcessResult inspect =
      RunProcess({MOEGRAPH_BIN, "inspect", prefix + "-00001-of-00003.gguf"});
  ASSERT_EQ(inspect.exit_code, 0) << inspect.err;
  EXPECT_TRUE(Contains(inspect.out, "shards:        3\n  " + prefix + "-00001-of-00003.gguf"));
  EXPECT_TRUE(Contains(inspect.out, "total: 27 tensors"));

  const ProcessResult later = run(prefix + "-00002-of-00003.gguf");
  EXPECT_EQ(later.exit_code, 1);
  EXPECT_TRUE(Contains(later.err, "a split model is opened from its first shard"));

  const ProcessResult again = RunProcess({MOEGRAPH_BIN, "gguf-split", "--split-max-tensors", "20",
                                          prefix + "-00001-of-00003.gguf", dir.Path("again")});
  ASSERT_EQ(again.exit_code, 0) << again.err;
  std::unique_ptr<GgufFile> whole_file = OpenOrFail(fixture_path());
  std::unique_ptr<GgufFile> resplit = OpenOrFail(dir.Path("again-00001-of-00002.gguf"));
  ASSERT_NE(whole_file, nullptr);
  ASSERT_NE(resplit, nullptr);
  ExpectSameTensors(*whole_file, *resplit);
}

TEST_F(GgufSplitTest, CliRefusesBadFlagsAndArguments) {
  ScratchDir dir("split_flags");
  const std::string out = dir.Path("x");
  const ProcessResult both = RunProcess({MOEGRAPH_BIN, "gguf-split", "--split-max-tensors", "4",
                                         "--split-max-size", "1M", fixture_path(), out});
  EXPECT_EQ(both.exit_code, 1);
  EXPECT_TRUE(Contains(both.err, "give one of them"));
  const ProcessResult zero =
      RunProcess({MOEGRAPH_BIN, "gguf-split", "--split-max-tensors", "0", fixture_path(), out});
  EXPECT_EQ(zero.exit_code, 1);
  EXPECT_TRUE(Contains(zero.err, "--split-max-tensors 0 must be at least 1"));
  const ProcessResult unit =
      RunProcess({MOEGRAPH_BIN, "gguf-split", "--split-max-size", "5K", fixture_path(), out});
  EXPECT_EQ(unit.exit_code, 1);
  EXPECT_TRUE(Contains(unit.err, "--split-max-size '5K'"));
  const ProcessResult one_arg = RunProcess({MOEGRAPH_BIN, "gguf-split", fixture_path()});
  EXPECT_EQ(one_arg.exit_code, 2);
  EXPECT_TRUE(Contains(one_arg.err, "usage: moegraph gguf-split"));
  const ProcessResult dry = RunProcess(
      {MOEGRAPH_BIN, "gguf-split", "--dry-run", "--split-max-size", "1M", fixture_path(), out});
  EXPECT_EQ(dry.exit_code, 0) << dry.err;
  EXPECT_TRUE(Contains(dry.out, "n_split: 1"));
  EXPECT_FALSE(std::filesystem::exists(out + "-00001-of-00001.gguf"));
  EXPECT_TRUE(std::filesystem::is_empty(std::filesystem::path(out).parent_path()));
}

}  // namespace
}  // namespace moegraph
