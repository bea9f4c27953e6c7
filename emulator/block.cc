// One block of a kernel: its CUDA threads as fibers on the calling OS thread.
//
// The scheduler resumes a thread picked at random among the runnable ones; the
// thread runs until it finishes, waits at __syncthreads, or waits at a warp
// primitive. A barrier releases when every thread of the block waits at it; a
// warp primitive when every lane of its mask waits at it, and then each lane
// gets its result. What CUDA leaves undefined is a fault here: threads that wait
// at different barriers, a barrier some threads exited before, a warp primitive
// whose mask names a lane that exited or does not exist, a shuffle that reads a
// lane outside its mask, and any wait that can never be released.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "emulator/fibers.h"
#include "emulator/state.h"

constinit thread_local uint3 threadIdx{};
constinit thread_local uint3 blockIdx{};
constinit thread_local dim3 blockDim;
constinit thread_local dim3 gridDim;

// The section every __shared__ variable lives in (emulator/include/cuda_runtime_api.h);
// weak, so a program without kernels links.
extern "C" char __start_moegraph_emu_shared[] __attribute__((weak));
extern "C" char __stop_moegraph_emu_shared[] __attribute__((weak));

namespace moegraph_emu {
namespace {

constexpr int kWarpSize = 32;

enum class Wait { kRunnable, kBarrier, kWarp, kDone };
enum class WarpOp { kSync, kShuffleXor };

struct ThreadState {
  uint3 index{};
  int id = 0;
  Wait wait = Wait::kRunnable;
  Fiber* fiber = nullptr;
  Site site{};
  // At a warp primitive.
  WarpOp op = WarpOp::kSync;
  unsigned mask = 0;
  int lane_mask = 0;
  int width = kWarpSize;
  uint64_t value = 0;
  uint64_t result = 0;
};

bool SameSite(Site a, Site b) {
  return a.line == b.line && (a.file == b.file || std::strcmp(a.file, b.file) == 0);
}

std::string Where(Site site) { return std::string(site.file) + ":" + std::to_string(site.line); }

const char* OpName(WarpOp op) { return op == WarpOp::kSync ? "__syncwarp" : "__shfl_xor_sync"; }

// A warp's lanes as bits: those waiting at a warp primitive, and those exited.
struct WarpState {
  unsigned waiting = 0;
  unsigned exited = 0;
};

class BlockRun;
thread_local BlockRun* running_block = nullptr;
thread_local ThreadState* running_thread = nullptr;

// The per-thread and per-warp state of a block, kept between blocks so a launch
// of many blocks does not allocate for each.
struct BlockScratch {
  std::vector<ThreadState> threads;
  std::vector<WarpState> warps;
  std::vector<int> runnable;
};

class BlockRun {
 public:
  BlockRun(const KernelLaunch& launch, Rng& rng, FiberPool& pool, BlockScratch& scratch)
      : launch_(launch),
        rng_(rng),
        pool_(pool),
        threads_(scratch.threads),
        warps_(scratch.warps),
        runnable_(scratch.runnable) {}

  // On the OS thread's own stack: starts the first thread, and is switched back
  // to when every thread has finished, on a fault, or when none can run.
  std::string Run() {
    const dim3 dim = launch_.block();
    const int n = static_cast<int>(dim.x * dim.y * dim.z);
    threads_.assign(static_cast<size_t>(n), ThreadState{});
    warps_.assign(static_cast<size_t>((n + kWarpSize - 1) / kWarpSize), WarpState{});
    runnable_.clear();
    for (int t = 0; t < n; ++t) {
      ThreadState& thread = threads_[static_cast<size_t>(t)];
      thread.id = t;
      thread.index = {static_cast<unsigned>(t) % dim.x, static_cast<unsigned>(t) / dim.x % dim.y,
                      static_cast<unsigned>(t) / (dim.x * dim.y)};
      runnable_.push_back(t);
    }
    BlockRun* const outer_block = running_block;
    running_block = this;
    pool_.scheduler().SwitchTo(EnterNext());
    running_block = outer_block;
    if (fault_.empty() && done_ < n) fault_ = DescribeDeadlock();
    if (!fault_.empty()) {
      // The suspended threads never finish: their fibers are not reused.
      for (ThreadState& thread : threads_) {
        if (thread.fiber != nullptr) pool_.Abandon(thread.fiber);
      }
    }
    return fault_;
  }

