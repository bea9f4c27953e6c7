#include "loader/fixture.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "loader/gguf_writer.h"
#include "loader/placement.h"
#include "loader/quantize.h"
#include "loader/status_util.h"

namespace moegraph {
namespace {

// llama.cpp's LLAMA_MAX_LAYERS and LLAMA_MAX_EXPERTS: larger files would not load there.
constexpr int kMaxLayers = 512;
constexpr int kMaxExperts = 512;
constexpr int kMaxDim = 1 << 20;
constexpr int kMinVocab = 8;

// Token types as llama.cpp numbers them (llama_token_type).
constexpr int32_t kTokenNormal = 1;
constexpr int32_t kTokenUnknown = 2;
constexpr int32_t kTokenControl = 3;
constexpr int32_t kTokenByte = 6;

// A fill smaller than this many values per thread runs on the calling thread.
constexpr int64_t kValuesPerThread = 1 << 18;

// splitmix64: a fixed generator, so a seed gives the same bytes on every platform.
class Rng {
 public:
  explicit Rng(uint64_t state) : state_(state) {}

  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

  // As if Next() had been called n times: the state is a counter.
  void Skip(uint64_t n) { state_ += n * 0x9e3779b97f4a7c15ull; }

  // Uniform in [0, 1) with 24 random bits.
  float Uniform() { return static_cast<float>(Next() >> 40) * 0x1.0p-24f; }

  // Zero mean, unit variance: a sum of four uniforms (Irwin-Hall) needs no libm,
  // which keeps the bytes identical across platforms.
  float Normal() {
    const float sum = Uniform() + Uniform() + Uniform() + Uniform();
    return (sum - 2.0f) * 1.7320508f;
  }

  static constexpr uint64_t kDrawsPerNormal = 4;  // Next() calls in one Normal()

 private:
  uint64_t state_;
};

// Each tensor (and each routed expert) draws from its own stream keyed by name,
// so its values do not depend on which tensors come before it or how experts
// are stored (merged or legacy).
Rng StreamRng(uint64_t seed, std::string_view key) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (char ch : key) h = (h ^ static_cast<uint8_t>(ch)) * 0x100000001b3ull;
  Rng mix(seed ^ h);
  return Rng(mix.Next());
}

struct Dims {
  int64_t embd, q_dim, kv_dim, head_dim, ff, shff, vocab;
  int64_t dense_ff = 0;  // glm4moe's leading dense layers
  DeltaNetShape delta_net;  // qwen35moe
};

// qwen35moe's conv kernel (linear_conv_kernel_dim of the released models).
constexpr int kQwen35ConvKernel = 4;

// IMRoPE sections that give text NEOX RoPE over n_rot / 2 pairs: each pair's
// sector (its index) falls in its t, h or w section (ImropeTurnsAllPairsByPosition
// in loader/model_config.cc), the fourth empty; [11, 11, 10, 0] for 32 pairs,
// as Qwen3.5's files carry.
std::vector<int32_t> Qwen35RopeSections(int64_t n_rot) {
  const int32_t pairs = static_cast<int32_t>(n_rot / 2);
  return {(pairs + 2) / 3, (pairs + 1) / 3, pairs / 3, 0};
}

// The shared direction behind --router-skew: token embeddings carry a constant
// component along it, so every normed hidden state leans the same way, and each
// router row is shifted along it by a per-expert amount. A linear router on
// inputs without such a common component cannot favour any expert for more than
// half of them (x and -x rank the experts in reverse).
struct Skew {
  float strength = 0.0f;
  std::vector<float> direction;  // unit, n_embd
};

std::string BlockName(int layer, std::string_view name) {
  return absl::StrCat("blk.", layer, ".", Av(name));
}

std::string ExpertStreamKey(int layer, std::string_view proj, int expert) {
  return absl::StrCat("blk.", layer, ".", Av(proj), ".", expert);
}

// Rows of `cols` values in `type`, each from make_row, quantized row by row.
// make_row draws exactly `cols` normals from the generator it is given, so row
// r's generator is `stream` skipped past r * cols normals; large fills then split
// their rows over threads and write the bytes one thread would (q4_K
// quantization is most of the time a multi-GiB fixture takes).
void FillRows(GgmlType type, int64_t cols, int64_t rows, uint8_t* dst, const Rng& stream,
              const std::function<void(int64_t row, Rng* rng, float* out)>& make_row) {
  const size_t row_bytes = ggml_row_size(type, cols);
  auto fill_range = [&](int64_t begin, int64_t end) {
    std::vector<float> row(cols);
    Rng rng = stream;
    rng.Skip(static_cast<uint64_t>(begin * cols) * Rng::kDrawsPerNormal);
    for (int64_t r = begin; r < end; ++r) {
      make_row(r, &rng, row.data());
      quantize_row(type, row.data(), dst + r * row_bytes, cols);
    }
  };
  const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  const int64_t n_threads =
      std::max<int64_t>(1, std::min({cores, rows, rows * cols / kValuesPerThread}));
  if (n_threads == 1) {
    fill_range(0, rows);
    return;
  }
  std::vector<std::thread> threads;
  for (int64_t t = 0; t < n_threads; ++t) {
    threads.emplace_back(fill_range, rows * t / n_threads, rows * (t + 1) / n_threads);
  }
  for (std::thread& thread : threads) thread.join();
}

// Fill functions start from their stream on each call, so a writer serialized
// twice writes the same bytes twice.
GgufWriter::FillFn GaussianFill(GgmlType type, int64_t cols, int64_t rows, float stddev,
                                Rng stream) {
  return [=](uint8_t* dst, size_t) {
    FillRows(type, cols, rows, dst, stream, [&](int64_t, Rng* rng, float* out) {
      for (int64_t i = 0; i < cols; ++i) out[i] = stddev * rng->Normal();
    });
  };
}

// Norm weights scatter around 1 as trained ones do; biases around 0.
GgufWriter::FillFn VectorFill(int64_t n, float center, float spread, Rng stream) {
  return [=](uint8_t* dst, size_t) {
    FillRows(GgmlType::kF32, n, 1, dst, stream, [&](int64_t, Rng* rng, float* out) {
      for (int64_t i = 0; i < n; ++i) out[i] = center + spread * rng->Normal();
    });
  };
}

class FixtureBuilder {
 public:
  FixtureBuilder(const FixtureSpec& spec, const Dims& d) : spec_(spec), d_(d) {
    skew_ = std::make_shared<Skew>();
    skew_->strength = spec.router_skew;
    if (spec.router_skew > 0) {
      Rng rng = StreamRng(spec.seed, "router_skew.direction");
      std::vector<double> v(d.embd);
      double norm2 = 0;
      for (double& x : v) {
        x = rng.Normal();
        norm2 += x * x;
      }
      const double inv = 1.0 / std::sqrt(norm2);
      skew_->direction.resize(d.embd);
      for (int64_t i = 0; i < d.embd; ++i) skew_->direction[i] = static_cast<float>(v[i] * inv);
    }
  }

