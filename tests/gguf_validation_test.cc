// Malformed GGUF files: one test per check of llama.cpp's gguf_init_from_reader
// and per published parser bug class. Each builds the bad bytes by hand and
// expects a clean InvalidArgument naming the field and the byte offset.
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "gtest/gtest.h"
#include "loader/gguf.h"
#include "loader/gguf_writer.h"

namespace moegraph {
namespace {

constexpr uint64_t kU64Max = std::numeric_limits<uint64_t>::max();
constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();

// Little-endian byte builder for hand-made GGUF files.
class Bytes {
 public:
  Bytes& U8(uint8_t v) { return Put(v); }
  Bytes& U32(uint32_t v) { return Put(v); }
  Bytes& I32(int32_t v) { return Put(v); }
  Bytes& U64(uint64_t v) { return Put(v); }
  Bytes& I64(int64_t v) { return Put(v); }
  Bytes& Str(std::string_view s) {
    U64(s.size());
    data_.insert(data_.end(), s.begin(), s.end());
    return *this;
  }
  Bytes& Zeros(size_t n) {
    data_.resize(data_.size() + n, 0);
    return *this;
  }
  Bytes& PadTo(size_t alignment) {
    data_.resize((data_.size() + alignment - 1) / alignment * alignment, 0);
    return *this;
  }
  // GGUF header: magic, version, n_tensors, n_kv.
  Bytes& Header(int64_t n_tensors, int64_t n_kv, uint32_t version = 3) {
    return U32(kGgufMagic).U32(version).I64(n_tensors).I64(n_kv);
  }
  // One tensor info record.
  Bytes& Tensor(std::string_view name, std::vector<int64_t> ne, uint32_t type, uint64_t offset) {
    Str(name).U32(static_cast<uint32_t>(ne.size()));
    for (int64_t d : ne) I64(d);
    return U32(type).U64(offset);
  }
  size_t size() const { return data_.size(); }
  const std::vector<uint8_t>& data() const { return data_; }