  // ---- from the running thread ----

  void WaitAtBarrier(Site site) {
    ThreadState& thread = *running_thread;
    thread.wait = Wait::kBarrier;
    thread.site = site;
    ++at_barrier_;
    if (at_barrier_ + done_ == static_cast<int>(threads_.size())) ReleaseBarrier();
    Yield(thread);
  }

  uint64_t WaitAtWarp(Site site, WarpOp op, unsigned mask, uint64_t value, int lane_mask,
                      int width) {
    ThreadState& thread = *running_thread;
    thread.wait = Wait::kWarp;
    thread.site = site;
    thread.op = op;
    thread.mask = mask;
    thread.value = value;
    thread.lane_mask = lane_mask;
    thread.width = width;
    ArriveAtWarp(thread);
    Yield(thread);
    return thread.result;
  }

 private:
  // A fiber's life: run the thread it was given, then hand the fiber on.
  static void FiberEntry(Fiber& fiber) {
    while (!fiber.quit) {
      ThreadState& thread = *static_cast<ThreadState*>(fiber.job);
      BlockRun& block = *running_block;
      block.launch_.RunThread();
      thread.wait = Wait::kDone;
      block.Finish(thread);
    }
  }

  // The thread to run next, picked at random among the runnable ones, made
  // current: its fiber (a free one for a thread that has not started), or the
  // scheduler's context when none can run or a fault stopped the block.
  Fiber& EnterNext() {
    if (runnable_.empty() || !fault_.empty()) {
      running_thread = nullptr;
      return pool_.scheduler();
    }
    const size_t pick = rng_.Below(runnable_.size());
    ThreadState& thread = threads_[static_cast<size_t>(runnable_[pick])];
    runnable_[pick] = runnable_.back();
    runnable_.pop_back();
    if (thread.fiber == nullptr) {
      thread.fiber = pool_.Acquire(&BlockRun::FiberEntry);
      thread.fiber->job = &thread;
    }
    thread.wait = Wait::kRunnable;
    threadIdx = thread.index;
    running_thread = &thread;
    return *thread.fiber;
  }

  // The running thread waits: switch to the next one (itself, when its own
  // arrival released it).
  void Yield(ThreadState& thread) {
    Fiber& here = *thread.fiber;
    Fiber& next = EnterNext();
    if (&next != &here) here.SwitchTo(next);
  }

  // The running thread finished: its fiber goes back to the pool and on to the
  // next thread. When that is a new thread, it may get this very fiber: then the
  // entry's loop runs it without a switch. Touches nothing of the block after
  // the switch: the fiber resumes here for a thread of some later block.
  void Finish(ThreadState& thread) {
    Fiber& here = *thread.fiber;
    pool_.Release(&here);
    thread.fiber = nullptr;
    ++done_;
    Exit(thread);
    if (fault_.empty() && at_barrier_ > 0 &&
        at_barrier_ + done_ == static_cast<int>(threads_.size())) {
      ReleaseBarrier();
    }
    Fiber& next = EnterNext();
    if (&next != &here) here.SwitchTo(next);
  }

  static std::string Thread(const ThreadState& thread) {
    return "thread (" + std::to_string(thread.index.x) + "," + std::to_string(thread.index.y) +
           "," + std::to_string(thread.index.z) + ")";
  }

  // Every thread that has not exited waits at a barrier.
  void ReleaseBarrier() {
    const ThreadState* first = nullptr;
    for (const ThreadState& thread : threads_) {
      if (thread.wait != Wait::kBarrier) continue;
      if (first == nullptr) {
        first = &thread;
      } else if (!SameSite(first->site, thread.site)) {
        fault_ = "divergent __syncthreads: " + Thread(*first) + " waits at " + Where(first->site) +
                 ", " + Thread(thread) + " at " + Where(thread.site);
        return;
      }
    }
    if (done_ > 0) {
      fault_ = "__syncthreads at " + Where(first->site) + " after " + std::to_string(done_) +
               " thread(s) of the block exited";
      return;
    }
    for (ThreadState& thread : threads_) {
      thread.wait = Wait::kRunnable;
      runnable_.push_back(thread.id);
    }
    at_barrier_ = 0;
  }

