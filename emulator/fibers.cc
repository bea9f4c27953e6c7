#include "emulator/fibers.h"

#include <algorithm>
#include <boost/context/preallocated.hpp>
#include <boost/context/protected_fixedsize_stack.hpp>
#include <memory>
#include <utility>

// AddressSanitizer's fiber interface, weak: present when the program links the
// ASan runtime (the emulated tree always does), null otherwise. The emulator
// itself is compiled without instrumentation, for speed.
extern "C" {
void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom, size_t size)
    __attribute__((weak));
void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old,
                                     size_t* size_old) __attribute__((weak));
}

namespace moegraph_emu {
namespace {

// A kernel's frames are small, but AddressSanitizer's red zones make them larger.
constexpr size_t kStackBytes = 256 * 1024;

// The context a switch comes from, for the context it goes to.
thread_local Fiber* switching_from = nullptr;

void StartSwitch(void** fake_stack_save, const void* bottom, size_t size) {
  if (__sanitizer_start_switch_fiber != nullptr) {
    __sanitizer_start_switch_fiber(fake_stack_save, bottom, size);
  }
}

void FinishSwitch(void* fake_stack_save, const void** bottom_old, size_t* size_old) {
  if (__sanitizer_finish_switch_fiber != nullptr) {
    __sanitizer_finish_switch_fiber(fake_stack_save, bottom_old, size_old);
  }
}

}  // namespace

Fiber::Fiber(size_t stack_bytes, Entry entry) {
  boost::context::protected_fixedsize_stack allocator(stack_bytes);
  boost::context::stack_context stack = allocator.allocate();
  stack_bottom_ = static_cast<const char*>(stack.sp) - stack.size;
  stack_size_ = stack.size;
  self_ = boost::context::fiber(
      std::allocator_arg, boost::context::preallocated(stack.sp, stack.size, stack),
      std::move(allocator), [this, entry](boost::context::fiber&& previous) {
        return Start(std::move(previous), entry);
      });
}

boost::context::fiber Fiber::Start(boost::context::fiber&& previous, Entry entry) {
  Arrived(std::move(previous));
  entry(*this);
  // Quit: back to the context that switched here last, for good.
  Fiber& to = *switching_from;
  StartSwitch(nullptr, to.stack_bottom_, to.stack_size_);
  switching_from = this;
  return std::move(to.self_);
}

void Fiber::SwitchTo(Fiber& to) {
  switching_from = this;
  StartSwitch(&fake_stack_, to.stack_bottom_, to.stack_size_);
  Arrived(std::move(to.self_).resume());
}

void Fiber::Arrived(boost::context::fiber&& previous) {
  const void* from_bottom = nullptr;
  size_t from_size = 0;
  FinishSwitch(fake_stack_, &from_bottom, &from_size);
  Fiber& from = *switching_from;
  from.self_ = std::move(previous);
  if (from.stack_bottom_ == nullptr) {
    from.stack_bottom_ = from_bottom;
    from.stack_size_ = from_size;
  }
}

FiberPool::~FiberPool() {
  // Each idle fiber's entry returns once it sees quit.
  for (Fiber* fiber : all_) {
    fiber->quit = true;
    scheduler_.SwitchTo(*fiber);
    delete fiber;
  }
}

Fiber* FiberPool::Acquire(Fiber::Entry entry) {
  if (idle_.empty()) {
    all_.push_back(new Fiber(kStackBytes, entry));
    return all_.back();
  }
  Fiber* fiber = idle_.back();
  idle_.pop_back();
  return fiber;
}

void FiberPool::Release(Fiber* fiber) { idle_.push_back(fiber); }

void FiberPool::Abandon(Fiber* fiber) {
  all_.erase(std::find(all_.begin(), all_.end(), fiber));
  std::erase(idle_, fiber);
  // Reachable for LeakSanitizer, and never destroyed.
  static auto* abandoned = new std::vector<Fiber*>;
  abandoned->push_back(fiber);
}

FiberPool& FiberPool::ThisThread() {
  thread_local FiberPool pool;
  return pool;
}

}  // namespace moegraph_emu
