// The handshake of the cached arms' one expert pass (ExpertPass::kReady): the
// stage copy, launched just before the pass, sets a missed rank's flag to
// kRankCopied once the rank's whole expert is in its slot (a release), and the
// pass's threads of that rank wait for it (an acquire) before they read the
// slot. Hit ranks do not wait, so they run while the misses copy.
#pragma once

#include <cstdint>

#include "kernels/moe_math.h"

namespace moegraph {

// By one thread, after every block of the rank has copied and fenced.
__device__ __forceinline__ void mark_rank_copied(uint8_t* missed) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.release.gpu.global.u8 [%0], %1;" ::"l"(missed),
               "r"(static_cast<unsigned int>(kRankCopied))
               : "memory");
#else
  *missed = kRankCopied;
#endif
}

// By every thread of a block of a missed rank, each acquiring the copy's
// writes for its own loads (a warp's polls are one load of one word; thread 0
// alone, then a barrier, cost instances a convergence barrier spilled to the
// stack). A copy takes well under a millisecond; a flag still unset after
// seconds is a bug, and a trap (a launch error the host sees) tells it where
// a hang would not.
__device__ __forceinline__ void wait_for_rank_copy(const uint8_t* missed) {
#if defined(__CUDA_ARCH__)
  constexpr uint32_t kMaxPolls = 1u << 25;  // at least 200 ns each: over 6 s
  for (uint32_t poll = 0;; ++poll) {
    unsigned int flag;
    asm volatile("ld.acquire.gpu.global.u8 %0, [%1];" : "=r"(flag) : "l"(missed) : "memory");
    if (flag != kRankStaging) break;
    if (poll == kMaxPolls) __trap();
    __nanosleep(200);
  }
#else
  // The emulator runs a stream's kernels one after another, so the copy
  // launched before the pass is done: a rank still staging is a pass launched
  // without its copy.
  if (*missed == kRankStaging) __trap();
#endif
}

}  // namespace moegraph
