// The paged decode attention body, included by paged_attention.cpp once per ISA inside a
// namespace that defines ``Vec`` (vec.h); T is the element type of q, the caches and out:
// float, or uint16_t holding bf16. Arithmetic is fp32 throughout.
// (No include guard: this file is meant to be included several times.)

// Rows of K, V and the accumulators are walked in chunks of C = 2W elements, each loaded as
// two vectors (Vec::load2). For bf16 the pair is (even elements, odd elements) with no
// shuffle, so inside the first D / C * C elements the fp32 buffers (scaled q, accumulators)
// hold each chunk in that order; ``slot`` maps element d to its place. The rest is in order.
constexpr int64_t C = 2 * Vec::W;

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
// finish() asks for whatever is left.
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

template <typename T>
inline int64_t slot(int64_t d, int64_t D) {
  if (!std::is_same<T, uint16_t>::value || d >= D / C * C) return d;
  const int64_t r = d % C;
  return d - r + (r % 2) * Vec::W + r / 2;
}

// The query heads that share a KV head are taken together, up to kMaxHeads at a time (on
// AVX2 more, see kMaxScoreHeads), so a K or V chunk is loaded (and widened from bf16) once
// for all of them; their queries and accumulators stay in registers (32 vector registers
// with AVX-512, 16 with AVX2).
constexpr int kMaxHeads = Vec::W >= 16 ? 4 : 2;
// V accumulators per pass: with AVX2, 12 of the 16 registers (three heads of a GQA group x
// two chunks in one pass; 8 took decode attention 7-10% longer, fp32, batch 64 x 384 tokens,
// benchmarks.decode_attention, five alternated pairs on an AVX2 Zen 3 host)
constexpr int kAccRegs = Vec::W >= 16 ? 16 : 12;

// out[h * os + i] = q_h . k_i for NH heads q_h = q + h * D (fp32, pre-scaled, chunk order) and
// n key rows k_i = k + i * stride. Four rows at a time, summed across lanes together.
template <int NH, typename T>
inline void dots(const float* q, const T* k, int64_t stride, int64_t n, int64_t D, float* out,
                 int64_t os, Ahead& ah) {
  constexpr int64_t W = Vec::W;
  const int64_t Dc = D / C * C;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    ah.step();
    const T* k0 = k + i * stride;
    Vec a[NH][4];
    for (int h = 0; h < NH; ++h) {
      for (int r = 0; r < 4; ++r) a[h][r] = Vec::zero();
    }
    for (int64_t d = 0; d < Dc; d += C) {
      Vec qa[NH], qb[NH], ka, kb;
      for (int h = 0; h < NH; ++h) {
        qa[h] = Vec::load(q + h * D + d);
        qb[h] = Vec::load(q + h * D + d + W);
      }
      for (int r = 0; r < 4; ++r) {
        Vec::load2(k0 + r * stride + d, ka, kb);
        for (int h = 0; h < NH; ++h) a[h][r] = Vec::fma(qb[h], kb, Vec::fma(qa[h], ka, a[h][r]));
      }
    }
    for (int h = 0; h < NH; ++h) {
      float* o = out + h * os + i;
      Vec::reduce4(a[h][0], a[h][1], a[h][2], a[h][3], o);
      for (int64_t d = Dc; d < D; ++d) {
        for (int r = 0; r < 4; ++r) o[r] += q[h * D + d] * to_f32(k0[r * stride + d]);
      }
    }
  }
  for (; i < n; ++i) {
    const T* ki = k + i * stride;
    for (int h = 0; h < NH; ++h) {
      const float* qh = q + h * D;
      Vec a = Vec::zero(), ka, kb;
      for (int64_t d = 0; d < Dc; d += C) {
        Vec::load2(ki + d, ka, kb);
        a = Vec::fma(Vec::load(qh + d + W), kb, Vec::fma(Vec::load(qh + d), ka, a));
      }
      float sum = Vec::reduce_add(a);
      for (int64_t d = Dc; d < D; ++d) sum += qh[d] * to_f32(ki[d]);
      out[h * os + i] = sum;
    }
  }
}

