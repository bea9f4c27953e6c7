// A persistent pool for the CPU path. A job's tasks are claimed one at a time
// from a shared cursor by whichever threads are running, the caller included,
// and the job ends when its tasks are done, not when every worker has checked
// in: a worker the OS has descheduled (another process wants the core) delays
// at most the one task it holds, and a worker that never woke up during a job
// takes no part in it. Waits spin, pausing, for up to 3 ms (longer than the
// gaps between a decode step's hundreds of short jobs: no thread sleeps inside
// a step, so none pays a wake-up and no lower-priority process takes its core
// mid-step), then sleep on a futex; they never sched_yield (a yield gives the
// core to any runnable process, a niced one included).
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"

namespace moegraph {

// The machine's physical cores (hyper-threads counted once), at least 1.
int PhysicalCores();

// The logical CPUs this process may run on (its affinity mask), at least 1.
int LogicalCpus();

class ThreadPool {
 public:
  // n_threads >= 1, the calling thread included.
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(task) once for every task in [0, n_tasks), on the pool's threads
  // and the caller's, and returns when all have returned. Tasks are claimed in
  // order, so which thread runs a task varies; callers make each task's result
  // independent of that. One Run at a time (the CPU path has one caller).
  void Run(int64_t n_tasks, absl::FunctionRef<void(int64_t)> fn);
  // Run where the tasks hold at least kPoolElements elements of work in all,
  // else every task on the calling thread (decode's rows: the dispatch would
  // cost more than it saves).
  static constexpr int64_t kPoolElements = 1 << 16;
  void RunSized(int64_t n_tasks, int64_t elements, absl::FunctionRef<void(int64_t)> fn);

 private:
  // The cursor packs the job's id, its unit count and the next unit to claim,
  // so a claim is one compare-and-swap that fails for any other job's cursor.
  static constexpr int kUnitBits = 16;
  static constexpr uint64_t kMaxUnits = (uint64_t{1} << kUnitBits) - 1;

  void Work();
  // Claims and runs units of the job `job` until none is left.
  void TakeUnits(uint32_t job);

  std::vector<std::thread> workers_;
  std::atomic<uint64_t> cursor_{0};    // job << 32 | units << 16 | next unit
  std::atomic<uint32_t> published_{0}; // the latest job's id; sleeping workers wait on it
  std::atomic<uint32_t> done_{0};      // units of the current job finished
  std::atomic<int> sleeping_workers_{0};
  std::atomic<bool> caller_sleeping_{false};
  // The current job, valid to a thread that has claimed one of its units (the
  // caller waits in Run until every claimed unit is done, so it cannot change).
  std::atomic<const absl::FunctionRef<void(int64_t)>*> fn_{nullptr};
  std::atomic<int64_t> n_tasks_{0};
  std::atomic<int64_t> tasks_per_unit_{1};
  uint32_t job_ = 0;  // the caller's count of jobs published
  std::atomic<bool> stop_{false};
};

}  // namespace moegraph