 private:
  template <typename T>
  Bytes& Put(T v) {
    const size_t at = data_.size();
    data_.resize(at + sizeof(T));
    std::memcpy(data_.data() + at, &v, sizeof(T));
    return *this;
  }
  std::vector<uint8_t> data_;
};

constexpr uint32_t kU8 = 0, kI32 = 5, kU32 = 4, kStr = 8, kArr = 9, kU64 = 10;
constexpr uint32_t kF32Type = 0, kI8Type = 24, kQ4_0Type = 2;

// Expects FromBytes to fail cleanly with a message that names the field,
// the exact byte offset and what is wrong.
void ExpectRejected(const Bytes& b, absl::string_view field, uint64_t at, absl::string_view what) {
  auto f = GgufFile::FromBytes("bad.gguf", b.data());
  ASSERT_FALSE(f.ok()) << "accepted a malformed file; expected: " << what;
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << f.status();
  const std::string message(f.status().message());
  const std::string prefix = "bad.gguf: " + std::string(field) + " at byte " + std::to_string(at);
  EXPECT_EQ(message.rfind(prefix, 0), 0u) << message << "\nexpected prefix: " << prefix;
  EXPECT_NE(message.find(std::string(what)), std::string::npos)
      << message << "\nexpected: " << what;
}

// A small valid file: one u32 key, two f32 tensors.
Bytes ValidFile() {
  Bytes b;
  b.Header(2, 1).Str("general.x").U32(kU32).U32(7);
  b.Tensor("a", {4}, kF32Type, 0).Tensor("b", {2, 2}, kF32Type, 32);
  b.PadTo(32).Zeros(16).PadTo(32).Zeros(16).PadTo(32);
  return b;
}

TEST(GgufValidationTest, ValidFileIsAccepted) {
  auto f = GgufFile::FromBytes("ok.gguf", ValidFile().data());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->tensors().size(), 2u);
}

// ---- header (llama.cpp: magic, version, n_tensors, n_kv) ----

TEST(GgufValidationTest, FileTooShortForMagic) {
  Bytes b;
  b.U8('G').U8('G').U8('U');
  ExpectRejected(b, "header", 0, "too short for the magic");
}

TEST(GgufValidationTest, BadMagic) {
  Bytes b;
  b.U32(0x58554747).U32(3).I64(0).I64(0);
  ExpectRejected(b, "header", 0, "bad magic 'GGUX'");
}

TEST(GgufValidationTest, VersionZero) {
  Bytes b;
  b.Header(0, 0, 0);
  ExpectRejected(b, "header", 4, "version 0");
}

TEST(GgufValidationTest, BigEndianFileRejectedByName) {
  Bytes b;
  b.Header(0, 0, 0x03000000);
  ExpectRejected(b, "header", 4, "big-endian GGUF is not supported");
}

TEST(GgufValidationTest, VersionOneRejected) {
  Bytes b;
  b.Header(0, 0, 1);
  ExpectRejected(b, "header", 4, "GGUF v1 is not supported");
}

TEST(GgufValidationTest, VersionNewerThanThreeRejected) {
  Bytes b;
  b.Header(0, 0, 4);
  ExpectRejected(b, "header", 4, "GGUF v4 is newer than v3");
}

// The counts are uint64 (the spec's) and printed as such.
TEST(GgufValidationTest, AllOnesTensorCountIsPrintedUnsigned) {
  Bytes b;
  b.Header(-1, 0);
  ExpectRejected(b, "header", 8, "n_tensors 18446744073709551615 does not fit");
}

// CVE-2024-21836: n_tensors sized the tensor-info allocation and overflowed it.
TEST(GgufValidationTest, TensorCountBeyondFile_CVE_2024_21836) {
  Bytes b;
  b.Header(kI64Max / 16, 0).Zeros(64);
  ExpectRejected(b, "header", 8, "does not fit in the 64 bytes after the header");
}

TEST(GgufValidationTest, TopBitKeyCountIsPrintedUnsigned) {
  Bytes b;
  b.Header(0, std::numeric_limits<int64_t>::min());
  ExpectRejected(b, "header", 16, "n_kv 9223372036854775808 does not fit");
}

// CVE-2024-23605: n_kv sized the key/value allocation and overflowed it.
TEST(GgufValidationTest, KeyCountBeyondFile_CVE_2024_23605) {
  Bytes b;
  b.Header(0, int64_t{1} << 60).Zeros(100);
  ExpectRejected(b, "header", 16, "n_kv 1152921504606846976 does not fit");
}

TEST(GgufValidationTest, TruncatedCounts) {
  Bytes b;
  b.U32(kGgufMagic).U32(3).U32(0);
  ExpectRejected(b, "header", 8, "n_tensors");
}

// ---- key/value pairs (llama.cpp: key string, empty key, duplicates, type) ----

TEST(GgufValidationTest, EmptyKey) {
  Bytes b;
  b.Header(0, 1).Str("").U32(kU8).U8(1).Zeros(8);
  ExpectRejected(b, "key #0", 24, "key is empty");
}

TEST(GgufValidationTest, DuplicateKey) {
  Bytes b;
  b.Header(0, 2).Str("k").U32(kU8).U8(1);
  const uint64_t second = b.size();
  b.Str("k").U32(kU8).U8(2);
  ExpectRejected(b, "key 'k'", second, "duplicate key (first at byte 24)");
}

// CVE-2024-23496: a string length of SIZE_MAX made the +1 for the NUL wrap.
TEST(GgufValidationTest, KeyLengthHuge_CVE_2024_23496) {
  Bytes b;
  b.Header(0, 1).U64(kU64Max).Zeros(16);
  ExpectRejected(b, "key #0", 24, "key length 18446744073709551615 exceeds the limit");
}

TEST(GgufValidationTest, StringValueLongerThanLimit) {
  Bytes b;
  b.Header(0, 1).Str("s").U32(kStr);
  const uint64_t at = b.size();
  b.U64((uint64_t{1} << 30) + 1).Zeros(8);
  ExpectRejected(b, "key 's'", at, "string value length 1073741825 exceeds the limit");
}

TEST(GgufValidationTest, StringValuePastEndOfFile) {
  Bytes b;
  b.Header(0, 1).Str("s").U32(kStr);
  const uint64_t at = b.size();
  b.U64(1000).Zeros(10);
  ExpectRejected(b, "key 's'", at, "runs past the end of the file (10 bytes left)");
}

TEST(GgufValidationTest, UnknownValueType) {
  Bytes b;
  b.Header(0, 1).Str("k");
  const uint64_t at = b.size();
  b.U32(13).U64(0);
  ExpectRejected(b, "key 'k'", at, "unknown value type 13");
}

TEST(GgufValidationTest, TruncatedScalarValue) {
  Bytes b;
  b.Header(0, 1).Str("k").U32(kU64).U32(0);
  ExpectRejected(b, "key 'k'", 24 + 9 + 4, "file ends inside u64 value");
}

TEST(GgufValidationTest, UnknownArrayElementType) {
  Bytes b;
  b.Header(0, 1).Str("k").U32(kArr);
  const uint64_t at = b.size();
  b.U32(99).U64(0);
  ExpectRejected(b, "key 'k'", at, "unknown array element type 99");
}

TEST(GgufValidationTest, NestedArrayRejected) {
  Bytes b;
  b.Header(0, 1).Str("k").U32(kArr);
  const uint64_t at = b.size();
  b.U32(kArr).U64(1).U32(kU8).U64(0);
  ExpectRejected(b, "key 'k'", at, "nested arrays are not supported");
}

// CVE-2024-21825: array counts times element size overflowed the allocation.
TEST(GgufValidationTest, ArrayCountAboveLimit_CVE_2024_21825) {
  Bytes b;
  b.Header(0, 1).Str("k").U32(kArr).U32(kU64);
  const uint64_t at = b.size();
  b.U64(uint64_t{1} << 61).Zeros(64);
  ExpectRejected(b, "key 'k'", at, "array element count 2305843009213693952 exceeds the limit");
}

// CVE-2024-21825 (string arrays): the count must fit the bytes left before a
// single element is allocated.
TEST(GgufValidationTest, StringArrayCountBeyondFile_CVE_2024_21825) {
  Bytes b;
  b.Header(0, 1).Str("tokenizer.ggml.tokens").U32(kArr).U32(kStr);
  const uint64_t at = b.size();
  b.U64(1000000).Str("a").Str("b");
  ExpectRejected(b, "key 'tokenizer.ggml.tokens'", at,
                 "array of 1000000 str needs at least 8000000 bytes, 18 left");
}

TEST(GgufValidationTest, NumericArrayBeyondFile) {
  Bytes b;
  b.Header(0, 1).Str("k").U32(kArr).U32(kI32);
  const uint64_t at = b.size();
  b.U64(10).Zeros(39);
  ExpectRejected(b, "key 'k'", at, "array of 10 i32 needs at least 40 bytes, 39 left");
}

TEST(GgufValidationTest, StringInsideArrayPastEnd) {
  Bytes b;
  b.Header(0, 1).Str("k").U32(kArr).U32(kStr).U64(2).Str("ok");
  const uint64_t at = b.size();
  b.U64(100).Zeros(4);
  ExpectRejected(b, "key 'k'", at, "array string 1 length 100 runs past the end");
}

// llama.cpp #26690: an array's element type must be checked before its data is
// read with the caller's stride.
TEST(GgufValidationTest, ArrayElementTypeCheckedBeforeUse_26690) {
  Bytes b;
  b.Header(0, 2).Str("tokenizer.ggml.scores").U32(kArr).U32(kU8).U64(3).U8(1).U8(2).U8(3);
  const uint64_t tokens_at = b.size();
  b.Str("tokenizer.ggml.tokens").U32(kArr).U32(kStr).U64(1).Str("x");
  auto f = GgufFile::FromBytes("arr.gguf", b.data());
  ASSERT_TRUE(f.ok()) << f.status();
  auto tokens = (*f)->GetIntArray("tokenizer.ggml.tokens");
  ASSERT_FALSE(tokens.ok());
  EXPECT_EQ(std::string(tokens.status().message()),
            "arr.gguf: key 'tokenizer.ggml.tokens' at byte " + std::to_string(tokens_at) +
                ": is array of str, expected an array of integers");
  auto scores = (*f)->GetStringArray("tokenizer.ggml.scores");
  ASSERT_FALSE(scores.ok());
  EXPECT_NE(std::string(scores.status().message()).find("key 'tokenizer.ggml.scores' at byte 24"),
            std::string::npos);
  EXPECT_FALSE((*f)->GetFloatArray("tokenizer.ggml.tokens").ok());
  // The u8 scores are read one byte apart, not four.
  EXPECT_EQ(*(*f)->GetFloatArray("tokenizer.ggml.scores"), (std::vector<double>{1, 2, 3}));
}

// ---- general.alignment (llama.cpp: u32, non-zero power of two; #24997: bounded) ----

TEST(GgufValidationTest, AlignmentNotU32) {
  Bytes b;
  b.Header(0, 1).Str("general.alignment").U32(kI32).I32(32);
  ExpectRejected(b, "key 'general.alignment'", 24, "must be u32, is i32");
}

TEST(GgufValidationTest, AlignmentZero) {
  Bytes b;
  b.Header(0, 1).Str("general.alignment").U32(kU32).U32(0);
  ExpectRejected(b, "key 'general.alignment'", 24, "alignment 0 is not a power of two");
}

TEST(GgufValidationTest, AlignmentNotPowerOfTwo) {
  Bytes b;
  b.Header(0, 1).Str("general.alignment").U32(kU32).U32(48);
  ExpectRejected(b, "key 'general.alignment'", 24, "alignment 48 is not a power of two");
}

TEST(GgufValidationTest, AlignmentUnbounded_24997) {
  Bytes b;
  b.Header(0, 1).Str("general.alignment").U32(kU32).U32(0x80000000u);
  ExpectRejected(b, "key 'general.alignment'", 24,
                 "alignment 2147483648 exceeds the limit of 1048576");
}

// ---- tensor infos ----

TEST(GgufValidationTest, TensorNameTooLong) {
  Bytes b;
  b.Header(1, 0).Tensor(std::string(64, 'n'), {1}, kF32Type, 0).PadTo(32).Zeros(32);
  ExpectRejected(b, "tensor '" + std::string(64, 'n') + "'", 24,
                 "name is 64 bytes, ggml allows at most 63");
}

TEST(GgufValidationTest, TensorNameLengthPastEnd) {
  Bytes b;
  b.Header(1, 0).U64(kU64Max).Zeros(32);
  ExpectRejected(b, "tensor #0", 24, "name length 18446744073709551615 exceeds the limit");
}

TEST(GgufValidationTest, DuplicateTensorName) {
  Bytes b;
  b.Header(2, 0).Tensor("w", {8}, kF32Type, 0);
  const uint64_t second = b.size();
  b.Tensor("w", {8}, kF32Type, 32).PadTo(32).Zeros(64);
  ExpectRejected(b, "tensor 'w'", second, "duplicate tensor name (first at byte 24)");
}

// CVE-2024-21802: n_dims > 4 wrote past info->ne[4].
TEST(GgufValidationTest, TooManyDimensions_CVE_2024_21802) {
  Bytes b;
  b.Header(1, 0).Tensor("w", {1, 1, 1, 1, 1}, kF32Type, 0).PadTo(32).Zeros(32);
  ExpectRejected(b, "tensor 'w'", 24 + 9, "n_dims 5 exceeds 4");
}

TEST(GgufValidationTest, NegativeDimension) {
  Bytes b;
  b.Header(1, 0).Tensor("w", {4, -2}, kF32Type, 0).PadTo(32).Zeros(32);
  ExpectRejected(b, "tensor 'w'", 24 + 9 + 4 + 8, "dimension 1 is -2, must be >= 0");
}

TEST(GgufValidationTest, ElementCountOverflow) {
  Bytes b;
  b.Header(1, 0).Tensor("w", {int64_t{1} << 32, int64_t{1} << 32}, kI8Type, 0).Zeros(64);
  ExpectRejected(b, "tensor 'w'", 24 + 9, "element count of shape [4294967296, 4294967296]");
}

// llama.cpp #27203: (INT64_MAX, 2) wraps to a negative count that skipped the check.
TEST(GgufValidationTest, ElementCountWrapsNegative_27203) {
  Bytes b;
  b.Header(1, 0).Tensor("w", {kI64Max, 2}, kI8Type, 0).Zeros(64);
  ExpectRejected(b, "tensor 'w'", 24 + 9, "overflows int64");
}

TEST(GgufValidationTest, UnknownTensorTypeNamesTensorAndId) {
  for (uint32_t type : {4u, 31u, 36u, 43u, 0x80000000u}) {
    Bytes b;
    b.Header(1, 0).Tensor("blk.0.w", {32}, type, 0).PadTo(32).Zeros(128);
    ExpectRejected(b, "tensor 'blk.0.w'", 24 + 15 + 4 + 8,
                   "unknown ggml type " + std::to_string(type));
  }
}

TEST(GgufValidationTest, RowNotMultipleOfBlockSize) {
  Bytes b;
  b.Header(1, 0).Tensor("q", {33, 2}, kQ4_0Type, 0).PadTo(32).Zeros(64);
  ExpectRejected(b, "tensor 'q'", 24 + 9,
                 "row length 33 is not a multiple of q4_0's block size 32");
}

// CVE-2026-33298: element count x type size overflowed size_t.
TEST(GgufValidationTest, ByteSizeOverflow_CVE_2026_33298) {
  Bytes b;
  b.Header(1, 0).Tensor("w", {int64_t{1} << 62}, kF32Type, 0).Zeros(64);
  ExpectRejected(b, "tensor 'w'", 24 + 9 + 4 + 8, "byte size of 4611686018427387904 blocks of f32");
}

TEST(GgufValidationTest, TruncatedTensorInfo) {
  Bytes b;
  b.Header(1, 0).Str("w").U32(2).I64(4).I64(4).U32(kF32Type).U32(0);
  ExpectRejected(b, "tensor 'w'", b.size() - 4, "file ends inside data offset");
}

// ---- data section (llama.cpp: offsets equal the running aligned offset, data in file) ----

TEST(GgufValidationTest, OffsetNotTheRunningOffset) {
  Bytes b;
  b.Header(2, 0).Tensor("a", {4}, kF32Type, 0);
  const uint64_t second = b.size();
  b.Tensor("b", {4}, kF32Type, 64).PadTo(32).Zeros(128);
  ExpectRejected(b, "tensor 'b'", second, "data offset 64, expected 32");
}

TEST(GgufValidationTest, OffsetMisaligned) {
  Bytes b;
  b.Header(1, 0).Tensor("a", {4}, kF32Type, 4).PadTo(32).Zeros(64);
  ExpectRejected(b, "tensor 'a'", 24, "data offset 4, expected 0 (alignment 32)");
}

TEST(GgufValidationTest, TensorDataPastEndOfFile) {
  Bytes b;
  b.Header(1, 0).Tensor("a", {16}, kF32Type, 0).PadTo(32).Zeros(63);
  ExpectRejected(b, "tensor 'a'", 24, "data [0, +64) runs past the end of the file");
}

TEST(GgufValidationTest, DataSectionStartPastEndOfFile) {
  Bytes b;
  b.Header(1, 0).Tensor("a", {0}, kF32Type, 0);
  const uint64_t end = b.size();
  ExpectRejected(b, "header", end, "data section would start at byte 64");
}

// llama.cpp #26979: a byte size within 31 of 2^64 wrapped to 0 when padded.
TEST(GgufValidationTest, PaddedSizeWraps) {
  Bytes b;
  b.Header(1, 0)
      .Tensor("w", {4, (int64_t{1} << 30) - 1, (int64_t{1} << 30) + 1}, kF32Type, 0)
      .PadTo(32)
      .Zeros(64);
  ExpectRejected(b, "tensor 'w'", 24, "byte size 18446744073709551600 overflows when padded");
}

// CVE-2025-53630 / CVE-2026-27940: the running size of the data section wrapped,
// so a small allocation backed huge tensors. Here a huge tensor followed by one
// at the wrapped offset 0 is stopped at the first: its data must lie in the file.
TEST(GgufValidationTest, DataSizeSumWraps_CVE_2025_53630_CVE_2026_27940) {
  Bytes b;
  b.Header(2, 0)
      .Tensor("huge", {kI64Max - 31}, kI8Type, 0)
      .Tensor("next", {32}, kI8Type, 0)
      .PadTo(32)
      .Zeros(64);
  ExpectRejected(b, "tensor 'huge'", 24, "runs past the end of the file");
}

// ---- robustness ----

std::vector<uint8_t> WriterFile() {
  GgufWriter w;
  w.SetString("general.architecture", "qwen3moe");
  w.SetUint32("qwen3moe.block_count", 2);
  w.SetFloat32("qwen3moe.rope.freq_base", 1e6f);
  w.SetBool("general.flag", true);
  w.SetStringArray("tokenizer.ggml.tokens", {"a", "bb", "ccc"});
  w.SetInt32Array("tokenizer.ggml.token_type", {1, 2, 3});
  w.SetFloat32Array("tokenizer.ggml.scores", {0.5f, 1.5f, 2.5f});
  w.AddTensor("token_embd.weight", GgmlType::kF32, {4, 3}, std::vector<uint8_t>(48, 1));
  w.AddTensor("blk.0.ffn_up_exps.weight", GgmlType::kQ4_0, {32, 2, 2},
              std::vector<uint8_t>(4 * 18, 2));
  w.AddTensor("output_norm.weight", GgmlType::kF16, {4}, std::vector<uint8_t>(8, 3));
  return w.Serialize();
}

// Every proper prefix of a valid file is rejected with a located message.
TEST(GgufValidationTest, EveryTruncationIsAnError) {
  const std::vector<uint8_t> full = WriterFile();
  ASSERT_TRUE(GgufFile::FromBytes("full.gguf", full).ok());
  // The last tensor's trailing padding is not data, so the file stays valid
  // down to the end of that tensor's bytes.
  auto parsed = GgufFile::FromBytes("full.gguf", full);
  const GgufTensor& last = (*parsed)->tensors().back();
  const size_t min_valid = (*parsed)->data_offset() + last.offset + last.nbytes;
  for (size_t n = 0; n < full.size(); ++n) {
    std::vector<uint8_t> cut(full.begin(), full.begin() + n);
    auto f = GgufFile::FromBytes("cut.gguf", cut);
    if (n >= min_valid) {
      EXPECT_TRUE(f.ok()) << n << ": " << f.status();
      continue;
    }
    ASSERT_FALSE(f.ok()) << "accepted a file truncated to " << n << " bytes";
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(f.status().message()).find(" at byte "), std::string::npos) << f.status();
  }
}

// Seeded single-byte corruptions either parse or fail cleanly, never crash; the
// ones that parse still keep every tensor inside the file.
TEST(GgufValidationTest, RandomByteCorruptionsNeverCrash) {
  const std::vector<uint8_t> full = WriterFile();
  std::mt19937 rng(1234);
  int rejected = 0;
  for (int i = 0; i < 5000; ++i) {
    std::vector<uint8_t> bad = full;
    bad[rng() % bad.size()] = static_cast<uint8_t>(rng());
    auto f = GgufFile::FromBytes("corrupt.gguf", bad);
    if (!f.ok()) {
      ++rejected;
      EXPECT_NE(std::string(f.status().message()).find(" at byte "), std::string::npos)
          << f.status();
      continue;
    }
    for (const GgufTensor& t : (*f)->tensors()) {
      EXPECT_LE((*f)->data_offset() + t.offset + t.nbytes, (*f)->file_size()) << t.name;
    }
  }
  EXPECT_GT(rejected, 0);
}

}  // namespace
}  // namespace moegraph