// With the transposed K pool (Shape::k_t, the cpp backend's layout: kv_cache.allocate) a
// block holds, per KV head, head_dim rows of block_size tokens, element (d, t) at
// kt[d * bs + t]. W tokens of a row are one vector, so W scores come out of D FMAs with a
// broadcast query element each, and no sum across lanes (the [token][d] layout above needs
// one per token and head, which costs more than the products).
//
// out[h * os + t] = q_h . k_t for t < n and NH heads q_h = q + h * D (fp32, pre-scaled,
// natural order). Lanes past n (inside the block) are computed and stored, never read.
template <int NH, typename T>
inline void dots_t(const float* q, const T* kt, int64_t bs, int64_t n, int64_t D, float* out,
                   int64_t os, Ahead& ah) {
  constexpr int64_t W = Vec::W;
  constexpr int U = 4;  // partial sums per head: four FMA chains in flight each
  int64_t t0 = 0;
  for (; t0 < n && t0 + W <= bs; t0 += W) {
    Vec a[NH][U];
    for (int h = 0; h < NH; ++h) {
      for (int u = 0; u < U; ++u) a[h][u] = Vec::zero();
    }
    int64_t d = 0;
    for (; d + U <= D; d += U) {
      ah.step();
      for (int u = 0; u < U; ++u) {
        const Vec k = Vec::load(kt + (d + u) * bs + t0);
        for (int h = 0; h < NH; ++h) a[h][u] = Vec::fma(Vec::set1(q[h * D + d + u]), k, a[h][u]);
      }
    }
    for (; d < D; ++d) {
      const Vec k = Vec::load(kt + d * bs + t0);
      for (int h = 0; h < NH; ++h) a[h][0] = Vec::fma(Vec::set1(q[h * D + d]), k, a[h][0]);
    }
    for (int h = 0; h < NH; ++h) {
      Vec::add(Vec::add(a[h][0], a[h][1]), Vec::add(a[h][2], a[h][3])).store(out + h * os + t0);
    }
  }
  for (; t0 < n; ++t0) {  // a block narrower than a vector
    for (int h = 0; h < NH; ++h) {
      float sum = 0.f;
      for (int64_t d = 0; d < D; ++d) sum += q[h * D + d] * to_f32(kt[d * bs + t0]);
      out[h * os + t0] = sum;
    }
  }
}

// dots_t with two vectors of tokens per broadcast query element (AVX2, blocks of a multiple
// of 2W tokens): a broadcast feeds 2 FMAs instead of 1. With one vector, a head's FMA needs a
// load of K and a broadcast, more loads than the core issues per FMA once K sits in L1, as it
// does in prompt attention (an item's rows re-read their blocks); with two, and up to
// kMaxScoreHeads heads, NH * 2 accumulators (two partial sums each for fewer than 4 heads).
// Same contract as dots_t: lanes past n (inside the block) are computed and stored, unread.
template <int NH, typename T>
inline void dots_t2(const float* q, const T* kt, int64_t bs, int64_t n, int64_t D, float* out,
                    int64_t os, Ahead& ah) {
  constexpr int64_t W = Vec::W;
  constexpr int U = NH >= 4 ? 1 : 2;  // partial sums per (head, vector)
  for (int64_t t0 = 0; t0 < n; t0 += 2 * W) {
    Vec a[NH][U][2];
    for (int h = 0; h < NH; ++h) {
      for (int u = 0; u < U; ++u) a[h][u][0] = a[h][u][1] = Vec::zero();
    }
    auto step = [&](int64_t d, int u) {
      const T* r = kt + d * bs + t0;
      const Vec k0 = Vec::load(r), k1 = Vec::load(r + W);
      for (int h = 0; h < NH; ++h) {
        const Vec qd = Vec::set1(q[h * D + d]);
        a[h][u][0] = Vec::fma(qd, k0, a[h][u][0]);
        a[h][u][1] = Vec::fma(qd, k1, a[h][u][1]);
      }
    };
    int64_t d = 0;
    for (; d + U <= D; d += U) {
      ah.step();
      for (int u = 0; u < U; ++u) step(d + u, u);
    }
    for (; d < D; ++d) step(d, 0);
    for (int h = 0; h < NH; ++h) {
      for (int j = 0; j < 2; ++j) {
        Vec sum = a[h][0][j];
        for (int u = 1; u < U; ++u) sum = Vec::add(sum, a[h][u][j]);
        sum.store(out + h * os + t0 + j * W);
      }
    }
  }
}

// Query heads per pass on AVX2. Scores (transposed K): six heads of dots_t2 fill the 16
// registers (12 accumulators, two K vectors, a broadcast); the token-major kernel (dots)
// holds the queries in registers and keeps kMaxHeads. V: four heads of one chunk each (8
// accumulators) instead of two heads of two chunks: a V chunk is loaded once for four heads.
// Measured on an AVX2 Zen 3 host against two heads for both (benchmarks.prompt_attention, 8
// prompts x 256 tokens, fp32, alternated): 11.9-12.4 -> 7.6-9.5 ms a layer; decode
// (benchmarks.decode_attention, batch 64, 384 tokens, from memory): 2.94 -> 2.71-2.79 ms.
// Taking three heads for V alone, or six, measured no better than four.
constexpr int kMaxScoreHeads = Vec::W == 8 ? 6 : kMaxHeads;
constexpr int kMaxValueHeads = Vec::W == 8 ? 4 : kMaxHeads;

