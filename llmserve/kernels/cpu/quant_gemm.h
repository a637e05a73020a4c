// SIMD tiles of the quantized GEMM (quant_gemm.cpp): y[m, n] for R output rows x MT activation
// rows at a time, with int8 activations against 4- or 8-bit weights.
//
// Both ISA paths walk K in "pairs" of two 32-column blocks (64 columns), and read activations
// that quant_activations.h laid out per pair in the register order of the weights:
//
//   8-bit weights: bytes 0..63 = columns 64p .. 64p+63 (natural order)
//   4-bit weights: the 32 packed bytes of blocks 2p, 2p+1, low nibbles then high nibbles:
//       bytes  0..15 block 2p   cols 0..15   |  bytes 32..47 block 2p   cols 16..31
//       bytes 16..31 block 2p+1 cols 0..15   |  bytes 48..63 block 2p+1 cols 16..31
//
// so a weight vector needs no shuffle across lanes. An int32 lane of a dot product covers 4
// bytes; per lane, xsv holds the activation block scale and WeightScale builds the weight
// group scale, so the float step is acc += float(dot) * (ws * xs) on whole vectors. With an
// odd number of blocks the last pair is half padding: zero activations and scales.
//
//   avx512_vnni  vpdpbusd (u8 x s8, 4 products per int32 lane). The weight is the u8 operand:
//                4-bit codes as they are; 8-bit values and lut values + 128 (xor 0x80), and
//                the dot starts from corr = -128 * sum(xq) of the lane to take the offset out.
//   avx2         vpmaddubsw + vpmaddwd. 4-bit codes (<= 15) as the u8 operand directly; signed
//                values (8-bit, lut) by llama.cpp's sign trick: maddubs(|w|, sign(x, w)), whose
//                pairs stay within int16 (2 * 128 * 127 <= 32767) as long as xq != -128.
//                4-bit: both 32-byte halves of a pair map lane j to the same block, so their
//                dots add before one float step per pair (8-bit: one per half = block).
//
// Two-digit activations (kSplit, "int8x2"): x / xs = hi + lo / 128 with hi, lo int8
// (|lo| <= 64), so the activation error drops from xs / 2 to xs / 256 per element, 15 bits
// per block instead of 8. Every dot runs twice, once per digit, on the same decoded weights,
// and the int32 results combine as (dot_hi << 7) + dot_lo before the one float step (xsv then
// holds xs / 128). With the u8 offset, corr = -128 * (128 * sum(hi) + sum(lo)) / 128, so the
// hi dot starts from corr and the lo dot from the shifted hi dot.
#pragma once

#include <immintrin.h>

#include <cstdint>

#define LLMSERVE_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define LLMSERVE_AVX512_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

namespace llmserve_quant {

enum class Mode { kCodes4, kLut4, kInt8 };  // 4-bit codes as values, 4-bit through lut, int8

struct WeightView {
  const uint8_t* q;      // row n starts at q + n * row_bytes
  int64_t row_bytes;     // K (8-bit) or K / 2 (4-bit)
  const float* scales;   // [N, num_groups]
  const float* mins;     // [N, num_groups] or nullptr
  const int8_t* lut;     // [16] or nullptr
  const float* bias;     // [N] or nullptr
  int64_t num_groups;
};

struct ActView {
  const int8_t* xq;      // [M, 64 * num_pairs] pair layout above (the hi digit with kSplit)
  const int8_t* xq2;     // [M, 64 * num_pairs] the lo digit (kSplit), else nullptr
  const float* xsv;      // [M, 16 * num_pairs] block scale per int32 lane (0 in padding)
  const int32_t* corr;   // [M, 16 * num_pairs] -128 * sum of the lane's 4 xq
  const float* gsum;     // [M, num_groups] sum of x over each weight group (with mins)
  int64_t num_pairs;
  bool odd_blocks;       // the last pair holds one block
};

// Where each pair's weight scales are: the 16 lanes read scales[n, base[p] + idx[p][lane]],
// idx in 0..3 (a pair spans at most 4 groups of 16 columns), count[p] of them in bounds.
struct PairTable {
  const int32_t* base;   // [num_pairs]
  const int32_t* count;  // [num_pairs] 1..4
  const int32_t* idx;    // [num_pairs, 16]
};

// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI

template <Mode kMode>
LLMSERVE_AVX512_TARGET inline __m512i load_weights512(const uint8_t* row, int64_t p, bool half,
                                                      __m512i lut) {
  if constexpr (kMode == Mode::kInt8) {
    const __m512i v = half ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, row + 64 * p)
                           : _mm512_loadu_si512(row + 64 * p);
    return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    const __m256i v = half ? _mm256_maskz_loadu_epi8(0xFFFFu, row + 32 * p)
                           : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * p));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
    const __m512i codes = _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
    if constexpr (kMode == Mode::kLut4) return _mm512_shuffle_epi8(lut, codes);
    return codes;
  }
}

