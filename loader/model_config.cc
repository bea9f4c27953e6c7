#include "loader/model_config.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "loader/check.h"
#include "loader/quantize.h"
#include "loader/status_util.h"

namespace moegraph {
namespace {

// Key names as llama.cpp's LLM_KV_NAMES spells them ("%s" is the architecture).
constexpr char kKeyVocabSize[] = "vocab_size";
constexpr char kKeyContextLength[] = "context_length";
constexpr char kKeyEmbeddingLength[] = "embedding_length";
constexpr char kKeyBlockCount[] = "block_count";
constexpr char kKeyFeedForwardLength[] = "feed_forward_length";
constexpr char kKeyExpertFeedForwardLength[] = "expert_feed_forward_length";
constexpr char kKeyExpertSharedFeedForwardLength[] = "expert_shared_feed_forward_length";
constexpr char kKeyExpertCount[] = "expert_count";
constexpr char kKeyExpertUsedCount[] = "expert_used_count";
constexpr char kKeyExpertWeightsNorm[] = "expert_weights_norm";
constexpr char kKeyHeadCount[] = "attention.head_count";
constexpr char kKeyHeadCountKv[] = "attention.head_count_kv";
constexpr char kKeyKeyLength[] = "attention.key_length";
constexpr char kKeyValueLength[] = "attention.value_length";
constexpr char kKeyRmsEps[] = "attention.layer_norm_rms_epsilon";
constexpr char kKeyRopeFreqBase[] = "rope.freq_base";
constexpr char kKeyRopeDimensionCount[] = "rope.dimension_count";
constexpr char kKeyTokens[] = "tokenizer.ggml.tokens";
constexpr char kKeyRopeScalingType[] = "rope.scaling.type";
constexpr char kKeyRopeScalingFactor[] = "rope.scaling.factor";
constexpr char kKeyRopeScalingOrigCtx[] = "rope.scaling.original_context_length";
constexpr char kKeyRopeScalingAttnFactor[] = "rope.scaling.attn_factor";
constexpr char kKeySlidingWindow[] = "attention.sliding_window";
constexpr char kKeySlidingWindowPattern[] = "attention.sliding_window_pattern";
constexpr char kKeyRopeFreqBaseSwa[] = "rope.freq_base_swa";
constexpr char kKeyLeadingDenseBlockCount[] = "leading_dense_block_count";
constexpr char kKeyExpertSharedCount[] = "expert_shared_count";
constexpr char kKeyExpertWeightsScale[] = "expert_weights_scale";
constexpr char kKeyExpertGatingFunc[] = "expert_gating_func";
constexpr char kKeyNextnPredictLayers[] = "nextn_predict_layers";
constexpr char kKeySsmConvKernel[] = "ssm.conv_kernel";
constexpr char kKeySsmStateSize[] = "ssm.state_size";
constexpr char kKeySsmGroupCount[] = "ssm.group_count";
constexpr char kKeySsmTimeStepRank[] = "ssm.time_step_rank";
constexpr char kKeySsmInnerSize[] = "ssm.inner_size";
constexpr char kKeyRecurrentLayers[] = "attention.recurrent_layers";
constexpr char kKeyFullAttentionInterval[] = "full_attention_interval";
constexpr char kKeyRopeDimensionSections[] = "rope.dimension_sections";

// llama_expert_gating_func_type's values (src/llama-hparams.h).
constexpr int kGatingNone = 0;
constexpr int kGatingSoftmax = 1;
constexpr int kGatingSigmoid = 2;

class ConfigReader {
 public:
  ConfigReader(const GgufFile& file, Arch arch) : file_(file), arch_(arch) {}

  std::string Key(std::string_view suffix) const {
    return absl::StrCat(Av(arch_gguf_name(arch_)), ".", Av(suffix));
  }

  // An integer key that must fit in int; a missing key uses fallback when given.
  absl::Status Int(std::string_view suffix, int* out, const int* fallback = nullptr) const {
    const std::string key = Key(suffix);
    if (fallback != nullptr && file_.FindKey(key) == nullptr) {
      *out = *fallback;
      return absl::OkStatus();
    }
    if (const GgufKV* kv = file_.FindKey(key); kv != nullptr && kv->type == GgufType::kArray) {
      return PerLayerInt(*kv, out);
    }
    absl::StatusOr<uint64_t> v = file_.GetUint(key);
    if (!v.ok()) return v.status();
    if (*v > static_cast<uint64_t>(INT_MAX)) {
      return file_.KeyError(*file_.FindKey(key), absl::StrCat("value ", *v, " is too large"));
    }
    *out = static_cast<int>(*v);
    return absl::OkStatus();
  }

  absl::Status Float(std::string_view suffix, float* out, const float* fallback) const {
    const std::string key = Key(suffix);
    if (fallback != nullptr && file_.FindKey(key) == nullptr) {
      *out = *fallback;
      return absl::OkStatus();
    }
    absl::StatusOr<double> v = file_.GetFloat(key);
    if (!v.ok()) return v.status();
    if (!std::isfinite(*v) || *v <= 0) {
      return file_.KeyError(*file_.FindKey(key), absl::StrCat("value ", *v, " must be positive"));
    }
    *out = static_cast<float>(*v);
    return absl::OkStatus();
  }