#ifdef LLMSERVE_X86
// dots_t for bf16 with AVX512_BF16 (Isa::kAvx512Bf16): rows d and d + 1 of 16 tokens, one
// vpermw apart from (k[d], k[d + 1]) pairs per 32-bit lane, times the query's (q[d], q[d + 1])
// pair broadcast: vdpbf16ps adds both products to an fp32 lane in one instruction. qw holds
// each head's query as bf16 pairs, unscaled (q is bf16 already: no rounding), so the scores
// are multiplied by scale after.
template <int NH>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c"))) inline void
dots_t_dpbf16(const uint32_t* qw, const uint16_t* kt, int64_t bs, int64_t n, int64_t D,
              float scale, float* out, int64_t os, Ahead& ah) {
  constexpr int U = 4;
  const int64_t P = D / 2;  // query pairs per head
  // word j of the result = 16-bit lanes j (row d) and 16 + j (row d + 1)
  alignas(64) static const int16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5,
                                                      21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                                      11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(kInterleave);
  const __m512 sc = _mm512_set1_ps(scale);
  int64_t t0 = 0;
  for (; t0 < n && t0 + 16 <= bs; t0 += 16) {
    __m512 a[NH][U];
    for (int h = 0; h < NH; ++h) {
      for (int u = 0; u < U; ++u) a[h][u] = _mm512_setzero_ps();
    }
    auto step = [&](int64_t p, int u) {
      const uint16_t* r = kt + 2 * p * bs + t0;
      const __m512i rows = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + bs)), 1);
      const __m512bh k = (__m512bh)_mm512_permutexvar_epi16(idx, rows);
      for (int h = 0; h < NH; ++h) {
        const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[h * P + p]));
        a[h][u] = _mm512_dpbf16_ps(a[h][u], k, qp);
      }
    };
    int64_t p = 0;
    for (; p + U <= P; p += U) {
      ah.step();
      for (int u = 0; u < U; ++u) step(p + u, u);
    }
    for (; p < P; ++p) step(p, 0);
    for (int h = 0; h < NH; ++h) {
      const __m512 s = _mm512_add_ps(_mm512_add_ps(a[h][0], a[h][1]), _mm512_add_ps(a[h][2], a[h][3]));
      _mm512_storeu_ps(out + h * os + t0, _mm512_mul_ps(s, sc));
    }
  }
  for (; t0 < n; ++t0) {  // a block narrower than 16 tokens
    for (int h = 0; h < NH; ++h) {
      float sum = 0.f;
      for (int64_t p = 0; p < P; ++p) {
        const uint32_t w = qw[h * P + p];
        sum += bf16_to_float(uint16_t(w)) * bf16_to_float(kt[2 * p * bs + t0]) +
               bf16_to_float(uint16_t(w >> 16)) * bf16_to_float(kt[(2 * p + 1) * bs + t0]);
      }
      out[h * os + t0] = sum * scale;
    }
  }
}
#endif

// the scores of a block's n tokens for NH query heads h.. that share KV head g; head h + j's
// go to out + j * os
template <int NH, typename T>
inline void block_scores(const Shape& sh, const Scratch& w, int64_t h, int64_t g, const T* kb,
                         int64_t n, float* out, int64_t os, Ahead& ah) {
  const int64_t D = sh.head_dim, bs = sh.block_size;
  if (!sh.k_t) return dots<NH>(w.q.data() + h * D, kb + g * D, sh.row, n, D, out, os, ah);
#ifdef LLMSERVE_X86
  if constexpr (Vec::W == 16 && std::is_same<T, uint16_t>::value) {
    if (sh.dp_bf16) {
      return dots_t_dpbf16<NH>(w.qw.data() + h * (D / 2), kb + g * D * bs, bs, n, D, sh.scale,
                               out, os, ah);
    }
  }
#endif
  if constexpr (Vec::W == 8) {
    if (bs % (2 * Vec::W) == 0) {
      return dots_t2<NH>(w.q.data() + h * D, kb + g * D * bs, bs, n, D, out, os, ah);
    }
  }
  dots_t<NH>(w.q.data() + h * D, kb + g * D * bs, bs, n, D, out, os, ah);
}

// Query head h's row src (D elements) into the scratch: w.q = scale * q as fp32, in the order
// the score kernel reads it (chunk order for the [token][d] K layout, natural for the
// transposed one), and for vdpbf16ps w.qw, q's bf16 pairs.
template <typename T>
inline void load_query(const Shape& sh, const T* src, int64_t h, Scratch& w) {
  const int64_t D = sh.head_dim;
  for (int64_t d = 0; d < D; ++d) {
    w.q[h * D + (sh.k_t ? d : slot<T>(d, D))] = sh.scale * to_f32(src[d]);
  }
  if constexpr (std::is_same<T, uint16_t>::value) {
    if (sh.dp_bf16) {
      for (int64_t p = 0; p < D / 2; ++p) {
        w.qw[h * (D / 2) + p] = uint32_t(src[2 * p]) | (uint32_t(src[2 * p + 1]) << 16);
      }
    }
  }
}

