// GGUF writer -> reader round trips, the ggml type table, typed getters, and
// the file (mmap) path.
#include "loader/gguf.h"

#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "loader/ggml_type.h"
#include "loader/gguf_writer.h"
#include "loader/host_memory.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::Contains;

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(n);
  for (uint8_t& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

std::unique_ptr<GgufFile> Parse(const std::vector<uint8_t>& bytes) {
  return testing_util::ParseOrFail(bytes, "mem.gguf");
}

// A fresh path under the test temp dir, removed at the end of the test.
class TempPath {
 public:
  explicit TempPath(const std::string& name) : path_(testing_util::TempPath(name)) {}
  ~TempPath() { std::filesystem::remove(path_); }
  std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

TEST(GgmlTypeTest, TableMatchesGgml) {
  struct Row {
    uint32_t id;
    const char* name;
    int64_t block;
    size_t bytes;
  };
  // ggml.h enum ggml_type and ggml.c type_traits (block size, sizeof(block_*)).
  const Row rows[] = {
      {0, "f32", 1, 4},         {1, "f16", 1, 2},         {2, "q4_0", 32, 18},
      {3, "q4_1", 32, 20},      {6, "q5_0", 32, 22},      {7, "q5_1", 32, 24},
      {8, "q8_0", 32, 34},      {9, "q8_1", 32, 36},      {10, "q2_K", 256, 84},
      {11, "q3_K", 256, 110},   {12, "q4_K", 256, 144},   {13, "q5_K", 256, 176},
      {14, "q6_K", 256, 210},   {15, "q8_K", 256, 292},   {16, "iq2_xxs", 256, 66},
      {17, "iq2_xs", 256, 74},  {18, "iq3_xxs", 256, 98}, {19, "iq1_s", 256, 50},
      {20, "iq4_nl", 32, 18},   {21, "iq3_s", 256, 110},  {22, "iq2_s", 256, 82},
      {23, "iq4_xs", 256, 136}, {24, "i8", 1, 1},         {25, "i16", 1, 2},
      {26, "i32", 1, 4},        {27, "i64", 1, 8},        {28, "f64", 1, 8},
      {29, "iq1_m", 256, 56},   {30, "bf16", 1, 2},       {34, "tq1_0", 256, 54},
      {35, "tq2_0", 256, 66},   {39, "mxfp4", 32, 17},    {40, "nvfp4", 64, 36},
      {41, "q1_0", 128, 18},    {42, "q2_0", 64, 18},
  };
  size_t known = 0;
  for (uint32_t id = 0; id < 64; ++id) known += ggml_type_info(id) != nullptr;
  EXPECT_EQ(known, std::size(rows));
  for (const Row& r : rows) {
    const GgmlTypeInfo* info = ggml_type_info(r.id);
    ASSERT_NE(info, nullptr) << r.name;
    EXPECT_EQ(info->name, r.name);
    EXPECT_EQ(info->block_size, r.block) << r.name;
    EXPECT_EQ(info->type_size, r.bytes) << r.name;
    GgmlType parsed;
    ASSERT_TRUE(ggml_type_from_name(r.name, &parsed)) << r.name;
    EXPECT_EQ(static_cast<uint32_t>(parsed), r.id);
  }
}

TEST(GgmlTypeTest, RemovedIdsAreUnknown) {
  for (uint32_t id : {4u, 5u, 31u, 32u, 33u, 36u, 37u, 38u, 43u, 0xFFFFFFFFu}) {
    EXPECT_EQ(ggml_type_info(id), nullptr) << id;
  }
  EXPECT_EQ(ggml_type_name(31), "type 31");
  EXPECT_EQ(ggml_type_name(12), "q4_K");
}

TEST(GgmlTypeTest, NamesParseInAnyCase) {
  GgmlType t;
  ASSERT_TRUE(ggml_type_from_name("Q4_K", &t));
  EXPECT_EQ(t, GgmlType::kQ4_K);
  ASSERT_TRUE(ggml_type_from_name("BF16", &t));
  EXPECT_EQ(t, GgmlType::kBF16);
  ASSERT_TRUE(ggml_type_from_name("q4_k", &t));
  EXPECT_EQ(t, GgmlType::kQ4_K);
  ASSERT_TRUE(ggml_type_from_name("Q8_0", &t));
  EXPECT_EQ(t, GgmlType::kQ8_0);
  EXPECT_FALSE(ggml_type_from_name("q4_0_4_4", &t));
  EXPECT_FALSE(ggml_type_from_name("", &t));
}

TEST(GgmlTypeTest, RowSize) {
  EXPECT_EQ(ggml_row_size(GgmlType::kQ4_K, 512), 288u);
  EXPECT_EQ(ggml_row_size(GgmlType::kF16, 7), 14u);
  EXPECT_EQ(ggml_row_size(GgmlType::kMXFP4, 64), 34u);
  EXPECT_EQ(ggml_row_size(GgmlType::kQ8_0, 0), 0u);
}

TEST(GgmlTypeDeathTest, RowSizeOfPartialBlockAborts) {
  EXPECT_DEATH(ggml_row_size(GgmlType::kQ4_0, 33), "not a whole number of blocks");
}

TEST(GgufRoundTripTest, EveryScalarType) {
  GgufWriter w;
  w.SetUint8("u8", 200);
  w.SetInt8("i8", -100);
  w.SetUint16("u16", 60000);
  w.SetInt16("i16", -30000);
  w.SetUint32("u32", 4000000000u);
  w.SetInt32("i32", -2000000000);
  w.SetFloat32("f32", 1.5f);
  w.SetBool("bool", true);
  w.SetString("str", std::string("h\0llo", 5));
  w.SetUint64("u64", std::numeric_limits<uint64_t>::max());
  w.SetInt64("i64", std::numeric_limits<int64_t>::min());
  w.SetFloat64("f64", -0.1);
  auto f = Parse(w.Serialize());
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->version(), 3u);
  ASSERT_EQ(f->kvs().size(), 12u);
  const GgufType expected_types[] = {GgufType::kUint8,   GgufType::kInt8,   GgufType::kUint16,
                                     GgufType::kInt16,   GgufType::kUint32, GgufType::kInt32,
                                     GgufType::kFloat32, GgufType::kBool,   GgufType::kString,
                                     GgufType::kUint64,  GgufType::kInt64,  GgufType::kFloat64};
  for (size_t i = 0; i < 12; ++i) EXPECT_EQ(f->kvs()[i].type, expected_types[i]) << i;

  EXPECT_EQ(*f->GetUint("u8"), 200u);
  EXPECT_EQ(*f->GetInt("i8"), -100);
  EXPECT_EQ(*f->GetUint("u16"), 60000u);
  EXPECT_EQ(*f->GetInt("i16"), -30000);
  EXPECT_EQ(*f->GetUint("u32"), 4000000000u);
  EXPECT_EQ(*f->GetInt("i32"), -2000000000);
  EXPECT_EQ(*f->GetFloat("f32"), 1.5);
  EXPECT_EQ(*f->GetBool("bool"), true);
  EXPECT_EQ(*f->GetString("str"), std::string_view("h\0llo", 5));
  EXPECT_EQ(*f->GetUint("u64"), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(*f->GetInt("i64"), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(*f->GetFloat("f64"), -0.1);
  EXPECT_EQ(*f->GetInt("u32"), 4000000000);
  EXPECT_EQ(*f->GetFloat("i32"), -2000000000.0);
}

TEST(GgufRoundTripTest, EveryArrayType) {
  GgufWriter w;
  const std::vector<uint8_t> u8 = {0, 7, 255};
  const std::vector<int8_t> i8 = {-128, 0, 127};
  const std::vector<uint16_t> u16 = {1, 65535};
  const std::vector<int16_t> i16 = {-32768, 5};
  const std::vector<uint32_t> u32 = {4000000000u};
  const std::vector<int32_t> i32 = {-7, 0, 7, 1 << 30};
  const std::vector<float> f32 = {0.25f, -3.0f};
  const std::vector<uint8_t> bools = {1, 0, 1};
  const std::vector<uint64_t> u64 = {uint64_t{1} << 40};
  const std::vector<int64_t> i64 = {-(int64_t{1} << 50), 3};
  const std::vector<double> f64 = {1e300, -2.5};
  w.SetArray("a.u8", GgufType::kUint8, u8.data(), u8.size());
  w.SetArray("a.i8", GgufType::kInt8, i8.data(), i8.size());
  w.SetArray("a.u16", GgufType::kUint16, u16.data(), u16.size());
  w.SetArray("a.i16", GgufType::kInt16, i16.data(), i16.size());
  w.SetArray("a.u32", GgufType::kUint32, u32.data(), u32.size());
  w.SetInt32Array("a.i32", i32);
  w.SetFloat32Array("a.f32", f32);
  w.SetArray("a.bool", GgufType::kBool, bools.data(), bools.size());
  w.SetArray("a.u64", GgufType::kUint64, u64.data(), u64.size());
  w.SetArray("a.i64", GgufType::kInt64, i64.data(), i64.size());
  w.SetArray("a.f64", GgufType::kFloat64, f64.data(), f64.size());
  w.SetStringArray("a.str", {"alpha", "", "gamma\n"});
  w.SetInt32Array("a.empty", {});
  auto f = Parse(w.Serialize());
  ASSERT_NE(f, nullptr);

  auto ints = [&](const char* key) { return *f->GetIntArray(key); };
  EXPECT_EQ(ints("a.u8"), (std::vector<int64_t>{0, 7, 255}));
  EXPECT_EQ(ints("a.i8"), (std::vector<int64_t>{-128, 0, 127}));
  EXPECT_EQ(ints("a.u16"), (std::vector<int64_t>{1, 65535}));
  EXPECT_EQ(ints("a.i16"), (std::vector<int64_t>{-32768, 5}));
  EXPECT_EQ(ints("a.u32"), (std::vector<int64_t>{4000000000}));
  EXPECT_EQ(ints("a.i32"), (std::vector<int64_t>{-7, 0, 7, 1 << 30}));
  EXPECT_EQ(ints("a.u64"), (std::vector<int64_t>{int64_t{1} << 40}));
  EXPECT_EQ(ints("a.i64"), (std::vector<int64_t>{-(int64_t{1} << 50), 3}));
  EXPECT_TRUE(ints("a.empty").empty());
  EXPECT_EQ(*f->GetFloatArray("a.f32"), (std::vector<double>{0.25, -3.0}));
  EXPECT_EQ(*f->GetFloatArray("a.f64"), (std::vector<double>{1e300, -2.5}));
  EXPECT_EQ(*f->GetFloatArray("a.i8"), (std::vector<double>{-128, 0, 127}));
  EXPECT_EQ(*f->GetStringArray("a.str"), (std::vector<std::string_view>{"alpha", "", "gamma\n"}));

  const GgufKV* b = f->FindKey("a.bool");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->type, GgufType::kArray);
  EXPECT_EQ(b->array_type, GgufType::kBool);
  ASSERT_EQ(b->array_n, 3u);
  EXPECT_EQ(std::memcmp(b->array_data, bools.data(), 3), 0);
  const GgufKV* s = f->FindKey("a.str");
  EXPECT_EQ(s->array_type, GgufType::kString);
  EXPECT_EQ(s->array_n, 3u);
}

TEST(GgufRoundTripTest, SettingAKeyTwiceKeepsTheLastValue) {
  GgufWriter w;
  w.SetUint32("k", 1);
  w.SetString("other", "x");
  w.SetString("k", "replaced");
  auto f = Parse(w.Serialize());
  ASSERT_EQ(f->kvs().size(), 2u);
  EXPECT_EQ(*f->GetString("k"), "replaced");
}

TEST(GgufGetterTest, WrongTypeAndMissingKeyNameTheKey) {
  GgufWriter w;
  w.SetString("name", "x");
  w.SetInt32("neg", -1);
  w.SetUint64("huge", std::numeric_limits<uint64_t>::max());
  w.SetFloat32Array("floats", {1.0f});
  const std::vector<uint64_t> big = {std::numeric_limits<uint64_t>::max()};
  w.SetArray("bigs", GgufType::kUint64, big.data(), 1);
  auto f = Parse(w.Serialize());

  auto missing = f->GetUint("nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(missing.status().message(), "mem.gguf: key 'nope'"));

  auto check = [](const absl::Status& s, const char* key) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(Contains(s.message(), std::string("key '") + key + "' at byte "));
  };
  check(f->GetUint("name").status(), "name");
  check(f->GetUint("neg").status(), "neg");
  check(f->GetInt("huge").status(), "huge");
  check(f->GetBool("name").status(), "name");
  check(f->GetString("neg").status(), "neg");
  check(f->GetFloat("name").status(), "name");
  check(f->GetStringArray("floats").status(), "floats");
  check(f->GetIntArray("floats").status(), "floats");
  check(f->GetIntArray("bigs").status(), "bigs");
  check(f->GetFloatArray("name").status(), "name");
  EXPECT_EQ(f->KeyError(*f->FindKey("neg"), "bad").message(),
            "mem.gguf: key 'neg' at byte " + std::to_string(f->FindKey("neg")->offset) + ": bad");
}

struct TensorSpec {
  std::string name;
  GgmlType type;
  std::vector<int64_t> shape;
  size_t nbytes;
};

const std::vector<TensorSpec>& SampleTensors() {
  static const auto* specs = new std::vector<TensorSpec>{
      {"token_embd.weight", GgmlType::kF32, {3}, 12},
      {"blk.0.attn_q.weight", GgmlType::kF16, {4, 2}, 16},
      {"blk.0.ffn_up.weight", GgmlType::kQ4_0, {64, 3}, 2 * 3 * 18},
      {"blk.0.ffn_gate_exps.weight", GgmlType::kQ4_K, {256, 2, 2}, 4 * 144},
      {"blk.0.ffn_down_exps.weight", GgmlType::kMXFP4, {32, 1, 3, 2}, 6 * 17},
      {"empty", GgmlType::kI8, {0, 5}, 0},
      {"output.weight", GgmlType::kQ8_0, {32, 1}, 34},
  };
  return *specs;
}

void AddSampleTensors(GgufWriter& w, std::vector<std::vector<uint8_t>>* data) {
  uint32_t seed = 1;
  for (const TensorSpec& s : SampleTensors()) {
    data->push_back(RandomBytes(s.nbytes, seed++));
    w.AddTensor(s.name, s.type, s.shape, data->back());
  }
}

void ExpectSampleTensors(const GgufFile& f, const std::vector<std::vector<uint8_t>>& data) {
  ASSERT_EQ(f.tensors().size(), SampleTensors().size());
  EXPECT_EQ(f.data_offset() % f.alignment(), 0u);
  for (size_t i = 0; i < SampleTensors().size(); ++i) {
    const TensorSpec& s = SampleTensors()[i];
    const GgufTensor* t = f.FindTensor(s.name);
    ASSERT_NE(t, nullptr) << s.name;
    EXPECT_EQ(t, &f.tensors()[i]);
    EXPECT_EQ(t->ggml_type(), s.type);
    ASSERT_EQ(t->n_dims, static_cast<int>(s.shape.size()));
    int64_t n = 1;
    for (int j = 0; j < t->n_dims; ++j) {
      EXPECT_EQ(t->ne[j], s.shape[j]);
      n *= s.shape[j];
    }
    for (int j = t->n_dims; j < kGgufMaxDims; ++j) EXPECT_EQ(t->ne[j], 1);
    EXPECT_EQ(t->n_elements(), n);
    EXPECT_EQ(t->nbytes, s.nbytes);
    EXPECT_EQ(t->offset % f.alignment(), 0u);
    EXPECT_EQ(t->data, f.tensors()[0].data + t->offset);
    if (s.nbytes > 0) {
      EXPECT_EQ(std::memcmp(t->data, data[i].data(), s.nbytes), 0) << s.name;
    }
  }
  EXPECT_EQ(f.FindTensor("missing"), nullptr);
}

TEST(GgufRoundTripTest, TensorsOfSeveralTypesAndShapes) {
  GgufWriter w;
  w.SetString("general.architecture", "qwen3moe");
  std::vector<std::vector<uint8_t>> data;
  AddSampleTensors(w, &data);
  const std::vector<uint8_t> bytes = w.Serialize();
  EXPECT_EQ(bytes.size() % kGgufDefaultAlignment, 0u);
  auto f = Parse(bytes);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->alignment(), kGgufDefaultAlignment);
  EXPECT_EQ(f->FindKey("general.alignment"), nullptr);
  ExpectSampleTensors(*f, data);
  EXPECT_EQ(f->tensors()[3].shape_string(), "[256, 2, 2]");
  EXPECT_EQ(f->tensors()[0].shape_string(), "[3]");
  EXPECT_EQ(f->TensorError(f->tensors()[1], "bad").message(),
            "mem.gguf: tensor 'blk.0.attn_q.weight' at byte " +
                std::to_string(f->tensors()[1].info_offset) + ": bad");
}

TEST(GgufRoundTripTest, CustomAlignment) {
  for (uint32_t alignment : {1u, 8u, 64u, 4096u}) {
    GgufWriter w(alignment);
    std::vector<std::vector<uint8_t>> data;
    AddSampleTensors(w, &data);
    const std::vector<uint8_t> bytes = w.Serialize();
    EXPECT_EQ(bytes.size() % alignment, 0u);
    auto f = Parse(bytes);
    ASSERT_NE(f, nullptr) << alignment;
    EXPECT_EQ(f->alignment(), alignment);
    EXPECT_EQ(*f->GetUint("general.alignment"), alignment);
    ExpectSampleTensors(*f, data);
  }
}

TEST(GgufRoundTripTest, Version2IsRead) {
  GgufWriter w;
  w.SetUint32("x", 5);
  std::vector<std::vector<uint8_t>> data;
  AddSampleTensors(w, &data);
  std::vector<uint8_t> bytes = w.Serialize();
  bytes[4] = 2;  // v2 and v3 share the layout
  auto f = Parse(bytes);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->version(), 2u);
  ExpectSampleTensors(*f, data);
}

