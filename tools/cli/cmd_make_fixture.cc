// moegraph make-fixture: writes a synthetic MoE model as GGUF (loader/fixture.h).
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "loader/fixture.h"
#include "loader/gguf.h"
#include "loader/model_config.h"
#include "loader/status_util.h"
#include "text/hf_tokenizer.h"
#include "tools/cli/commands.h"

// What each flag means to each command: tools/cli/command_line.cc.
ABSL_FLAG(std::string, arch, "qwen3moe",
          "qwen3moe | olmoe | qwen2moe | mixtral | gpt-oss | glm4moe");
ABSL_FLAG(int32_t, swa, 4, "make-fixture: gpt-oss: the attention window of the even layers");
ABSL_FLAG(int32_t, dense_layers, 1, "make-fixture: glm4moe: leading layers with a dense FFN");
ABSL_FLAG(int32_t, nextn, 1, "make-fixture: glm4moe, qwen35moe: NextN (MTP) layers after the decode layers");
ABSL_FLAG(bool, qk_norm, false, "make-fixture: glm4moe: per-head q/k norms");
ABSL_FLAG(int32_t, full_attn_interval, 4,
          "make-fixture: qwen35moe: every N-th layer is attention, the rest Gated DeltaNets");
ABSL_FLAG(int32_t, ssm_k_heads, 2, "make-fixture: qwen35moe: Gated DeltaNet key heads");
ABSL_FLAG(int32_t, ssm_v_heads, 4,
          "make-fixture: qwen35moe: Gated DeltaNet value heads (a multiple of the key heads)");
ABSL_FLAG(int32_t, ssm_head_dim, 0,
          "make-fixture: qwen35moe: Gated DeltaNet head size (0: the attention's)");
ABSL_FLAG(int32_t, layers, 0, "layers (0: the command's default)");
ABSL_FLAG(int32_t, experts, 0, "routed experts per layer (0: the command's default)");
ABSL_FLAG(int32_t, top_k, moegraph::kUnsetTopK,
          "experts per token (make-fixture, trace synth) or sampling's top-k (run, chat, serve)");
ABSL_FLAG(int32_t, embd, 64, "make-fixture: embedding width");
ABSL_FLAG(int32_t, ff, 32, "make-fixture: hidden size of one routed expert");
ABSL_FLAG(int32_t, shared_ff, 0,
          "make-fixture: qwen2moe shared expert hidden size (0: twice --ff)");
ABSL_FLAG(int32_t, heads, 4, "make-fixture: attention heads");
ABSL_FLAG(int32_t, kv_heads, 0,
          "make-fixture: key/value heads (0: --heads for olmoe, whose llama.cpp graph has no "
          "GQA; else --heads / 2 when even)");
ABSL_FLAG(int32_t, head_dim, 0, "make-fixture: head size (0: --embd / --heads)");
ABSL_FLAG(int32_t, vocab, 256, "make-fixture: vocabulary size (ignored with --tokenizer-json)");
ABSL_FLAG(std::string, tokenizer_json, "",
          "make-fixture: a Hugging Face tokenizer.json (tokenizer_config.json and config.json "
          "beside it are read too): its vocabulary, converted as llama.cpp's converter does, "
          "instead of the synthetic one");
ABSL_FLAG(int32_t, pad_vocab, 0,
          "make-fixture: with --tokenizer-json, pad the vocabulary with unused [PADn] tokens to "
          "this many rows (0: config.json's vocab_size, else the tokenizer's own)");
ABSL_FLAG(std::string, quant, "f32",
          "make-fixture: TYPE[,expert=TYPE]: weight type of the dense matrices and, unless "
          "given after expert=, of the routed experts (f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 "
          "q2_K q3_K q4_K q5_K q6_K iq4_nl iq4_xs mxfp4); "
          "norms, biases and routers stay f32");
ABSL_FLAG(double, router_skew, 0.0,
          "make-fixture: 0 routes tokens evenly; larger values make a few experts dominate");
ABSL_FLAG(int64_t, seed, moegraph::kUnsetFlag, "random seed (unset or -1: the command's default)");
ABSL_FLAG(int32_t, expert_variants, 0,
          "make-fixture: 0: every routed expert distinct; V > 0: expert e is a byte copy of "
          "expert e % V (fast for large fixtures; only for benchmarks whose routing comes from "
          "--routing-trace, since identical experts compute identical outputs)");
ABSL_FLAG(bool, legacy_experts, false,
          "make-fixture: mixtral only: per-expert ffn_gate.N tensors instead of merged ones");
ABSL_FLAG(bool, tied_output, false,
          "make-fixture: qwen3moe and mixtral: omit output.weight (lm_head is token_embd)");