// the largest of m and s[0..n)
inline float running_max(const float* s, int64_t n, float m) {
  constexpr int64_t W = Vec::W;
  int64_t i = 0;
  if (n >= W) {
    Vec mv = Vec::load(s);
    for (i = W; i + W <= n; i += W) mv = Vec::max(mv, Vec::load(s + i));
    m = std::max(m, Vec::reduce_max(mv));
  }
  for (; i < n; ++i) m = std::max(m, s[i]);
  return m;
}

// s[i] = exp(s[i] - mx) for i < n; returns their sum
inline float exp_and_sum(float* s, int64_t n, float mx) {
  constexpr int64_t W = Vec::W;
  const Vec mv = Vec::set1(mx);
  Vec acc = Vec::zero();
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const Vec e = Vec::exp(Vec::sub(Vec::load(s + i), mv));
    e.store(s + i);
    acc = Vec::add(acc, e);
  }
  if (i < n) {  // the rest through one vector padded with -inf (e^-inf = 0 adds nothing)
    float tail[W];
    std::fill(tail, tail + W, -std::numeric_limits<float>::infinity());
    std::copy(s + i, s + n, tail);
    const Vec e = Vec::exp(Vec::sub(Vec::load(tail), mv));
    e.store(tail);
    std::copy(tail, tail + (n - i), s + i);
    acc = Vec::add(acc, e);
  }
  return Vec::reduce_add(acc);
}

// x[i] = exp(x[i]) for i < n
inline void exp_inplace(float* x, int64_t n) {
  constexpr int64_t W = Vec::W;
  int64_t i = 0;
  for (; i + W <= n; i += W) Vec::exp(Vec::load(x + i)).store(x + i);
  if (i < n) {  // the rest through one padded vector (fewer heads than lanes, usually)
    float tail[W] = {};
    std::copy(x + i, x + n, tail);
    Vec::exp(Vec::load(tail)).store(tail);
    std::copy(tail, tail + (n - i), x + i);
  }
}

// For NH heads h (acc_h = acc + h * D, p_h = p + h * ps): elements [0, NC * C) of acc_h =
// acc_h * correction[h] + sum_i p_h[i] v_i (chunk order) over n rows v_i that lie in blocks
// of bs rows: row i = blocks[i / bs] + off + (i % bs) * stride. The accumulators stay in
// registers over all n rows, each V chunk is widened once. kStep: ah->step() once a row.
template <int NC, int NH, bool kStep, typename T>
inline void accumulate_rows(float* acc, int64_t D, const float* p, int64_t ps,
                            const T* const* blocks, int64_t off, int64_t bs, int64_t stride,
                            int64_t n, const float* correction, Ahead* ah) {
  constexpr int64_t W = Vec::W;
  Vec a[NH][2 * NC], w[NH], x0, x1;
  for (int h = 0; h < NH; ++h) {
    const Vec c = Vec::set1(correction[h]);
    for (int j = 0; j < 2 * NC; ++j) a[h][j] = Vec::mul(Vec::load(acc + h * D + j * W), c);
  }
  for (int64_t b0 = 0; b0 < n; b0 += bs) {
    const T* v = blocks[b0 / bs] + off;
    const int64_t bn = std::min(bs, n - b0);
    for (int64_t i = 0; i < bn; ++i) {
      if constexpr (kStep) ah->step();
      for (int h = 0; h < NH; ++h) w[h] = Vec::set1(p[h * ps + b0 + i]);
      const T* row = v + i * stride;
      for (int j = 0; j < NC; ++j) {
        Vec::load2(row + j * C, x0, x1);
        for (int h = 0; h < NH; ++h) {
          a[h][2 * j] = Vec::fma(w[h], x0, a[h][2 * j]);
          a[h][2 * j + 1] = Vec::fma(w[h], x1, a[h][2 * j + 1]);
        }
      }
    }
  }
  for (int h = 0; h < NH; ++h) {
    for (int j = 0; j < 2 * NC; ++j) a[h][j].store(acc + h * D + j * W);
  }
}

// accumulate_rows over all of D: V rows of KV head g at blocks[b] + off (off = g * D); ah
// null: no asking ahead (the rows are in the caches)
template <int NH, typename T>
inline void accumulate(float* acc, const float* p, int64_t ps, const T* const* blocks,
                       int64_t off, int64_t bs, int64_t stride, int64_t n, int64_t D,
                       const float* correction, Ahead* ah) {
  constexpr int NC = kAccRegs / (2 * NH) >= 4 ? 4 : kAccRegs / (2 * NH) >= 2 ? 2 : 1;
  const int64_t Dc = D / C * C;
  int64_t d = 0;
  auto rows = [&](auto nc) {
    constexpr int kNC = decltype(nc)::value;
    if (ah != nullptr) {
      accumulate_rows<kNC, NH, true>(acc + d, D, p, ps, blocks, off + d, bs, stride, n,
                                     correction, ah);
    } else {
      accumulate_rows<kNC, NH, false>(acc + d, D, p, ps, blocks, off + d, bs, stride, n,
                                      correction, ah);
    }
  };
  for (; d + NC * C <= Dc; d += NC * C) rows(std::integral_constant<int, NC>{});
  for (; d < Dc; d += C) rows(std::integral_constant<int, 1>{});
  for (int h = 0; h < NH; ++h) {
    for (int64_t e = d; e < D; ++e) {
      float a = acc[h * D + e] * correction[h];
      for (int64_t i = 0; i < n; ++i) {
        a += p[h * ps + i] * to_f32(blocks[i / bs][off + (i % bs) * stride + e]);
      }
      acc[h * D + e] = a;
    }
  }
}

