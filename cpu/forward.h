// The fast CPU forward pass: the oracle's graph (reference/oracle.cc) computed
// the way ggml's CPU backend computes it, with a persistent thread pool, each
// matmul input quantized once to the weights' dot type and SIMD dot products
// (cpu/simd_kernels.h), f32 activations, and an f16 (or f32) KV cache. A batch
// of tokens (the prompt) goes through as one batch: each matmul reads a weight
// row once for all of the batch's rows, and the routed experts run once on the
// rows routed to them.
//
// Every output element is computed with the same operations in the same order,
// whatever the thread count or where an expert's weights live, so 1 thread
// equals N bit for bit; and whatever the batch size, so a batch equals its
// tokens fed one by one, where the batch kernels are off (batch_matmul) or
// the CPU has neither AMX nor AVX-512 VNNI.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "loader/model_config.h"
#include "reference/ops.h"
#include "reference/oracle.h"

namespace moegraph {

// Checkpoints of a Gated DeltaNet model's recurrent state the fast path keeps
// (each RecurrentStateBytes): the newest, taken at the start of each call of
// two tokens or more and before its last token, so a rewind to one of those
// positions or past it feeds again only from there (a chat's edited turn, a
// re-sent prompt), not from the start.
inline constexpr int kStateCheckpoints = 3;

struct CpuForwardOptions {
  int threads = 0;                          // 0: the physical cores
  KvCacheType kv_type = KvCacheType::kF16;  // llama.cpp's default
  // A batch runs in ubatches of at most this many tokens (-ub); a windowed
  // layer's K/V caches are rings of n_swa + ubatch rows where that is fewer
  // than the context (KvLayerRows), unless swa_full keeps every position. A
  // Truncate back past what the rings hold feeds the kept ids again from 0 at
  // the next Forward (the same bits as never having lost them).
  int ubatch = 512;
  bool swa_full = false;
  // Products of q8_0 and q4_K weights with 8 activation rows or more (a
  // prompt's, an expert's group in it) on the batch kernels where the CPU has
  // AMX tiles or AVX-512 VNNI (cpu/amx_matmul.h, cpu/vnni_matmul.h): their
  // own rounding order, so a prompt's logits then differ from its tokens fed
  // one by one in the last bits. MOEGRAPH_BATCH_MATMUL=0 turns it off.
  bool batch_matmul = true;
  // Those of 16 rows or more on AMX tiles where the CPU has them, the rest on
  // AVX-512 VNNI: the same bits. MOEGRAPH_AMX=0 keeps them all on VNNI.
  bool amx = true;
  // A row's experts computed as the disk tier's reads bring them (the ones
  // the provider has first, ExpertProvider::ProvideStart): the same bits as
  // waiting for every read. MOEGRAPH_READ_OVERLAP=0 waits.
  bool overlap_reads = true;
  // KvLayerRows's ring slack: the ubatch, or none (-1) with swa_full.
  int ring_slack() const { return swa_full ? -1 : ubatch; }
};

// Like Oracle::Create, with the fast path's arithmetic. Errors name the tensor
// whose type the path cannot compute, or the bad option (-t, -ub).
absl::StatusOr<std::unique_ptr<Oracle>> CreateCpuForward(const Model& model, int max_ctx,
                                                         ExpertProvider* experts,
                                                         const CpuForwardOptions& options);

}  // namespace moegraph