  static unsigned Bit(int lane) { return 1u << lane; }

  // The lanes of the thread's warp that exist in the block.
  unsigned LanesOf(int base) const {
    const int present = static_cast<int>(threads_.size()) - base;
    return present >= kWarpSize ? ~0u : Bit(present) - 1;
  }

  void ArriveAtWarp(ThreadState& thread) {
    const int lane = thread.id % kWarpSize;
    const int base = thread.id - lane;
    WarpState& warp = warps_[static_cast<size_t>(thread.id / kWarpSize)];
    auto where = [&thread] { return std::string(OpName(thread.op)) + " at " + Where(thread.site); };
    if ((thread.mask & Bit(lane)) == 0) {
      fault_ = Thread(thread) + " calls " + where() + " with a mask that leaves out its own lane";
      return;
    }
    if (const unsigned absent = thread.mask & ~LanesOf(base); absent != 0) {
      fault_ = where() + ": the mask names lane " + std::to_string(__builtin_ctz(absent)) +
               ", but the block has " + std::to_string(threads_.size()) + " threads";
      return;
    }
    if (const unsigned exited = thread.mask & warp.exited; exited != 0) {
      fault_ =
          where() + ": lane " + std::to_string(__builtin_ctz(exited)) + " of the mask has exited";
      return;
    }
    warp.waiting |= Bit(lane);
    if ((warp.waiting & thread.mask) == thread.mask) CompleteWarpOp(thread, warp);
  }

  void CompleteWarpOp(const ThreadState& last, WarpState& warp) {
    const int base = last.id - last.id % kWarpSize;
    for (unsigned lanes = last.mask; lanes != 0; lanes &= lanes - 1) {
      const ThreadState& other = threads_[static_cast<size_t>(base + __builtin_ctz(lanes))];
      if (other.op != last.op || other.mask != last.mask || !SameSite(other.site, last.site)) {
        fault_ = "divergent warp: " + Thread(last) + " waits at " + OpName(last.op) + " " +
                 Where(last.site) + ", " + Thread(other) + " at " + OpName(other.op) + " " +
                 Where(other.site);
        return;
      }
    }
    if (last.op == WarpOp::kShuffleXor) {
      for (unsigned lanes = last.mask; lanes != 0; lanes &= lanes - 1) {
        const int l = __builtin_ctz(lanes);
        ThreadState& thread = threads_[static_cast<size_t>(base + l)];
        const int source = l ^ thread.lane_mask;
        if (source >= kWarpSize || source / thread.width > l / thread.width) {
          thread.result = thread.value;
        } else if ((last.mask & Bit(source)) == 0) {
          fault_ = "__shfl_xor_sync at " + Where(thread.site) + ": lane " + std::to_string(l) +
                   " reads lane " + std::to_string(source) + ", which is not in the mask";
          return;
        } else {
          thread.result = threads_[static_cast<size_t>(base + source)].value;
        }
      }
    }
    warp.waiting &= ~last.mask;
    for (unsigned lanes = last.mask; lanes != 0; lanes &= lanes - 1) {
      const int id = base + __builtin_ctz(lanes);
      threads_[static_cast<size_t>(id)].wait = Wait::kRunnable;
      runnable_.push_back(id);
    }
  }

  // A lane that exits while others of its warp wait for it at a warp primitive.
  void Exit(const ThreadState& exited) {
    const int lane = exited.id % kWarpSize;
    const int base = exited.id - lane;
    WarpState& warp = warps_[static_cast<size_t>(exited.id / kWarpSize)];
    warp.exited |= Bit(lane);
    for (unsigned lanes = warp.waiting; lanes != 0; lanes &= lanes - 1) {
      const ThreadState& other = threads_[static_cast<size_t>(base + __builtin_ctz(lanes))];
      if ((other.mask & Bit(lane)) != 0) {
        fault_ = Thread(exited) + " exited while " + Thread(other) + " waits for it at " +
                 OpName(other.op) + " " + Where(other.site);
        return;
      }
    }
  }

