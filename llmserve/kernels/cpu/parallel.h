// Work spread over torch's intra-op threads by taking, not by dealing.
//
// at::parallel_for deals [0, n) out in equal parts up front. On a machine whose cores the
// kernels share (the server's HTTP thread, a benchmark client, the OS), a thread that is
// preempted holds the whole parallel region back: every other thread finishes its part and
// waits at the barrier. parallel_take hands out chunks of ``grain`` items from an atomic
// counter instead, so the threads that run take the preempted one's remaining chunks.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace llmserve {

// [0, n) as chunks of at most grain items, handed out by one atomic counter: body(next,
// chunks, grain) runs once on each of up to torch's thread count of threads, and takes
// chunk c = next++ while c < chunks
template <typename Body>
inline void on_taking_threads(int64_t n, int64_t grain, const Body& body) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t chunks = (n + grain - 1) / grain;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { body(next, chunks, grain); });
}

// f(state, begin, end) for chunks [begin, end) of [0, n), at most grain items each, where
// ``state = make_state()`` is built once per thread (its scratch)
template <typename MakeState, typename F>
inline void parallel_take(int64_t n, int64_t grain, const MakeState& make_state, const F& f) {
  on_taking_threads(n, grain, [&](std::atomic<int64_t>& next, int64_t chunks, int64_t g) {
    auto state = make_state();
    for (int64_t c = next++; c < chunks; c = next++) f(state, c * g, std::min(n, (c + 1) * g));
  });
}

// f(begin, end) for chunks of [0, n): the same, with no per-thread state
template <typename F>
inline void parallel_take(int64_t n, int64_t grain, const F& f) {
  parallel_take(n, grain, [] { return 0; }, [&](int, int64_t b, int64_t e) { f(b, e); });
}

// f(begin, end, next) for chunks [begin, end) of [0, n) as parallel_take hands them out, but
// each thread claims its next chunk before it works on the current one, so f knows where
// that thread reads next (``next``: the next chunk's begin, or -1 where there is none). A
// thread the OS preempts holds one chunk more than with parallel_take (measured even in
// the server on Zen 5: docs/bench/journal.md).
template <typename F>
inline void parallel_take_ahead(int64_t n, int64_t grain, const F& f) {
  on_taking_threads(n, grain, [&](std::atomic<int64_t>& next, int64_t chunks, int64_t g) {
    for (int64_t c = next++; c < chunks;) {
      const int64_t after = next++;
      f(c * g, std::min(n, (c + 1) * g), after < chunks ? after * g : -1);
      c = after;
    }
  });
}

// the grain that gives each of torch's threads about ``per_thread`` chunks of [0, n)
inline int64_t grain_for(int64_t n, int64_t per_thread) {
  return std::max<int64_t>(1, n / (std::max<int64_t>(at::get_num_threads(), 1) * per_thread));
}

}  // namespace llmserve
