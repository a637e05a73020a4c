// Asking for memory ahead of its use, included by the kernel bodies that stream it
// (attention_scores_impl.h, gemm_impl.h, gemm_bf16.cpp), so once per ISA inside their namespaces.
// (No include guard: this file is meant to be included several times.)

// ask for the cache lines of [p, p + bytes) ahead of their use; Locality is
// __builtin_prefetch's: 3 = prefetcht0 (into L1), 1 = prefetcht2 (into L2), 0 = prefetchnta.
// On x86 through inline asm: GCC deletes a loop of nothing but __builtin_prefetch as free of
// side effects.
template <int Locality>
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) {
#ifdef LLMSERVE_X86
    if constexpr (Locality == 0) {
      asm volatile("prefetchnta %0" : : "m"(c[off]));
    } else if constexpr (Locality == 1) {
      asm volatile("prefetcht2 %0" : : "m"(c[off]));
    } else {
      asm volatile("prefetcht0 %0" : : "m"(c[off]));
    }
#else
    __builtin_prefetch(c + off, 0, Locality);
#endif
  }
}

// The block a work item reads next, asked for (into L1, prefetch<3>, or with into_l2 into L2,
// prefetch<1>) a few cache lines at a time from inside the kernels' loops (step(), once per
// iteration of their outer loops), so that its misses are spread over the current block's
// compute instead of issued in one burst. The lines per step come from the steps the previous
// block took (the same kernels, so the same count but for a sequence's last, partial block);
// finish() asks for whatever is left. spread() takes the count of steps to come instead
// where the caller knows it (the GEMMs' tiles, through over_groups).
struct Ahead {
  const char* cur = nullptr;
  const char* end = nullptr;
  int64_t per_step = 1, steps = 0;
  bool into_l2 = false;
  void ask(const char* p, int64_t bytes) const {
    into_l2 ? prefetch<1>(p, bytes) : prefetch<3>(p, bytes);
  }
  void begin(const void* p, int64_t bytes) {
    per_step = steps > 0 ? ((bytes + 63) / 64 + steps - 1) / steps : 1;
    steps = 0;
    cur = static_cast<const char*>(p);
    end = cur + bytes;
  }
  void spread(const void* p, int64_t bytes, int64_t over_steps) {
    steps = over_steps;
    begin(p, bytes);
  }
  inline void step() {
    ++steps;
    const int64_t n = std::min<int64_t>(per_step * 64, end - cur);
    if (n > 0) {
      ask(cur, n);
      cur += n;
    }
  }
  void finish() {
    ask(cur, end - cur);
    cur = end;
  }
};

// step(k) for k in [0, n) in groups of Every, next.step() before each whole group and
// next.finish() after them (the last n % Every k's run after): the GEMM tiles' loop over their
// k's, their share of the next panel spread over it by next.spread(..., n / Every). Ask =
// false: a tile with nothing to ask for, whose loop then has no calls on next at all.
template <int64_t Every, bool Ask = true, typename Step>
__attribute__((always_inline)) inline void over_groups(int64_t n, Ahead& next, const Step& step) {
  int64_t k = 0;
  for (; k + Every <= n; k += Every) {
    if constexpr (Ask) next.step();
#pragma GCC unroll 16
    for (int64_t j = 0; j < Every; ++j) step(k + j);
  }
  if constexpr (Ask) next.finish();
#pragma GCC unroll 2
  for (; k < n; ++k) step(k);
}