  void Build(GgufWriter* w) {
    WriteMetadata(w);
    WriteTokenizer(w);
    WriteTensors(w);
  }

 private:
  std::string Key(std::string_view suffix) const {
    return absl::StrCat(Av(arch_gguf_name(spec_.arch)), ".", Av(suffix));
  }

  void WriteMetadata(GgufWriter* w) const {
    const Arch arch = spec_.arch;
    w->SetString("general.architecture", std::string(arch_gguf_name(arch)));
    w->SetString("general.name",
                 absl::StrCat("moegraph fixture ",
                              arch == Arch::kMixtral ? "mixtral" : Av(arch_gguf_name(arch)),
                              " seed ", spec_.seed));
    w->SetUint32(Key("vocab_size"), spec_.n_vocab);
    w->SetUint32(Key("context_length"), spec_.n_ctx_train);
    w->SetUint32(Key("embedding_length"), spec_.n_embd);
    const bool glm = arch == Arch::kGlm4Moe;
    w->SetUint32(Key("block_count"), spec_.n_layer + NextnLayers());
    // feed_forward_length as the converters write it: the dense intermediate
    // size for the qwen models (n_ff_exp * top-k is what llama.cpp would derive
    // an expert size from), the per-expert size for olmoe and mixtral.
    uint32_t n_ff = static_cast<uint32_t>(d_.ff);
    if (arch == Arch::kQwen3Moe || arch == Arch::kQwen35Moe) {
      n_ff = static_cast<uint32_t>(d_.ff * spec_.n_expert_used);
    }
    if (arch == Arch::kQwen2Moe) n_ff = static_cast<uint32_t>(d_.shff);
    if (glm) n_ff = static_cast<uint32_t>(d_.dense_ff);
    w->SetUint32(Key("feed_forward_length"), n_ff);
    w->SetUint32(Key("attention.head_count"), spec_.n_head);
    w->SetUint32(Key("attention.head_count_kv"), spec_.n_head_kv);
    w->SetUint32(Key("attention.key_length"), static_cast<uint32_t>(d_.head_dim));
    w->SetUint32(Key("attention.value_length"), static_cast<uint32_t>(d_.head_dim));
    // GLM-4.5 turns half of each head (partial_rotary_factor 0.5), Qwen3.5 a quarter.
    const bool qwen35 = arch == Arch::kQwen35Moe;
    const int64_t n_rot = glm ? d_.head_dim / 2 : qwen35 ? d_.head_dim / 4 : d_.head_dim;
    w->SetUint32(Key("rope.dimension_count"), static_cast<uint32_t>(n_rot));
    // rope_theta and rms_norm_eps of the released models of each family.
    const bool qwen = arch == Arch::kQwen3Moe || arch == Arch::kQwen2Moe || qwen35;
    w->SetFloat32(Key("rope.freq_base"), arch == Arch::kOlmoe    ? 10000.0f
                                         : arch == Arch::kGptOss ? 150000.0f
                                         : qwen35                ? 10000000.0f
                                                                 : 1000000.0f);
    w->SetFloat32(Key("attention.layer_norm_rms_epsilon"), qwen ? 1e-6f : 1e-5f);
    w->SetUint32(Key("expert_count"), spec_.n_expert);
    w->SetUint32(Key("expert_used_count"), spec_.n_expert_used);
    if (qwen || arch == Arch::kGptOss || glm) {
      w->SetUint32(Key("expert_feed_forward_length"), static_cast<uint32_t>(d_.ff));
    }
    if (glm) {
      // As convert_hf_to_gguf.py writes GLM-4.5 (Glm4MoeModel): sigmoid routing
      // with normalized weights times routed_scaling_factor 2.5, one shared expert.
      w->SetUint32(Key("leading_dense_block_count"), static_cast<uint32_t>(spec_.n_dense_lead));
      w->SetUint32(Key("nextn_predict_layers"), static_cast<uint32_t>(spec_.n_nextn));
      w->SetUint32(Key("expert_shared_count"), 1);
      w->SetFloat32(Key("expert_weights_scale"), 2.5f);
      w->SetBool(Key("expert_weights_norm"), true);
      w->SetUint32(Key("expert_gating_func"), 2);
    }
    if (arch == Arch::kGptOss) {
      // As convert_hf_to_gguf.py writes gpt-oss: a window on alternate layers and
      // YaRN over a 4096-position original context (factor 32).
      w->SetUint32(Key("attention.sliding_window"), static_cast<uint32_t>(spec_.n_swa));
      w->SetString(Key("rope.scaling.type"), "yarn");
      w->SetFloat32(Key("rope.scaling.factor"), 32.0f);
      w->SetUint32(Key("rope.scaling.original_context_length"), 4096);
    }
    if (arch == Arch::kQwen2Moe || arch == Arch::kQwen35Moe) {
      w->SetUint32(Key("expert_shared_feed_forward_length"), static_cast<uint32_t>(d_.shff));
    }

    if (arch == Arch::kQwen35Moe) {
      // As convert_hf_to_gguf.py writes Qwen3.5 (Qwen3NextModel): the ssm.*
      // sizes, both the interval and the per-layer flags, the IMRoPE sections.
      const DeltaNetShape& s = d_.delta_net;
      w->SetUint32(Key("ssm.conv_kernel"), static_cast<uint32_t>(s.d_conv));
      w->SetUint32(Key("ssm.state_size"), static_cast<uint32_t>(s.head_dim));
      w->SetUint32(Key("ssm.group_count"), static_cast<uint32_t>(s.n_k_heads));
      w->SetUint32(Key("ssm.time_step_rank"), static_cast<uint32_t>(s.n_v_heads));
      w->SetUint32(Key("ssm.inner_size"), static_cast<uint32_t>(s.value_dim()));
      w->SetUint32(Key("full_attention_interval"),
                   static_cast<uint32_t>(spec_.full_attention_interval));
      if (spec_.n_nextn > 0) {
        w->SetUint32(Key("nextn_predict_layers"), static_cast<uint32_t>(spec_.n_nextn));
      }
      // One flag a block, the MTP blocks' false (Qwen3NextModel pads them so).
      std::vector<uint8_t> recurrent(static_cast<size_t>(spec_.n_layer + NextnLayers()));
      for (size_t il = 0; il < recurrent.size(); ++il) {
        recurrent[il] = Qwen35Recurrent(static_cast<int>(il)) ? 1 : 0;
      }
      w->SetArray(Key("attention.recurrent_layers"), GgufType::kBool, recurrent.data(),
                  recurrent.size());
      const std::vector<int32_t> sections = Qwen35RopeSections(d_.head_dim / 4);
      w->SetInt32Array(Key("rope.dimension_sections"), sections);
    }
  }

