// The fibers a block's CUDA threads run on: Boost.Context (Debian's
// libboost-context-dev), whose switch is a few instructions in user space.
// glibc's swapcontext would also do, but it saves and restores the signal mask
// with a system call on every switch, and a block of 1024 threads switches at
// every barrier and every warp shuffle of every thread.
//
// Switches are symmetric: a fiber that waits picks the next thread and switches
// straight to its fiber, so a wait costs one switch, and a thread that finishes
// hands its fiber to the next new thread without switching at all.
//
// Each switch is announced to AddressSanitizer (__sanitizer_start_switch_fiber /
// __sanitizer_finish_switch_fiber), which otherwise takes a fiber's stack for a
// stack overflow of the thread it runs on.
#pragma once

#include <boost/context/fiber.hpp>
#include <cstddef>
#include <vector>

namespace moegraph_emu {

// An execution context: an OS thread's own stack (the scheduler's) or a fiber.
class Fiber {
 public:
  using Entry = void (*)(Fiber& self);

  // The calling OS thread's own context.
  Fiber() = default;
  // A fiber that runs entry(*this) when first switched to; entry returns only
  // once quit is set (FiberPool's destructor), and must not return before.
  Fiber(size_t stack_bytes, Entry entry);
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;

  // From this context, which is running, to `to`; returns when some context
  // switches back to this one.
  void SwitchTo(Fiber& to);

  void* job = nullptr;  // what the entry runs next (set before switching to it)
  bool quit = false;

 private:
  boost::context::fiber Start(boost::context::fiber&& previous, Entry entry);
  // In this context, just switched to: takes the previous context's continuation.
  void Arrived(boost::context::fiber&& previous);

  boost::context::fiber self_;  // this context while it is suspended
  // AddressSanitizer's view of this context's stack (an OS thread's: learnt on
  // its first switch).
  void* fake_stack_ = nullptr;
  const void* stack_bottom_ = nullptr;
  size_t stack_size_ = 0;
};

// The fibers of one OS thread, reused from block to block, and its own context.
class FiberPool {
 public:
  ~FiberPool();
  // An idle fiber (suspended in its entry, ready for a job), new if none is.
  Fiber* Acquire(Fiber::Entry entry);
  void Release(Fiber* fiber);
  // A fiber whose job will never be resumed again (its block faulted): never
  // reused, never destroyed (destroying a suspended fiber unwinds its job).
  void Abandon(Fiber* fiber);
  Fiber& scheduler() { return scheduler_; }

  // The calling OS thread's pool.
  static FiberPool& ThisThread();

 private:
  Fiber scheduler_;
  std::vector<Fiber*> idle_;
  std::vector<Fiber*> all_;
};

}  // namespace moegraph_emu
