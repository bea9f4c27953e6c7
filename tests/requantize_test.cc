// loader/requantize.h: llama-quantize --pure's choice of types and its bytes.
#include "loader/requantize.h"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>

#include "loader/fixture.h"
#include "loader/gguf.h"
#include "tests/test_util.h"

namespace moegraph {
namespace {

using testing_util::TempPath;

GgufTensor Tensor(const std::string& name, int n_dims, int64_t ne0, GgmlType type) {
  GgufTensor t;
  t.name = name;
  t.n_dims = n_dims;
  t.ne[0] = ne0;
  t.ne[1] = 8;
  t.type = static_cast<uint32_t>(type);
  return t;
}

TEST(RequantizeTest, TheTypesAreLlamaQuantizePures) {
  const GgmlType f32 = GgmlType::kF32, f16 = GgmlType::kF16, q4k = GgmlType::kQ4_K;
  EXPECT_EQ(PureQuantizedType(Tensor("blk.0.attn_q.weight", 2, 256, f16), q4k), q4k);
  EXPECT_EQ(PureQuantizedType(Tensor("blk.0.ffn_down_exps.weight", 3, 512, f16), q4k), q4k);
  // Kept: norms, the router, 1-D tensors, conv kernels, non-weights.
  EXPECT_EQ(PureQuantizedType(Tensor("blk.0.attn_q_norm.weight", 2, 256, f32), q4k), f32);
  EXPECT_EQ(PureQuantizedType(Tensor("blk.0.ffn_gate_inp.weight", 2, 256, f32), q4k), f32);
  EXPECT_EQ(PureQuantizedType(Tensor("blk.0.ffn_norm.weight", 1, 256, f32), q4k), f32);
  EXPECT_EQ(PureQuantizedType(Tensor("blk.0.ssm_conv1d.weight", 2, 256, f32), q4k), f32);
  EXPECT_EQ(PureQuantizedType(Tensor("blk.0.ssm_a", 2, 256, f32), q4k), f32);
  // tensor_type_fallback: rows that do not fill 256-blocks, then 32-blocks.
  EXPECT_EQ(PureQuantizedType(Tensor("blk.0.ffn_down_exps.weight", 3, 64, f16), q4k),
            GgmlType::kQ5_0);
  EXPECT_EQ(PureQuantizedType(Tensor("blk.0.ffn_down_exps.weight", 3, 64, f16), GgmlType::kQ6_K),
            GgmlType::kQ8_0);
  EXPECT_EQ(PureQuantizedType(Tensor("blk.0.ffn_down_exps.weight", 3, 48, f16), q4k), f16);
  EXPECT_EQ(PureFileType(GgmlType::kQ8_0), 7);
  EXPECT_EQ(PureFileType(GgmlType::kQ4_K), 14);
}

// An f32 fixture rewritten as q8_0 holds, tensor for tensor, the bytes
// make-fixture writes for the same seed at q8_0 (both ggml's reference
// quantizer over the same values), and the keys llama-quantize sets.
TEST(RequantizeTest, AnF32FixtureRewrittenIsTheQuantizedFixture) {
  FixtureSpec spec;
  spec.router_skew = 1;
  const std::string f32 = TempPath("rq-f32.gguf"), q8 = TempPath("rq-q8.gguf"),
                    out = TempPath("rq-out.gguf");
  ASSERT_TRUE(WriteFixture(spec, f32).ok());
  spec.dense_type = spec.expert_type = GgmlType::kQ8_0;
  ASSERT_TRUE(WriteFixture(spec, q8).ok());
  absl::StatusOr<std::unique_ptr<GgufFile>> in = GgufFile::Open(f32);
  ASSERT_TRUE(in.ok()) << in.status();
  ASSERT_TRUE(RequantizeFile(**in, GgmlType::kQ8_0, out, nullptr).ok());
  absl::StatusOr<std::unique_ptr<GgufFile>> got = GgufFile::Open(out);
  absl::StatusOr<std::unique_ptr<GgufFile>> want = GgufFile::Open(q8);
  ASSERT_TRUE(got.ok() && want.ok());
  ASSERT_EQ((*got)->tensors().size(), (*want)->tensors().size());
  int quantized = 0;
  for (size_t i = 0; i < (*got)->tensors().size(); ++i) {
    const GgufTensor& a = (*got)->tensors()[i];
    const GgufTensor& b = (*want)->tensors()[i];
    ASSERT_EQ(a.name, b.name);
    EXPECT_EQ(a.type, b.type) << a.name;
    ASSERT_EQ(a.nbytes, b.nbytes) << a.name;
    EXPECT_EQ(std::memcmp(a.data, b.data, a.nbytes), 0) << a.name;
    quantized += a.ggml_type() == GgmlType::kQ8_0;
  }
  EXPECT_GT(quantized, 10);
  const GgufKV* ftype = (*got)->FindKey("general.file_type");
  ASSERT_NE(ftype, nullptr);
  EXPECT_EQ(ftype->u64, 7u);
  EXPECT_NE((*got)->FindKey("general.quantization_version"), nullptr);
  EXPECT_NE((*got)->FindKey("tokenizer.ggml.tokens"), nullptr);
}

}  // namespace
}  // namespace moegraph