LLMSERVE_AVX512_TARGET inline __m512 weight_scales512(const float* row, const PairTable& t,
                                                      int64_t p) {
  const __mmask8 mask = static_cast<__mmask8>((1u << t.count[p]) - 1);
  const __m128 four = _mm_maskz_loadu_ps(mask, row + t.base[p]);
  const __m512i idx = _mm512_loadu_si512(t.idx + 16 * p);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(four));
}

// acc += mins[n, :] . gsum[m, :]
LLMSERVE_AVX512_TARGET inline __m512 mins_dot512(__m512 acc, const float* mins, const float* gsum,
                                                 int64_t num_groups) {
  for (int64_t g = 0; g < num_groups; g += 16) {
    const int64_t left = num_groups - g;
    const __mmask16 mask = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, mins + g),
                          _mm512_maskz_loadu_ps(mask, gsum + g), acc);
  }
  return acc;
}

// y[m0 + i, n0 + r] (row stride ldy) for r < R, i < MT
template <Mode kMode, bool kSplit, int R, int MT>
LLMSERVE_AVX512_TARGET void tile512(const WeightView& w, const ActView& a, const PairTable& t,
                                    int64_t n0, int64_t m0, float* y, int64_t ldy) {
  constexpr bool kOffset = kMode != Mode::kCodes4;
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MT; ++i) acc[r][i] = _mm512_setzero_ps();
  __m512i lut = _mm512_setzero_si512();
  if constexpr (kMode == Mode::kLut4) {
    const __m128i l = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.lut));
    lut = _mm512_broadcast_i32x4(_mm_xor_si128(l, _mm_set1_epi8(static_cast<char>(0x80))));
  }
  const int64_t xq_stride = 64 * a.num_pairs, lane_stride = 16 * a.num_pairs;
  for (int64_t p = 0; p < a.num_pairs; ++p) {
    const bool half = a.odd_blocks && p == a.num_pairs - 1;
    __m512i wv[R];
    __m512 ws[R];
    for (int r = 0; r < R; ++r) {
      wv[r] = load_weights512<kMode>(w.q + (n0 + r) * w.row_bytes, p, half, lut);
      ws[r] = weight_scales512(w.scales + (n0 + r) * w.num_groups, t, p);
    }
    for (int i = 0; i < MT; ++i) {
      const int64_t m = m0 + i;
      const __m512i xv = _mm512_loadu_si512(a.xq + m * xq_stride + 64 * p);
      const __m512i xv2 = kSplit ? _mm512_loadu_si512(a.xq2 + m * xq_stride + 64 * p) : xv;
      const __m512 xs = _mm512_loadu_ps(a.xsv + m * lane_stride + 16 * p);
      const __m512i start =
          kOffset ? _mm512_loadu_si512(a.corr + m * lane_stride + 16 * p) : _mm512_setzero_si512();
      for (int r = 0; r < R; ++r) {
        __m512i dot = _mm512_dpbusd_epi32(start, wv[r], xv);
        if constexpr (kSplit) dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(dot, 7), wv[r], xv2);
        acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws[r], xs), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t n = n0 + r;
    for (int i = 0; i < MT; ++i) {
      __m512 v = acc[r][i];
      if (w.mins != nullptr)
        v = mins_dot512(v, w.mins + n * w.num_groups, a.gsum + (m0 + i) * w.num_groups, w.num_groups);
      y[(m0 + i) * ldy + n] = _mm512_reduce_add_ps(v) + (w.bias ? w.bias[n] : 0.f);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA: the same walk, a pair as two 32-byte halves h (lanes 8h .. 8h+7)

LLMSERVE_AVX2_TARGET inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// the signed values (kInt8, kLut4) or codes (kCodes4) of half h of pair p
template <Mode kMode>
LLMSERVE_AVX2_TARGET inline __m256i load_weights256(const uint8_t* row, int64_t p, int h,
                                                    bool half, __m256i lut) {
  if constexpr (kMode == Mode::kInt8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 64 * p + 32 * h));
  } else {
    const __m256i v =
        half ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * p)))
             : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * p));
    const __m256i codes = _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
    if constexpr (kMode == Mode::kLut4) return _mm256_shuffle_epi8(lut, codes);
    return codes;
  }
}

LLMSERVE_AVX2_TARGET inline void weight_scales256(const float* row, const PairTable& t, int64_t p,
                                                  __m256* lo, __m256* hi) {
  const __m128i lanes = _mm_setr_epi32(0, 1, 2, 3);
  const __m128i mask = _mm_cmpgt_epi32(_mm_set1_epi32(t.count[p]), lanes);
  const __m256 four = _mm256_castps128_ps256(_mm_maskload_ps(row + t.base[p], mask));
  const int32_t* idx = t.idx + 16 * p;
  *lo = _mm256_permutevar8x32_ps(four, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx)));
  *hi = _mm256_permutevar8x32_ps(four, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx + 8)));
}

