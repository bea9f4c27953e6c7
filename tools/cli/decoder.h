// The backend a decoding command (run, chat) drives: the CPU backend or the
// CUDA engine, picked and set up by --backend, --arm (and the environment's
// doors), --slots, --steps-per-launch, the CPU path's -t and --kv-type and the
// sampling flags (--temp, --top-k, --top-p, --min-p, --seed), with the start-up lines and the
// summary line the commands print.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "capture/doors.h"
#include "capture/engine.h"
#include "cpu/cpu_backend.h"
#include "cpu/forward.h"
#include "kernels/sample_math.h"
#include "loader/model_config.h"
#include "quality/logprobs.h"
#include "reference/oracle.h"

namespace moegraph {

// A graph of more decode steps than this is no faster and takes its memory.
inline constexpr int kMaxStepsPerLaunch = 1024;

struct DecoderFlags {
  bool cuda = false;  // --backend cuda, or auto with a device
  int32_t slots = 0;  // --slots; 0: auto
  int32_t n_cpu_moe = -1;  // --n-cpu-moe; -1: not given
  bool verbose = false;
  std::string backend_note;  // "no CUDA device: running on the CPU backend", or empty
  ResolvedDoors doors;
  int steps_per_launch = 1;
  SamplingParams sampling;  // --seed unset: a random seed, drawn here
  CpuForwardOptions cpu;    // -t, --kv-type, -ub, --swa-full (the last three on both backends)
  LoadOptions load;         // --load-mode, or --mmap / --no-mmap / --mlock
  // --host-cache: the CPU backend's disk tier, experts read from the file into
  // a cache of this many bytes (the file mapped, its experts never faulted in); 0: off.
  uint64_t host_cache_bytes = 0;
  // --drop-cold-experts F and --drop-in-prompts (CpuBackendOptions::drop_cold).
  double drop_cold = 0;
  bool drop_in_prompts = false;
  int32_t n_expert_used = 0;  // --n-expert-used; 0: the file's top-k (ApplyExpertsUsed)
  // Every position's logits kept (perplexity): on CUDA each prompt position a
  // recorded decode step (no batched prefill).
  bool every_position_logits = false;
};

// --load-mode auto|none|mmap|mlock|mmap+mlock (llama.cpp's), or its older
// spellings --mmap, --no-mmap, --mlock; errors name the flags. auto: on the
// CPU backend the file is read into memory where it fits (else mapped and
// faulted in at load); on CUDA mapped (the experts are copied to pinned
// memory at load anyway).
absl::StatusOr<LoadOptions> ReadLoadFlags(bool cuda);

// file->Load(load), a command's last step before its engine starts: every
// check that needs only the header (GgufFile::Open maps it and LoadModel
// binds its tensors; neither reads them) runs before it, so a bad flag or
// input fails in milliseconds whatever the file's size. Errors name
// --load-mode; where bytes are read or faulted in, a line on info says how
// many and how fast.
absl::Status ReadWeights(GgufFile* file, const LoadOptions& load, std::FILE* info);

// One -t value: 0 is the physical cores; above the logical CPUs it is clamped
// to them with a warning on stderr; negative or not a number is an error.
absl::StatusOr<int> ParseThreads(absl::string_view text);

// One -ub value: at least 1, else an error naming the flag.
absl::StatusOr<int32_t> ParseUbatch(absl::string_view text);
// -ub's value (run, chat, serve, perplexity: one).
absl::StatusOr<int32_t> ReadUbatch();

// --slots N | auto (the default, 0), else an error naming the flag.
absl::StatusOr<int32_t> ReadSlots();

// A size: bytes, or a number with a K, M, G or T suffix (binary); "1.5G" too.
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text);
// --host-cache SIZE (empty: 0, off), else an error naming the flag; given,
// it sets load to map the file without a fault-in pass, and is an error on
// CUDA or beside an explicit --load-mode (--mmap, --no-mmap, --mlock).
absl::StatusOr<uint64_t> ReadHostCache(bool cuda, LoadOptions* load);
// The slots bytes of host cache hold (every expert at most); a budget below
// one token's working set (k experts in each MoE layer, which a global pool
// would evict within the token) is an error with the arithmetic naming
// --host-cache.
absl::StatusOr<int32_t> HostCacheSlots(const ExpertStore& store, const ModelConfig& config,
                                       uint64_t bytes);
// "1.50 GiB", or "12.25 MiB" below a GiB.
std::string HumanSize(uint64_t bytes);

// HostCacheSlots's check from the header alone (no weight is read); bytes 0: none.
absl::Status CheckHostCache(const Model& model, uint64_t bytes);

// --host-cache's default where it is not given, on the CPU backend with the
// load mode auto, the cache on and no --slots or --n-cpu-moe: a file whose
// tensors do not fit in the memory available (HostMemoryAvailable) less a
// 1 GiB rail gets a host cache of what the rest leaves (the other tensors,
// the KV cache at ctx, the rail), said on info with the arithmetic, and the
// file is mapped without a fault-in pass. Where that is under one token's
// working set, the file is mapped as before and info says why.
absl::Status AutoHostCache(const Model& model, int ctx, DecoderFlags* flags, std::FILE* info);

// --n-expert-used N: the model runs N experts a token, the router's N best
// (llama.cpp's --override-kv ARCH.expert_used_count=int:N), said on info. N
// is at most the file's top-k: every buffer and slot pool is sized by k, and
// more than k is a mix the model was not trained on. Errors name the flag and
// path; none when the flag is not given.
absl::Status ApplyExpertsUsed(const DecoderFlags& flags, const std::string& path, Model* model,
                              std::FILE* info);