// f(std::integral_constant<int, nh>) for a run-time nh in [1, Max]
template <int Max, typename F>
inline void with_heads(int64_t nh, F&& f) {
  if constexpr (Max > 1) {
    if (nh < Max) return with_heads<Max - 1>(nh, f);
  }
  f(std::integral_constant<int, Max>{});
}

// f(std::integral_constant<int, NH>, h, g) for each run of NH <= Max query heads
// h .. h + NH - 1 that share KV head g
template <int Max = kMaxHeads, typename F>
inline void for_head_groups(const Shape& sh, F&& f) {
  for (int64_t g = 0; g < sh.kv_heads; ++g) {
    const int64_t end = (g + 1) * sh.group;
    for (int64_t h = g * sh.group; h < end; h += Max) {
      with_heads<Max>(std::min<int64_t>(Max, end - h), [&](auto nh) { f(nh, h, g); });
    }
  }
}

// scores [h * stride + i] of token b0 + i = -inf where that token is at or past limits[h]
inline void mask_beyond(const int64_t* limits, int64_t heads, int64_t b0, int64_t n,
                        float* scores, int64_t stride) {
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = std::max<int64_t>(limits[h] - b0, 0); i < n; ++i) {
      scores[h * stride + i] = -std::numeric_limits<float>::infinity();
    }
  }
}

constexpr int64_t kCachedContextBytes = 1 << 20;  // K + V of one sequence held in L2

