// The decode-shape SIMD kernels of quant_float.cpp (M < kTileRows): y = x @ W^T for up to 4
// rows of x, each 32-column block of a weight row decoded to floats in registers and used for
// every row. Included by quant_float.cpp inside its anonymous namespace, after Weight,
// kBlock and kMaxRows, on x86-64 only; each function carries its own target attribute.
//   gemv_avx512<R>   4 output rows at a time (two 16-lane halves a block), group scale
//                    applied to partial sums when groups are >= 32 columns (kLate)
//   gemv_avx2<R>     1-2 output rows at a time (four 8-lane vectors a block)

// AVX-512: a block of 32 weights is two 16-lane vectors: columns 0..15 and 16..31 (for 4-bit
// the low and the high nibbles of the block's 16 bytes), each with its group's scale and min.
// Scale and min of the two 16-column halves of block b: one group for G >= 32, two for G 16.
struct HalfScales {
  float s0, s1, m0, m1;
};

inline HalfScales half_scales(const float* sc, const float* mn, int64_t b, int64_t bpg) {
  const int64_t g0 = bpg > 0 ? b / bpg : 2 * b;  // bpg: blocks per group (0 for G = 16)
  const int64_t g1 = bpg > 0 ? g0 : g0 + 1;
  return {sc[g0], sc[g1], mn != nullptr ? mn[g0] : 0.0f, mn != nullptr ? mn[g1] : 0.0f};
}

// Both SIMD paths compute NB output rows at once (R rows of x each): R * NB independent
// accumulator chains hide the FMA latency (one row alone waits on its own chain: 2-4 dependent
// FMAs per block), and each x vector loaded serves NB weight rows.

// AVX-512: the 32 values of a 4-bit block's 16 bytes (low nibbles, then high), as floats:
// the codes themselves, or their lut entries (NF4 / FP4)
__attribute__((target("avx512f,avx512bw,avx512vl,fma")))
inline void values512(const Weight& w, const uint8_t* p, __m512* lo, __m512* hi) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  const __m512i c0 = _mm512_and_si512(q, _mm512_set1_epi32(15)), c1 = _mm512_srli_epi32(q, 4);
  if (w.has_lut) {
    const __m512 table = _mm512_loadu_ps(w.lut);
    *lo = _mm512_permutexvar_ps(c0, table);
    *hi = _mm512_permutexvar_ps(c1, table);
  } else {
    *lo = _mm512_cvtepi32_ps(c0);
    *hi = _mm512_cvtepi32_ps(c1);
  }
}

// AVX-512: the raw values (codes, lut entries or int8) of the two 16-column halves of block b
// of row n, as floats
__attribute__((target("avx512f,avx512bw,avx512vl,fma")))
inline void raw_halves512(const Weight& w, int64_t n, int64_t b, __m512* v0, __m512* v1) {
  if (w.q4 != nullptr) return values512(w, w.q4 + n * (w.k / 2) + b * 16, v0, v1);
  const int8_t* p = w.q8 + n * w.k + b * kBlock;
  *v0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  *v1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
}

// the same halves decoded: scaled and shifted by their groups' scale and min
__attribute__((target("avx512f,avx512bw,avx512vl,fma")))
inline void decode_halves512(const Weight& w, int64_t n, int64_t b, const HalfScales& hs, __m512* v0,
                             __m512* v1) {
  __m512 a, c;
  raw_halves512(w, n, b, &a, &c);
  *v0 = _mm512_fmadd_ps(a, _mm512_set1_ps(hs.s0), _mm512_set1_ps(hs.m0));
  *v1 = _mm512_fmadd_ps(c, _mm512_set1_ps(hs.s1), _mm512_set1_ps(hs.m1));
}

