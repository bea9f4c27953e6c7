#include "cpu/thread_pool.h"

#include <fstream>
#include <set>
#include <string>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace moegraph {
namespace {

// Spins before a worker sleeps: about 100 microseconds of pause instructions.
constexpr int kSpinsBeforeSleep = 20000;

void Pause() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
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
  if (!cores.empty()) return static_cast<int>(cores.size());
  return n > 0 ? static_cast<int>(n) : 1;
}

ThreadPool::ThreadPool(int n_threads) {
  for (int i = 1; i < n_threads; ++i) workers_.emplace_back([this, i] { Work(i); });
}

ThreadPool::~ThreadPool() {
  stop_ = true;
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::TakeTasks() {
  for (int64_t task = next_task_.fetch_add(1, std::memory_order_relaxed); task < n_tasks_;
       task = next_task_.fetch_add(1, std::memory_order_relaxed)) {
    (*fn_)(task);
  }
}

void ThreadPool::Run(int64_t n_tasks, absl::FunctionRef<void(int64_t)> fn) {
  if (n_tasks <= 0) return;
  if (workers_.empty() || n_tasks == 1) {
    for (int64_t task = 0; task < n_tasks; ++task) fn(task);
    return;
  }
  fn_ = &fn;
  n_tasks_ = n_tasks;
  next_task_.store(0, std::memory_order_relaxed);
  busy_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  TakeTasks();
  while (busy_.load(std::memory_order_acquire) != 0) Pause();
  fn_ = nullptr;
}

void ThreadPool::Work(int /*index*/) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t now = generation_.load(std::memory_order_acquire);
    for (int spin = 0; now == seen && spin < kSpinsBeforeSleep; ++spin) {
      Pause();
      now = generation_.load(std::memory_order_acquire);
    }
    if (now == seen) {
      generation_.wait(seen, std::memory_order_acquire);
      continue;
    }
    seen = now;
    if (stop_) return;
    TakeTasks();
    busy_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace moegraph