TEST(GgufRoundTripTest, EmptyFile) {
  GgufWriter w;
  const std::vector<uint8_t> bytes = w.Serialize();
  EXPECT_EQ(bytes.size(), 32u);  // 24-byte header padded to 32
  auto f = Parse(bytes);
  ASSERT_NE(f, nullptr);
  EXPECT_TRUE(f->kvs().empty());
  EXPECT_TRUE(f->tensors().empty());
}

TEST(GgufFileTest, StreamingWriteMatchesSerializeAndOpensMapped) {
  GgufWriter w(64);
  w.SetString("general.architecture", "test");
  std::vector<size_t> fill_sizes;
  w.AddTensor("filled", GgmlType::kF32, {5, 3}, [&](uint8_t* dst, size_t n) {
    fill_sizes.push_back(n);
    for (size_t i = 0; i < n; ++i) dst[i] = static_cast<uint8_t>(i * 7);
  });
  w.AddTensor("given", GgmlType::kQ8_0, {32}, RandomBytes(34, 9));
  w.AddTensor("filled2", GgmlType::kBF16, {3}, [&](uint8_t* dst, size_t n) {
    fill_sizes.push_back(n);
    std::memset(dst, 0xAB, n);
  });
  TempPath path("stream.gguf");
  ASSERT_TRUE(w.WriteFile(path.str()).ok());
  EXPECT_EQ(fill_sizes, (std::vector<size_t>{60, 6}));
  const std::vector<uint8_t> expected = w.Serialize();

  auto f = GgufFile::Open(path.str());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->path(), path.str());
  ASSERT_EQ((*f)->file_size(), expected.size());
  const uint8_t* mapped = (*f)->tensors()[0].data - (*f)->data_offset();
  EXPECT_EQ(std::memcmp(mapped, expected.data(), expected.size()), 0);
  EXPECT_EQ((*f)->alignment(), 64u);
  EXPECT_EQ((*f)->FindTensor("filled")->data[59], static_cast<uint8_t>(59 * 7));
  EXPECT_EQ((*f)->FindTensor("filled2")->data[5], 0xAB);
}

