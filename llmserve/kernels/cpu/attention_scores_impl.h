// The scores of a paged attention step, included by paged_attention_impl.h (so once per ISA,
// inside a namespace that defines ``Vec``, vec.h): the query loaded into a thread's scratch
// (load_query), and q . k for the query heads of one KV head over a block, on either K layout
// (dots, dots_t, dots_t2, dots_t_dpbf16, chosen by block_scores). T: the cache's element type,
// float, uint16_t holding bf16, or fp8 (fp8.h).
// (No include guard: this file is meant to be included several times.)

#include "prefetch_impl.h"  // asking for the next block ahead of its use: prefetch, Ahead

// Rows of K, V and the accumulators are walked in chunks of C = 2W elements, each loaded as
// two vectors (Vec::load2). For bf16 the pair is (even elements, odd elements) with no
// shuffle, so inside the first D / C * C elements the fp32 buffers (scaled q, accumulators)
// hold each chunk in that order; ``slot`` maps element d to its place. The rest is in order.
constexpr int64_t C = 2 * Vec::W;

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

// q . k for two vectors of W tokens at once, NH heads: rows d of the two at k0 + d * stride and
// k1 + d * stride, their scores to out0 + h * os and out1 + h * os. A broadcast query element
// feeds 2 FMAs instead of 1. With one vector, a head's FMA needs a load of K and a broadcast,
// more loads than the core issues per FMA once K sits in L1, as it does in prompt attention (an
// item's rows re-read their blocks); with two, NH * 2 accumulators (two partial sums each for
// fewer than 4 heads). The two vectors are one block's (dots_t2, AVX2) or two blocks' (AVX-512
// prompt rows, pair_scores).
template <int NH, typename T>
inline void dots_two(const float* q, const T* k0, const T* k1, int64_t stride, int64_t D,
                     float* out0, float* out1, int64_t os, Ahead& ah) {
  constexpr int U = NH >= 4 ? 1 : 2;  // partial sums per (head, vector)
  Vec a[NH][U][2];
  for (int h = 0; h < NH; ++h) {
    for (int u = 0; u < U; ++u) a[h][u][0] = a[h][u][1] = Vec::zero();
  }
  auto step = [&](int64_t d, int u) {
    const Vec x0 = Vec::load(k0 + d * stride), x1 = Vec::load(k1 + d * stride);
    for (int h = 0; h < NH; ++h) {
      const Vec qd = Vec::set1(q[h * D + d]);
      a[h][u][0] = Vec::fma(qd, x0, a[h][u][0]);
      a[h][u][1] = Vec::fma(qd, x1, a[h][u][1]);
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
      sum.store((j == 0 ? out0 : out1) + h * os);
    }
  }
}