  // A per-layer array where llama.cpp reads one (get_key_or_arr: head counts,
  // feed-forward and expert sizes, experts used): moegraph takes it when every
  // layer has the same value.
  absl::Status PerLayerInt(const GgufKV& kv, int* out) const {
    absl::StatusOr<std::vector<int64_t>> values = file_.GetIntArray(kv.key);
    if (!values.ok()) return values.status();
    if (values->empty()) return file_.KeyError(kv, "is an empty array");
    for (size_t il = 0; il < values->size(); ++il) {
      if ((*values)[il] != (*values)[0]) {
        return file_.KeyError(
            kv, absl::StrCat("layer ", il, " has ", (*values)[il], " where layer 0 has ",
                             (*values)[0], "; per-layer values that differ are not supported"));
      }
    }
    if ((*values)[0] < 0 || (*values)[0] > INT_MAX) {
      return file_.KeyError(kv, absl::StrCat("value ", (*values)[0], " is out of range"));
    }
    *out = static_cast<int>((*values)[0]);
    return absl::OkStatus();
  }

  // "FILE: key 'K' at byte N: what" for a key that is present, else "FILE: key 'K': what".
  absl::Status Invalid(std::string_view suffix, std::string_view what) const {
    const std::string key = Key(suffix);
    if (const GgufKV* kv = file_.FindKey(key)) return file_.KeyError(*kv, what);
    return absl::InvalidArgumentError(absl::StrCat(file_.path(), ": key '", key, "': ", Av(what)));
  }