// Attend the query rows in w (num_heads of them, put there by load_query) over tokens [t0, t1)
// of one sequence (t0 on a block boundary) with an online softmax, a step of up to
// step_blocks blocks (kStepTokens tokens) at a time: the step's scores block by block, the
// running maxima m and sums l (acc rescaled when a maximum grows, folded into the first V
// pass), then the blocks' V rows. The next blocks' K and V are asked for while this one is
// computed, and the scores never leave L1. Leaves acc [num_heads, head_dim] unnormalised
// (chunk order), m and l [num_heads]. ``limits`` (causal prompt rows, else null): head h sees
// tokens [t0, limits[h]) only; the first token must be visible to every head.
template <typename T>
void attend_chunk(const Shape& sh, const T* k_cache, const T* v_cache, const int32_t* table,
                  int64_t t0, int64_t t1, Scratch& w, float* acc, float* m, float* l,
                  const int64_t* limits = nullptr) {
  const int64_t H = sh.num_heads, D = sh.head_dim, bs = sh.block_size;
  const int64_t stride = bs * step_blocks(bs);  // a head's scores in the scratch
  std::fill(acc, acc + H * D, 0.f);
  std::fill(m, m + H, -std::numeric_limits<float>::infinity());
  std::fill(l, l + H, 0.f);
  const int64_t row_bytes = sh.row * int64_t(sizeof(T));
  // Blocks are scattered, so no hardware prefetcher finds the next one; how they are asked
  // for depends on the vendor (cpu_is_amd, measured):
  // - AMD: the next block in read order (a step's K blocks, then its V blocks, then the next
  //   step's K blocks) into L1, spread over the current block's loops (Ahead). Measured on an
  //   AVX2 Zen 3 host (benchmarks.decode_attention shapes, batch 64, 172 and 384 tokens, one
  //   process, seven alternated rounds) against the scheme measured best on Zen 5 before (the
  //   next block with prefetcht0 and the one after with prefetchnta, each in one burst when
  //   its block starts): 8.4 -> 11.7 GB/s fp32 at 172 tokens, 8.1 -> 10.4 at 384, bf16 8.6 ->
  //   13.1 and 9.2 -> 14.2, batch 4 x 2048 (split) 9.6 -> 14.2. prefetcht2 measured even;
  //   adding the two-ahead burst back lost 2-7%. A burst of ~200 lines is more than a core
  //   keeps in flight, so the loads behind it waited (most likely).
  // - Intel (Sapphire Rapids, benchmarks.decode_attention, batch 64, 172-320 tokens, block
  //   16): the old AMD scheme read 7.1-7.6 GB/s there, half of no prefetch at all (15.2-16.2):
  //   nta and t0 bursts hold the line-fill buffers and the loads behind them wait. The block
  //   two ahead into L2 (prefetcht2) reads 17.6-18.5 GB/s fp32, 14.5-15.7 bf16 (memory 23.9
  //   GB/s); kept so (the spread scheme is not measured on Intel).
  // - AMD with AVX-512 (Zen 4 measured; Zen 5 not): both, the next block spread and the one
  //   two ahead in a burst, each into L2. On a Zen 4 VM (bf16, batch 64 x 320, 32 x 1024 and
  //   16 x 1024 tokens, one process, the same pools, the scheme switched per call, nine
  //   alternated rounds): the burst added to the spread (then into L1) read 1.33-1.48x the
  //   spread alone on shuffled blocks, 1.60x on descending runs, 1.00-1.16x on ascending ones
  //   (as a fresh pool hands them out). The spread into L2 instead of L1, measured the same
  //   way (benchmarks.decode_attention shapes, block 16, 8 layers, median of 9): fp32 64 x 320
  //   16.6 -> 19.2 GB/s shuffled, 24.8 -> 28.5 ascending, 16 x 1024 20.2 -> 22.7; bf16 64 x
  //   320 21.5 -> 23.2, 32 x 1024 24.1 -> 25.5. A core keeps few L1 misses in flight (the
  //   line-fill buffers) and more L2 ones, most likely the reason; a third block in a burst
  //   measured even. Zen 3 keeps the spread alone, into L1: a two-ahead burst (prefetchnta)
  //   lost 2-7% there; prefetcht2 for either is not measured on it.
  // Prompt rows re-read their sequence's blocks item after item: a context that fits the
  // caches is not asked for (the asking cost 5% of the prompt attention at 256 tokens).
  const bool ask = limits == nullptr || (t1 - t0) * row_bytes * 2 > kCachedContextBytes;
  const bool spread = ::llmserve::cpu_is_amd();
  static const bool burst = !spread || ::llmserve::cpu_supports(::llmserve::Isa::kAvx512);
  const int64_t block_bytes = bs * row_bytes;
  Ahead k_ahead, v_ahead;  // left empty on Intel: step() then asks for nothing
  k_ahead.into_l2 = v_ahead.into_l2 = spread && burst;  // AMD with AVX-512
  // before block b0 (of the step [s0, s0 + sn)) of the K pass (is_k) or the V pass
  auto ask_ahead = [&](bool is_k, int64_t b0, int64_t s0, int64_t sn) {
    if (!ask) return;
    const T* pool = is_k ? k_cache : v_cache;
    if (burst && b0 + 2 * bs < t1) {
      prefetch<1>(pool + table[b0 / bs + 2] * bs * sh.row,
                  std::min(bs, t1 - b0 - 2 * bs) * row_bytes);
    }
    if (!spread) return;
    int64_t next = b0 + bs;
    if (next >= s0 + sn) {  // the pass's last block: the other pass's first one
      pool = is_k ? v_cache : k_cache;
      next = is_k ? s0 : s0 + sn;
      if (next >= t1) return;
    }
    (is_k ? k_ahead : v_ahead).begin(pool + table[next / bs] * bs * sh.row, block_bytes);
  };
  for (int64_t s0 = t0; s0 < t1; s0 += stride) {
    const int64_t sn = std::min(stride, t1 - s0);  // the step's tokens
    for (int64_t b0 = s0; b0 < s0 + sn; b0 += bs) {
      const T* kb = k_cache + table[b0 / bs] * bs * sh.row;  // token i: kb + i * row
      const int64_t n = std::min(bs, t1 - b0);
      ask_ahead(true, b0, s0, sn);
      auto scores = [&](auto nh, int64_t h, int64_t g) {
        block_scores<decltype(nh)::value>(sh, w, h, g, kb, n,
                                          w.scores.data() + h * stride + (b0 - s0), stride, k_ahead);
      };
      sh.k_t ? for_head_groups<kMaxScoreHeads>(sh, scores) : for_head_groups(sh, scores);
      k_ahead.finish();
    }
    if (limits != nullptr) mask_beyond(limits, H, s0, sn, w.scores.data(), stride);
    for (int64_t h = 0; h < H; ++h) {
      const float mx = running_max(w.scores.data() + h * stride, sn, m[h]);
      w.correction[h] = m[h] - mx;
      m[h] = mx;
    }
    exp_inplace(w.correction.data(), H);  // ~0 on the first step (m = -inf), where acc = l = 0
    for (int64_t h = 0; h < H; ++h) {
      l[h] = l[h] * w.correction[h] + exp_and_sum(w.scores.data() + h * stride, sn, m[h]);
    }
    // The V rows. Decode rows (from memory): block by block, each next block asked for
    // while this one is read. Prompt rows (their context re-read item after item, from the
    // caches): each pass of accumulators runs over the whole step, so it loads and stores
    // them once a step instead of once a block. Measured on an AVX2 Zen 3 host, one process,
    // alternated against block by block: benchmarks.prompt_attention fp32 1.08-1.23x (8 x 256
    // and 2 x 1024 tokens), bf16 1.05-1.08x; the engine's attention calls over 8 prompts of
    // 1024 tokens 4.57 -> 3.96 s, 16 of 256 0.78 -> 0.72 s (medians of 4 and 10 rounds).
    const bool whole_step = limits != nullptr;
    const T* vbs[kMaxStepBlocks];
    for (int64_t b0 = s0; b0 < s0 + sn; b0 += bs) {
      vbs[(b0 - s0) / bs] = v_cache + table[b0 / bs] * bs * sh.row;
    }
    for (int64_t b0 = s0; b0 < s0 + sn; b0 += whole_step ? sn : bs) {
      const int64_t n = whole_step ? sn : std::min(bs, t1 - b0);
      const float* correction = b0 == s0 ? w.correction.data() : w.ones.data();
      if (!whole_step) ask_ahead(false, b0, s0, sn);
      auto values = [&](auto nh, int64_t h, int64_t g) {
        accumulate<decltype(nh)::value>(acc + h * D, w.scores.data() + h * stride + (b0 - s0),
                                        stride, vbs + (b0 - s0) / bs, g * D, bs, sh.row, n, D,
                                        correction + h, whole_step ? nullptr : &v_ahead);
      };
      for_head_groups<kMaxValueHeads>(sh, values);
      v_ahead.finish();
    }
  }
}