namespace moegraph {
namespace {

constexpr int kDefaultTrainContext = 4096;

absl::Status ParseType(const std::string& flag_value, const std::string& name, GgmlType* out) {
  if (!ggml_type_from_name(name, out)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--quant ", flag_value, ": '", name, "' is not a ggml type name"));
  }
  return absl::OkStatus();
}

// "TYPE" sets both; "TYPE,expert=TYPE" or "expert=TYPE" sets the experts apart.
absl::Status ParseQuant(const std::string& value, FixtureSpec* spec) {
  bool dense_given = false;
  bool expert_given = false;
  for (absl::string_view part_view : absl::StrSplit(value, ',')) {
    const std::string part(part_view);
    if (part.rfind("expert=", 0) == 0) {
      if (expert_given) {
        return absl::InvalidArgumentError(
            absl::StrCat("--quant ", value, ": expert= is given twice"));
      }
      expert_given = true;
      if (absl::Status s = ParseType(value, part.substr(7), &spec->expert_type); !s.ok()) {
        return s;
      }
      continue;
    }
    if (dense_given) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--quant ", value, ": expected TYPE[,expert=TYPE], got a second type '", part, "'"));
    }
    dense_given = true;
    if (absl::Status s = ParseType(value, part, &spec->dense_type); !s.ok()) return s;
  }
  if (!expert_given) spec->expert_type = spec->dense_type;
  return absl::OkStatus();
}

absl::Status MakeFixture(const std::vector<std::string>& args) {
  if (!args.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("make-fixture takes no arguments, got '", args[0], "'"));
  }
  const std::string path = absl::GetFlag(FLAGS_o);
  if (path.empty()) return absl::InvalidArgumentError("-o FILE.gguf is required");

  FixtureSpec spec;
  const std::string arch = absl::GetFlag(FLAGS_arch);
  if (!arch_from_name(arch, &spec.arch)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--arch ", arch,
        " is not one of qwen3moe, olmoe, qwen2moe, mixtral, gpt-oss, glm4moe, qwen35moe"));
  }
  spec.n_layer = FlagOr(FLAGS_layers, spec.n_layer);
  spec.n_expert = FlagOr(FLAGS_experts, spec.n_expert);
  spec.n_expert_used = TopKFlagOr(spec.n_expert_used);
  spec.n_embd = absl::GetFlag(FLAGS_embd);
  spec.n_ff_exp = absl::GetFlag(FLAGS_ff);
  spec.n_ff_shexp = absl::GetFlag(FLAGS_shared_ff);
  spec.n_head = absl::GetFlag(FLAGS_heads);
  spec.n_head_kv = absl::GetFlag(FLAGS_kv_heads);
  if (spec.n_head_kv == 0) {
    const bool halve = spec.arch != Arch::kOlmoe && spec.n_head % 2 == 0;
    spec.n_head_kv = halve ? spec.n_head / 2 : spec.n_head;
  }
  spec.head_dim = absl::GetFlag(FLAGS_head_dim);
  spec.n_vocab = absl::GetFlag(FLAGS_vocab);
  const int ctx = absl::GetFlag(FLAGS_ctx);
  spec.n_ctx_train = ctx != 0 ? ctx : kDefaultTrainContext;
  if (absl::Status s = ParseQuant(absl::GetFlag(FLAGS_quant), &spec); !s.ok()) return s;
  spec.router_skew = static_cast<float>(absl::GetFlag(FLAGS_router_skew));
  MG_ASSIGN_OR_RETURN(spec.seed, SeedFlagOr(1));
  spec.expert_variants = absl::GetFlag(FLAGS_expert_variants);
  spec.legacy_experts = absl::GetFlag(FLAGS_legacy_experts);
  spec.tied_output = absl::GetFlag(FLAGS_tied_output);
  spec.n_swa = absl::GetFlag(FLAGS_swa);
  spec.n_dense_lead = absl::GetFlag(FLAGS_dense_layers);
  spec.n_nextn = absl::GetFlag(FLAGS_nextn);
  spec.qk_norm = absl::GetFlag(FLAGS_qk_norm);
  spec.full_attention_interval = absl::GetFlag(FLAGS_full_attn_interval);
  spec.ssm_k_heads = absl::GetFlag(FLAGS_ssm_k_heads);
  spec.ssm_v_heads = absl::GetFlag(FLAGS_ssm_v_heads);
  spec.ssm_head_dim = absl::GetFlag(FLAGS_ssm_head_dim);
  if (spec.qk_norm && spec.arch != Arch::kGlm4Moe) {
    return absl::InvalidArgumentError(
        "--qk-norm: only glm4moe's norms are optional (qwen3moe and olmoe always write theirs)");
  }
  FixtureVocab vocab;
  if (const std::string json = absl::GetFlag(FLAGS_tokenizer_json); !json.empty()) {
    absl::StatusOr<FixtureVocab> read = ReadHfTokenizer(json, absl::GetFlag(FLAGS_pad_vocab));
    if (!read.ok()) return read.status();
    vocab = std::move(*read);
    spec.vocab = &vocab;
    spec.n_vocab = static_cast<int>(vocab.tokens.size());
  }

  if (absl::Status s = WriteFixture(spec, path); !s.ok()) return s;
  // Reading the file back both validates it and gives the numbers to print.
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  if (!file.ok()) return file.status();
  std::printf("wrote %s: %s, %d layers, %d experts (top-%d), %zu tensors, %.2f MiB\n", path.c_str(),
              std::string(arch_gguf_name(spec.arch)).c_str(), spec.n_layer, spec.n_expert,
              spec.n_expert_used, (*file)->tensors().size(),
              static_cast<double>((*file)->file_size()) / (1024.0 * 1024.0));
  return absl::OkStatus();
}

}  // namespace

int RunMakeFixture(const std::vector<std::string>& args) {
  if (absl::Status s = MakeFixture(args); !s.ok()) {
    std::fprintf(stderr, "moegraph make-fixture: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}

}  // namespace moegraph