LLMSERVE_AVX2_TARGET inline __m256 mins_dot256(__m256 acc, const float* mins, const float* gsum,
                                               int64_t num_groups) {
  int64_t g = 0;
  for (; g + 8 <= num_groups; g += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(mins + g), _mm256_loadu_ps(gsum + g), acc);
  alignas(32) float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t j = g; j < num_groups; ++j) tail[j - g] = mins[j] * gsum[j];
  return _mm256_add_ps(acc, _mm256_load_ps(tail));
}

// maddubs pairs of (|w|, sign(x, w)) summed to int32 lanes: signed w times x
LLMSERVE_AVX2_TARGET inline __m256i signed_dot256(__m256i wv, __m256i xv) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv)),
                           _mm256_set1_epi16(1));
}

// 4-bit: the dot of a pair's two halves (lo, hi nibble vectors) with one digit array
template <Mode kMode>
LLMSERVE_AVX2_TARGET inline __m256i nibble_dot256(__m256i lo, __m256i hi, const int8_t* xq) {
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32));
  if constexpr (kMode == Mode::kCodes4) {  // |pair| <= 2 * 15 * 127: two of them fit int16
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1)),
                             _mm256_set1_epi16(1));
  } else {
    return _mm256_add_epi32(signed_dot256(lo, x0), signed_dot256(hi, x1));
  }
}

template <Mode kMode, bool kSplit, int R, int MT>
LLMSERVE_AVX2_TARGET void tile256(const WeightView& w, const ActView& a, const PairTable& t,
                                  int64_t n0, int64_t m0, float* y, int64_t ldy) {
  __m256 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MT; ++i) acc[r][i] = _mm256_setzero_ps();
  __m256i lut = _mm256_setzero_si256();
  if constexpr (kMode == Mode::kLut4)
    lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.lut)));
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t xq_stride = 64 * a.num_pairs, lane_stride = 16 * a.num_pairs;
  for (int64_t p = 0; p < a.num_pairs; ++p) {
    const bool half = a.odd_blocks && p == a.num_pairs - 1;
    __m256 ws[R][2];
    for (int r = 0; r < R; ++r)
      weight_scales256(w.scales + (n0 + r) * w.num_groups, t, p, &ws[r][0], &ws[r][1]);
    if constexpr (kMode == Mode::kInt8) {
      for (int h = 0; h < (half ? 1 : 2); ++h) {
        __m256i wv[R];
        for (int r = 0; r < R; ++r) wv[r] = load_weights256<kMode>(w.q + (n0 + r) * w.row_bytes, p, h, half, lut);
        for (int i = 0; i < MT; ++i) {
          const int64_t m = m0 + i;
          const int64_t at = m * xq_stride + 64 * p + 32 * h;
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq + at));
          const __m256 xs = _mm256_loadu_ps(a.xsv + m * lane_stride + 16 * p + 8 * h);
          for (int r = 0; r < R; ++r) {
            __m256i dot = signed_dot256(wv[r], xv);
            if constexpr (kSplit) {
              const __m256i xv2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq2 + at));
              dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 7), signed_dot256(wv[r], xv2));
            }
            acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws[r][h], xs), acc[r][i]);
          }
        }
      }
    } else {
      // 4-bit: lane j of both halves reads the same block (nibble order) with G >= 32, so the
      // two halves' int32 dots add up before the one float step
      __m256i lo[R], hi[R];
      for (int r = 0; r < R; ++r) {
        lo[r] = load_weights256<kMode>(w.q + (n0 + r) * w.row_bytes, p, 0, half, lut);
        hi[r] = load_weights256<kMode>(w.q + (n0 + r) * w.row_bytes, p, 1, half, lut);
      }
      for (int i = 0; i < MT; ++i) {
        const int64_t m = m0 + i;
        const int64_t at = m * xq_stride + 64 * p;
        const __m256 xs = _mm256_loadu_ps(a.xsv + m * lane_stride + 16 * p);
        for (int r = 0; r < R; ++r) {
          __m256i dot = nibble_dot256<kMode>(lo[r], hi[r], a.xq + at);
          if constexpr (kSplit)
            dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 7), nibble_dot256<kMode>(lo[r], hi[r], a.xq2 + at));
          acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws[r][0], xs), acc[r][i]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t n = n0 + r;
    for (int i = 0; i < MT; ++i) {
      __m256 v = acc[r][i];
      if (w.mins != nullptr)
        v = mins_dot256(v, w.mins + n * w.num_groups, a.gsum + (m0 + i) * w.num_groups, w.num_groups);
      y[(m0 + i) * ldy + n] = hsum256(v) + (w.bias ? w.bias[n] : 0.f);
    }
  }
}

}  // namespace llmserve_quant