 private:
  const GgufFile& file_;
  Arch arch_;
};

absl::Status ReadVocabSize(const GgufFile& file, const ConfigReader& r, int* n_vocab) {
  if (file.FindKey(r.Key(kKeyVocabSize)) != nullptr) return r.Int(kKeyVocabSize, n_vocab);
  if (const GgufKV* tokens = file.FindKey(kKeyTokens)) {
    if (tokens->type != GgufType::kArray || tokens->array_type != GgufType::kString) {
      return file.KeyError(*tokens, "is not an array of strings");
    }
    if (tokens->array_n > static_cast<uint64_t>(INT_MAX)) {
      return file.KeyError(*tokens, absl::StrCat(tokens->array_n, " tokens is too many"));
    }
    *n_vocab = static_cast<int>(tokens->array_n);
    return absl::OkStatus();
  }
  if (const GgufTensor* embd = file.FindTensor("token_embd.weight")) {
    if (embd->ne[1] > INT_MAX) return file.TensorError(*embd, "too many rows");
    *n_vocab = static_cast<int>(embd->ne[1]);
    return absl::OkStatus();
  }
  return absl::NotFoundError(absl::StrCat(file.path(), ": vocabulary size unknown: no key '",
                                          r.Key(kKeyVocabSize), "', no key '", kKeyTokens,
                                          "' and no tensor 'token_embd.weight'"));
}

// {arch}.rope.scaling.*, as llama_model_base's load_hparams reads them and
// llama_context's constructor turns them into ggml_rope_ext's arguments (in f32,
// as there): linear scaling divides the frequencies by the factor; YaRN mixes
// them per dimension (ext_factor 1) with the magnitude correction llama_context
// cancels and ggml's rope_yarn applies again.
absl::Status ReadRopeScaling(const GgufFile& file, const ConfigReader& r, ModelConfig* c) {
  RopeScaling& s = c->rope_scaling;
  std::string_view type = "linear";
  if (const GgufKV* kv = file.FindKey(r.Key(kKeyRopeScalingType))) {
    absl::StatusOr<std::string_view> v = file.GetString(kv->key);
    if (!v.ok()) return v.status();
    type = *v;
    if (type != "none" && type != "linear" && type != "yarn") {
      return file.KeyError(
          *kv, absl::StrCat("RoPE scaling '", Av(type), "' is not supported (none, linear, yarn)"));
    }
  }
  float factor = 0.0f;
  if (file.FindKey(r.Key(kKeyRopeScalingFactor)) != nullptr) {
    MG_RETURN_IF_ERROR(r.Float(kKeyRopeScalingFactor, &factor, nullptr));
  }
  s.freq_scale = factor == 0.0f || type == "none" ? 1.0f : 1.0f / factor;
  MG_RETURN_IF_ERROR(r.Int(kKeyRopeScalingOrigCtx, &s.n_ctx_orig, &c->n_ctx_train));
  float rope_attn_factor = 1.0f;
  if (file.FindKey(r.Key(kKeyRopeScalingAttnFactor)) != nullptr) {
    MG_RETURN_IF_ERROR(r.Float(kKeyRopeScalingAttnFactor, &rope_attn_factor, nullptr));
  }
  s.ext_factor = type == "yarn" ? 1.0f : 0.0f;
  s.attn_factor = 1.0f;
  if (s.ext_factor != 0.0f) {
    const float f = 1.0f / s.freq_scale;
    s.attn_factor = f <= 1.0f ? 1.0f : 0.1f * std::log(f) + 1.0f;  // get_mscale(f, 1)
    s.attn_factor *= 1.0f / (1.0f + 0.1f * std::log(f));
  }
  s.attn_factor *= rope_attn_factor;
  return absl::OkStatus();
}

// Hyper-parameter sanity checks, each naming the key that holds the bad value.
absl::Status CheckConfig(const ModelConfig& c, const ConfigReader& r, bool head_dim_given) {
  const std::initializer_list<std::pair<const char*, int>> positive = {
      {kKeyBlockCount, c.n_layer},        {kKeyEmbeddingLength, c.n_embd},
      {kKeyHeadCount, c.n_head},          {kKeyHeadCountKv, c.n_head_kv},
      {kKeyExpertCount, c.n_expert},      {kKeyExpertUsedCount, c.n_expert_used},
      {kKeyContextLength, c.n_ctx_train}, {kKeyVocabSize, c.n_vocab},
  };
  for (const auto& [suffix, value] : positive) {
    if (value <= 0) return r.Invalid(suffix, absl::StrCat("value ", value, " must be positive"));
  }
  if (c.n_expert_used > c.n_expert) {
    return r.Invalid(kKeyExpertUsedCount, absl::StrCat(c.n_expert_used, " exceeds ",
                                                       r.Key(kKeyExpertCount), " ", c.n_expert));
  }
  if (c.n_head % c.n_head_kv != 0) {
    return r.Invalid(kKeyHeadCountKv, absl::StrCat(r.Key(kKeyHeadCount), " ", c.n_head,
                                                   " is not a multiple of ", c.n_head_kv));
  }
  if (!head_dim_given && c.n_embd % c.n_head != 0) {
    return r.Invalid(kKeyHeadCount, absl::StrCat(r.Key(kKeyEmbeddingLength), " ", c.n_embd,
                                                 " is not a multiple of ", c.n_head, " and no ",
                                                 r.Key(kKeyKeyLength), " gives the head size"));
  }
  if (c.head_dim <= 0 || c.head_dim % 2 != 0) {
    return r.Invalid(kKeyKeyLength, absl::StrCat("head size ", c.head_dim,
                                                 " must be positive and even (RoPE pairs)"));
  }
  if (c.n_rot <= 0 || c.n_rot > c.head_dim || c.n_rot % 2 != 0) {
    return r.Invalid(kKeyRopeDimensionCount,
                     absl::StrCat("RoPE over ", c.n_rot, " dimensions of ", c.head_dim,
                                  " must be positive, even and at most the head size"));
  }
  // llama.cpp builds these two with wq of [n_embd, n_embd].
  if ((c.arch == Arch::kOlmoe || c.arch == Arch::kQwen2Moe) &&
      static_cast<int64_t>(c.n_head) * c.head_dim != c.n_embd) {
    return r.Invalid(kKeyKeyLength,
                     absl::StrCat("head size ", c.head_dim, " x ", c.n_head,
                                  " heads != ", r.Key(kKeyEmbeddingLength), " ", c.n_embd, " (",
                                  Av(arch_gguf_name(c.arch)), " needs them equal)"));
  }
  if (c.n_ff_exp <= 0) {
    return r.Invalid(kKeyExpertFeedForwardLength,
                     absl::StrCat("expert hidden size ", c.n_ff_exp, " must be positive"));
  }
  if (c.n_layer_dense_lead > 0 && c.n_ff_dense <= 0) {
    return r.Invalid(kKeyFeedForwardLength,
                     absl::StrCat("dense FFN hidden size ", c.n_ff_dense, " must be positive"));
  }
  if (c.arch == Arch::kQwen2Moe && c.n_ff_shexp <= 0) {
    return r.Invalid(kKeyExpertSharedFeedForwardLength,
                     absl::StrCat("shared expert hidden size ", c.n_ff_shexp, " must be positive"));
  }
  return absl::OkStatus();
}

std::string ShapeString(std::initializer_list<int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Finds tensors and checks them, collecting one line per problem.
class Binder {
 public:
  explicit Binder(const GgufFile& file) : file_(file) {}

  const GgufTensor* Bind(const std::string& name, std::initializer_list<int64_t> shape) {
    const GgufTensor* t = file_.FindTensor(name);
    if (t == nullptr) {
      problems_.push_back(absl::StrCat(file_.path(), ": tensor '", name, "': missing"));
      return nullptr;
    }
    bool shape_ok = true;
    int dim = 0;
    for (int64_t expected : shape) shape_ok &= t->ne[dim++] == expected;
    for (; dim < kGgufMaxDims; ++dim) shape_ok &= t->ne[dim] == 1;
    if (!shape_ok) {
      problems_.push_back(
          std::string(file_
                          .TensorError(*t, absl::StrCat("expected shape ", ShapeString(shape),
                                                        ", found ", t->shape_string()))
                          .message()));
      return nullptr;
    }
    if (!quant_supported(t->ggml_type())) {
      problems_.push_back(
          std::string(file_
                          .TensorError(*t, absl::StrCat("type ", ggml_type_name(t->type),
                                                        " is not supported by moegraph (",
                                                        quant_supported_names(), ")"))
                          .message()));
      return nullptr;
    }
    return t;
  }

  // A tensor present in the file that the architecture's graph never reads
  // where moegraph would read another: an error naming both.
  void Refuse(const std::string& name, std::string_view why) {
    if (const GgufTensor* t = file_.FindTensor(name)) {
      problems_.push_back(std::string(file_.TensorError(*t, why).message()));
    }
  }

  // Legacy per-expert tensors become one block each; llama.cpp merges them into
  // one tensor, so every expert of a projection must share expert 0's type.
  void BindLegacy(int layer, const char* proj, std::initializer_list<int64_t> shape, int n_expert,
                  std::vector<const GgufTensor*>* out) {
    out->assign(n_expert, nullptr);
    for (int e = 0; e < n_expert; ++e) {
      (*out)[e] = Bind(absl::StrCat("blk.", layer, ".", proj, ".", e, ".weight"), shape);
      const GgufTensor* first = (*out)[0];
      const GgufTensor* t = (*out)[e];
      if (first != nullptr && t != nullptr && t->type != first->type) {
        problems_.push_back(std::string(
            file_
                .TensorError(*t, absl::StrCat("type ", ggml_type_name(t->type), " differs from ",
                                              first->name, "'s ", ggml_type_name(first->type)))
                .message()));
      }
    }
  }

  absl::Status Result() const {
    if (problems_.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrJoin(problems_, "\n"));
  }

 private:
  const GgufFile& file_;
  std::vector<std::string> problems_;
};

std::string BlockName(int layer, std::string_view name) {
  return absl::StrCat("blk.", layer, ".", Av(name));
}

// Whether IMRoPE with these sections turns every one of the n_rot / 2 pairs by
// the token's position, as NEOX RoPE does: for text llama.cpp gives the t, h
// and w sections the position and the fourth 0 (llm_graph_input_pos), and
// pair p falls in section (p mod the sections' sum) mod 3 while that is under
// 3 times its size (ggml_mrope_cache_init's IMROPE branch).
bool ImropeTurnsAllPairsByPosition(const int (&sections)[4], int n_rot) {
  const int sum = sections[0] + sections[1] + sections[2] + sections[3];
  if (sum <= 0) return false;
  for (int p = 0; p < n_rot / 2; ++p) {
    const int sector = p % sum;
    const int section = sector % 3;
    if (sector >= 3 * sections[section]) return false;
  }
  return true;
}

// qwen35moe's keys (llama_model_qwen35moe::load_arch_hparams,
// src/models/qwen35moe.cpp): the Gated DeltaNet's sizes, which layers are
// Gated DeltaNets (attention.recurrent_layers, one flag per block including the
// NextN ones, else every layer but each full_attention_interval-th), and the
// IMRoPE sections, which must turn text as NEOX RoPE does.
absl::Status ReadQwen35Moe(const GgufFile& file, const ConfigReader& r, ModelConfig* c) {
  DeltaNetShape& s = c->delta_net;
  int inner = 0;
  for (const auto& [key, value] : {std::pair{kKeySsmConvKernel, &s.d_conv},
                                   std::pair{kKeySsmStateSize, &s.head_dim},
                                   std::pair{kKeySsmGroupCount, &s.n_k_heads},
                                   std::pair{kKeySsmTimeStepRank, &s.n_v_heads},
                                   std::pair{kKeySsmInnerSize, &inner}}) {
    MG_RETURN_IF_ERROR(r.Int(key, value));
    if (*value <= 0) return r.Invalid(key, absl::StrCat("value ", *value, " must be positive"));
  }
  if (inner != s.value_dim()) {
    return r.Invalid(kKeySsmInnerSize,
                     absl::StrCat(inner, " != ", r.Key(kKeySsmStateSize), " ", s.head_dim, " x ",
                                  r.Key(kKeySsmTimeStepRank), " ", s.n_v_heads));
  }
  if (s.n_v_heads % s.n_k_heads != 0) {
    return r.Invalid(kKeySsmTimeStepRank,
                     absl::StrCat(s.n_v_heads, " value heads are not a multiple of ",
                                  r.Key(kKeySsmGroupCount), " ", s.n_k_heads, " key heads"));
  }

  const int n_blocks = c->n_layer + c->n_layer_nextn;
  std::vector<bool> recurrent(static_cast<size_t>(n_blocks));
  if (const GgufKV* kv = file.FindKey(r.Key(kKeyRecurrentLayers))) {
    absl::StatusOr<std::vector<bool>> flags = file.GetFlagArray(kv->key);
    if (!flags.ok()) return flags.status();
    if (static_cast<int>(flags->size()) != n_blocks) {
      return file.KeyError(*kv, absl::StrCat(flags->size(), " flags for ", n_blocks, " blocks"));
    }
    recurrent = *flags;
  } else {
    const int default_interval = 4;
    int interval = 0;
    MG_RETURN_IF_ERROR(r.Int(kKeyFullAttentionInterval, &interval, &default_interval));
    if (interval <= 0) {
      return r.Invalid(kKeyFullAttentionInterval,
                       absl::StrCat("value ", interval, " must be positive"));
    }
    for (int il = 0; il < c->n_layer; ++il) recurrent[il] = (il + 1) % interval != 0;
  }
  c->mixers.clear();
  for (int il = 0; il < c->n_layer; ++il) {
    c->mixers.push_back(recurrent[il] ? LayerMixer::kDeltaNet : LayerMixer::kGatedAttention);
  }

  const std::string sections_key = r.Key(kKeyRopeDimensionSections);
  absl::StatusOr<std::vector<int64_t>> sections = file.GetIntArray(sections_key);
  if (!sections.ok()) return sections.status();
  if (sections->size() != 4) {
    return r.Invalid(kKeyRopeDimensionSections,
                     absl::StrCat(sections->size(), " sections where llama.cpp reads 4"));
  }
  int section[4];
  for (int i = 0; i < 4; ++i) {
    if ((*sections)[i] < 0 || (*sections)[i] > INT_MAX) {
      return r.Invalid(kKeyRopeDimensionSections,
                       absl::StrCat("section ", i, " of ", (*sections)[i], " is out of range"));
    }
    section[i] = static_cast<int>((*sections)[i]);
  }
  if (!ImropeTurnsAllPairsByPosition(section, c->n_rot)) {
    return r.Invalid(kKeyRopeDimensionSections,
                     absl::StrCat("sections [", absl::StrJoin(*sections, ", "),
                                  "] leave pairs of the ", c->n_rot,
                                  " rotated dimensions to the fourth (text) position, 0: not "
                                  "supported"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string_view arch_gguf_name(Arch arch) {
  switch (arch) {
    case Arch::kQwen3Moe:
      return "qwen3moe";
    case Arch::kOlmoe:
      return "olmoe";
    case Arch::kQwen2Moe:
      return "qwen2moe";
    case Arch::kMixtral:
      return "llama";
    case Arch::kGptOss:
      return "gpt-oss";
    case Arch::kGlm4Moe:
      return "glm4moe";
    case Arch::kQwen35Moe:
      return "qwen35moe";
  }
  MG_CHECK(false, "arch_gguf_name: unknown Arch value");
  std::abort();
}

bool arch_from_name(std::string_view name, Arch* out) {
  if (name == "qwen3moe") {
    *out = Arch::kQwen3Moe;
  } else if (name == "olmoe") {
    *out = Arch::kOlmoe;
  } else if (name == "qwen2moe") {
    *out = Arch::kQwen2Moe;
  } else if (name == "llama" || name == "mixtral") {
    *out = Arch::kMixtral;
  } else if (name == "gpt-oss") {
    *out = Arch::kGptOss;
  } else if (name == "glm4moe") {
    *out = Arch::kGlm4Moe;
  } else if (name == "qwen35moe") {
    *out = Arch::kQwen35Moe;
  } else {
    return false;
  }
  return true;
}

absl::StatusOr<ModelConfig> LoadConfig(const GgufFile& file) {
  absl::StatusOr<std::string_view> arch_name = file.GetString("general.architecture");
  if (!arch_name.ok()) return arch_name.status();
  ModelConfig c;
  if (!arch_from_name(*arch_name, &c.arch)) {
    return file.KeyError(
        *file.FindKey("general.architecture"),
        absl::StrCat("architecture '", Av(*arch_name),
                     "' is not supported (qwen3moe, olmoe, qwen2moe, llama, gpt-oss, glm4moe, "
                     "qwen35moe)"));
  }
  const ConfigReader r(file, c.arch);

  MG_RETURN_IF_ERROR(r.Int(kKeyContextLength, &c.n_ctx_train));
  MG_RETURN_IF_ERROR(r.Int(kKeyEmbeddingLength, &c.n_embd));
  MG_RETURN_IF_ERROR(r.Int(kKeyBlockCount, &c.n_layer));
  // block_count counts the NextN layers too (llama_hparams::n_layer()).
  const int no_layers = 0;
  MG_RETURN_IF_ERROR(r.Int(kKeyNextnPredictLayers, &c.n_layer_nextn, &no_layers));
  if (c.n_layer_nextn > 0 && c.n_layer_nextn >= c.n_layer) {
    return r.Invalid(kKeyNextnPredictLayers, absl::StrCat(c.n_layer_nextn, " of ", c.n_layer,
                                                          " layers leaves none to decode"));
  }
  c.n_layer -= c.n_layer_nextn;
  MG_RETURN_IF_ERROR(r.Int(kKeyExpertCount, &c.n_expert));
  MG_RETURN_IF_ERROR(r.Int(kKeyExpertUsedCount, &c.n_expert_used));
  MG_RETURN_IF_ERROR(r.Int(kKeyHeadCount, &c.n_head));
  MG_RETURN_IF_ERROR(r.Int(kKeyHeadCountKv, &c.n_head_kv, &c.n_head));
  if (c.n_head <= 0)
    return r.Invalid(kKeyHeadCount, absl::StrCat("value ", c.n_head, " must be positive"));

  // llama.cpp: key and value length default to n_embd / n_head; n_rot to key length.
  const bool head_dim_given = file.FindKey(r.Key(kKeyKeyLength)) != nullptr;
  const int default_head_dim = c.n_embd / c.n_head;
  MG_RETURN_IF_ERROR(r.Int(kKeyKeyLength, &c.head_dim, &default_head_dim));
  int value_dim = 0;
  MG_RETURN_IF_ERROR(r.Int(kKeyValueLength, &value_dim, &default_head_dim));
  if (value_dim != c.head_dim) {
    return r.Invalid(kKeyValueLength,
                     absl::StrCat("value head size ", value_dim, " != key head size ", c.head_dim,
                                  " (moegraph needs them equal)"));
  }
  MG_RETURN_IF_ERROR(r.Int(kKeyRopeDimensionCount, &c.n_rot, &c.head_dim));
  // llama.cpp asserts n_rot == head_dim in the other architectures' graphs.
  if (c.arch != Arch::kGlm4Moe && c.arch != Arch::kQwen35Moe && c.n_rot != c.head_dim) {
    return r.Invalid(kKeyRopeDimensionCount,
                     absl::StrCat("partial RoPE (", c.n_rot, " of ", c.head_dim,
                                  " dimensions) is not supported for ", Av(arch_gguf_name(c.arch)),
                                  " (llama.cpp asserts them equal)"));
  }

  const float default_freq_base = 10000.0f;
  MG_RETURN_IF_ERROR(r.Float(kKeyRopeFreqBase, &c.rope_freq_base, &default_freq_base));
  MG_RETURN_IF_ERROR(r.Float(kKeyRmsEps, &c.rms_eps, nullptr));

  // Expert hidden sizes as each architecture's load_arch_tensors derives them.
  const bool has_ff = file.FindKey(r.Key(kKeyFeedForwardLength)) != nullptr;
  int n_ff = 0;
  if (has_ff) MG_RETURN_IF_ERROR(r.Int(kKeyFeedForwardLength, &n_ff));
  switch (c.arch) {
    case Arch::kQwen3Moe:
    case Arch::kQwen2Moe:
    case Arch::kQwen35Moe: {
      if (file.FindKey(r.Key(kKeyExpertFeedForwardLength)) != nullptr || !has_ff) {
        MG_RETURN_IF_ERROR(r.Int(kKeyExpertFeedForwardLength, &c.n_ff_exp));
      } else if (c.n_expert_used > 0) {
        c.n_ff_exp = n_ff / c.n_expert_used;
      }
      if (c.arch == Arch::kQwen35Moe) MG_RETURN_IF_ERROR(ReadQwen35Moe(file, r, &c));
      if (c.arch == Arch::kQwen2Moe || c.arch == Arch::kQwen35Moe) {
        if (file.FindKey(r.Key(kKeyExpertSharedFeedForwardLength)) != nullptr || !has_ff) {
          MG_RETURN_IF_ERROR(r.Int(kKeyExpertSharedFeedForwardLength, &c.n_ff_shexp));
        } else {
          c.n_ff_shexp = n_ff;
        }
      }
      break;
    }
    case Arch::kOlmoe:
    case Arch::kMixtral:
      MG_RETURN_IF_ERROR(r.Int(kKeyFeedForwardLength, &c.n_ff_exp));
      break;
    case Arch::kGptOss:
      // llama_model_openai_moe::load_arch_hparams.
      MG_RETURN_IF_ERROR(r.Int(kKeyExpertFeedForwardLength, &c.n_ff_exp));
      MG_RETURN_IF_ERROR(r.Int(kKeySlidingWindow, &c.n_swa));
      if (c.n_swa <= 0) {
        return r.Invalid(kKeySlidingWindow, absl::StrCat("value ", c.n_swa, " must be positive"));
      }
      c.swa_pattern = 2;
      if (const GgufKV* kv = file.FindKey(r.Key(kKeySlidingWindowPattern))) {
        if (kv->type == GgufType::kArray) {
          return file.KeyError(*kv, "a per-layer window pattern is not supported (a count is)");
        }
        MG_RETURN_IF_ERROR(r.Int(kKeySlidingWindowPattern, &c.swa_pattern));
      }
      // rope.freq_base_swa, when given, must be the base: moegraph ropes every
      // layer alike.
      if (file.FindKey(r.Key(kKeyRopeFreqBaseSwa)) != nullptr) {
        float base_swa = 0.0f;
        MG_RETURN_IF_ERROR(r.Float(kKeyRopeFreqBaseSwa, &base_swa, nullptr));
        if (base_swa != c.rope_freq_base) {
          return r.Invalid(
              kKeyRopeFreqBaseSwa,
              absl::StrCat("a windowed layers' base ", base_swa, " other than ",
                           r.Key(kKeyRopeFreqBase), " ", c.rope_freq_base, " is not supported"));
        }
      }
      c.attn_sinks = true;
      c.attn_out_bias = true;
      c.router_bias = true;
      c.expert_bias = true;
      c.gating = ExpertGating::kSoftmaxWeight;
      c.expert_act = ExpertAct::kSwigluOai;
      c.qkv_bias = file.FindTensor("blk.0.attn_q.bias") != nullptr;
      break;
    case Arch::kGlm4Moe: {
      // llama_model_glm4_moe::load_arch_hparams and load_arch_tensors.
      MG_RETURN_IF_ERROR(r.Int(kKeyExpertFeedForwardLength, &c.n_ff_exp));
      MG_RETURN_IF_ERROR(r.Int(kKeyLeadingDenseBlockCount, &c.n_layer_dense_lead, &no_layers));
      if (c.n_layer_dense_lead >= c.n_layer) {
        return r.Invalid(kKeyLeadingDenseBlockCount,
                         absl::StrCat(c.n_layer_dense_lead, " dense layers of ", c.n_layer,
                                      " leaves no MoE layer"));
      }
      if (c.n_layer_dense_lead > 0) MG_RETURN_IF_ERROR(r.Int(kKeyFeedForwardLength, &c.n_ff_dense));
      int n_shared = 0;
      MG_RETURN_IF_ERROR(r.Int(kKeyExpertSharedCount, &n_shared));
      c.n_ff_shexp = c.n_ff_exp * n_shared;
      const float no_scale = 1.0f;
      MG_RETURN_IF_ERROR(r.Float(kKeyExpertWeightsScale, &c.expert_weights_scale, &no_scale));
      const int default_gating = kGatingNone;
      int gating = 0;
      MG_RETURN_IF_ERROR(r.Int(kKeyExpertGatingFunc, &gating, &default_gating));
      if (gating == kGatingSoftmax) {
        c.gating = ExpertGating::kSoftmax;
      } else if (gating == kGatingSigmoid || gating == kGatingNone) {
        c.gating = ExpertGating::kSigmoid;
      } else {
        return r.Invalid(
            kKeyExpertGatingFunc,
            absl::StrCat("gating function ", gating, " is not supported (1 softmax, 2 sigmoid)"));
      }
      c.expert_score_bias = true;
      c.qkv_bias = file.FindTensor("blk.0.attn_q.bias") != nullptr;
      c.qk_norm = file.FindTensor("blk.0.attn_q_norm.weight") != nullptr;
      break;
    }
  }
  MG_RETURN_IF_ERROR(ReadRopeScaling(file, r, &c));

  MG_RETURN_IF_ERROR(ReadVocabSize(file, r, &c.n_vocab));

  c.rope_type = c.arch == Arch::kMixtral ? RopeType::kNorm : RopeType::kNeox;
  // The norm_w argument each architecture's graph passes to build_moe_ffn.
  c.norm_topk_prob = c.arch == Arch::kQwen3Moe || c.arch == Arch::kMixtral;
  // gpt-oss's graph passes norm_w false whatever the file says; glm4moe's
  // hparams.expert_weights_norm defaults to false.
  const GgufKV* norm_kv = file.FindKey(r.Key(kKeyExpertWeightsNorm));
  if (const GgufKV* kv = c.arch == Arch::kGptOss ? nullptr : norm_kv) {
    absl::StatusOr<bool> norm = file.GetBool(kv->key);
    if (!norm.ok()) return norm.status();
    c.norm_topk_prob = *norm;
  }
  if (c.arch == Arch::kQwen35Moe) c.norm_topk_prob = true;  // its build_moe_ffn's norm_w
  if (c.arch == Arch::kQwen3Moe || c.arch == Arch::kQwen35Moe) c.qk_norm = true;
  c.qk_norm_full = c.arch == Arch::kOlmoe;
  if (c.arch == Arch::kQwen2Moe) c.qkv_bias = true;
  c.shexp_gated = c.arch == Arch::kQwen2Moe || c.arch == Arch::kQwen35Moe;
  // Only qwen3moe, llama and glm4moe fall back to token_embd when output.weight is absent.
  c.tied_embeddings =
      (c.arch == Arch::kQwen3Moe || c.arch == Arch::kMixtral || c.arch == Arch::kGlm4Moe) &&
      file.FindTensor("output.weight") == nullptr;

  MG_RETURN_IF_ERROR(CheckConfig(c, r, head_dim_given));
  return c;
}

absl::StatusOr<Model> LoadModel(const GgufFile& file) {
  absl::StatusOr<ModelConfig> config = LoadConfig(file);
  if (!config.ok()) return config.status();
  Model m;
  m.file = &file;
  m.config = *config;
  const ModelConfig& c = m.config;
  const int64_t embd = c.n_embd;
  const int64_t q_dim = static_cast<int64_t>(c.n_head) * c.head_dim;
  const int64_t kv_dim = static_cast<int64_t>(c.n_head_kv) * c.head_dim;
  const int64_t ff = c.n_ff_exp;
  const int64_t n_expert = c.n_expert;

  Binder b(file);
  m.token_embd = b.Bind("token_embd.weight", {embd, c.n_vocab});
  m.output_norm = b.Bind("output_norm.weight", {embd});
  m.output = c.tied_embeddings ? m.token_embd : b.Bind("output.weight", {embd, c.n_vocab});

  m.layers.resize(c.n_layer);
  for (int il = 0; il < c.n_layer; ++il) {
    LayerTensors& l = m.layers[il];
    auto name = [il](std::string_view base) { return BlockName(il, base); };
    l.attn_norm = b.Bind(name("attn_norm.weight"), {embd});
    if (c.mixer(il) == LayerMixer::kDeltaNet) {
      // llama_model_qwen35moe::load_arch_tensors' recurrent layers.
      const DeltaNetShape& s = c.delta_net;
      LayerTensors::DeltaNet& d = l.delta_net;
      d.qkv = b.Bind(name("attn_qkv.weight"), {embd, s.conv_dim()});
      d.gate = b.Bind(name("attn_gate.weight"), {embd, s.value_dim()});
      d.conv = b.Bind(name("ssm_conv1d.weight"), {s.d_conv, s.conv_dim()});
      d.dt_bias = b.Bind(name("ssm_dt.bias"), {s.n_v_heads});
      d.a = b.Bind(name("ssm_a"), {s.n_v_heads});
      d.beta = b.Bind(name("ssm_beta.weight"), {embd, s.n_v_heads});
      d.alpha = b.Bind(name("ssm_alpha.weight"), {embd, s.n_v_heads});
      d.norm = b.Bind(name("ssm_norm.weight"), {s.head_dim});
      d.out = b.Bind(name("ssm_out.weight"), {s.value_dim(), embd});
    } else {
      // A gated attention's q rows hold each head's query and its gate.
      const int64_t q_rows = c.mixer(il) == LayerMixer::kGatedAttention ? 2 * q_dim : q_dim;
      l.wq = b.Bind(name("attn_q.weight"), {embd, q_rows});
      l.wk = b.Bind(name("attn_k.weight"), {embd, kv_dim});
      l.wv = b.Bind(name("attn_v.weight"), {embd, kv_dim});
      l.wo = b.Bind(name("attn_output.weight"), {q_dim, embd});
    }
    if (c.attn_out_bias) l.bo = b.Bind(name("attn_output.bias"), {embd});
    if (c.attn_sinks) l.sinks = b.Bind(name("attn_sinks.weight"), {c.n_head});
    if (c.qkv_bias) {
      l.bq = b.Bind(name("attn_q.bias"), {q_dim});
      l.bk = b.Bind(name("attn_k.bias"), {kv_dim});
      l.bv = b.Bind(name("attn_v.bias"), {kv_dim});
    }
    if (c.qk_norm && c.kv_layer(il)) {
      l.q_norm = b.Bind(name("attn_q_norm.weight"), {c.head_dim});
      l.k_norm = b.Bind(name("attn_k_norm.weight"), {c.head_dim});
    } else if (c.qk_norm_full) {
      l.q_norm = b.Bind(name("attn_q_norm.weight"), {q_dim});
      l.k_norm = b.Bind(name("attn_k_norm.weight"), {kv_dim});
    }
    // gpt-oss, glm4moe and qwen35moe norm the FFN's input with attn_post_norm.
    const bool post_norm =
        c.arch == Arch::kGptOss || c.arch == Arch::kGlm4Moe || c.arch == Arch::kQwen35Moe;
    l.ffn_norm = b.Bind(name(post_norm ? "post_attention_norm.weight" : "ffn_norm.weight"), {embd});
    if (!c.moe_layer(il)) {
      const int64_t dff = c.n_ff_dense;
      l.ffn_gate = b.Bind(name("ffn_gate.weight"), {embd, dff});
      l.ffn_up = b.Bind(name("ffn_up.weight"), {embd, dff});
      l.ffn_down = b.Bind(name("ffn_down.weight"), {dff, embd});
      continue;
    }
    l.router = b.Bind(name("ffn_gate_inp.weight"), {embd, n_expert});
    if (c.expert_score_bias) l.score_b = b.Bind(name("exp_probs_b.bias"), {n_expert});
    if (c.router_bias) l.router_b = b.Bind(name("ffn_gate_inp.bias"), {n_expert});
    if (c.expert_bias) {
      l.gate_exps_b = b.Bind(name("ffn_gate_exps.bias"), {ff, n_expert});
      l.up_exps_b = b.Bind(name("ffn_up_exps.bias"), {ff, n_expert});
      l.down_exps_b = b.Bind(name("ffn_down_exps.bias"), {embd, n_expert});
    }
    // Mixtral files from before merged experts store ffn_gate.N per expert;
    // llama.cpp takes that path when ffn_gate_exps is absent.
    const bool legacy = c.arch == Arch::kMixtral &&
                        file.FindTensor(name("ffn_gate_exps.weight")) == nullptr &&
                        file.FindTensor(name("ffn_gate.0.weight")) != nullptr;
    if (legacy) {
      b.BindLegacy(il, "ffn_gate", {embd, ff}, c.n_expert, &l.gate_legacy);
      b.BindLegacy(il, "ffn_up", {embd, ff}, c.n_expert, &l.up_legacy);
      b.BindLegacy(il, "ffn_down", {ff, embd}, c.n_expert, &l.down_legacy);
    } else {
      // llama.cpp v0.5.0 reads a fused ffn_gate_up_exps (create_tensor_gate_up_exps)
      // for qwen35moe, qwen3next, deepseek2 and a few others; moegraph reads
      // separate ones.
      b.Refuse(name("ffn_gate_up_exps.weight"),
               c.arch == Arch::kQwen35Moe
                   ? std::string("a fused gate/up expert tensor is not supported yet (moegraph "
                                 "reads ffn_gate_exps and ffn_up_exps)")
                   : absl::StrCat("a fused gate/up expert tensor is not part of ",
                                  Av(arch_gguf_name(c.arch)),
                                  " (llama.cpp reads separate ffn_gate_exps and ffn_up_exps for "
                                  "it)"));
      l.gate_exps = b.Bind(name("ffn_gate_exps.weight"), {embd, ff, n_expert});
      l.up_exps = b.Bind(name("ffn_up_exps.weight"), {embd, ff, n_expert});
      l.down_exps = b.Bind(name("ffn_down_exps.weight"), {ff, embd, n_expert});
    }
    if (c.n_ff_shexp > 0) {
      const int64_t shff = c.n_ff_shexp;
      if (c.shexp_gated) l.shexp_gate_inp = b.Bind(name("ffn_gate_inp_shexp.weight"), {embd});
      l.shexp_gate = b.Bind(name("ffn_gate_shexp.weight"), {embd, shff});
      l.shexp_up = b.Bind(name("ffn_up_shexp.weight"), {embd, shff});
      l.shexp_down = b.Bind(name("ffn_down_shexp.weight"), {shff, embd});
    }
  }
  MG_RETURN_IF_ERROR(b.Result());
  return m;
}

WeightView weight_view(const GgufTensor& t) {
  WeightView v;
  v.data = t.data;
  v.type = t.ggml_type();
  v.cols = t.ne[0];
  v.rows = t.ne[1] * t.ne[2] * t.ne[3];
  v.row_bytes = ggml_row_size(v.type, v.cols);
  return v;
}

WeightView Model::expert(int layer, ExpertProj proj, int expert) const {
  MG_CHECK(layer >= 0 && layer < static_cast<int>(layers.size()) && config.moe_layer(layer) &&
               expert >= 0 && expert < config.n_expert,
           "Model::expert: layer, MoE layer or expert out of range");
  const LayerTensors& l = layers[layer];
  const GgufTensor* merged = nullptr;
  const std::vector<const GgufTensor*>* legacy = nullptr;
  switch (proj) {
    case ExpertProj::kGate:
      merged = l.gate_exps;
      legacy = &l.gate_legacy;
      break;
    case ExpertProj::kUp:
      merged = l.up_exps;
      legacy = &l.up_legacy;
      break;
    case ExpertProj::kDown:
      merged = l.down_exps;
      legacy = &l.down_legacy;
      break;
  }
  if (merged == nullptr) return weight_view(*(*legacy)[expert]);
  // Experts are the outermost dimension: expert e is one contiguous [cols, rows] slice.
  WeightView v = weight_view(*merged);
  v.rows = merged->ne[1];
  v.data += static_cast<size_t>(expert) * v.row_bytes * static_cast<size_t>(v.rows);
  return v;
}

int KvLayerRows(const ModelConfig& config, int il, int max_ctx, int ring_slack) {
  if (!config.kv_layer(il)) return 0;
  if (ring_slack < 0 || !config.swa_layer(il)) return max_ctx;
  return static_cast<int>(std::min<int64_t>(max_ctx, int64_t{config.n_swa} + ring_slack));
}

size_t KvCacheBytes(const ModelConfig& config, int max_ctx, KvCacheType type, int ring_slack) {
  const size_t elem = type == KvCacheType::kF16 ? 2 : 4;
  size_t rows = 0;
  for (int il = 0; il < config.n_layer; ++il) {
    rows += static_cast<size_t>(KvLayerRows(config, il, max_ctx, ring_slack));
  }
  return 2 * rows * static_cast<size_t>(config.n_head_kv) * static_cast<size_t>(config.head_dim) *
         elem;
}

size_t RecurrentStateBytes(const ModelConfig& config) {
  const DeltaNetShape& d = config.delta_net;
  const size_t layers = static_cast<size_t>(config.n_layer - config.n_kv_layers());
  return layers * static_cast<size_t>(d.conv_state_floats() + d.delta_state_floats()) *
         sizeof(float);
}

KvRingPositions::KvRingPositions(const ModelConfig& config, int max_ctx, int ring_slack)
    : window_(config.n_swa) {
  for (int il = 0; il < config.n_layer; ++il) {
    const int rows = KvLayerRows(config, il, max_ctx, ring_slack);
    if (rows < max_ctx) {
      positions_.assign(static_cast<size_t>(rows), -1);
      return;
    }
  }
}

bool KvRingPositions::Holds(int start) const {
  if (positions_.empty()) return true;
  const int rows = static_cast<int>(positions_.size());
  for (int p = std::max(0, start - window_ + 1); p < start; ++p) {
    if (positions_[static_cast<size_t>(p % rows)] != p) return false;
  }
  return true;
}

void KvRingPositions::Wrote(int first, int end) {
  if (positions_.empty()) return;
  const int rows = static_cast<int>(positions_.size());
  for (int p = std::max(first, end - rows); p < end; ++p) {
    positions_[static_cast<size_t>(p % rows)] = p;
  }
}

}  // namespace moegraph