TEST(GgufFileTest, MissingFileIsNotFoundWithReason) {
  const std::string path = ::testing::TempDir() + "/does_not_exist.gguf";
  auto f = GgufFile::Open(path);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(f.status().message(), path));
  EXPECT_TRUE(Contains(f.status().message(), std::strerror(ENOENT)));
}

TEST(GgufFileTest, DirectoryAndEmptyFileAreRejected) {
  EXPECT_EQ(GgufFile::Open(::testing::TempDir()).status().code(),
            absl::StatusCode::kInvalidArgument);
  TempPath empty("empty.gguf");
  std::fclose(std::fopen(empty.str().c_str(), "wb"));
  auto f = GgufFile::Open(empty.str());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(f.status().message(), "header at byte 0"));
}

TEST(GgufFileTest, WriteToMissingDirectoryNamesThePath) {
  GgufWriter w;
  const std::string path = ::testing::TempDir() + "/no/such/dir/x.gguf";
  absl::Status s = w.WriteFile(path);
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(Contains(s.message(), path));
}

TEST(GgufWriterDeathTest, MisuseAborts) {
  EXPECT_DEATH(GgufWriter(48), "not a power of two");
  GgufWriter w;
  EXPECT_DEATH(w.AddTensor("t", GgmlType::kQ4_0, {33}, std::vector<uint8_t>(18)), "not a multiple");
  EXPECT_DEATH(w.AddTensor("t", GgmlType::kF32, {2}, std::vector<uint8_t>(7)), "bytes given");
  EXPECT_DEATH(w.SetUint32("general.alignment", 64), "general.alignment");
  w.AddTensor("t", GgmlType::kF32, {1}, std::vector<uint8_t>(4));
  EXPECT_DEATH(w.AddTensor("t", GgmlType::kF32, {1}, std::vector<uint8_t>(4)), "duplicate");
}

