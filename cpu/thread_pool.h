// A persistent pool for the CPU path: the threads start once and wait between
// jobs, spinning a little first (a decode step runs hundreds of short jobs; a
// futex wake for each would cost more than the job), then sleeping.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"

namespace moegraph {

// The machine's physical cores (hyper-threads counted once), at least 1.
int PhysicalCores();

class ThreadPool {
 public:
  // n_threads >= 1, the calling thread included.
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(task) once for every task in [0, n_tasks), on the pool's threads
  // and the caller's, and returns when all have returned. Tasks are taken in
  // order from a shared counter, so which thread runs a task varies; callers
  // make each task's result independent of that.
  void Run(int64_t n_tasks, absl::FunctionRef<void(int64_t)> fn);

 private:
  void Work(int index);
  void TakeTasks();

  std::vector<std::thread> workers_;
  std::atomic<uint64_t> generation_{0};  // bumped to publish a job (or the stop)
  std::atomic<int> busy_{0};             // workers still inside the current job
  std::atomic<int64_t> next_task_{0};
  int64_t n_tasks_ = 0;
  const absl::FunctionRef<void(int64_t)>* fn_ = nullptr;
  bool stop_ = false;
};

}  // namespace moegraph