  // Whether qwen35moe's block il is a Gated DeltaNet: never an MTP block.
  bool Qwen35Recurrent(int il) const {
    return il < spec_.n_layer && (il + 1) % spec_.full_attention_interval != 0;
  }

  // The NextN (MTP) blocks after the decode layers: glm4moe's and qwen35moe's.
  int NextnLayers() const {
    return spec_.arch == Arch::kGlm4Moe || spec_.arch == Arch::kQwen35Moe ? spec_.n_nextn : 0;
  }

  // A given vocabulary, keyed as llama.cpp's converter keys it.
  void WriteVocab(GgufWriter* w, const FixtureVocab& v) const {
    w->SetString("tokenizer.ggml.model", v.model);
    if (!v.pre.empty()) w->SetString("tokenizer.ggml.pre", v.pre);
    w->SetStringArray("tokenizer.ggml.tokens", v.tokens);
    w->SetInt32Array("tokenizer.ggml.token_type", v.types);
    if (!v.merges.empty()) w->SetStringArray("tokenizer.ggml.merges", v.merges);
    if (!v.scores.empty()) w->SetFloat32Array("tokenizer.ggml.scores", v.scores);
    if (v.add_space_prefix.has_value()) {
      w->SetBool("tokenizer.ggml.add_space_prefix", *v.add_space_prefix);
    }
    for (const auto& [name, id] : v.special_ids) {
      w->SetUint32(absl::StrCat("tokenizer.ggml.", name, "_token_id"), id);
    }
    for (const auto& [name, add] : v.add_special) {
      w->SetBool(absl::StrCat("tokenizer.ggml.add_", name, "_token"), add);
    }
    if (!v.chat_template.empty()) w->SetString("tokenizer.chat_template", v.chat_template);
  }

  // Without one, a small vocabulary llama.cpp's loader accepts: specials, byte
  // tokens (so every text has a tokenization, '\n' included), two-letter pieces
  // with the merges (gpt2) or scores (llama) that make them, then filler pieces.
  void WriteTokenizer(GgufWriter* w) const {
    if (spec_.vocab != nullptr) {
      WriteVocab(w, *spec_.vocab);
      return;
    }
    const int n_vocab = spec_.n_vocab;
    std::vector<std::string> tokens;
    std::vector<int32_t> types;
    std::vector<float> scores;
    std::vector<std::string> merges;
    auto add = [&](std::string text, int32_t type, float score) {
      tokens.push_back(std::move(text));
      types.push_back(type);
      scores.push_back(score);
    };
    const bool spm = spec_.arch == Arch::kMixtral;
    const int n_special = spm ? 3 : 2;
    const int n_regular = n_vocab - n_special;
    if (spm) {
      add("<unk>", kTokenUnknown, 0.0f);
      add("<s>", kTokenControl, 0.0f);
      add("</s>", kTokenControl, 0.0f);
      for (int b = 0; b < 256 && static_cast<int>(tokens.size()) < n_vocab; ++b) {
        add(absl::StrFormat("<0x%02X>", b), kTokenByte, 0.0f);
      }
    } else {
      for (const std::string& piece : Gpt2BytePieces()) {
        if (static_cast<int>(tokens.size()) >= n_regular) break;
        add(piece, kTokenNormal, 0.0f);
      }
    }
    // Two-letter pieces: "▁a" style word starts for SPM, "Ġa" for byte-level BPE.
    const std::string space = spm ? "\xe2\x96\x81" : "\xc4\xa0";
    const int limit = spm ? n_vocab : n_regular;
    // A BPE merge is only valid when both halves are tokens: all byte pieces fit.
    const bool halves_present = spm || tokens.size() == 256;
    for (char a = 'a'; a <= 'z' && halves_present; ++a) {
      for (int second = -1; second < 26 && static_cast<int>(tokens.size()) < limit; ++second) {
        const std::string left = second < 0 ? space : std::string(1, a);
        const std::string right =
            second < 0 ? std::string(1, a) : std::string(1, static_cast<char>('a' + second));
        add(left + right, kTokenNormal, -static_cast<float>(tokens.size()));
        if (!spm) merges.push_back(left + " " + right);
      }
    }
    for (int i = static_cast<int>(tokens.size()); i < limit; ++i) {
      add(absl::StrCat("[tok", i, "]"), kTokenNormal, -static_cast<float>(i));
    }

    if (spm) {
      w->SetString("tokenizer.ggml.model", "llama");
      w->SetFloat32Array("tokenizer.ggml.scores", scores);
      w->SetUint32("tokenizer.ggml.bos_token_id", 1);
      w->SetUint32("tokenizer.ggml.eos_token_id", 2);
      w->SetUint32("tokenizer.ggml.unknown_token_id", 0);
      w->SetBool("tokenizer.ggml.add_bos_token", true);
    } else {
      const bool olmoe = spec_.arch == Arch::kOlmoe;
      const uint32_t first_special = static_cast<uint32_t>(tokens.size());
      add("<|endoftext|>", kTokenControl, 0.0f);
      add(olmoe ? "<|padding|>" : "<|im_end|>", kTokenControl, 0.0f);
      w->SetString("tokenizer.ggml.model", "gpt2");
      w->SetString("tokenizer.ggml.pre", olmoe ? "olmo" : "qwen2");
      w->SetStringArray("tokenizer.ggml.merges", merges);
      w->SetUint32("tokenizer.ggml.bos_token_id", first_special);
      w->SetUint32("tokenizer.ggml.eos_token_id", olmoe ? first_special : first_special + 1);
      w->SetUint32("tokenizer.ggml.padding_token_id", olmoe ? first_special + 1 : first_special);
      w->SetBool("tokenizer.ggml.add_bos_token", false);
    }
    w->SetStringArray("tokenizer.ggml.tokens", tokens);
    w->SetInt32Array("tokenizer.ggml.token_type", types);
  }

