#include "tools/cli/command_line.h"

#include <algorithm>
#include <cstddef>
#include <iterator>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "loader/status_util.h"
#include "tools/cli/commands.h"
#include "tools/cli/version.h"

namespace moegraph::cli {
namespace {

// ---- the flags each command reads ----

const FlagDoc kModel = {"m", "FILE", "model file (GGUF)"};
// -p and -f's text (run, tokenize, perplexity), as llama.cpp's common arguments.
const FlagDoc kEscape = {"escape", "",
                         "process escapes in the text of -p and -f (\\n \\r \\t \\' \\\" \\\\ "
                         "\\xHH), as llama.cpp does (default: true)"};
const FlagDoc kNoEscape = {"no_escape", "", "take the text of -p and -f as it is"};

std::vector<FlagDoc> Sampling(absl::string_view seed_default) {
  return {
      {"temp", "T",
       "sampling temperature; 0 is greedy decoding (the argmax), > 0 samples after --top-k, "
       "--top-p and --min-p (default: 0)"},
      {"top_k", "K", "keep the K most likely tokens; 0 or less: every token (default: 40)"},
      {"top_p", "P",
       "keep the most likely tokens holding this share of the probability; 1: off "
       "(default: 0.95)"},
      {"min_p", "P",
       "drop tokens less likely than this share of the most likely one; 0: off "
       "(default: 0.05)"},
      {"seed", "N", seed_default},
  };
}

// How the model file comes into memory (run, chat, serve, bench).
std::vector<FlagDoc> LoadFlags() {
  return {
      {"load_mode", "auto|none|mmap|mlock|mmap+mlock",
       "llama.cpp's --load-mode: none reads the file into memory (huge pages where the kernel "
       "gives them), mmap maps it and reads every page at load, mlock / mmap+mlock also lock "
       "it in memory; auto: cpu: none where the tensors fit in the available memory less 1 "
       "GiB, else mmap; cuda: mapped (the experts are copied at load) (default: auto)"},
      {"mmap", "", "llama.cpp's older spelling of --load-mode mmap"},
      {"no_mmap", "", "llama.cpp's older spelling of --load-mode none"},
      {"mlock", "", "llama.cpp's older --mlock: --load-mode mmap+mlock, or mlock with --no-mmap"},
  };
}

// The engine's flags (run, chat, serve).
std::vector<FlagDoc> Engine() {
  std::vector<FlagDoc> flags = {
      {"backend", "cpu|cuda|auto", "cuda when a device exists, else cpu (default: auto)"},
      {"slots", "N|auto",
       "expert slots: cuda: as many as the memory budget allows; cpu: every expert read in "
       "place from the file, no copies (default: auto)"},
      {"host_cache", "SIZE",
       "cpu: the disk tier: experts read from the file (O_DIRECT) into a host cache of SIZE "
       "bytes (8G, 512M), at least one token's experts; the file is mapped, its experts never "
       "faulted in (default: off)"},
      {"drop_cold_experts", "F",
       "cpu: a routed expert that is not in a slot and weighs under F / k is skipped (weight 0, "
       "no read), the top one kept; decode only unless --drop-in-prompts (default: 0, off)"},
      {"drop_in_prompts", "", "cpu: --drop-cold-experts in prompts too (default: false)"},
      {"n_expert_used", "N",
       "experts a token, the router's N best, at most the model's top-k (llama.cpp's "
       "--override-kv ARCH.expert_used_count=int:N; default: the model's)"},
      {"n_cpu_moe", "N",
       "llama.cpp's --n-cpu-moe: the experts of N layers' worth stay in host memory, so the GPU "
       "holds slots for the other layers' experts ((layers - N) x experts); cpu: no meaning"},
      {"arm", "NAME",
       "resident | graph | eager | host | stage (default: graph, or what the "
       "MOEGRAPH_* doors in the environment say)"},
      {"steps_per_launch", "N", "cuda: decode steps captured in one CUDA graph (default: 1)"},
      {"ub", "N",
       "prompt tokens per ubatch: cuda: of the batched prefill (MOEGRAPH_PREFILL); cpu: of a "
       "batch, one token where slots hold fewer than the experts (default: 512, as llama.cpp)"},
      {"swa_full", "",
       "windowed layers (gpt-oss) keep every position's KV instead of a ring of window + "
       "ubatch rows (default: false, as llama.cpp)"},
      {"t", "N",
       "cpu: threads, the caller included; at most the logical CPUs (default: the "
       "physical cores)"},
      {"kv_type", "f16|f32", "the KV cache's element type (default: f16)"},
      {"verbose", "",
       "print the doors line and the CUDA runtime's reason when there is no "
       "device (default: false)"},
  };
  const std::vector<FlagDoc> load = LoadFlags();
  flags.insert(flags.end(), load.begin(), load.end());
  return flags;
}

std::vector<FlagDoc> Join(std::vector<std::vector<FlagDoc>> parts) {
  std::vector<FlagDoc> out;
  for (auto& part : parts) out.insert(out.end(), part.begin(), part.end());
  return out;
}

std::vector<CommandSpec> MakeCommands() {
  std::vector<CommandSpec> c;
  c.push_back({"inspect",
               "FILE | -m FILE [--walk [--arm resident|graph] [--slots N] [--ctx N] [--kv-type T]]",
               "architecture, hyper-parameters and tensor table of a GGUF file, or with --walk "
               "the launches of one decode step at its shape",
               RunInspect,
               {{"m", "FILE", "the file, as the argument FILE"},
                {"walk", "",
                 "instead: one decode step's kernel launches as the CUDA engine would make them "
                 "(grid, block, weight bytes per token; no device, no weights read), then the "
                 "kernel nodes per layer (default: false)"},
                {"arm", "resident|graph",
                 "--walk: every expert resident, or the design's device policy with the doors at "
                 "their defaults (default: graph)"},
                {"slots", "N|auto",
                 "--walk, graph arm: the slot count, at least top-k (default: auto)"},
                {"ctx", "N",
                 "--walk: KV cache positions, which size the attention's grid (default: 4096)"},
                {"kv_type", "f16|f32", "--walk: the KV cache's element type (default: f16)"}}});
  c.push_back(
      {"make-fixture",
       "-o FILE.gguf [flags]",
       "write a synthetic MoE model as GGUF",
       RunMakeFixture,
       {{"o", "FILE", "the GGUF file to write (required)"},
        {"arch", "NAME",
         "qwen3moe | olmoe | qwen2moe | mixtral | gpt-oss | glm4moe | qwen35moe (default: "
         "qwen3moe)"},
        {"swa", "N", "gpt-oss: the attention window of the even layers, in positions (default: 4)"},
        {"dense_layers", "N", "glm4moe: leading layers with a dense FFN (default: 1)"},
        {"nextn", "N",
         "glm4moe, qwen35moe: NextN (MTP) layers written after the decode layers (default: 1)"},
        {"qk_norm", "", "glm4moe: per-head q/k norms, as GLM-4.5 355B (default: false)"},
        {"full_attn_interval", "N",
         "qwen35moe: every N-th layer is gated attention, the rest Gated DeltaNets (default: 4)"},
        {"ssm_k_heads", "N", "qwen35moe: Gated DeltaNet key heads (default: 2)"},
        {"ssm_v_heads", "N",
         "qwen35moe: Gated DeltaNet value heads, a multiple of the key heads (default: 4)"},
        {"ssm_head_dim", "N",
         "qwen35moe: Gated DeltaNet head size (default: 0, the attention's)"},
        {"layers", "N", "transformer blocks (default: 2)"},
        {"experts", "N", "routed experts per layer (default: 8)"},
        {"top_k", "K", "experts used per token (default: 2)"},
        {"embd", "N", "embedding width (default: 64)"},
        {"ff", "N", "hidden size of one routed expert (default: 32)"},
        {"shared_ff", "N", "qwen2moe: shared expert hidden size (default: 0, twice --ff)"},
        {"heads", "N", "attention heads (default: 4)"},
        {"kv_heads", "N",
         "key/value heads (default: 0: --heads for olmoe, else --heads / 2 when even)"},
        {"head_dim", "N", "head size (default: 0: --embd / --heads)"},
        {"vocab", "N", "vocabulary size, ignored with --tokenizer-json (default: 256)"},
        {"tokenizer_json", "FILE",
         "a Hugging Face tokenizer.json whose vocabulary the file carries, converted as "
         "llama.cpp's converter does"},
        {"pad_vocab", "N",
         "with --tokenizer-json: pad to N rows with unused tokens (default: 0: "
         "config.json's vocab_size, else the tokenizer's size)"},
        {"quant", "TYPE[,expert=TYPE]",
         "dense and routed-expert weight types: f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 "
         "q2_K q3_K q4_K q5_K q6_K iq4_nl iq4_xs mxfp4 (default: f32)"},
        {"router_skew", "S",
         "0 routes evenly; larger makes a few experts dominate "
         "(default: 0)"},
        {"seed", "N", "the same seed writes the same bytes (default: 1)"},
        {"expert_variants", "V",
         "V > 0: expert e is a byte copy of expert e % V, fast for large benchmark files "
         "(default: 0: every expert distinct)"},
        {"legacy_experts", "", "mixtral: per-expert ffn_gate.N tensors (default: false)"},
        {"tied_output", "", "qwen3moe, mixtral: no output.weight (default: false)"},
        {"ctx", "N", "the {arch}.context_length written (default: 4096)"}}});
  c.push_back({"run", "-m FILE (-p TEXT | -f FILE | --tokens IDS) [-n N] [flags]",
               "decode a prompt: the text as it is generated (or ids), then tok/s", RunRun,
               Join({{kModel,
                      {"p", "TEXT", "the prompt, tokenized with the file's vocabulary"},
                      {"f", "FILE", "read the prompt from this file"},
                      kEscape,
                      kNoEscape,
                      {"tokens", "IDS", "the prompt as token ids (1,2,3); the output is ids too"},
                      {"n", "N",
                       "tokens to generate; -1: until end-of-generation or the context is full "
                       "(default: 16)"},
                      {"ctx", "N",
                       "KV cache positions (default: 0: the prompt and -n, at most the model's "
                       "context length; with -n -1, 4096 or the model's context length if "
                       "smaller)"},
                      {"ignore_eos", "", "go on past end-of-generation tokens (default: false)"},
                      {"special", "", "print control tokens' text too (default: false)"}},
                     Sampling("the sampler's seed; -1: random (default: random, printed)"),
                     Engine()})});
  c.push_back({"chat", "-m FILE [--system TEXT] [flags]",
               "a conversation, one message a line (a terminal or a pipe; EOF or /exit ends)",
               RunChat,
               Join({{kModel,
                      {"system", "TEXT", "a system message before the first turn"},
                      {"chat_template", "NAME",
                       "a template name (chatml, llama3, ...) or Jinja text, instead of the "
                       "file's tokenizer.chat_template"},
                      {"n", "N", "most tokens of one reply (default: -1: until its end)"},
                      {"ctx", "N",
                       "KV cache positions; when a turn does not fit, the oldest turns are "
                       "dropped (default: 4096)"},
                      {"special", "", "print control tokens' text too (default: false)"},
                      {"verbose_prompt", "",
                       "print the text each turn prefills, JSON-quoted, to stderr (default: "
                       "false)"}},
                     Sampling("the sampler's seed; -1: random (default: random, printed)"),
                     Engine()})});
  c.push_back(
      {"serve", "-m FILE [--host 127.0.0.1] [--port 8080] [flags]",
       "an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models, "
       "/health, /metrics, /tokenize, /detokenize)",
       RunServe,
       Join(
           {{kModel,
             {"host", "ADDR", "the address to listen on (default: 127.0.0.1, this machine only)"},
             {"port", "N", "the port; 0: any free port, printed (default: 8080)"},
             {"api_key", "KEY", "requests must send Authorization: Bearer KEY; /health stays open"},
             {"alias", "NAME", "the model's id in /v1/models and replies (default: the file name)"},
             {"max_queue", "N", "requests that may wait; more get 503 (default: 16)"},
             {"max_body", "BYTES", "the largest request body; larger gets 413 (default: 4194304)"},
             {"timeout", "SECONDS",
              "a connection that takes longer to send its request is dropped (default: 10)"},
             {"ctx", "N", "KV cache positions (default: 4096)"}},
            Sampling("the seed of requests that name none (default: random, printed)"),
            Engine()})});
  c.push_back(
      {"bench", "-m FILE [-p 512] [-n 128] [-pg 512,128] [--arms ...] [--slots 16,32] [flags]",
       "arms side by side, llama-bench style", RunBench,
       Join({{kModel,
              {"p", "N[,N...]",
               "prompt tokens of a pp test, one per value; given twice, the lists join; 0: none "
               "(default: 512)"},
              {"n", "N[,N...]", "tokens of a tg test, one per value; 0: none (default: 128)"},
              {"pg", "P,N[,P,N...]",
               "a pp+tg test a pair: a P-token prompt, then N tokens, all timed (default: none)"},
              {"arms", "A[,A...]", "arms to compare (default: resident,graph,eager,host,stage)"},
              {"slots", "N[,N...]", "slot counts, auto allowed (default: auto)"},
              {"host_cache", "SIZE",
               "cpu: the disk tier: the arms' slots fill SIZE bytes over the file, misses read "
               "from it (run's --host-cache; default: off)"},
              {"t", "N[,N...]", "cpu: thread counts, a row each (default: the physical cores)"},
              {"r", "N", "timed repetitions of every test (default: 5)"},
              {"o", "md|json|jsonl|csv", "output format; notes go to stderr (default: md)"},
              {"routing_trace", "FILE", "a routing trace whose selections replace the router's"},
              {"record_routing", "FILE",
               "write the routing the run used (.jsonl: JSONL, else binary)"},
              {"ctx", "N", "KV cache positions (default: 0: what the tests need)"},
              {"backend", "cpu|cuda|auto", "cuda when a device exists, else cpu (default: auto)"},
              {"steps_per_launch", "N",
               "cuda: decode steps captured in one CUDA graph (default: 1)"},
              {"ub", "N[,N...]", "prompt tokens per ubatch, a row group each (default: 512)"},
              {"kv_type", "f16|f32", "the KV cache's element type (default: f16)"},
              {"verbose", "",
               "print the CUDA runtime's reason when there is no device (default: "
               "false)"}},
             LoadFlags()})});
  c.push_back({"perplexity",
               "-m FILE (-f FILE | --kl-divergence --kl-divergence-base BASE) [flags]",
               "perplexity over a text's chunks, or KL divergence against a base run, as "
               "llama-perplexity measures them",
               RunPerplexity,
               Join({{kModel,
                      {"f", "FILE", "the text (llama.cpp's wiki.test.raw, say)"},
                      {"p", "TEXT", "the text itself, instead of -f"},
                      kEscape,
                      kNoEscape,
                      {"ctx", "N",
                       "tokens a chunk; its second half is scored (default: 512, as "
                       "llama-perplexity)"},
                      {"b", "N",
                       "positions a forward pass takes at once (with -ub, the smaller); below -c "
                       "or a multiple of it (default: 2048)"},
                      {"chunks", "N", "score the first N chunks; -1: all (default: -1)"},
                      {"kl_divergence_base", "FILE",
                       "without --kl-divergence: also save each scored position's "
                       "log-probabilities here (llama.cpp's format); with it: the base to "
                       "compare with"},
                      {"kl_divergence", "",
                       "KL divergence, perplexity ratio and token probability statistics "
                       "against --kl-divergence-base, on its tokens (default: false)"},
                      {"record_routing", "FILE",
                       "cpu: write the experts every scored chunk's positions chose, in order, "
                       "as a routing trace (.jsonl or binary) for moegraph simulate"}},
                     Engine()})});
  c.push_back({"tokenize",
               "-m FILE (-p TEXT | -f FILE) [flags]",
               "text to token ids with the file's vocabulary, like llama-tokenize",
               RunTokenize,
               {kModel,
                {"p", "TEXT", "the text"},
                {"f", "FILE", "read the text from this file"},
                kEscape,
                kNoEscape,
                {"ids", "", "print [1, 2, 3] instead of one id -> 'piece' a line (default: false)"},
                {"no_bos", "", "add no BOS or EOS (default: false)"},
                {"no_parse_special", "",
                 "special tokens written in the text stay text (default: false)"}}});
  c.push_back(
      {"gguf-split",
       "[flags] IN.gguf OUT_PREFIX",
       "split a GGUF model into OUT_PREFIX-00001-of-0000N.gguf, ... as llama.cpp's gguf-split "
       "does (every command opens the first shard as the model)",
       RunGgufSplit,
       {{"split_max_tensors", "N",
         "a new shard every N tensors, in the input's order (default: 128)"},
        {"split_max_size", "N(M|G)",
         "instead of --split-max-tensors: a new shard before the tensor that would take its "
         "tensor data past N megabytes (M, 10^6 bytes) or gigabytes (G, 10^9)"},
        {"no_tensor_first_split", "", "shard 1 holds the metadata only (default: false)"},
        {"dry_run", "", "print each shard's tensors and bytes, write nothing (default: false)"}}});
  c.push_back({"quantize", "IN.gguf OUT.gguf TYPE",
               "rewrite a GGUF model with its weight matrices in TYPE, as llama-quantize --pure "
               "does (norms, routers and 1-D tensors kept)",
               RunQuantize,
               {}});
  c.push_back(
      {"trace",
       "stats FILE [-o md|json] | synth [flags] -o FILE | convert IN OUT",
       "routing traces (JSONL or binary)",
       RunTrace,
       {{"o", "FILE|md|json", "synth: the trace to write; stats: the format (default: md)"},
        {"experts", "N",
         "synth: experts per layer (default: 128); stats: the expert count "
         "when above the largest id + 1"},
        {"layers", "N", "synth: layers (default: 48)"},
        {"top_k", "K", "synth: experts per layer per step (default: 8)"},
        {"steps", "N", "synth: decode steps (default: 1000)"},
        {"zipf", "S", "synth: Zipf exponent of expert popularity (default: 1.0)"},
        {"reuse", "R",
         "synth: chance an expert is selected again next step (default: "
         "0.45)"},
        {"drift", "N", "synth: every N steps two popularity ranks swap (default: 0: never)"},
        {"weights", "", "synth: also write router weights (default: false)"},
        {"seed", "N", "synth: the same seed writes the same trace (default: 1)"}}});
  c.push_back(
      {"simulate",
       "--trace FILE [--policy lru,slru,default,opt] [--slots 16,32,64] [flags]",
       "hit rates and the cost model of residency policies on a routing trace",
       RunSimulate,
       {{"trace", "FILE", "routing trace (.jsonl or binary)"},
        {"policy", "P[,P...]", "lru, slru, hazard, opt, default (default: lru,slru,default,opt)"},
        {"slots", "N[,N...]", "slot counts (default: 16,32,64)"},
        {"pool", "global|per-layer", "one pool, or slots split over the layers (default: global)"},
        {"protected_frac", "F", "slru's protected share of the slots (default: 0.8)"},
        {"experts", "N", "the expert count when above the trace's largest id + 1"},
        {"block_mib", "MIB", "bytes of one expert block (default: 1.0)"},
        {"pcie_gbps", "GBPS", "host-to-device bandwidth (default: 50)"},
        {"hbm_gbps", "GBPS", "device memory bandwidth (default: 4800)"},
        {"ram_gbps", "GBPS", "host RAM bandwidth of a CPU expert pass (default: 80)"},
        {"resident_ms", "MS", "step time with every expert resident (default: 0: from HBM)"},
        {"o", "md|json", "output format (default: md)"}}});
  return c;
}

// ---- llama.cpp's spellings ----

// llama.cpp's name (normalized) for a moegraph flag.
struct Alias {
  absl::string_view llama;
  absl::string_view ours;
};
constexpr Alias kAliases[] = {
    {"c", "ctx"},
    {"ctx_size", "ctx"},
    {"s", "seed"},
    {"threads", "t"},
    {"model", "m"},
    {"prompt", "p"},
    {"file", "f"},
    {"e", "escape"},
    {"n_predict", "n"},
    {"predict", "n"},
    {"ctk", "kv_type"},
    {"cache_type_k", "kv_type"},
    {"ctv", "kv_type"},
    {"cache_type_v", "kv_type"},
    {"sys", "system"},
    {"system_prompt", "system"},
    {"temperature", "temp"},
    {"sp", "special"},
    {"ncmoe", "n_cpu_moe"},
    {"ubatch_size", "ub"},
    {"batch_size", "b"},
    {"lm", "load_mode"},
    {"mmp", "mmap"},
    {"v", "verbose"},
    {"log_verbose", "verbose"},
    {"a", "alias"},
    {"n_prompt", "p"},
    {"n_gen", "n"},
    {"repetitions", "r"},
    {"output", "o"},
    {"n_gpu_layers", "ngl"},
    {"gpu_layers", "ngl"},
    {"flash_attn", "fa"},
    {"conversation", "cnv"},
    {"no_conversation", "no_cnv"},
    {"parallel", "np"},
};

// llama.cpp's flags that have no meaning in moegraph: accepted with a note (or
// refused with the reason) by the commands listed.
struct Ignored {
  absl::string_view name;
  // The next argument is its value: always (kValue), never (kNone), or when it
  // is one of llama.cpp's switch words (kOneOf: -fa takes on|off|auto now and
  // took no value before).
  enum Value { kNone, kValue, kOneOf } value;
  absl::string_view commands;  // comma-separated
  absl::string_view note;      // empty: refused
  absl::string_view refusal;
};
constexpr Ignored kIgnored[] = {
    {"ngl", Ignored::kValue, "run,chat,serve,bench",
     "every dense weight goes to the GPU and experts to its slots (--slots, --n-cpu-moe), so "
     "-ngl is ignored",
     ""},
    {"fa", Ignored::kOneOf, "run,chat,serve",
     "attention is moegraph's own kernel on every backend, so -fa is ignored", ""},
    {"fa", Ignored::kValue, "bench",
     "attention is moegraph's own kernel on every backend, so -fa is ignored (one row, not one "
     "a value)",
     ""},
    {"jinja", Ignored::kNone, "run,chat,serve",
     "the chat template is detected from the file's tokenizer.chat_template, as llama.cpp "
     "detects it, so --jinja is ignored",
     ""},
    {"no_jinja", Ignored::kNone, "run,chat,serve", "--no-jinja is ignored (see --jinja)", ""},
    {"cnv", Ignored::kNone, "chat", "chat is always a conversation; -cnv is ignored", ""},
    {"cnv", Ignored::kNone, "run", "", "a conversation is `moegraph chat -m FILE`; run decodes one prompt"},
    {"no_cnv", Ignored::kNone, "run", "run decodes one prompt and exits, as -no-cnv asks", ""},
    {"np", Ignored::kValue, "serve",
     "one engine serves the requests one at a time from a FIFO (--max-queue), so -np is "
     "ignored",
     ""},
};

bool Lists(absl::string_view list, absl::string_view name) {
  size_t start = 0;
  while (start <= list.size()) {
    const size_t end = std::min(list.find(',', start), list.size());
    if (list.substr(start, end - start) == name) return true;
    start = end + 1;
  }
  return false;
}

bool Reads(const CommandSpec& c, absl::string_view name) {
  return std::any_of(c.flags.begin(), c.flags.end(),
                     [&](const FlagDoc& f) { return f.name == name; });
}

const Ignored* FindIgnored(const CommandSpec& c, absl::string_view name) {
  for (const Ignored& i : kIgnored) {
    if (i.name == name && Lists(i.commands, c.name)) return &i;
  }
  return nullptr;
}

size_t EditDistance(absl::string_view a, absl::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// The command's flag (or llama.cpp spelling of one) nearest to name, if near.
std::optional<std::string> Nearest(const CommandSpec& c, absl::string_view name) {
  std::optional<std::string> best;
  // One letter is one edit from every other one-letter flag: no hint.
  if (name.size() <= 1) return best;
  size_t best_distance = name.size() <= 3 ? 1 : 2;
  auto consider = [&](absl::string_view candidate) {
    const size_t d = EditDistance(name, candidate);
    if (d <= best_distance && (!best.has_value() || d < best_distance)) {
      best = Spelled(candidate);
      best_distance = d;
    }
  };
  for (const FlagDoc& f : c.flags) consider(f.name);
  for (const Alias& a : kAliases) {
    if (Reads(c, a.ours)) consider(a.llama);
  }
  return best;
}

struct Arg {
  std::string name;                  // normalized, without dashes
  std::optional<std::string> value;  // after '='
};

// A flag argument ("--name[=value]" or "-name..."), or none for a positional one.
std::optional<Arg> ParseFlagArg(const std::string& arg) {
  if (arg.size() < 2 || arg[0] != '-' || arg == "--") return std::nullopt;
  const size_t start = arg.find_first_not_of('-');
  if (start == std::string::npos || start > 2) return std::nullopt;
  const size_t equals = arg.find('=');
  Arg out;
  out.name = arg.substr(start, equals == std::string::npos ? std::string::npos : equals - start);
  if (out.name.empty()) return std::nullopt;
  if (equals != std::string::npos) out.value = arg.substr(equals + 1);
  return out;
}

bool IsBoolFlag(absl::string_view name) {
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  return flag != nullptr && flag->IsOfType<bool>();
}

std::string UnknownFlagError(const CommandSpec& c, const std::string& as_written,
                             absl::string_view name) {
  std::string hint;
  if (const std::optional<std::string> near = Nearest(c, name); near.has_value()) {
    hint = absl::StrCat(" (did you mean ", *near, "?)");
  }
  return absl::StrFormat("%s is not a flag of %s%s; 'moegraph %s --help' lists them", as_written,
                         c.name, hint, c.name);
}

}  // namespace

const std::vector<CommandSpec>& Commands() {
  static const std::vector<CommandSpec>* const commands =
      new std::vector<CommandSpec>(MakeCommands());
  return *commands;
}

const CommandSpec* FindCommand(absl::string_view name) {
  for (const CommandSpec& c : Commands()) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

std::string Spelled(absl::string_view name) {
  // One letter, and llama.cpp's (and llama-bench's) short names, take one dash.
  constexpr absl::string_view kSingleDash[] = {"pg",  "ngl", "fa", "cnv",   "no_cnv", "ctk", "ctv",
                                               "sys", "np",  "sp", "ncmoe", "ub",     "lm"};
  const bool single = name.size() == 1 || std::find(std::begin(kSingleDash), std::end(kSingleDash),
                                                    name) != std::end(kSingleDash);
  return absl::StrCat(single ? "-" : "--", absl::StrReplaceAll(name, {{"_", "-"}}));
}

std::string Usage() {
  std::string s = "usage: moegraph COMMAND [flags] [args]\n\ncommands:\n";
  for (const CommandSpec& c : Commands()) absl::StrAppend(&s, "  ", c.name, "  ", c.summary, "\n");
  absl::StrAppend(&s,
                  "\n'moegraph COMMAND --help' (or 'moegraph help COMMAND') lists a command's "
                  "flags; 'moegraph --version' prints the version.\n");
  return s;
}

std::string CommandHelp(const CommandSpec& c) {
  std::string s = absl::StrCat("usage: moegraph ", c.name, " ", c.synopsis, "\n", c.summary, "\n");
  if (c.flags.empty()) return absl::StrCat(s, "\n", c.name, " takes no flags.\n");
  absl::StrAppend(&s, "\nflags:\n");
  for (const FlagDoc& f : c.flags) {
    absl::StrAppend(&s, "  ", Spelled(f.name), f.value.empty() ? "" : " ", f.value, "\n      ",
                    f.help, "\n");
  }
  std::string aliases;
  for (const Alias& a : kAliases) {
    if (Reads(c, a.ours)) {
      absl::StrAppend(&aliases, aliases.empty() ? "" : ", ", Spelled(a.llama), " = ",
                      Spelled(a.ours));
    }
  }
  if (!aliases.empty()) absl::StrAppend(&s, "\nllama.cpp's spellings: ", aliases, "\n");
  std::string ignored;
  for (const Ignored& i : kIgnored) {
    if (Lists(i.commands, c.name) && !i.note.empty()) {
      absl::StrAppend(&ignored, ignored.empty() ? "" : ", ", Spelled(i.name));
    }
  }
  if (!ignored.empty()) {
    absl::StrAppend(&s, "accepted and ignored, with a note: ", ignored, "\n");
  }
  absl::StrAppend(&s, "docs/FLAGS.md has the details.\n");
  return s;
}

std::string VersionLine() {
  return absl::StrCat("moegraph ", kVersion, " (git ", kGitCommit, "), built with ", kCompiler,
                      ", ", kCudaBuild, "\n");
}

bool AsksFor(const std::vector<std::string>& args, absl::string_view what) {
  for (const std::string& arg : args) {
    if (arg == "--") break;
    if (what == "help" && (arg == "--help" || arg == "-help" || arg == "-h")) return true;
    if (what == "version" && arg == "--version") return true;
  }
  return false;
}

absl::StatusOr<CommandLine> Rewrite(const CommandSpec& c, const std::vector<std::string>& args) {
  CommandLine out;
  std::vector<std::pair<std::string, std::string>> kv_types;  // (spelling, value) given
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      out.args.insert(out.args.end(), args.begin() + static_cast<ptrdiff_t>(i), args.end());
      break;
    }
    std::optional<Arg> flag = ParseFlagArg(arg);
    if (!flag.has_value()) {
      out.args.push_back(arg);
      continue;
    }
    const std::string as_written = arg.substr(0, arg.find('='));
    std::string name = absl::StrReplaceAll(flag->name, {{"-", "_"}});
    for (const Alias& a : kAliases) {
      if (a.llama == name) {
        name = std::string(a.ours);
        break;
      }
    }
    // The value: after '=', else the next argument (for a flag that takes one).
    auto take_value = [&](bool takes_value) -> absl::StatusOr<std::optional<std::string>> {
      if (flag->value.has_value() || !takes_value) return flag->value;
      if (i + 1 >= args.size()) {
        return absl::InvalidArgumentError(absl::StrCat(as_written, " needs a value"));
      }
      return std::optional<std::string>(args[++i]);
    };
    if (const Ignored* ignored = FindIgnored(c, name); ignored != nullptr) {
      if (ignored->note.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(as_written, ": ", ignored->refusal));
      }
      // llama.cpp's own switch words (common/arg.cpp's is_truthy, is_falsey, is_autoy).
      constexpr absl::string_view kSwitchWords[] = {"on", "off", "auto", "enabled", "disabled",
                                                    "true", "false", "1", "0"};
      const bool next_is_word =
          i + 1 < args.size() && std::find(std::begin(kSwitchWords), std::end(kSwitchWords),
                                           args[i + 1]) != std::end(kSwitchWords);
      const bool takes = ignored->value == Ignored::kValue ||
                         (ignored->value == Ignored::kOneOf && next_is_word);
      MG_ASSIGN_OR_RETURN(const std::optional<std::string> value, take_value(takes));
      (void)value;
      out.notes.push_back(absl::StrCat("note: ", as_written, ": ", ignored->note));
      continue;
    }
    if (c.name == "serve" && (name == "slots" || name == "no_slots") &&
        !flag->value.has_value()) {
      // llama-server's --slots/--no-slots switch its /slots endpoint; here
      // --slots N sizes the expert cache. A --slots with no count after it is
      // llama-server's switch: /slots is always on.
      const bool counted = name != "no_slots" && i + 1 < args.size() &&
                           !args[i + 1].starts_with("-");
      if (!counted) {
        out.notes.push_back(absl::StrCat(
            "note: ", as_written,
            ": llama-server's switch for the /slots endpoint, which is always on here (--slots "
            "N sets the expert cache's slots)"));
        continue;
      }
    }
    bool negated = false;
    if (!Reads(c, name)) {
      // --noflag for a boolean flag.
      negated = name.starts_with("no") && Reads(c, name.substr(2)) && IsBoolFlag(name.substr(2));
      if (!negated) return absl::InvalidArgumentError(UnknownFlagError(c, as_written, name));
    }
    const std::string flag_name = negated ? name.substr(2) : name;
    if (c.name == "bench" && flag_name == "mmap" && !negated) {
      // llama-bench's --mmap takes 0 or 1: 0 reads the file (--load-mode none).
      const bool valued = flag->value.has_value() ||
                          (i + 1 < args.size() && (args[i + 1] == "0" || args[i + 1] == "1"));
      if (valued) {
        MG_ASSIGN_OR_RETURN(const std::optional<std::string> value, take_value(true));
        if (*value != "0" && *value != "1") {
          return absl::InvalidArgumentError(absl::StrFormat(
              "%s '%s': bench takes one of 0 (read the file) or 1 (map it)", as_written, *value));
        }
        out.args.push_back(*value == "0" ? "--load_mode=none" : "--load_mode=mmap");
        continue;
      }
    }
    const bool boolean = IsBoolFlag(flag_name);
    MG_ASSIGN_OR_RETURN(const std::optional<std::string> value, take_value(!boolean));
    if (flag_name == "kv_type" && value.has_value()) {
      // -ctk and -ctv (and --kv-type) name one type: the same, or an error.
      for (const auto& [spelling, earlier] : kv_types) {
        if (earlier != *value) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "%s %s and %s %s: moegraph's KV cache has one element type for keys and values "
              "(--kv-type)",
              spelling, earlier, as_written, *value));
        }
      }
      kv_types.emplace_back(as_written, *value);
    }
    // A value Abseil would refuse gets moegraph's message naming the flag as
    // written, not Abseil's "Illegal value ... for flag 'top_k'". (ParseFrom
    // sets the value ParseCommandLine sets again next.)
    std::string parse_error;
    if (absl::CommandLineFlag* f = absl::FindCommandLineFlag(flag_name);
        f != nullptr && value.has_value() && !f->ParseFrom(*value, &parse_error)) {
      const bool integer = f->IsOfType<int32_t>() || f->IsOfType<int64_t>() ||
                           f->IsOfType<uint32_t>() || f->IsOfType<uint64_t>();
      const bool real = f->IsOfType<double>() || f->IsOfType<float>();
      return absl::InvalidArgumentError(
          absl::StrFormat("%s '%s' is not %s", as_written, *value,
                          integer ? "an integer" : real ? "a number" : "a value it takes"));
    }
    std::string rewritten = absl::StrCat("--", negated ? "no" : "", flag_name);
    if (value.has_value()) absl::StrAppend(&rewritten, "=", *value);
    // bench's lists grow with each repetition of their flag, as llama-bench's do.
    const std::string prefix = absl::StrCat("--", flag_name, "=");
    const bool appends = c.name == "bench" && value.has_value() &&
                         (flag_name == "p" || flag_name == "n" || flag_name == "pg" ||
                          flag_name == "t" || flag_name == "slots" || flag_name == "ub");
    auto earlier = std::find_if(out.args.begin(), out.args.end(),
                                [&](const std::string& a) { return a.starts_with(prefix); });
    if (appends && earlier != out.args.end()) {
      absl::StrAppend(&*earlier, ",", *value);
      continue;
    }
    out.args.push_back(std::move(rewritten));
  }
  return out;
}

}  // namespace moegraph::cli
