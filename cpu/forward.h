// The fast CPU forward pass: the oracle's graph (reference/oracle.cc) computed
// the way ggml's CPU backend computes it, with a persistent thread pool, each
// matmul input quantized once to the weights' dot type and SIMD dot products
// (cpu/simd_kernels.h), f32 activations, and an f16 (or f32) KV cache. A batch
// of tokens (the prompt) goes through as one batch: each matmul reads a weight
// row once for all of the batch's rows, and the routed experts run once on the
// rows routed to them.
//
// Every output element is computed with the same operations in the same order,
// whatever the batch size, the thread count or where an expert's weights live,
// so a batch equals its tokens fed one by one, and 1 thread equals N, bit for bit.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "loader/model_config.h"
#include "reference/ops.h"
#include "reference/oracle.h"

namespace moegraph {

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
  // Products of q8_0 and q4_K weights with 16 activation rows or more (prompts) on AMX
  // int8 tiles where the CPU has them (cpu/amx_matmul.h): their own rounding
  // order, so a prompt's logits then differ from its tokens fed one by one
  // in the last bits. MOEGRAPH_AMX=0 turns it off.
  bool amx = true;
  // KvLayerRows's ring slack: the ubatch, or none (-1) with swa_full.
  int ring_slack() const { return swa_full ? -1 : ubatch; }
};

// Like Oracle::Create, with the fast path's arithmetic. Errors name the tensor
// whose type the path cannot compute, or the bad option (-t, -ub).
absl::StatusOr<std::unique_ptr<Oracle>> CreateCpuForward(const Model& model, int max_ctx,
                                                         ExpertProvider* experts,
                                                         const CpuForwardOptions& options);

}  // namespace moegraph