// AVX-512, groups of 32 columns or more (kLate): the block's raw values v are multiplied with
// x first and the group scale applied to that partial sum, acc += s * (v0 . x0 + v1 . x1): one
// FP op fewer per block and row of x than decoding w = s * v + m, for R <= 2; the mins add
// m . (sum of x over the group) per row at the end (gsum: [R, groups_per_row]).
// y[m0 + r, n + j] for r < R, j < NB
template <int R, int NB, bool kLate>
__attribute__((target("avx512f,avx512bw,avx512vl,fma")))
void gemv_tile512(const Weight& w, const float* x, int64_t m0, int64_t n, float* y, int64_t n_total,
                  const float* gsum) {
  const int64_t num_blocks = w.k / kBlock;
  const int64_t bpg = w.group >= kBlock ? w.group / kBlock : 0;
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  const float* sc[NB];
  const float* mn[NB];
  HalfScales hs[NB];
  for (int j = 0; j < NB; ++j) {
    sc[j] = w.scales + (n + j) * w.groups_per_row;
    mn[j] = w.mins != nullptr ? w.mins + (n + j) * w.groups_per_row : nullptr;
  }
  for (int64_t b = 0, in_group = 0; b < num_blocks; ++b, ++in_group) {
    if (b == 0 || bpg == 0 || in_group == bpg) {  // a new group starts: no division per block
      if constexpr (kLate) {
        for (int j = 0; j < NB; ++j) hs[j].s0 = sc[j][b / bpg];
      } else {
        for (int j = 0; j < NB; ++j) hs[j] = half_scales(sc[j], mn[j], b, bpg);
      }
      in_group = 0;
    }
    // Software prefetch of the rows four tiles ahead, a cache line at a time (4 blocks of
    // 4-bit, 2 of 8-bit), and of their scales and mins: streaming from DRAM, the hardware
    // prefetcher alone left one thread at 13-14 GB/s; with this, 17-18 (Zen 5, Q4_1 layers).
    if ((b & (w.q4 != nullptr ? 3 : 1)) == 0)
      for (int j = 0; j < NB; ++j) {
        const int64_t ahead = n + j + 4 * NB;
        const uint8_t* row = w.q4 != nullptr ? w.q4 + ahead * (w.k / 2) + b * 16
                                             : reinterpret_cast<const uint8_t*>(w.q8) + ahead * w.k + b * kBlock;
        _mm_prefetch((const char*)row, _MM_HINT_T0);
        if ((b & 15) == 0) {  // scales and mins: 16 floats (a line) at a time
          const int64_t g = ahead * w.groups_per_row + (b * kBlock) / w.group;
          _mm_prefetch((const char*)(w.scales + g), _MM_HINT_T0);
          if (w.mins != nullptr) _mm_prefetch((const char*)(w.mins + g), _MM_HINT_T0);
        }
      }
    __m512 v0[NB], v1[NB];
    for (int j = 0; j < NB; ++j) {
      if constexpr (kLate) {
        raw_halves512(w, n + j, b, &v0[j], &v1[j]);
      } else {
        decode_halves512(w, n + j, b, hs[j], &v0[j], &v1[j]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float* xr = x + (m0 + r) * w.k + b * kBlock;
      const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);
      for (int j = 0; j < NB; ++j) {
        if constexpr (kLate) {
          const __m512 t = _mm512_fmadd_ps(v1[j], x1, _mm512_mul_ps(v0[j], x0));
          acc[r][j] = _mm512_fmadd_ps(t, _mm512_set1_ps(hs[j].s0), acc[r][j]);
        } else {
          acc[r][j] = _mm512_fmadd_ps(v0[j], x0, acc[r][j]);
          acc[r][j] = _mm512_fmadd_ps(v1[j], x1, acc[r][j]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) {
      float out = _mm512_reduce_add_ps(acc[r][j]);
      if (kLate && mn[j] != nullptr)
        for (int64_t g = 0; g < w.groups_per_row; ++g) out += mn[j][g] * gsum[r * w.groups_per_row + g];
      y[(m0 + r) * n_total + n + j] = out;
    }
}

template <int R>
void gemv_avx512(const Weight& w, const float* x, int64_t m0, int64_t n0, int64_t n1, float* y,
                 int64_t n_total) {
  int64_t n = n0;
  if (R <= 2 && w.group >= kBlock) {
    std::vector<float> gsum(R * w.groups_per_row, 0.0f);
    if (w.mins != nullptr)
      for (int r = 0; r < R; ++r)
        for (int64_t c = 0; c < w.k; ++c) gsum[r * w.groups_per_row + c / w.group] += x[(m0 + r) * w.k + c];
    for (; n + 4 <= n1; n += 4) gemv_tile512<R, 4, true>(w, x, m0, n, y, n_total, gsum.data());
    for (; n < n1; ++n) gemv_tile512<R, 1, true>(w, x, m0, n, y, n_total, gsum.data());
    return;
  }
  for (; n + 4 <= n1; n += 4) gemv_tile512<R, 4, false>(w, x, m0, n, y, n_total, nullptr);
  for (; n < n1; ++n) gemv_tile512<R, 1, false>(w, x, m0, n, y, n_total, nullptr);
}

// AVX2: four 8-lane vectors per block (columns 0..7, 8..15, 16..23, 24..31); 16 registers
// hold R * NB * 2 accumulators (columns 0..15 and 16..31 on separate chains)
template <int R, int NB>
__attribute__((target("avx2,fma")))
void gemv_tile256(const Weight& w, const float* x, int64_t m0, int64_t n, float* y, int64_t n_total) {
  const __m256i low4 = _mm256_set1_epi32(15);
  const int64_t num_blocks = w.k / kBlock;
  const int64_t bpg = w.group >= kBlock ? w.group / kBlock : 0;
  __m256 acc[R][NB][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
  HalfScales hs[NB];
  for (int64_t b = 0, in_group = 0; b < num_blocks; ++b, ++in_group) {
    if (b == 0 || bpg == 0 || in_group == bpg) {
      for (int j = 0; j < NB; ++j) {
        const int64_t row = (n + j) * w.groups_per_row;
        hs[j] = half_scales(w.scales + row, w.mins != nullptr ? w.mins + row : nullptr, b, bpg);
      }
      in_group = 0;
    }
    __m256 wv[NB][4];
    for (int j = 0; j < NB; ++j) {
      __m256 v[4];
      if (w.q4 != nullptr) {
        const uint8_t* p = w.q4 + (n + j) * (w.k / 2) + b * 16;
        const __m256i qa = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
        const __m256i qb = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)));
        v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(qa, low4));
        v[1] = _mm256_cvtepi32_ps(_mm256_and_si256(qb, low4));
        v[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(qa, 4));
        v[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(qb, 4));
      } else {
        const int8_t* p = w.q8 + (n + j) * w.k + b * kBlock;
        for (int i = 0; i < 4; ++i)
          v[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8 * i))));
      }
      for (int i = 0; i < 4; ++i) {
        const bool high = i >= 2;
        wv[j][i] = _mm256_fmadd_ps(v[i], _mm256_set1_ps(high ? hs[j].s1 : hs[j].s0),
                                   _mm256_set1_ps(high ? hs[j].m1 : hs[j].m0));
      }
    }
    for (int r = 0; r < R; ++r) {
      const float* xr = x + (m0 + r) * w.k + b * kBlock;
      for (int i = 0; i < 4; ++i) {
        const __m256 xv = _mm256_loadu_ps(xr + 8 * i);
        for (int j = 0; j < NB; ++j) acc[r][j][i / 2] = _mm256_fmadd_ps(wv[j][i], xv, acc[r][j][i / 2]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) {
      const __m256 sum = _mm256_add_ps(acc[r][j][0], acc[r][j][1]);
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
      s = _mm_hadd_ps(s, s);
      s = _mm_hadd_ps(s, s);
      y[(m0 + r) * n_total + n + j] = _mm_cvtss_f32(s);
    }
}

template <int R>
void gemv_avx2(const Weight& w, const float* x, int64_t m0, int64_t n0, int64_t n1, float* y,
               int64_t n_total) {
  constexpr int kNb = R <= 1 ? 2 : 1;  // accumulators and decoded vectors fit 16 registers
  int64_t n = n0;
  for (; n + kNb <= n1; n += kNb) gemv_tile256<R, kNb>(w, x, m0, n, y, n_total);
  for (; n < n1; ++n) gemv_tile256<R, 1>(w, x, m0, n, y, n_total);
}