  std::string DescribeDeadlock() const {
    std::string out = "deadlock: no thread can run;";
    int listed = 0;
    for (const ThreadState& thread : threads_) {
      if (thread.wait == Wait::kDone) continue;
      if (listed++ == 4) {
        out += " ...";
        break;
      }
      out += " " + Thread(thread) + " waits at " +
             (thread.wait == Wait::kBarrier ? std::string("__syncthreads") : OpName(thread.op)) +
             " " + Where(thread.site) + ";";
    }
    return out;
  }

  const KernelLaunch& launch_;
  Rng& rng_;
  FiberPool& pool_;
  std::vector<ThreadState>& threads_;
  std::vector<WarpState>& warps_;
  std::vector<int>& runnable_;
  int done_ = 0;
  int at_barrier_ = 0;
  std::string fault_;
};

BlockRun& RunningBlock(const char* what) {
  if (running_block == nullptr || running_thread == nullptr) {
    std::fprintf(stderr, "moegraph-emu: %s called outside a kernel\n", what);
    std::abort();
  }
  return *running_block;
}

}  // namespace

void Poison(void* begin, size_t bytes) {
  auto* out = static_cast<uint8_t*>(begin);
  const uint64_t words = uint64_t{kPoisonWord} << 32 | kPoisonWord;
  size_t i = 0;
  for (; i + 8 <= bytes; i += 8) std::memcpy(out + i, &words, 8);
  for (; i < bytes; ++i) out[i] = static_cast<uint8_t>(kPoisonWord >> (8 * (i % 4)));
}

std::string RunBlock(const KernelLaunch& launch, uint3 block, Rng& rng) {
  if (__start_moegraph_emu_shared != nullptr) {
    Poison(__start_moegraph_emu_shared,
           static_cast<size_t>(__stop_moegraph_emu_shared - __start_moegraph_emu_shared));
  }
  blockIdx = block;
  blockDim = launch.block();
  gridDim = launch.grid();
  thread_local BlockScratch scratch;
  BlockRun run(launch, rng, FiberPool::ThisThread(), scratch);
  return run.Run();
}

void SyncThreads(Site site) { RunningBlock("__syncthreads").WaitAtBarrier(site); }

void SyncWarp(Site site, unsigned mask) {
  RunningBlock("__syncwarp").WaitAtWarp(site, WarpOp::kSync, mask, 0, 0, kWarpSize);
}

uint64_t ShuffleXor(Site site, unsigned mask, uint64_t bits, int lane_mask, int width) {
  return RunningBlock("__shfl_xor_sync")
      .WaitAtWarp(site, WarpOp::kShuffleXor, mask, bits, lane_mask, width);
}

std::string KernelNameFromSignature(const char* signature) {
  // GCC: "const char* moegraph_emu::KernelName() [with auto Kernel = {anonymous}::matvec_kernel]"
  std::string text(signature);
  const std::string key = "Kernel = ";
  const size_t at = text.find(key);
  if (at == std::string::npos) return text;
  std::string name = text.substr(at + key.size());
  name = name.substr(0, name.find_first_of(";]"));
  if (!name.empty() && name[0] == '&') name.erase(0, 1);
  // Every qualifier goes, in the template's argument too:
  // "{anonymous}::grouped_matvec_kernel<moegraph::GgmlType::kQ4_K>" is
  // "grouped_matvec_kernel<kQ4_K>".
  std::string out;
  for (const char c : name) {
    out.push_back(c);
    if (out.size() >= 2 && out.compare(out.size() - 2, 2, "::") == 0) {
      const size_t start = out.find_last_of("<, ", out.size() - 3);
      out.erase(start == std::string::npos ? 0 : start + 1);
    }
  }
  return out;
}

}  // namespace moegraph_emu