// one sequence's query [num_heads, D] into the scratch (load_query)
template <typename T>
inline void scaled_query(const Shape& sh, const T* q, Scratch& w) {
  for (int64_t h = 0; h < sh.num_heads; ++h) load_query(sh, q + h * sh.head_dim, h, w);
}

// out[d] = acc[slot(d)] * inv, stored as T
template <typename T>
inline void store_scaled(T* out, const float* acc, float inv, int64_t D) {
  constexpr int64_t W = Vec::W;
  const Vec iv = Vec::set1(inv);
  int64_t d = 0;
  for (; d + C <= D; d += C) {
    Vec::store2(out + d, Vec::mul(Vec::load(acc + d), iv), Vec::mul(Vec::load(acc + d + W), iv));
  }
  for (; d < D; ++d) put_f32(out + d, acc[d] * inv);
}

// One work item per sequence, taken by the threads as they come free: out_h = acc_h / l_h.
template <typename T>
void attend_per_sequence(const Batch& b) {
  const int64_t H = b.sh.num_heads, D = b.sh.head_dim;
  const T* q = static_cast<const T*>(b.q);
  T* out = static_cast<T*>(b.out);
  auto scratch = [&] { return Scratch(b.sh); };
  ::llmserve::parallel_take(b.num_seqs, 1, scratch, [&](Scratch& w, int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      scaled_query(b.sh, q + s * b.q_stride, w);
      attend_chunk(b.sh, static_cast<const T*>(b.k_cache),
                   static_cast<const T*>(b.v_cache), b.tables + s * b.max_blocks, 0, b.lens[s], w,
                   w.acc.data(), w.m.data(), w.l.data());
      for (int64_t h = 0; h < H; ++h) {
        store_scaled(out + (s * H + h) * D, w.acc.data() + h * D, 1.f / w.l[h], D);
      }
    }
  });
}

// Split-K (flash-decoding): chunk c of sequence s covers whole blocks [c * per, (c + 1) * per)
// of its table; each chunk leaves (m, l, acc), then one reduction per (sequence, head)
// rescales them to the common maximum M:  out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c.
template <typename T>
void attend_split(const Batch& b, int64_t chunks) {
  const int64_t H = b.sh.num_heads, D = b.sh.head_dim, bs = b.sh.block_size;
  const int64_t items = b.num_seqs * chunks;
  const T* q = static_cast<const T*>(b.q);
  std::vector<float> part_acc(items * H * D), part_m(items * H), part_l(items * H);
  auto scratch = [&] { return Scratch(b.sh); };
  ::llmserve::parallel_take(items, 1, scratch, [&](Scratch& w, int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / chunks, c = item % chunks, len = b.lens[s];
      const int64_t per = ((len + bs - 1) / bs + chunks - 1) / chunks;  // blocks per chunk
      const int64_t t0 = std::min(c * per * bs, len), t1 = std::min((c + 1) * per * bs, len);
      float* m = part_m.data() + item * H;
      float* l = part_l.data() + item * H;
      if (t0 >= t1) {  // a short sequence has fewer chunks than the longest
        std::fill(m, m + H, -std::numeric_limits<float>::infinity());
        std::fill(l, l + H, 0.f);
        continue;
      }
      scaled_query(b.sh, q + s * b.q_stride, w);
      attend_chunk(b.sh, static_cast<const T*>(b.k_cache),
                   static_cast<const T*>(b.v_cache), b.tables + s * b.max_blocks, t0, t1, w,
                   part_acc.data() + item * H * D, m, l);
    }
  });
  T* out = static_cast<T*>(b.out);
  at::parallel_for(0, b.num_seqs * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t s = pair / H, h = pair % H;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, part_m[(s * chunks + c) * H + h]);
      std::fill(o.begin(), o.end(), 0.f);
      float total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t item = s * chunks + c;
        if (part_l[item * H + h] == 0.f) continue;
        const float wt = std::exp(part_m[item * H + h] - mx);
        total += wt * part_l[item * H + h];
        const float* a = part_acc.data() + (item * H + h) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += wt * a[d];
      }
      store_scaled(out + pair * D, o.data(), 1.f / total, D);
    }
  });
}