// dots_t with two vectors of a block's tokens per broadcast query element (AVX2, blocks of a
// multiple of 2W tokens), up to kMaxScoreHeads heads. Same contract as dots_t: lanes past n
// (inside the block) are computed and stored, unread.
template <int NH, typename T>
inline void dots_t2(const float* q, const T* kt, int64_t bs, int64_t n, int64_t D, float* out,
                    int64_t os, Ahead& ah) {
  constexpr int64_t W = Vec::W;
  for (int64_t t0 = 0; t0 < n; t0 += 2 * W) {
    dots_two<NH>(q, kt + t0, kt + t0 + W, bs, D, out + t0, out + t0 + W, os, ah);
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
// Query heads per pass of the two-block score kernels (AVX-512 only: AVX2's dots_t2 already
// takes two vectors of a block): 16 accumulators at 8. Measured on a Zen 5 host (prompt rows of
// the default model, 12 heads per KV head, fp32, alternated with one block at a time): 8 heads
// 1.20x (1 x 2048 and 8 x 256 tokens), 6 1.16x / 1.09x, 12 1.07x / 1.03x (GCC keeps 24
// accumulators in memory, not registers).
constexpr int kMaxPairHeads = 8;

#ifdef LLMSERVE_X86
// vpermw's indices for the vdpbf16ps kernels: word j of the result = 16-bit lanes j (row d)
// and 16 + j (row d + 1) of two rows of 16 tokens
alignas(64) inline constexpr int16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5,
                                                       21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                                       11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

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

// dots_t_dpbf16 over two whole blocks of 16 tokens (as pair_scores' dots_two): one broadcast
// query pair feeds a vdpbf16ps per block.
template <int NH>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c"))) inline void
dots_t_dpbf16_pair(const uint32_t* qw, const uint16_t* kt0, const uint16_t* kt1, int64_t D,
                   float scale, float* out, int64_t os, Ahead& ah) {
  const int64_t P = D / 2;
  const __m512i idx = _mm512_load_si512(kInterleave);
  __m512 a[NH][2];
  for (int h = 0; h < NH; ++h) a[h][0] = a[h][1] = _mm512_setzero_ps();
  auto pairs_of = [&](const uint16_t* r) {  // rows d, d + 1 of 16 tokens as bf16 pairs
    return (__m512bh)_mm512_permutexvar_epi16(idx, _mm512_loadu_si512(r));
  };
  auto step = [&](int64_t p) {
    const __m512bh k0 = pairs_of(kt0 + 2 * p * 16), k1 = pairs_of(kt1 + 2 * p * 16);
    for (int h = 0; h < NH; ++h) {
      const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[h * P + p]));
      a[h][0] = _mm512_dpbf16_ps(a[h][0], k0, qp);
      a[h][1] = _mm512_dpbf16_ps(a[h][1], k1, qp);
    }
  };
  int64_t p = 0;
  for (; p + 4 <= P; p += 4) {
    ah.step();
    step(p), step(p + 1), step(p + 2), step(p + 3);
  }
  for (; p < P; ++p) step(p);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int h = 0; h < NH; ++h) {
    _mm512_storeu_ps(out + h * os, _mm512_mul_ps(a[h][0], sc));
    _mm512_storeu_ps(out + h * os + 16, _mm512_mul_ps(a[h][1], sc));
  }
}
#endif

// the scores of two whole blocks (bs == W) for NH query heads h.. that share KV head g: block
// 0's to out + j * os, block 1's to out + j * os + W (prompt items on AVX-512)
template <int NH, typename T>
inline void pair_scores(const Shape& sh, const Scratch& w, int64_t h, int64_t g, const T* kb0,
                        const T* kb1, float* out, int64_t os, Ahead& ah) {
  const int64_t D = sh.head_dim, off = g * D * sh.block_size;
#ifdef LLMSERVE_X86
  if constexpr (Vec::W == 16 && std::is_same<T, uint16_t>::value) {
    if (sh.dp_bf16) {
      return dots_t_dpbf16_pair<NH>(w.qw.data() + h * (D / 2), kb0 + off, kb1 + off, D,
                                    sh.scale, out, os, ah);
    }
  }
#endif
  constexpr int64_t W = Vec::W;
  dots_two<NH>(w.q.data() + h * D, kb0 + off, kb1 + off, W, D, out, out + W, os, ah);
}

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
// transposed one; the chunk order is cache type K's), and for vdpbf16ps w.qw, q's bf16 pairs.
template <typename K, typename T>
inline void load_query(const Shape& sh, const T* src, int64_t h, Scratch& w) {
  const int64_t D = sh.head_dim;
  int64_t d = 0;
  if (sh.k_t) {  // natural order: whole vectors (a prompt item loads rows x heads of them)
    const Vec scale = Vec::set1(sh.scale);
    for (; d + Vec::W <= D; d += Vec::W) {
      Vec::mul(scale, Vec::load(src + d)).store(&w.q[h * D + d]);
    }
  }
  for (; d < D; ++d) w.q[h * D + (sh.k_t ? d : slot<K>(d, D))] = sh.scale * to_f32(src[d]);
  if constexpr (std::is_same<T, uint16_t>::value) {
    if (sh.dp_bf16) {
      for (int64_t p = 0; p < D / 2; ++p) {
        w.qw[h * (D / 2) + p] = uint32_t(src[2 * p]) | (uint32_t(src[2 * p + 1]) << 16);
      }
    }
  }
}