// ---- load modes (GgufFile::Load) ----

// Under AddressSanitizer (GCC's macro, clang's feature test).
#if defined(__SANITIZE_ADDRESS__)
#define MG_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MG_TEST_ASAN 1
#endif
#endif

// A file of three tensors, 70 KiB of data (more than one page, less than a load chunk).
std::vector<uint8_t> WriteLoadFixture(const std::string& path) {
  GgufWriter w;
  w.SetString("general.architecture", "test");
  w.AddTensor("a", GgmlType::kF32, {4096}, RandomBytes(4 * 4096, 1));
  w.AddTensor("b", GgmlType::kQ8_0, {32, 1024}, RandomBytes(34 * 1024, 2));
  w.AddTensor("c", GgmlType::kF16, {3000}, RandomBytes(2 * 3000, 3));
  EXPECT_TRUE(w.WriteFile(path).ok());
  return w.Serialize();
}

// Every mode gives every tensor the file's bytes; kRead and kAuto (where the
// memory allows) hold them in a copy, and progress counts each data byte once.
TEST(GgufLoadTest, EveryModeGivesTheFilesBytes) {
  TempPath path("load_modes.gguf");
  const std::vector<uint8_t> bytes = WriteLoadFixture(path.str());
  struct Case {
    const char* name;
    LoadOptions options;
    LoadMode expected;
  };
  std::vector<Case> cases(6);
  cases[0] = {"map", {}, LoadMode::kMap};
  cases[1] = {"map, fault in", {}, LoadMode::kMap};
  cases[1].options.fault_in = true;
  cases[2] = {"read", {}, LoadMode::kRead};
  cases[2].options.mode = LoadMode::kRead;
  cases[3] = {"auto, room", {}, LoadMode::kRead};
  cases[3].options.mode = LoadMode::kAuto;
  cases[3].options.available_bytes = uint64_t{4} << 30;
  cases[4] = {"auto, no room", {}, LoadMode::kMap};
  cases[4].options.mode = LoadMode::kAuto;
  cases[4].options.available_bytes = uint64_t{512} << 20;  // under the 1 GiB rail
  cases[5] = {"read, progress", {}, LoadMode::kRead};
  cases[5].options.mode = LoadMode::kRead;
  uint64_t last = 0, total = 0;
  int calls = 0;
  cases[5].options.progress = [&](uint64_t done, uint64_t of, double seconds) {
    EXPECT_GE(done, last);
    EXPECT_GE(seconds, 0.0);
    last = done;
    total = of;
    ++calls;
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::Open(path.str(), c.options);
    ASSERT_TRUE(f.ok()) << c.name << ": " << f.status();
    EXPECT_EQ((*f)->load_mode(), c.expected) << c.name;
    EXPECT_FALSE((*f)->locked()) << c.name;
    ASSERT_EQ((*f)->tensors().size(), 3u);
    for (const GgufTensor& t : (*f)->tensors()) {
      EXPECT_EQ(std::memcmp(t.data, bytes.data() + (*f)->data_offset() + t.offset, t.nbytes), 0)
          << c.name << ": tensor " << t.name;
    }
    EXPECT_EQ((*f)->total_data_bytes(), bytes.size() - (*f)->data_offset());
  }
  EXPECT_GT(calls, 0);
  EXPECT_EQ(last, bytes.size() - GgufFile::Open(path.str()).value()->data_offset());
  EXPECT_EQ(total, last);
}

