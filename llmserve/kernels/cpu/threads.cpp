// bind_threads: pin the calling thread and its OpenMP workers (torch's intra-op pool) one to
// each of ``cpus``, as vLLM's CPU worker does (VLLM_CPU_OMP_THREADS_BIND). libgomp keeps one
// pool of threads per thread that opens parallel regions and hands team slot i to the same
// pool thread every time, so slot i pinned here stays pinned for every later torch op and
// kernel that this thread runs. This library shares torch's libgomp (build.py), so the pool is
// the one torch's ops use.
#include <omp.h>
#include <sched.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "kernels_ops.h"

// pins team slot i (slot 0: the calling thread) to cpus[i]; returns how many slots were
// pinned: fewer than cpus.size() when the team came up smaller or the OS refused a CPU
int64_t llmserve::threads::bind_threads(const std::vector<int64_t>& cpus) {
  const int n = static_cast<int>(cpus.size());
  if (n == 0) return 0;
  std::atomic<int64_t> pinned{0};
#pragma omp parallel num_threads(n)
  {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[omp_get_thread_num()]), &set);
    if (sched_setaffinity(0, sizeof(set), &set) == 0) pinned++;
  }
  return pinned.load();
}
