#include "cpu/thread_pool.h"

#include <sched.h>

#include <chrono>
#include <fstream>
#include <set>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace moegraph {
namespace {

// How long a waiting thread spins (pausing, never yielding) before it sleeps
// on a futex: longer than any gap between two jobs of a decode step (the
// caller's serial work: norms, routing, sampling), so within a step no thread
// sleeps and none pays a wake-up, as llama.cpp's spinning pool; short enough
// that an idle pool soon leaves its cores to others. No sched_yield: a yield
// hands the core to any runnable process, a `nice 19` one included, for a
// whole time slice; a futex sleep lets the kernel run what was waited for.
constexpr std::chrono::microseconds kWorkerSpin{3000};
constexpr std::chrono::microseconds kCallerSpin{3000};

void Pause() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Spins until pred() holds or budget passes, each check after a pause;
// returns pred()'s last value.
template <typename Pred>
bool SpinUntil(Pred pred, std::chrono::microseconds budget) {
  if (pred()) return true;
  const auto until = std::chrono::steady_clock::now() + budget;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      Pause();
      if (pred()) return true;
    }
    if (std::chrono::steady_clock::now() >= until) return false;
  }
}

}  // namespace

int PhysicalCores() {
  // Each core's hyper-thread siblings share one thread_siblings_list.
  std::set<std::string> cores;
  const unsigned n = std::thread::hardware_concurrency();
  for (unsigned cpu = 0; cpu < n; ++cpu) {
    std::ifstream f("/sys/devices/system/cpu/cpu" + std::to_string(cpu) +
                    "/topology/thread_siblings_list");
    std::string siblings;
    if (f && std::getline(f, siblings)) cores.insert(siblings);
  }
  const int logical = LogicalCpus();
  const int physical = cores.empty() ? logical : static_cast<int>(cores.size());
  return physical < logical ? physical : logical;
}

int LogicalCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

ThreadPool::ThreadPool(int n_threads) {
  for (int i = 1; i < n_threads; ++i) workers_.emplace_back([this] { Work(); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  published_.store(++job_);
  published_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::TakeUnits(uint32_t job) {
  for (;;) {
    uint64_t c = cursor_.load(std::memory_order_acquire);
    uint64_t units = 0, unit = 0;
    do {
      if (static_cast<uint32_t>(c >> 32) != job) return;
      units = (c >> kUnitBits) & kMaxUnits;
      unit = c & kMaxUnits;
      if (unit >= units) return;
    } while (!cursor_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel,
                                            std::memory_order_acquire));
    // This unit is claimed and not done, so the job's fields stay as they are.
    const absl::FunctionRef<void(int64_t)>& fn = *fn_.load(std::memory_order_relaxed);
    const int64_t per = tasks_per_unit_.load(std::memory_order_relaxed);
    const int64_t n = n_tasks_.load(std::memory_order_relaxed);
    const int64_t begin = static_cast<int64_t>(unit) * per;
    const int64_t end = begin + per < n ? begin + per : n;
    for (int64_t task = begin; task < end; ++task) fn(task);
    // The last unit wakes the caller if it went to sleep (seq_cst on both
    // sides: either it sees this count or this sees its flag).
    if (done_.fetch_add(1) + 1 == units && caller_sleeping_.load()) done_.notify_one();
  }
}

void ThreadPool::RunSized(int64_t n_tasks, int64_t elements,
                          absl::FunctionRef<void(int64_t)> fn) {
  if (elements < kPoolElements) {
    for (int64_t task = 0; task < n_tasks; ++task) fn(task);
    return;
  }
  Run(n_tasks, fn);
}

void ThreadPool::Run(int64_t n_tasks, absl::FunctionRef<void(int64_t)> fn) {
  if (n_tasks <= 0) return;
  if (workers_.empty() || n_tasks == 1) {
    for (int64_t task = 0; task < n_tasks; ++task) fn(task);
    return;
  }
  const int64_t per = (n_tasks + static_cast<int64_t>(kMaxUnits) - 1) / kMaxUnits;
  const uint64_t units = static_cast<uint64_t>((n_tasks + per - 1) / per);
  fn_.store(&fn, std::memory_order_relaxed);
  n_tasks_.store(n_tasks, std::memory_order_relaxed);
  tasks_per_unit_.store(per, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  const uint32_t job = ++job_;
  cursor_.store(static_cast<uint64_t>(job) << 32 | units << kUnitBits, std::memory_order_release);
  published_.store(job);
  if (sleeping_workers_.load() > 0) published_.notify_all();
  TakeUnits(job);
  // Wait for units other threads hold: spin, then sleep.
  const auto all_done = [&] { return done_.load(std::memory_order_acquire) == units; };
  if (!SpinUntil(all_done, kCallerSpin)) {
    caller_sleeping_.store(true);
    for (uint32_t d = done_.load(); d != units; d = done_.load()) done_.wait(d);
    caller_sleeping_.store(false);
  }
}

void ThreadPool::Work() {
  uint32_t seen = 0;
  for (;;) {
    uint32_t job = seen;
    const auto published = [&] {
      job = published_.load(std::memory_order_acquire);
      return job != seen;
    };
    if (!SpinUntil(published, kWorkerSpin)) {
      // Sleep until the next job (seq_cst: either Run sees this count or
      // this sees its job).
      sleeping_workers_.fetch_add(1);
      if (published_.load() == seen) published_.wait(seen);
      sleeping_workers_.fetch_sub(1);
      continue;
    }
    seen = job;
    if (stop_.load()) return;
    TakeUnits(job);
  }
}

}  // namespace moegraph