// --kv-type: f16 or f32, else an error naming the flag.
absl::StatusOr<KvCacheType> ReadKvType();

// -t (one value) and --kv-type, each error naming its flag.
absl::StatusOr<CpuForwardOptions> ReadCpuFlags();

// --backend: true for cuda, or auto where a device exists (else note says so);
// an error for another name or for cuda without a device (with --verbose, the
// runtime's reason).
absl::StatusOr<bool> BackendIsCuda(std::string* note);

// The backend's context of ctx positions against the model and the machine:
// a warning on info above the file's context_length (as llama.cpp warns), an
// error with the arithmetic when the CPU backend's KV cache (cpu's type and
// rings) is more than the host has available (the CUDA engine checks its
// device memory itself). Decoder::Create checks the memory again once the
// weights are in.
absl::Status CheckContext(const Model& model, bool cuda, const CpuForwardOptions& cpu, int ctx,
                          std::FILE* info);

// Reads and checks the flags, each error naming its flag; no model is needed.
absl::StatusOr<DecoderFlags> ReadDecoderFlags();

// "sampling: greedy (--temp 0)" or the settings with the seed, for the banner.
std::string DescribeSampling(const SamplingParams& p);

// The lines a decoding command starts with: the doors (when one is not at its
// default, or with --verbose), the backend note, the sampling.
std::string StartupLines(const DecoderFlags& flags);

// Writes a backend's routing record (k ids per layer per step, rank order) as
// a trace in the format of path's extension; errors name --record-routing.
absl::Status WriteRoutingRecord(const std::vector<int32_t>& routing, const ModelConfig& cfg,
                                const std::string& path);

// Why the CUDA engine scores no tokens (Decoder::Score, serve's logprobs).
inline constexpr char kCudaScoresNoTokens[] =
    "logprobs: the CUDA engine keeps no logits of a prompt's positions; serve --backend cpu "
    "scores tokens";

class Decoder {
 public:
  // Makes the backend for model with a KV cache of max_ctx positions, printing
  // its start-up lines (notes, the slot arithmetic) to info.
  static absl::StatusOr<std::unique_ptr<Decoder>> Create(const Model& model,
                                                         const DecoderFlags& flags, int max_ctx,
                                                         std::FILE* info);
  ~Decoder();

  // prompt at positions start.. (the KV cache below start kept from earlier
  // calls; 0 begins anew), then n_predict tokens, each fed back but the last.
  // start must not pass the positions the earlier calls fed.
  absl::StatusOr<std::vector<int32_t>> Generate(absl::Span<const int32_t> prompt, int n_predict,
                                                int start, GenerateStats* stats,
                                                const TokenSink& sink);

  // The logits of every position of tokens from an empty context, T rows of
  // n_vocab (perplexity's chunks). On CUDA the decoder must have been created
  // with every_position_logits.
  absl::StatusOr<std::vector<float>> AllLogits(absl::Span<const int32_t> tokens);

  // The log-probabilities of tokens[from..] computed from position start
  // (quality/logprobs.h's ScoreTokens, -ub positions at a time), on the CPU
  // backend; the CUDA engine keeps no logits of a prompt's positions outside
  // perplexity's engine (every_position_logits): kCudaScoresNoTokens.
  absl::StatusOr<std::vector<TokenLogprobs>> Score(absl::Span<const int32_t> tokens, int start,
                                                   int from, int top_n);

  // The CPU backend's routing so far (CpuBackend::routing()); the CUDA engine
  // records none here.
  absl::StatusOr<std::vector<int32_t>> Routing() const;

  // The first position a Generate from start computes again
  // (Oracle::ResumePosition, CudaEngine::ResumePosition).
  int ResumePosition(int start) const;

  // The sampling of later Generate calls (on CUDA one small upload; the
  // captured graphs stay). Errors: settings out of range.
  absl::Status SetSampling(const SamplingParams& sampling);

  // The expert path's counters and, on CUDA, graph launches and host syncs, as
  // (name, value) for /metrics.
  absl::StatusOr<std::vector<std::pair<std::string, double>>> Counters();

  // "hit X%, N misses, E evictions, M MiB staged" with the disk tier's reads
  // and the dropped routings where they apply: the expert path so far.
  absl::StatusOr<std::string> ExpertSummary();

  // "backend cpu: P prompt tokens (x tok/s) + G generated (y tok/s) = N; hit
  // ...; peak RSS ..." with the counters so far.
  absl::Status PrintSummary(std::FILE* out, const GenerateStats& stats, size_t generated);

 private:
  Decoder() = default;
  // The expert path's counters of whichever backend runs (CUDA: one readback).
  absl::StatusOr<EngineCounters> ExpertCounters();
  std::unique_ptr<ExpertStore> store_;  // the CPU backend's experts; none when resident
  std::unique_ptr<ExpertFileReader> disk_;  // --host-cache: where misses are read from
  uint64_t file_bytes_ = 0;             // CPU: the model file and the KV cache, for the
  uint64_t kv_bytes_ = 0;               // summary's memory figures
  uint64_t state_bytes_ = 0;
  std::unique_ptr<CpuBackend> cpu_;
  std::unique_ptr<CudaEngine> cuda_;
  SamplingParams sampling_;
  int ubatch_ = 0;  // CPU: positions Score feeds at a time
  double drop_cold_ = 0;  // CPU: --drop-cold-experts, for the summary
};

}  // namespace moegraph