TEST(GgufLoadTest, ReadingMoreThanTheMemoryAvailableIsRefusedNamingTheFile) {
  TempPath path("load_refused.gguf");
  WriteLoadFixture(path.str());
  LoadOptions options;
  options.mode = LoadMode::kRead;
  options.available_bytes = uint64_t{1} << 20;
  absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::Open(path.str(), options);
  ASSERT_EQ(f.status().code(), absl::StatusCode::kResourceExhausted) << f.status();
  EXPECT_TRUE(Contains(f.status().message(), path.str())) << f.status();
  EXPECT_TRUE(Contains(f.status().message(), "map the file instead")) << f.status();
}

// Locking: where this process may lock the file's bytes they are locked; a
// refused lock (RLIMIT_MEMLOCK 0 without CAP_IPC_LOCK, in a child) names the
// file and the limit.
TEST(GgufLoadTest, LockingLocksOrNamesTheLimit) {
  TempPath path("load_lock.gguf");
  WriteLoadFixture(path.str());
  for (const LoadMode mode : {LoadMode::kMap, LoadMode::kRead}) {
    LoadOptions options;
    options.mode = mode;
    options.lock = true;
    absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::Open(path.str(), options);
    if (f.ok()) {
      EXPECT_TRUE((*f)->locked());
    } else {
      EXPECT_TRUE(Contains(f.status().message(), "RLIMIT_MEMLOCK")) << f.status();
    }
  }
#ifdef MG_TEST_ASAN
  GTEST_SKIP() << "ASan's mlock interceptor succeeds without locking, so no lock is refused";
#endif
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Drop CAP_IPC_LOCK (root ignores RLIMIT_MEMLOCK with it), then the limit.
    __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct caps[2] = {};
    ::syscall(SYS_capget, &header, caps);
    caps[CAP_IPC_LOCK / 32].effective &= ~(1u << (CAP_IPC_LOCK % 32));
    caps[CAP_IPC_LOCK / 32].permitted &= ~(1u << (CAP_IPC_LOCK % 32));
    ::syscall(SYS_capset, &header, caps);
    struct rlimit none = {0, 0};
    ::setrlimit(RLIMIT_MEMLOCK, &none);
    LoadOptions options;
    options.mode = LoadMode::kRead;
    options.lock = true;
    absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::Open(path.str(), options);
    const std::string message = f.ok() ? "" : std::string(f.status().message());
    (void)!::write(pipe_fds[1], message.data(), message.size());
    ::_exit(f.ok() ? 1 : 0);
  }
  ::close(pipe_fds[1]);
  std::string message;
  char buffer[512];
  for (ssize_t n; (n = ::read(pipe_fds[0], buffer, sizeof(buffer))) > 0;) message.append(buffer, n);
  ::close(pipe_fds[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0) << "the lock was granted with RLIMIT_MEMLOCK 0";
  EXPECT_TRUE(Contains(message, path.str())) << message;
  EXPECT_TRUE(Contains(message, "RLIMIT_MEMLOCK 0.00 MiB")) << message;
}

}  // namespace
}  // namespace moegraph