// Prompt rows and decodes in one pass (query_start: [num_seqs + 1] row offsets of q/out). A
// work item is up to kRows consecutive query rows of one sequence; its rows' heads that share
// a KV head are attended together as if they were one sequence's heads (virtual head
// g * rows * G + r * G + i is head g * G + i of row r), so each K/V chunk is loaded once for
// all of them, and row r (position p) sees tokens [0, p] only. Items run longest first and
// are taken by the threads as they come free (their costs differ by the context lengths).
constexpr int64_t kRows = 4;

template <typename T>
void attend_varlen(const Batch& b, const int32_t* query_start) {
  const int64_t H = b.sh.num_heads, D = b.sh.head_dim, G = b.sh.group;
  struct Item { int64_t seq, row0, rows, cost; };
  std::vector<Item> items;
  for (int64_t s = 0; s < b.num_seqs; ++s) {
    const int64_t q_len = query_start[s + 1] - query_start[s], first = b.lens[s] - q_len;
    for (int64_t r0 = 0; r0 < q_len; r0 += kRows) {
      const int64_t rows = std::min(kRows, q_len - r0);
      items.push_back({s, r0, rows, rows * (first + r0 + rows)});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& c) { return a.cost > c.cost; });
  const T* q = static_cast<const T*>(b.q);
  T* out = static_cast<T*>(b.out);
  struct State {
    Shape vs;  // the virtual sequence of an item's rows
    Scratch w;
    std::vector<int64_t> limits;
  };
  auto state = [&] {
    Shape vs = b.sh;
    vs.num_heads = H * kRows, vs.group = G * kRows;
    return State{vs, Scratch(vs), std::vector<int64_t>(H * kRows)};
  };
  const int64_t n = items.size();
  ::llmserve::parallel_take(n, 1, state, [&](State& st, int64_t begin, int64_t end) {
    Shape& vs = st.vs;
    Scratch& w = st.w;
    std::vector<int64_t>& limits = st.limits;
    for (int64_t it = begin; it < end; ++it) {
      const Item& item = items[it];
      const int64_t row = query_start[item.seq] + item.row0;  // the item's first row of q
      const int64_t first = b.lens[item.seq] - (query_start[item.seq + 1] - query_start[item.seq]);
      vs.num_heads = H * item.rows, vs.group = G * item.rows;
      for (int64_t g = 0; g < b.sh.kv_heads; ++g) {
        for (int64_t r = 0; r < item.rows; ++r) {
          for (int64_t i = 0; i < G; ++i) {
            const int64_t vh = (g * item.rows + r) * G + i;
            limits[vh] = first + item.row0 + r + 1;
            load_query(vs, q + (row + r) * b.q_stride + (g * G + i) * D, vh, w);
          }
        }
      }
      attend_chunk(vs, static_cast<const T*>(b.k_cache),
                   static_cast<const T*>(b.v_cache), b.tables + item.seq * b.max_blocks, 0,
                   first + item.row0 + item.rows, w, w.acc.data(), w.m.data(), w.l.data(),
                   item.rows > 1 ? limits.data() : nullptr);
      for (int64_t g = 0; g < b.sh.kv_heads; ++g) {
        for (int64_t r = 0; r < item.rows; ++r) {
          for (int64_t i = 0; i < G; ++i) {
            const int64_t vh = (g * item.rows + r) * G + i;
            store_scaled(out + ((row + r) * H + g * G + i) * D, w.acc.data() + vh * D,
                         1.f / w.l[vh], D);
          }
        }
      }
    }
  });
}

void run_varlen(const Batch& b, const int32_t* query_start) {
  b.is_bf16 ? attend_varlen<uint16_t>(b, query_start) : attend_varlen<float>(b, query_start);
}

void run(const Batch& b, int64_t chunks) {
  if (b.is_bf16) {
    chunks == 1 ? attend_per_sequence<uint16_t>(b) : attend_split<uint16_t>(b, chunks);
  } else {
    chunks == 1 ? attend_per_sequence<float>(b) : attend_split<float>(b, chunks);
  }
}