  // GPT-2's bytes_to_unicode, in its vocabulary order: the printable bytes as
  // themselves, then the other bytes as U+0100 onwards.
  static std::vector<std::string> Gpt2BytePieces() {
    std::vector<int> printable, others;
    for (int b = 0; b < 256; ++b) {
      const bool keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      (keep ? printable : others).push_back(b);
    }
    auto utf8 = [](int cp) {
      std::string s;
      if (cp < 0x80) {
        s.push_back(static_cast<char>(cp));
      } else {
        s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
        s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
      }
      return s;
    };
    std::vector<std::string> pieces;
    for (int b : printable) pieces.push_back(utf8(b));
    for (size_t i = 0; i < others.size(); ++i) pieces.push_back(utf8(256 + static_cast<int>(i)));
    return pieces;
  }

  void AddMatrix(GgufWriter* w, const std::string& name, GgmlType type, int64_t cols, int64_t rows,
                 float stddev) const {
    w->AddTensor(name, type, {cols, rows},
                 GaussianFill(type, cols, rows, stddev, StreamRng(spec_.seed, name)));
  }

  void AddVector(GgufWriter* w, const std::string& name, int64_t n, float center,
                 float spread) const {
    w->AddTensor(name, GgmlType::kF32, {n},
                 VectorFill(n, center, spread, StreamRng(spec_.seed, name)));
  }

  // Token embeddings: unit-variance rows plus, under skew, sqrt(n_embd) along the
  // skew direction (as large as the random part).
  void AddTokenEmbd(GgufWriter* w) const {
    const GgmlType type = spec_.dense_type;
    const int64_t cols = d_.embd, rows = d_.vocab;
    const std::shared_ptr<const Skew> skew = skew_;
    const Rng stream = StreamRng(spec_.seed, "token_embd.weight");
    w->AddTensor("token_embd.weight", type, {cols, rows}, [=](uint8_t* dst, size_t) {
      const float lean = skew->strength > 0 ? std::sqrt(static_cast<float>(cols)) : 0.0f;
      FillRows(type, cols, rows, dst, stream, [&](int64_t, Rng* rng, float* out) {
        for (int64_t i = 0; i < cols; ++i) {
          out[i] = rng->Normal() + (lean != 0 ? lean * skew->direction[i] : 0.0f);
        }
      });
    });
  }

  // Router rows: N(0, 1/n_embd) with the skew direction projected out, then
  // shifted along it by -S * ln(1 + rank) / sqrt(n_embd): a normed hidden state
  // leaning along the direction gives expert ranks logit offsets that fall like
  // ln(rank), so picks fall off roughly as a power of the rank (Zipf).
  void AddRouter(GgufWriter* w, int layer) const {
    const std::string name = BlockName(layer, "ffn_gate_inp.weight");
    const int64_t cols = d_.embd, rows = spec_.n_expert;
    std::vector<int> rank(rows);
    for (int64_t e = 0; e < rows; ++e) rank[e] = static_cast<int>(e);
    Rng perm = StreamRng(spec_.seed, BlockName(layer, "router_rank"));
    for (int64_t i = rows - 1; i > 0; --i) {
      std::swap(rank[i], rank[perm.Next() % static_cast<uint64_t>(i + 1)]);
    }
    const std::shared_ptr<const Skew> skew = skew_;
    const Rng stream = StreamRng(spec_.seed, name);
    w->AddTensor(name, GgmlType::kF32, {cols, rows}, [=](uint8_t* dst, size_t) {
      const float stddev = 1.0f / std::sqrt(static_cast<float>(cols));
      FillRows(GgmlType::kF32, cols, rows, dst, stream, [&](int64_t e, Rng* rng, float* out) {
        for (int64_t i = 0; i < cols; ++i) out[i] = stddev * rng->Normal();
        if (skew->strength <= 0) return;
        double along = 0;
        for (int64_t i = 0; i < cols; ++i) along += double{out[i]} * skew->direction[i];
        const double shift = -skew->strength * std::log1p(rank[e]) * stddev;
        for (int64_t i = 0; i < cols; ++i) {
          out[i] = static_cast<float>(out[i] + (shift - along) * skew->direction[i]);
        }
      });
    });
  }

