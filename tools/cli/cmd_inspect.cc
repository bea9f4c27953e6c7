// moegraph inspect FILE: what a GGUF file holds, or with --walk the launches of
// one decode step at its shape, without loading any weights.
#include <algorithm>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "capture/doors.h"
#include "capture/walk_shape.h"
#include "loader/ggml_type.h"
#include "loader/gguf.h"
#include "loader/model_config.h"
#include "loader/status_util.h"
#include "tools/cli/commands.h"
#include "tools/cli/decoder.h"

ABSL_FLAG(bool, walk, false, "inspect: the launches of one decode step at the file's shape");
ABSL_DECLARE_FLAG(std::string, arm);

namespace moegraph {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;
constexpr size_t kMaxShownString = 60;
// --walk's --ctx when not given: chat's and serve's context.
constexpr int32_t kWalkDefaultCtx = 4096;

// File text is escaped so a crafted name cannot drive the terminal.
std::string Escaped(std::string_view s) { return absl::CHexEscape(Av(s)); }

std::string QuotedString(std::string_view s) {
  if (s.size() <= kMaxShownString) return absl::StrCat("\"", Escaped(s), "\"");
  return absl::StrCat("\"", Escaped(s.substr(0, kMaxShownString)), "...\" (", s.size(), " bytes)");
}

// One value on one line; arrays are summarized, never dumped.
std::string FormatValue(const GgufKV& kv) {
  switch (kv.type) {
    case GgufType::kUint8:
    case GgufType::kUint16:
    case GgufType::kUint32:
    case GgufType::kUint64:
      return absl::StrCat(kv.u64);
    case GgufType::kInt8:
    case GgufType::kInt16:
    case GgufType::kInt32:
    case GgufType::kInt64:
      return absl::StrCat(kv.i64);
    case GgufType::kFloat32:
      return absl::StrFormat("%.7g", kv.f64);
    case GgufType::kFloat64:
      return absl::StrFormat("%.15g", kv.f64);
    case GgufType::kBool:
      return kv.u64 != 0 ? "true" : "false";
    case GgufType::kString:
      return QuotedString(kv.str);
    case GgufType::kArray:
      return absl::StrCat("[", Av(gguf_type_name(kv.array_type)), " x ", kv.array_n, "]");
  }
  return "?";
}

std::string_view GatingName(ExpertGating g) {
  switch (g) {
    case ExpertGating::kSoftmax:
      return "softmax";
    case ExpertGating::kSoftmaxWeight:
      return "softmax over the chosen k";
    case ExpertGating::kSigmoid:
      return "sigmoid";
  }
  return "?";
}

// The model as moegraph reads it: its layers, routing and attention, and where
// its bytes are (what the budget and the placement count), or why it does not load.
std::string ModelSection(const GgufFile& file) {
  absl::StatusOr<Model> loaded = LoadModel(file);
  if (!loaded.ok()) {
    return absl::StrCat("\nmodel: not loadable by moegraph: ", loaded.status().message(), "\n");
  }
  const Model& m = *loaded;
  const ModelConfig& c = m.config;
  std::string out = "\nmodel (as moegraph reads it):\n";
  absl::StrAppendFormat(&out, "  layers:     %d decoded (%d with experts", c.n_layer,
                        c.n_moe_layer());
  if (c.n_layer_dense_lead > 0) {
    absl::StrAppendFormat(&out, ", the first %d with a dense FFN of %d", c.n_layer_dense_lead,
                          c.n_ff_dense);
  }
  absl::StrAppend(&out, ")");
  if (c.n_layer_nextn > 0) absl::StrAppend(&out, "; ", c.n_layer_nextn, " NextN not read");
  absl::StrAppendFormat(&out, "\n  experts:    %d per layer of %d, top-%d, %s", c.n_expert,
                        c.n_ff_exp, c.n_expert_used, GatingName(c.gating));
  if (c.router_bias) absl::StrAppend(&out, " with a router bias");
  if (c.expert_score_bias) absl::StrAppend(&out, " with a score bias (exp_probs_b)");
  if (c.norm_topk_prob) absl::StrAppend(&out, ", weights normalized");
  if (c.expert_weights_scale != 1.0f) absl::StrAppend(&out, " x ", c.expert_weights_scale);
  absl::StrAppend(&out, c.expert_act == ExpertAct::kSwigluOai ? ", swiglu_oai" : ", silu");
  if (c.expert_bias) absl::StrAppend(&out, ", expert biases");
  if (c.n_ff_shexp > 0) {
    absl::StrAppendFormat(&out, "; a shared expert of %d%s", c.n_ff_shexp,
                          c.shexp_gated ? " (gated)" : "");
  }
  absl::StrAppendFormat(
      &out, "\n  attention:  %d heads, %d KV heads of %d; RoPE %s on %d dims, base %g", c.n_head,
      c.n_head_kv, c.head_dim, c.rope_type == RopeType::kNeox ? "neox" : "norm", c.n_rot,
      c.rope_freq_base);
  if (c.rope_scaling.ext_factor != 0.0f) {
    absl::StrAppendFormat(&out, ", YaRN x%g over %d", 1.0f / c.rope_scaling.freq_scale,
                          c.rope_scaling.n_ctx_orig);
  } else if (c.rope_scaling.freq_scale != 1.0f) {
    absl::StrAppendFormat(&out, ", linear x%g", 1.0f / c.rope_scaling.freq_scale);
  }
  if (c.n_swa > 0) {
    int windowed = 0;
    for (int il = 0; il < c.n_layer; ++il) windowed += c.swa_layer(il);
    absl::StrAppendFormat(&out, "; a window of %d on %d layers", c.n_swa, windowed);
  }
  if (c.attn_sinks) absl::StrAppend(&out, "; sinks");
  if (c.qkv_bias || c.attn_out_bias) {
    absl::StrAppend(&out, c.attn_out_bias ? "; q/k/v/o biases" : "; q/k/v biases");
  }
  if (c.qk_norm || c.qk_norm_full) absl::StrAppend(&out, "; QK-norm");
  int delta_layers = 0, gated_layers = 0;
  for (int il = 0; il < c.n_layer; ++il) {
    delta_layers += c.mixer(il) == LayerMixer::kDeltaNet;
    gated_layers += c.mixer(il) == LayerMixer::kGatedAttention;
  }
  if (gated_layers > 0) {
    absl::StrAppendFormat(&out, "; on %d layer%s, with an output gate", gated_layers,
                          gated_layers == 1 ? "" : "s");
  }
  if (delta_layers > 0) {
    const DeltaNetShape& d = c.delta_net;
    absl::StrAppendFormat(&out,
                          "\n  Gated DeltaNet: %d layers, %d key and %d value heads of %d, conv "
                          "%d; state %.2f MiB a sequence (f32)",
                          delta_layers, d.n_k_heads, d.n_v_heads, d.head_dim, d.d_conv,
                          RecurrentStateBytes(c) / kMiB);
  }

  // Bytes by what they are, each tensor once.
  struct Part {
    const char* name;
    uint64_t bytes = 0;
  };
  Part experts{"routed experts"}, attention{"attention"}, delta{"Gated DeltaNet"},
      shared{"shared expert"},
      dense_ffn{"dense FFN"}, routers{"routers"}, small{"norms/biases/sinks"},
      embd{"token embeddings"}, head{"lm_head"};
  std::vector<const GgufTensor*> seen;
  auto add = [&](Part& part, const GgufTensor* t) {
    if (t == nullptr || std::find(seen.begin(), seen.end(), t) != seen.end()) return;
    seen.push_back(t);
    part.bytes += t->nbytes;
  };
  add(embd, m.token_embd);
  add(head, m.output);
  add(small, m.output_norm);
  for (const LayerTensors& l : m.layers) {
    for (const GgufTensor* t : {l.wq, l.wk, l.wv, l.wo}) add(attention, t);
    const LayerTensors::DeltaNet& d = l.delta_net;
    for (const GgufTensor* t : {d.qkv, d.gate, d.conv, d.beta, d.alpha, d.out}) add(delta, t);
    for (const GgufTensor* t : {d.dt_bias, d.a, d.norm}) add(small, t);
    for (const GgufTensor* t : {l.gate_exps, l.up_exps, l.down_exps}) add(experts, t);
    for (const auto* legacy : {&l.gate_legacy, &l.up_legacy, &l.down_legacy}) {
      for (const GgufTensor* t : *legacy) add(experts, t);
    }
    for (const GgufTensor* t : {l.shexp_gate, l.shexp_up, l.shexp_down, l.shexp_gate_inp}) {
      add(shared, t);
    }
    for (const GgufTensor* t : {l.ffn_gate, l.ffn_up, l.ffn_down}) add(dense_ffn, t);
    for (const GgufTensor* t : {l.router, l.router_b, l.score_b}) add(routers, t);
    for (const GgufTensor* t : {l.attn_norm, l.ffn_norm, l.q_norm, l.k_norm, l.bq, l.bk, l.bv, l.bo,
                                l.sinks, l.gate_exps_b, l.up_exps_b, l.down_exps_b}) {
      add(small, t);
    }
  }
  uint64_t read = 0;
  for (const Part* part :
       {&experts, &attention, &delta, &shared, &dense_ffn, &routers, &small, &embd, &head}) {
    read += part->bytes;
  }
  uint64_t all = 0;
  for (const GgufTensor& t : file.tensors()) all += t.nbytes;
  absl::StrAppendFormat(&out, "\n  bytes:      %.2f MiB read:", read / kMiB);
  for (const Part* part :
       {&experts, &attention, &delta, &shared, &dense_ffn, &routers, &small, &embd, &head}) {
    if (part->bytes > 0) absl::StrAppendFormat(&out, " %s %.2f,", part->name, part->bytes / kMiB);
  }
  out.pop_back();
  if (all > read) absl::StrAppendFormat(&out, "; %.2f MiB not read", (all - read) / kMiB);
  absl::StrAppendFormat(&out, "\n  KV cache:   %.1f KiB per position (f16)%s",
                        KvCacheBytes(c, 1, KvCacheType::kF16) / 1024.0,
                        c.n_layer_nextn > 0 ? ", decoded layers only" : "");
  // The windowed layers' rings (KvLayerRows) at the default -ub, past their rows.
  constexpr int kUbatch = 512;
  int windowed = 0;
  for (int il = 0; il < c.n_layer; ++il) windowed += c.swa_layer(il);
  if (windowed > 0) {
    const double layer_kib = KvCacheBytes(c, 1, KvCacheType::kF16) / 1024.0 / c.n_layer;
    absl::StrAppendFormat(&out,
                          "; the %d windowed layers keep rings of %d rows (window + -ub "
                          "%d, %.2f MiB), then %.1f KiB per position",
                          windowed, c.n_swa + kUbatch, kUbatch,
                          windowed * (c.n_swa + kUbatch) * layer_kib / 1024.0,
                          (c.n_layer - windowed) * layer_kib);
  }
  out += "\n";
  return out;
}

bool HasPrefix(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

void AppendSection(std::string& out, std::string_view title,
                   const std::vector<const GgufKV*>& kvs) {
  if (kvs.empty()) return;
  size_t width = 0;
  for (const GgufKV* kv : kvs) width = std::max(width, Escaped(kv->key).size());
  absl::StrAppend(&out, "\n", Av(title), " (", kvs.size(), "):\n");
  for (const GgufKV* kv : kvs) {
    absl::StrAppend(&out, absl::StrFormat("  %-*s = %s\n", static_cast<int>(width),
                                          Escaped(kv->key), FormatValue(*kv)));
  }
}

std::string FormatInspect(const GgufFile& file) {
  std::string out;
  absl::StrAppend(&out, "file:          ", file.path(), "\n");
  absl::StrAppend(&out, "GGUF version:  ", file.version(), "\n");
  absl::StrAppend(&out, absl::StrFormat("size:          %d bytes (%.2f MiB)\n", file.total_size(),
                                        file.total_size() / kMiB));
  if (file.shard_count() > 1) {
    absl::StrAppend(&out, "shards:        ", file.shard_count(), "\n");
    for (int i = 0; i < file.shard_count(); ++i) {
      absl::StrAppend(&out, absl::StrFormat("  %s  %d bytes\n", file.shard(i).path(),
                                            file.shard(i).file_size()));
    }
  }
  absl::StrAppend(&out, "alignment:     ", file.alignment(), "\n");

  std::string arch;
  const GgufKV* arch_kv = file.FindKey("general.architecture");
  if (arch_kv == nullptr) {
    absl::StrAppend(&out, "architecture:  (general.architecture is not set)\n");
  } else if (arch_kv->type != GgufType::kString) {
    absl::StrAppend(&out, "architecture:  (general.architecture is ",
                    Av(gguf_type_name(arch_kv->type)), ", not str)\n");
  } else {
    arch = std::string(arch_kv->str);
    absl::StrAppend(&out, "architecture:  ", Escaped(arch), "\n");
  }

  std::vector<const GgufKV*> hparams, tokenizer, other;
  const std::string arch_prefix = arch + ".";
  for (const GgufKV& kv : file.kvs()) {
    if (HasPrefix(kv.key, "general.") || (!arch.empty() && HasPrefix(kv.key, arch_prefix))) {
      hparams.push_back(&kv);
    } else if (HasPrefix(kv.key, "tokenizer.")) {
      tokenizer.push_back(&kv);
    } else {
      other.push_back(&kv);
    }
  }
  if (!arch.empty()) absl::StrAppend(&out, ModelSection(file));
  AppendSection(out, "hyper-parameters", hparams);
  AppendSection(out, "tokenizer", tokenizer);
  AppendSection(out, "other keys", other);

  size_t name_width = 4;
  size_t shape_width = 5;
  for (const GgufTensor& t : file.tensors()) {
    name_width = std::max(name_width, Escaped(t.name).size());
    shape_width = std::max(shape_width, t.shape_string().size());
  }
  const int nw = static_cast<int>(name_width);
  const int sw = static_cast<int>(shape_width);
  absl::StrAppend(&out, "\ntensors (", file.tensors().size(), "):\n");
  absl::StrAppend(
      &out, absl::StrFormat("  %-*s  %-8s  %-*s  %10s\n", nw, "name", "type", sw, "shape", "MiB"));
  uint64_t total_bytes = 0;
  for (const GgufTensor& t : file.tensors()) {
    total_bytes += t.nbytes;
    absl::StrAppend(&out,
                    absl::StrFormat("  %-*s  %-8s  %-*s  %10.2f\n", nw, Escaped(t.name),
                                    ggml_type_name(t.type), sw, t.shape_string(), t.nbytes / kMiB));
  }
  absl::StrAppend(&out, absl::StrFormat("total: %d tensors, %.2f MiB\n", file.tensors().size(),
                                        total_bytes / kMiB));
  return out;
}

// --walk: the step's launches (capture/walk_shape.h) for --arm, --slots, --ctx
// and --kv-type, each refused by name before anything but the header is read.
absl::StatusOr<std::string> FormatWalk(const GgufFile& file) {
  WalkShapeOptions options;
  if (const std::string arm = absl::GetFlag(FLAGS_arm); !arm.empty()) {
    MG_ASSIGN_OR_RETURN(options.arm, ParseArm(arm));
  }
  MG_ASSIGN_OR_RETURN(options.slots, ReadSlots());
  options.max_ctx = FlagOr(FLAGS_ctx, kWalkDefaultCtx);
  MG_ASSIGN_OR_RETURN(options.kv_type, ReadKvType());
  MG_ASSIGN_OR_RETURN(const Model model, LoadModel(file));
  MG_ASSIGN_OR_RETURN(const WalkShape shape, ShapeWalk(model, options));
  const std::string arm =
      options.arm == Arm::kResident
          ? "resident (every expert in its own slot)"
          : absl::StrCat("graph (", Av(PolicyName(Doors{}.policy)), " policy, ",
                         Doors{}.split_passes ? "split expert passes" : "one expert pass",
                         ", slots ",
                         options.slots == 0 ? "auto" : absl::StrCat(options.slots), ")");
  return absl::StrCat("walk of ", file.path(), ": one decode step, arm ", arm, ", --ctx ",
                      options.max_ctx, ", ",
                      options.kv_type == KvCacheType::kF16 ? "f16" : "f32",
                      " KV cache; kernels in walk order, grids as the launchers compute them\n\n",
                      FormatWalkShape(shape));
}

}  // namespace

int RunInspect(const std::vector<std::string>& args) {
  // The file as its argument, or as -m like every other command's model.
  const std::string flag = absl::GetFlag(FLAGS_m);
  if (args.size() + (flag.empty() ? 0 : 1) != 1) {
    std::fprintf(stderr, "usage: moegraph inspect FILE (or -m FILE) [--walk [flags]]\n");
    return 2;
  }
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(flag.empty() ? args[0] : flag);
  if (!file.ok()) {
    std::fprintf(stderr, "moegraph inspect: %s\n", std::string(file.status().message()).c_str());
    return 1;
  }
  if (absl::GetFlag(FLAGS_walk)) {
    const absl::StatusOr<std::string> walk = FormatWalk(**file);
    if (!walk.ok()) {
      std::fprintf(stderr, "moegraph inspect: %s\n", std::string(walk.status().message()).c_str());
      return 1;
    }
    std::fwrite(walk->data(), 1, walk->size(), stdout);
    return 0;
  }
  const std::string text = FormatInspect(**file);
  std::fwrite(text.data(), 1, text.size(), stdout);
  return 0;
}

}  // namespace moegraph