namespace moegraph {
namespace {

// A cgroup tree in a temporary directory: files at root + path.
void WriteCgroupFile(const std::string& root, const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(root + path).parent_path());
  std::FILE* f = std::fopen((root + path).c_str(), "w");
  ASSERT_NE(f, nullptr) << root + path;
  std::fputs(text.c_str(), f);
  std::fclose(f);
}

// A container's memory limit, not the host's MemAvailable, is what a process
// in it can take: its limit less what it holds that is not page cache, the
// least over a v2 cgroup's ancestors; none without a limit.
TEST(HostMemoryTest, ACgroupsLimitLessWhatItHoldsIsTheRoomInIt) {
  const std::string root = testing_util::TempPath("cgroups");
  std::filesystem::remove_all(root);
  constexpr uint64_t kGiB = uint64_t{1} << 30;
  // v1: 8 GiB over the hierarchy, 3 GiB used of which 2 GiB page cache.
  WriteCgroupFile(root, "/memory/bench/memory.stat",
                  "cache 5\nhierarchical_memory_limit " + std::to_string(8 * kGiB) +
                      "\ntotal_cache " + std::to_string(2 * kGiB) + "\n");
  WriteCgroupFile(root, "/memory/bench/memory.usage_in_bytes", std::to_string(3 * kGiB) + "\n");
  EXPECT_EQ(CgroupMemoryAvailable("5:devices:/\n4:memory:/bench\n0::/\n", root), 7 * kGiB);
  // v1 without a limit (2^63 rounded to a page): none.
  WriteCgroupFile(root, "/memory/free/memory.stat", "hierarchical_memory_limit 9223372036854771712\n");
  WriteCgroupFile(root, "/memory/free/memory.usage_in_bytes", "4096\n");
  EXPECT_EQ(CgroupMemoryAvailable("4:memory:/free\n", root), std::nullopt);
  // v2: the parent's 4 GiB binds, not the child's "max".
  WriteCgroupFile(root, "/box/memory.max", std::to_string(4 * kGiB) + "\n");
  WriteCgroupFile(root, "/box/memory.current", std::to_string(3 * kGiB) + "\n");
  WriteCgroupFile(root, "/box/memory.stat", "anon 1\nfile " + std::to_string(kGiB) + "\n");
  WriteCgroupFile(root, "/box/app/memory.max", "max\n");
  WriteCgroupFile(root, "/box/app/memory.current", std::to_string(kGiB) + "\n");
  WriteCgroupFile(root, "/box/app/memory.stat", "file 0\n");
  EXPECT_EQ(CgroupMemoryAvailable("0::/box/app\n", root), 2 * kGiB);
  EXPECT_EQ(CgroupMemoryAvailable("0::/\n", root), std::nullopt);
  EXPECT_EQ(CgroupMemoryAvailable("", root), std::nullopt);
  std::filesystem::remove_all(root);
  EXPECT_EQ(ParseMemorySize("1.5G"), kGiB + kGiB / 2);
  EXPECT_EQ(ParseMemorySize(" 512M"), 512u << 20);
  EXPECT_EQ(ParseMemorySize("lots"), std::nullopt);
}

}  // namespace
}  // namespace moegraph