  // Routed experts. Merged tensors hold expert e's rows at slice e; each
  // expert's values come from the stream its legacy tensor would use. With
  // expert_variants V > 0, expert e takes variant e % V's stream, and a merged
  // tensor quantizes the V variants once and copies their bytes to the rest.
  void AddExperts(GgufWriter* w, int layer) const {
    const GgmlType type = spec_.expert_type;
    const float out_scale = 1.0f / std::sqrt(2.0f * spec_.n_layer);
    // gpt-oss: gate and up pre-activations of sd 4, so swiglu_oai's clamp at 7 bites.
    const float in_gain = spec_.arch == Arch::kGptOss ? 4.0f : 1.0f;
    struct Proj {
      const char* legacy;
      const char* merged;
      int64_t cols, rows;
      float stddev;
    };
    const Proj projs[] = {
        {"ffn_gate", "ffn_gate_exps.weight", d_.embd, d_.ff, in_gain / std::sqrt(float(d_.embd))},
        {"ffn_up", "ffn_up_exps.weight", d_.embd, d_.ff, in_gain / std::sqrt(float(d_.embd))},
        {"ffn_down", "ffn_down_exps.weight", d_.ff, d_.embd, out_scale / std::sqrt(float(d_.ff))},
    };
    const int n_expert = spec_.n_expert;
    const int n_distinct = spec_.expert_variants > 0 ? spec_.expert_variants : n_expert;
    for (const Proj& p : projs) {
      if (spec_.legacy_experts) {
        for (int e = 0; e < n_expert; ++e) {
          const std::string key = ExpertStreamKey(layer, p.legacy, e % n_distinct);
          w->AddTensor(absl::StrCat(BlockName(layer, p.legacy), ".", e, ".weight"), type,
                       {p.cols, p.rows},
                       GaussianFill(type, p.cols, p.rows, p.stddev, StreamRng(spec_.seed, key)));
        }
        continue;
      }
      const uint64_t seed = spec_.seed;
      const Proj proj = p;
      w->AddTensor(BlockName(layer, p.merged), type, {p.cols, p.rows, n_expert},
                   [=](uint8_t* dst, size_t) {
                     const size_t expert_bytes = ggml_row_size(type, proj.cols) * proj.rows;
                     for (int e = 0; e < n_distinct; ++e) {
                       Rng rng = StreamRng(seed, ExpertStreamKey(layer, proj.legacy, e));
                       GaussianFill(type, proj.cols, proj.rows, proj.stddev, rng)(
                           dst + e * expert_bytes, expert_bytes);
                     }
                     for (int e = n_distinct; e < n_expert; ++e) {
                       std::memcpy(dst + e * expert_bytes, dst + (e % n_distinct) * expert_bytes,
                                   expert_bytes);
                     }
                   });
    }
  }

  void WriteTensors(GgufWriter* w) const {
    const GgmlType dense = spec_.dense_type;
    const float in_std = 1.0f / std::sqrt(static_cast<float>(d_.embd));
    // Projections into the residual stream are scaled down by sqrt(2 * layers)
    // (GPT-2's init), so the embeddings' skew direction survives every layer.
    const float out_scale = 1.0f / std::sqrt(2.0f * spec_.n_layer);
    AddTokenEmbd(w);
    const bool glm = spec_.arch == Arch::kGlm4Moe;
    const int n_blocks = spec_.n_layer + NextnLayers();
    for (int il = 0; il < n_blocks; ++il) {
      auto name = [il](std::string_view base) { return BlockName(il, base); };
      AddVector(w, name("attn_norm.weight"), d_.embd, 1.0f, 0.1f);
      if (spec_.arch == Arch::kQwen35Moe) {
        AddQwen35Mixer(w, il);
      } else {
        AddAttention(w, il);
      }
      const bool oss = spec_.arch == Arch::kGptOss;
      const bool post_norm = oss || glm || spec_.arch == Arch::kQwen35Moe;
      AddVector(w, name(post_norm ? "post_attention_norm.weight" : "ffn_norm.weight"), d_.embd,
                1.0f, 0.1f);
      if (glm && il < spec_.n_dense_lead) {
        AddMatrix(w, name("ffn_gate.weight"), dense, d_.embd, d_.dense_ff, in_std);
        AddMatrix(w, name("ffn_up.weight"), dense, d_.embd, d_.dense_ff, in_std);
        AddMatrix(w, name("ffn_down.weight"), dense, d_.dense_ff, d_.embd,
                  out_scale / std::sqrt(static_cast<float>(d_.dense_ff)));
        continue;
      }
      AddRouter(w, il);
      AddExperts(w, il);
      if (oss) {
        // A router bias as large as the logits' spread: it changes the choice.
        AddVector(w, name("ffn_gate_inp.bias"), spec_.n_expert, 0.0f, 1.0f);
        AddMatrix(w, name("ffn_gate_exps.bias"), GgmlType::kF32, d_.ff, spec_.n_expert, 0.5f);
        AddMatrix(w, name("ffn_up_exps.bias"), GgmlType::kF32, d_.ff, spec_.n_expert, 0.5f);
        AddMatrix(w, name("ffn_down_exps.bias"), GgmlType::kF32, d_.embd, spec_.n_expert, 0.1f);
      }
      if (glm) {
        // A score bias as large as the sigmoids' spread: it changes the choice.
        AddVector(w, name("exp_probs_b.bias"), spec_.n_expert, 0.0f, 0.25f);
      }
      if (d_.shff > 0) {
        if (!glm) AddVector(w, name("ffn_gate_inp_shexp.weight"), d_.embd, 0.0f, in_std);
        AddMatrix(w, name("ffn_gate_shexp.weight"), dense, d_.embd, d_.shff, in_std);
        AddMatrix(w, name("ffn_up_shexp.weight"), dense, d_.embd, d_.shff, in_std);
        AddMatrix(w, name("ffn_down_shexp.weight"), dense, d_.shff, d_.embd,
                  out_scale / std::sqrt(static_cast<float>(d_.shff)));
      }
      if (il >= spec_.n_layer) {
        // The NextN tensors of llama_model_glm4_moe's and llama_model_qwen35moe's
        // load_arch_tensors (never read by decode).
        AddMatrix(w, name("nextn.eh_proj.weight"), dense, 2 * d_.embd, d_.embd, in_std);
        AddVector(w, name("nextn.enorm.weight"), d_.embd, 1.0f, 0.1f);
        AddVector(w, name("nextn.hnorm.weight"), d_.embd, 1.0f, 0.1f);
        AddVector(w, name("nextn.shared_head_norm.weight"), d_.embd, 1.0f, 0.1f);
      }
    }
    AddVector(w, "output_norm.weight", d_.embd, 1.0f, 0.1f);
    if (!spec_.tied_output) AddOutput(w);
  }

  // Attention tensors of layer il, as each architecture's load_arch_tensors reads them.
  void AddAttention(GgufWriter* w, int il) const {
    const GgmlType dense = spec_.dense_type;
    const float in_std = 1.0f / std::sqrt(static_cast<float>(d_.embd));
    const float out_scale = 1.0f / std::sqrt(2.0f * spec_.n_layer);
    const bool glm = spec_.arch == Arch::kGlm4Moe;
    auto name = [il](std::string_view base) { return BlockName(il, base); };
    AddMatrix(w, name("attn_q.weight"), dense, d_.embd, d_.q_dim, in_std);
    AddMatrix(w, name("attn_k.weight"), dense, d_.embd, d_.kv_dim, in_std);
    AddMatrix(w, name("attn_v.weight"), dense, d_.embd, d_.kv_dim, in_std);
    AddMatrix(w, name("attn_output.weight"), dense, d_.q_dim, d_.embd,
              out_scale / std::sqrt(static_cast<float>(d_.q_dim)));
    if (spec_.arch == Arch::kQwen2Moe || spec_.arch == Arch::kGptOss || glm) {
      AddVector(w, name("attn_q.bias"), d_.q_dim, 0.0f, 0.1f);
      AddVector(w, name("attn_k.bias"), d_.kv_dim, 0.0f, 0.1f);
      AddVector(w, name("attn_v.bias"), d_.kv_dim, 0.0f, 0.1f);
    }
    if (spec_.arch == Arch::kGptOss) {
      AddVector(w, name("attn_output.bias"), d_.embd, 0.0f, 0.1f);
      // Sinks around the scores' scale: some heads give the sink most weight.
      AddVector(w, name("attn_sinks.weight"), spec_.n_head, 0.0f, 2.0f);
    }
    if (spec_.arch == Arch::kQwen3Moe || (glm && spec_.qk_norm)) {
      AddVector(w, name("attn_q_norm.weight"), d_.head_dim, 1.0f, 0.1f);
      AddVector(w, name("attn_k_norm.weight"), d_.head_dim, 1.0f, 0.1f);
    }
    if (spec_.arch == Arch::kOlmoe) {
      AddVector(w, name("attn_q_norm.weight"), d_.q_dim, 1.0f, 0.1f);
      AddVector(w, name("attn_k_norm.weight"), d_.kv_dim, 1.0f, 0.1f);
    }
  }

  // qwen35moe's token mixer of layer il (llama_model_qwen35moe::load_arch_tensors):
  // a Gated DeltaNet, or attention whose q rows hold each head's query and gate.
  void AddQwen35Mixer(GgufWriter* w, int il) const {
    const GgmlType dense = spec_.dense_type;
    const float in_std = 1.0f / std::sqrt(static_cast<float>(d_.embd));
    const float out_scale = 1.0f / std::sqrt(2.0f * spec_.n_layer);
    auto name = [il](std::string_view base) { return BlockName(il, base); };
    if (!Qwen35Recurrent(il)) {
      AddMatrix(w, name("attn_q.weight"), dense, d_.embd, 2 * d_.q_dim, in_std);
      AddMatrix(w, name("attn_k.weight"), dense, d_.embd, d_.kv_dim, in_std);
      AddMatrix(w, name("attn_v.weight"), dense, d_.embd, d_.kv_dim, in_std);
      AddMatrix(w, name("attn_output.weight"), dense, d_.q_dim, d_.embd,
                out_scale / std::sqrt(static_cast<float>(d_.q_dim)));
      AddVector(w, name("attn_q_norm.weight"), d_.head_dim, 1.0f, 0.1f);
      AddVector(w, name("attn_k_norm.weight"), d_.head_dim, 1.0f, 0.1f);
      return;
    }
    const DeltaNetShape& s = d_.delta_net;
    AddMatrix(w, name("attn_qkv.weight"), dense, d_.embd, s.conv_dim(), in_std);
    AddMatrix(w, name("attn_gate.weight"), dense, d_.embd, s.value_dim(), in_std);
    // The conv taps of a channel sum to about 1, so its output keeps the scale.
    AddMatrix(w, name("ssm_conv1d.weight"), GgmlType::kF32, s.d_conv, s.conv_dim(), 0.5f);
    AddVector(w, name("ssm_dt.bias"), s.n_v_heads, 0.0f, 1.0f);
    // -exp(A_log) with A_log ~ N(0, 0.5), as the converter writes it: always
    // negative, so every decay exp(g) is below 1 (a positive one would grow
    // the state without bound over a long prompt).
    w->AddTensor(name("ssm_a"), GgmlType::kF32, {s.n_v_heads},
                 [n = s.n_v_heads, stream = StreamRng(spec_.seed, name("ssm_a"))](uint8_t* dst,
                                                                                    size_t) {
                   FillRows(GgmlType::kF32, n, 1, dst, stream, [&](int64_t, Rng* rng, float* out) {
                     for (int64_t i = 0; i < n; ++i) out[i] = -std::exp(0.5f * rng->Normal());
                   });
                 });
    AddMatrix(w, name("ssm_beta.weight"), dense, d_.embd, s.n_v_heads, in_std);
    AddMatrix(w, name("ssm_alpha.weight"), dense, d_.embd, s.n_v_heads, in_std);
    AddVector(w, name("ssm_norm.weight"), s.head_dim, 1.0f, 0.1f);
    AddMatrix(w, name("ssm_out.weight"), dense, s.value_dim(), d_.embd,
              out_scale / std::sqrt(static_cast<float>(s.value_dim())));
  }

  // lm_head rows with the skew direction projected out: every hidden state leans
  // along it, and rows that saw it would pick the same token at every step.
  void AddOutput(GgufWriter* w) const {
    const GgmlType type = spec_.dense_type;
    const int64_t cols = d_.embd, rows = d_.vocab;
    const std::shared_ptr<const Skew> skew = skew_;
    const Rng stream = StreamRng(spec_.seed, "output.weight");
    w->AddTensor("output.weight", type, {cols, rows}, [=](uint8_t* dst, size_t) {
      const float stddev = 1.0f / std::sqrt(static_cast<float>(cols));
      FillRows(type, cols, rows, dst, stream, [&](int64_t, Rng* rng, float* out) {
        for (int64_t i = 0; i < cols; ++i) out[i] = stddev * rng->Normal();
        if (skew->strength <= 0) return;
        double along = 0;
        for (int64_t i = 0; i < cols; ++i) along += double{out[i]} * skew->direction[i];
        for (int64_t i = 0; i < cols; ++i) {
          out[i] = static_cast<float>(out[i] - along * skew->direction[i]);
        }
      });
    });
  }

  const FixtureSpec& spec_;
  Dims d_;
  std::shared_ptr<Skew> skew_;
};

std::string TypeFlag(bool expert) { return expert ? "--quant expert=" : "--quant "; }

// A row length of `what` (a flag, or a product of flags) must fill whole blocks.
absl::Status CheckRowLength(std::string_view what, int64_t n, GgmlType type) {
  const GgmlTypeInfo* info = ggml_type_info(static_cast<uint32_t>(type));
  if (n % info->block_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(Av(what), " is not a multiple of ",
                                                   info->block_size, " (", Av(info->name),
                                                   " block size)"));
  }
  return absl::OkStatus();
}

absl::Status CheckType(GgmlType type, bool expert) {
  if (ggml_type_info(static_cast<uint32_t>(type)) == nullptr || !quant_supported(type)) {
    return absl::InvalidArgumentError(
        absl::StrCat(TypeFlag(expert), ggml_type_name(static_cast<uint32_t>(type)),
                     " is not supported (", quant_supported_names(), ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckRange(std::string_view flag, int64_t value, int64_t lo, int64_t hi) {
  if (value < lo || value > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat(Av(flag), " ", value, " is out of range [", lo, ", ", hi, "]"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Dims> ValidateSpec(const FixtureSpec& s) {
  const std::string arch =
      s.arch == Arch::kMixtral ? "mixtral" : std::string(arch_gguf_name(s.arch));
  MG_RETURN_IF_ERROR(CheckRange("--layers", s.n_layer, 1, kMaxLayers));
  MG_RETURN_IF_ERROR(CheckRange("--experts", s.n_expert, 1, kMaxExperts));
  if (s.n_expert_used > s.n_expert) {
    return absl::InvalidArgumentError(
        absl::StrCat("--top-k ", s.n_expert_used, " exceeds --experts ", s.n_expert));
  }
  MG_RETURN_IF_ERROR(CheckRange("--top-k", s.n_expert_used, 1, s.n_expert));
  MG_RETURN_IF_ERROR(CheckRange("--expert-variants", s.expert_variants, 0, s.n_expert));
  MG_RETURN_IF_ERROR(CheckRange("--embd", s.n_embd, 1, kMaxDim));
  MG_RETURN_IF_ERROR(CheckRange("--ff", s.n_ff_exp, 1, kMaxDim));
  MG_RETURN_IF_ERROR(CheckRange("--shared-ff", s.n_ff_shexp, 0, kMaxDim));
  MG_RETURN_IF_ERROR(CheckRange("--heads", s.n_head, 1, kMaxDim));
  MG_RETURN_IF_ERROR(CheckRange("--kv-heads", s.n_head_kv, 1, s.n_head));
  MG_RETURN_IF_ERROR(CheckRange("--head-dim", s.head_dim, 0, kMaxDim));
  MG_RETURN_IF_ERROR(CheckRange("--vocab", s.n_vocab, kMinVocab, kMaxDim));
  if (s.vocab != nullptr) {
    if (static_cast<size_t>(s.n_vocab) != s.vocab->tokens.size() ||
        s.vocab->types.size() != s.vocab->tokens.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--vocab ", s.n_vocab, " does not match the given vocabulary's ",
          s.vocab->tokens.size(), " tokens and ", s.vocab->types.size(), " types"));
    }
  }
  MG_RETURN_IF_ERROR(CheckRange("--ctx", s.n_ctx_train, 1, INT32_MAX));
  if (!(s.router_skew >= 0.0f) || !std::isfinite(s.router_skew)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--router-skew ", s.router_skew, " must be a finite number >= 0"));
  }
  MG_RETURN_IF_ERROR(CheckType(s.dense_type, false));
  MG_RETURN_IF_ERROR(CheckType(s.expert_type, true));
  MG_RETURN_IF_ERROR(CheckRowLength(absl::StrCat("--embd ", s.n_embd), s.n_embd, s.dense_type));
  MG_RETURN_IF_ERROR(CheckRowLength(absl::StrCat("--embd ", s.n_embd), s.n_embd, s.expert_type));
  MG_RETURN_IF_ERROR(CheckRowLength(absl::StrCat("--ff ", s.n_ff_exp), s.n_ff_exp, s.expert_type));
  if (s.n_head % s.n_head_kv != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--heads ", s.n_head, " is not a multiple of --kv-heads ", s.n_head_kv));
  }
  Dims d;
  d.embd = s.n_embd;
  d.ff = s.n_ff_exp;
  d.vocab = s.n_vocab;
  if (s.head_dim == 0 && s.n_embd % s.n_head != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--embd ", s.n_embd, " is not a multiple of --heads ", s.n_head, " (give --head-dim)"));
  }
  d.head_dim = s.head_dim != 0 ? s.head_dim : s.n_embd / s.n_head;
  if (d.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--head-dim ", d.head_dim, " must be even (RoPE rotates pairs)"));
  }
  d.q_dim = d.head_dim * s.n_head;
  d.kv_dim = d.head_dim * s.n_head_kv;
  if ((s.arch == Arch::kOlmoe || s.arch == Arch::kQwen2Moe) && d.q_dim != s.n_embd) {
    return absl::InvalidArgumentError(absl::StrCat("--head-dim ", d.head_dim, " x --heads ",
                                                   s.n_head, " must equal --embd ", s.n_embd,
                                                   " for --arch ", arch));
  }
  // llama.cpp's olmoe builds attn_k_norm over n_embd, so only equal heads load there.
  if (s.arch == Arch::kOlmoe && s.n_head_kv != s.n_head) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-heads ", s.n_head_kv, " must equal --heads ", s.n_head, " for --arch olmoe"));
  }
  if (s.arch != Arch::kQwen2Moe && s.n_ff_shexp != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shared-ff applies to --arch qwen2moe only, not ", arch));
  }
  d.shff = s.arch == Arch::kQwen2Moe ? (s.n_ff_shexp != 0 ? s.n_ff_shexp : 2 * s.n_ff_exp) : 0;
  if (s.arch == Arch::kQwen35Moe) {
    MG_RETURN_IF_ERROR(CheckRange("--full-attn-interval", s.full_attention_interval, 1, kMaxLayers));
    MG_RETURN_IF_ERROR(CheckRange("--ssm-k-heads", s.ssm_k_heads, 1, kMaxDim));
    MG_RETURN_IF_ERROR(CheckRange("--ssm-v-heads", s.ssm_v_heads, 1, kMaxDim));
    MG_RETURN_IF_ERROR(CheckRange("--ssm-head-dim", s.ssm_head_dim, 0, kMaxDim));
    if (s.ssm_v_heads % s.ssm_k_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat("--ssm-v-heads ", s.ssm_v_heads,
                                                     " is not a multiple of --ssm-k-heads ",
                                                     s.ssm_k_heads));
    }
    if (d.head_dim % 8 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--head-dim ", d.head_dim,
                       " must be a multiple of 8 for --arch qwen35moe (RoPE turns pairs of its "
                       "first quarter)"));
    }
    d.delta_net = {kQwen35ConvKernel,
                   s.ssm_head_dim != 0 ? s.ssm_head_dim : static_cast<int>(d.head_dim),
                   s.ssm_k_heads, s.ssm_v_heads};
    d.shff = s.n_ff_exp;
    MG_RETURN_IF_ERROR(CheckRowLength(
        absl::StrCat("--ssm-v-heads x the ssm head size (ssm_out)"), d.delta_net.value_dim(),
        s.dense_type));
  }
  if (s.arch == Arch::kGlm4Moe) {
    MG_RETURN_IF_ERROR(CheckRange("--dense-layers", s.n_dense_lead, 0, s.n_layer - 1));
    MG_RETURN_IF_ERROR(CheckRange("--nextn", s.n_nextn, 0, kMaxLayers - s.n_layer));
    if (d.head_dim % 4 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--head-dim ", d.head_dim,
                       " must be a multiple of 4 for --arch glm4moe (RoPE turns "
                       "pairs of its first half)"));
    }
    d.shff = s.n_ff_exp;
    d.dense_ff = 2 * s.n_ff_exp;
    MG_RETURN_IF_ERROR(CheckRowLength(absl::StrCat("2 x --ff ", s.n_ff_exp, " (the dense FFN)"),
                                      d.dense_ff, s.dense_type));
    MG_RETURN_IF_ERROR(CheckRowLength(absl::StrCat("2 x --embd ", s.n_embd, " (nextn.eh_proj)"),
                                      2 * s.n_embd, s.dense_type));
  }
  if (s.legacy_experts && s.arch != Arch::kMixtral) {
    return absl::InvalidArgumentError(
        absl::StrCat("--legacy-experts needs --arch mixtral, not ", arch));
  }
  if (s.arch == Arch::kGptOss) MG_RETURN_IF_ERROR(CheckRange("--swa", s.n_swa, 1, INT32_MAX));
  if (s.tied_output &&
      (s.arch == Arch::kOlmoe || s.arch == Arch::kQwen2Moe || s.arch == Arch::kGptOss)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tied-output: llama.cpp's ", arch, " requires output.weight"));
  }

  MG_RETURN_IF_ERROR(CheckRowLength(
      absl::StrCat("--heads ", s.n_head, " x --head-dim ", d.head_dim, " = ", d.q_dim), d.q_dim,
      s.dense_type));
  if (d.shff != 0) {
    MG_RETURN_IF_ERROR(CheckRowLength(absl::StrCat("--shared-ff ", d.shff), d.shff, s.dense_type));
  }
  return d;
}

absl::Status BuildFixture(const FixtureSpec& spec, GgufWriter* writer) {
  absl::StatusOr<Dims> dims = ValidateSpec(spec);
  if (!dims.ok()) return dims.status();
  FixtureBuilder(spec, *dims).Build(writer);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<uint8_t>> FixtureBytes(const FixtureSpec& spec) {
  GgufWriter writer;
  MG_RETURN_IF_ERROR(BuildFixture(spec, &writer));
  return writer.Serialize();
}

absl::Status WriteFixture(const FixtureSpec& spec, const std::string& path) {
  GgufWriter writer;
  MG_RETURN_IF_ERROR(BuildFixture(spec, &writer));
  // What writing takes, before it starts: one tensor in memory, the file on disk.
  constexpr double kGib = 1024.0 * 1024.0 * 1024.0;
  const uint64_t largest = writer.LargestTensorBytes();
  const uint64_t memory = HostMemoryAvailable();
  if (memory > 0 && largest > memory) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "-o %s: its largest tensor takes %.2f GiB and this machine has %.2f GiB available "
        "(MemAvailable); smaller --embd, --ff, --experts or --vocab fit",
        path, static_cast<double>(largest) / kGib, static_cast<double>(memory) / kGib));
  }
  const std::string folder = std::filesystem::path(path).parent_path().string();
  std::error_code error;
  const std::filesystem::space_info space =
      std::filesystem::space(folder.empty() ? "." : folder, error);
  if (!error && writer.FileBytes() > space.available) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("-o %s: the file takes %.2f GiB and its file system has %.2f GiB free",
                        path, static_cast<double>(writer.FileBytes()) / kGib,
                        static_cast<double>(space.available) / kGib));
  }
  return writer.WriteFile(path);
}

}  // namespace moegraph

