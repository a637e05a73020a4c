// SIMD vectors of fp32 lanes for the C++ CPU kernels, one struct per instruction set, all
// with the same interface, so a kernel body is written once (``*_impl.h``) and compiled once
// per ISA (see isa.h). Memory holds fp32, bf16 (raw uint16_t) or, read only, fp8 KV elements
// (fp8.h); arithmetic is fp32.
//
//   Vec512     AVX-512F/BW/VL: 16 lanes       Vec256   AVX2 + FMA: 8 lanes
//   VecScalar  one lane, plain C++ (any CPU)
//   Vec256x2   16 lanes as two Vec256: the AVX-512 code's shape (its tiles, head groups,
//              tails) on AVX2 instructions, a path for tests on hosts without AVX-512
//
// The x86 structs' functions carry their own target attributes: the library is built for the
// baseline x86-64 target and picks a path at run time, so one build is safe on every host.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "fp8.h"  // fp8_e4m3 / fp8_e5m2 KV cache elements: loads widen them to fp32 lanes

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LLMSERVE_X86 1
#define LLMSERVE_T512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"), always_inline))
#define LLMSERVE_T256 __attribute__((target("avx2,fma,f16c"), always_inline))
#endif

// bf16 <-> fp32 for one value: bf16 is the top half of an fp32; rounding is to nearest even
inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

struct VecScalar {
  static constexpr int W = 1;
  float v;
  static VecScalar zero() { return {0.f}; }
  static VecScalar set1(float x) { return {x}; }
  static VecScalar load(const float* p) { return {*p}; }
  static VecScalar load(const uint16_t* p) { return {bf16_to_float(*p)}; }
  static VecScalar load(const fp8_e4m3* p) { return {to_f32(*p)}; }
  static VecScalar load(const fp8_e5m2* p) { return {to_f32(*p)}; }
  // 2W elements as two vectors; bf16 pairs split into evens and odds (see Vec512::load2)
  template <typename T>
  static void load2(const T* p, VecScalar& a, VecScalar& b) { a = load(p), b = load(p + 1); }
  void store(float* p) const { *p = v; }
  void store(uint16_t* p) const { *p = float_to_bf16(v); }
  // the inverse of load2
  template <typename T>
  static void store2(T* p, VecScalar a, VecScalar b) { a.store(p), b.store(p + 1); }
  static VecScalar fma(VecScalar a, VecScalar b, VecScalar c) { return {a.v * b.v + c.v}; }
  static VecScalar add(VecScalar a, VecScalar b) { return {a.v + b.v}; }
  static VecScalar sub(VecScalar a, VecScalar b) { return {a.v - b.v}; }
  static VecScalar mul(VecScalar a, VecScalar b) { return {a.v * b.v}; }
  static VecScalar max(VecScalar a, VecScalar b) { return {a.v > b.v ? a.v : b.v}; }
  static VecScalar exp(VecScalar a) { return {std::exp(a.v)}; }
  static VecScalar recip(VecScalar a) { return {1.f / a.v}; }
  static float reduce_add(VecScalar a) { return a.v; }
  static float reduce_max(VecScalar a) { return a.v; }
  // out[j] = sum of the lanes of a_j, for four vectors
  static void reduce4(VecScalar a0, VecScalar a1, VecScalar a2, VecScalar a3, float* out) {
    out[0] = a0.v, out[1] = a1.v, out[2] = a2.v, out[3] = a3.v;
  }
};

#ifdef LLMSERVE_X86
// e^x for a vector: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 polynomial (Cephes'
// expf coefficients, about 1 ulp), times 2^n built in the exponent bits. P: the intrinsics'
// prefix, SI: the width in the cast's name; one body for both widths.
#define LLMSERVE_EXP_BODY(P, SI)                                                              \
  x = P##_min_ps(P##_max_ps(x, P##_set1_ps(-87.3f)), P##_set1_ps(88.3f));                    \
  const auto n = P##_round_nearest_ps(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)));  \
  auto r = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);                                   \
  r = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), r);                                     \
  auto p = P##_set1_ps(1.9875691500e-4f);                                                    \
  p = P##_fmadd_ps(p, r, P##_set1_ps(1.3981999507e-3f));                                     \
  p = P##_fmadd_ps(p, r, P##_set1_ps(8.3334519073e-3f));                                     \
  p = P##_fmadd_ps(p, r, P##_set1_ps(4.1665795894e-2f));                                     \
  p = P##_fmadd_ps(p, r, P##_set1_ps(1.6666665459e-1f));                                     \
  p = P##_fmadd_ps(p, r, P##_set1_ps(5.0000001201e-1f));                                     \
  p = P##_fmadd_ps(p, P##_mul_ps(r, r), P##_add_ps(r, P##_set1_ps(1.f)));                    \
  const auto e = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23); \
  return P##_mul_ps(p, P##_castsi##SI##_ps(e));

LLMSERVE_T256 inline __m256 _mm256_round_nearest_ps(__m256 x) {
  return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
LLMSERVE_T512 inline __m512 _mm512_round_nearest_ps(__m512 x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

struct Vec256 {
  static constexpr int W = 8;
  __m256 v;
  LLMSERVE_T256 static Vec256 zero() { return {_mm256_setzero_ps()}; }
  LLMSERVE_T256 static Vec256 set1(float x) { return {_mm256_set1_ps(x)}; }
  LLMSERVE_T256 static Vec256 load(const float* p) { return {_mm256_loadu_ps(p)}; }
  LLMSERVE_T256 static Vec256 load(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
  }
  // fp8 (fp8.h): 8 bytes zero-extended to 16-bit lanes, moved to an fp16's bits, F16C-widened
  LLMSERVE_T256 static __m128i fp8_words(const uint8_t* p) {
    return _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  LLMSERVE_T256 static Vec256 load(const fp8_e5m2* p) {
    return {_mm256_cvtph_ps(_mm_slli_epi16(fp8_words(&p->bits), 8))};
  }
  // e4m3 as value / 2^8 (fp8.h: kE4m3Unit): the byte sign-extended and shifted by 7 puts
  // e, m in an fp16's exponent and mantissa and the sign in bits 15 and 14; bit 14 cleared
  LLMSERVE_T256 static Vec256 load(const fp8_e4m3* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(&p->bits));
    const __m128i w = _mm_cvtepi8_epi16(b);
    return {_mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(-16385)))};
  }
  LLMSERVE_T256 static void load2(const float* p, Vec256& a, Vec256& b) { a = load(p), b = load(p + 8); }
  template <typename F8>  // fp8: in order, as fp32 (no pairs to split)
  LLMSERVE_T256 static void load2(const F8* p, Vec256& a, Vec256& b) {
    a = load(p), b = load(p + 8);
  }
  LLMSERVE_T256 static void load2(const uint16_t* p, Vec256& a, Vec256& b) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    a.v = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    b.v = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  LLMSERVE_T256 void store(float* p) const { _mm256_storeu_ps(p, v); }
  // each lane rounded to bf16 (nearest even; NaN stays NaN), in the lane's top 16 bits
  LLMSERVE_T256 static __m256i bf16_bits(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_blendv_epi8(u, _mm256_set1_epi32(0x7fc00000), _mm256_castps_si256(nan));
  }
  LLMSERVE_T256 void store(uint16_t* p) const {
    const __m256i u = _mm256_srli_epi32(bf16_bits(v), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  // the inverse of load2: fp32 a then b; bf16 pairs (a[j], b[j])
  LLMSERVE_T256 static void store2(float* p, Vec256 a, Vec256 b) { a.store(p), b.store(p + 8); }
  LLMSERVE_T256 static void store2(uint16_t* p, Vec256 a, Vec256 b) {
    const __m256i lo = _mm256_srli_epi32(bf16_bits(a.v), 16);
    const __m256i hi = _mm256_and_si256(bf16_bits(b.v), _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_or_si256(lo, hi));
  }
  LLMSERVE_T256 static Vec256 fma(Vec256 a, Vec256 b, Vec256 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  LLMSERVE_T256 static Vec256 add(Vec256 a, Vec256 b) { return {_mm256_add_ps(a.v, b.v)}; }
  LLMSERVE_T256 static Vec256 sub(Vec256 a, Vec256 b) { return {_mm256_sub_ps(a.v, b.v)}; }
  LLMSERVE_T256 static Vec256 mul(Vec256 a, Vec256 b) { return {_mm256_mul_ps(a.v, b.v)}; }
  LLMSERVE_T256 static Vec256 max(Vec256 a, Vec256 b) { return {_mm256_max_ps(a.v, b.v)}; }
  // 1 / a, divided: the 12-bit estimate and a Newton step miss 1 / 1 by an ulp, and silu(80)
  // must stay 80 (Vec512 takes its 14-bit estimate, which does not)
  LLMSERVE_T256 static Vec256 recip(Vec256 a) { return {_mm256_div_ps(_mm256_set1_ps(1.f), a.v)}; }
  LLMSERVE_T256 static __m256 exp_(__m256 x) { LLMSERVE_EXP_BODY(_mm256, 256) }
  LLMSERVE_T256 static Vec256 exp(Vec256 a) { return {exp_(a.v)}; }
  LLMSERVE_T256 static float reduce_add(Vec256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
  }
  LLMSERVE_T256 static float reduce_max(Vec256 a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  // hadd twice: lane j of the low half holds a_j's sum of lanes 0-3, the high half lanes 4-7
  LLMSERVE_T256 static __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  }
  LLMSERVE_T256 static void reduce4(Vec256 a0, Vec256 a1, Vec256 a2, Vec256 a3, float* out) {
    _mm_storeu_ps(out, sum4(a0.v, a1.v, a2.v, a3.v));
  }
};

// Vec512's 16 lanes and its memory orders (load2's even/odd bf16 split included) from two
// Vec256: lanes 0-7 in lo, 8-15 in hi. Compiled into the isa_avx2_w16 copy of each kernel
// (per_isa.h), which a host with AVX2 runs only when forced ("avx2_w16"): the tests put the
// AVX-512 code's logic through it on every host; it is not meant to be fast.
struct Vec256x2 {
  static constexpr int W = 16;
  Vec256 lo, hi;
  LLMSERVE_T256 static Vec256x2 zero() { return {Vec256::zero(), Vec256::zero()}; }
  LLMSERVE_T256 static Vec256x2 set1(float x) { return {Vec256::set1(x), Vec256::set1(x)}; }
  template <typename T>
  LLMSERVE_T256 static Vec256x2 load(const T* p) { return {Vec256::load(p), Vec256::load(p + 8)}; }
  // fp32: the first and second 16; bf16: lane j of a is element 2j, of b element 2j + 1
  template <typename T>
  LLMSERVE_T256 static void load2(const T* p, Vec256x2& a, Vec256x2& b) {
    if constexpr (sizeof(T) != 2) {  // fp32, fp8: in order
      a = load(p), b = load(p + 16);
    } else {
      Vec256::load2(p, a.lo, b.lo), Vec256::load2(p + 16, a.hi, b.hi);
    }
  }
  template <typename T>
  LLMSERVE_T256 void store(T* p) const { lo.store(p), hi.store(p + 8); }
  template <typename T>
  LLMSERVE_T256 static void store2(T* p, Vec256x2 a, Vec256x2 b) {
    if constexpr (sizeof(T) == 4) {
      a.store(p), b.store(p + 16);
    } else {
      Vec256::store2(p, a.lo, b.lo), Vec256::store2(p + 16, a.hi, b.hi);
    }
  }
#define LLMSERVE_X2(OP) \
  LLMSERVE_T256 static Vec256x2 OP(Vec256x2 a, Vec256x2 b) { return {Vec256::OP(a.lo, b.lo), Vec256::OP(a.hi, b.hi)}; }
  LLMSERVE_X2(add)
  LLMSERVE_X2(sub)
  LLMSERVE_X2(mul)
  LLMSERVE_X2(max)
#undef LLMSERVE_X2
  LLMSERVE_T256 static Vec256x2 fma(Vec256x2 a, Vec256x2 b, Vec256x2 c) {
    return {Vec256::fma(a.lo, b.lo, c.lo), Vec256::fma(a.hi, b.hi, c.hi)};
  }
  LLMSERVE_T256 static Vec256x2 exp(Vec256x2 a) { return {Vec256::exp(a.lo), Vec256::exp(a.hi)}; }
  LLMSERVE_T256 static Vec256x2 recip(Vec256x2 a) {
    return {Vec256::recip(a.lo), Vec256::recip(a.hi)};
  }
  LLMSERVE_T256 static float reduce_add(Vec256x2 a) { return Vec256::reduce_add(Vec256::add(a.lo, a.hi)); }
  LLMSERVE_T256 static float reduce_max(Vec256x2 a) { return Vec256::reduce_max(Vec256::max(a.lo, a.hi)); }
  LLMSERVE_T256 static void reduce4(Vec256x2 a0, Vec256x2 a1, Vec256x2 a2, Vec256x2 a3, float* out) {
    Vec256::reduce4(Vec256::add(a0.lo, a0.hi), Vec256::add(a1.lo, a1.hi), Vec256::add(a2.lo, a2.hi),
                    Vec256::add(a3.lo, a3.hi), out);
  }
};

struct Vec512 {
  static constexpr int W = 16;
  __m512 v;
  LLMSERVE_T512 static Vec512 zero() { return {_mm512_setzero_ps()}; }
  LLMSERVE_T512 static Vec512 set1(float x) { return {_mm512_set1_ps(x)}; }
  LLMSERVE_T512 static Vec512 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  LLMSERVE_T512 static Vec512 load(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  // 2W elements as two vectors. fp32: the first and second W. bf16: no shuffle, a 32-bit lane
  // holds a pair, so a = the even elements (shifted up), b = the odd ones (masked): lane j of
  // a is element 2j, of b element 2j + 1 (kernels that mix the two orders permute once).
  LLMSERVE_T512 static void load2(const float* p, Vec512& a, Vec512& b) { a = load(p), b = load(p + 16); }
  // fp8 (fp8.h): 16 bytes zero-extended to 16-bit lanes, moved to an fp16's bits, widened
  LLMSERVE_T512 static __m256i fp8_words(const uint8_t* p) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  LLMSERVE_T512 static Vec512 load(const fp8_e5m2* p) {
    return {_mm512_cvtph_ps(_mm256_slli_epi16(fp8_words(&p->bits), 8))};
  }
  LLMSERVE_T512 static Vec512 load(const fp8_e4m3* p) {  // value / 2^8, as Vec256's
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(&p->bits));
    const __m256i w = _mm256_cvtepi8_epi16(b);
    return {_mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(-16385)))};
  }
  template <typename F8>  // fp8: in order, as fp32 (no pairs to split)
  LLMSERVE_T512 static void load2(const F8* p, Vec512& a, Vec512& b) {
    a = load(p), b = load(p + 16);
  }
  LLMSERVE_T512 static void load2(const uint16_t* p, Vec512& a, Vec512& b) {
    const __m512i x = _mm512_loadu_si512(p);
    a.v = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    b.v = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  LLMSERVE_T512 void store(float* p) const { _mm512_storeu_ps(p, v); }
  // each lane rounded to bf16 (nearest even; NaN stays NaN), in the lane's top 16 bits
  LLMSERVE_T512 static __m512i bf16_bits(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000));
  }
  LLMSERVE_T512 void store(uint16_t* p) const {
    const __m512i u = _mm512_srli_epi32(bf16_bits(v), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(u));
  }
  // the inverse of load2: fp32 a then b; bf16 pairs (a[j], b[j])
  LLMSERVE_T512 static void store2(float* p, Vec512 a, Vec512 b) { a.store(p), b.store(p + 16); }
  LLMSERVE_T512 static void store2(uint16_t* p, Vec512 a, Vec512 b) {
    const __m512i lo = _mm512_srli_epi32(bf16_bits(a.v), 16);
    const __m512i hi = _mm512_and_si512(bf16_bits(b.v), _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
    _mm512_storeu_si512(p, _mm512_or_si512(lo, hi));
  }
  LLMSERVE_T512 static Vec512 fma(Vec512 a, Vec512 b, Vec512 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  LLMSERVE_T512 static Vec512 add(Vec512 a, Vec512 b) { return {_mm512_add_ps(a.v, b.v)}; }
  LLMSERVE_T512 static Vec512 sub(Vec512 a, Vec512 b) { return {_mm512_sub_ps(a.v, b.v)}; }
  LLMSERVE_T512 static Vec512 mul(Vec512 a, Vec512 b) { return {_mm512_mul_ps(a.v, b.v)}; }
  LLMSERVE_T512 static Vec512 max(Vec512 a, Vec512 b) { return {_mm512_max_ps(a.v, b.v)}; }
  // 1 / a: the 14-bit estimate and one Newton step r (2 - a r), instead of vdivps in silu's
  // sigmoid (Sapphire Rapids, bf16 [2048, 2 x 1536]: 0.90 -> 0.80-0.84 ms from cache, 1.75 ->
  // 1.61-1.66 from memory; [64, 2 x 1536] 30 -> 25 us)
  LLMSERVE_T512 static Vec512 recip(Vec512 a) {
    const __m512 r = _mm512_rcp14_ps(a.v);
    return {_mm512_mul_ps(r, _mm512_fnmadd_ps(a.v, r, _mm512_set1_ps(2.f)))};
  }
  LLMSERVE_T512 static __m512 exp_(__m512 x) { LLMSERVE_EXP_BODY(_mm512, 512) }
  LLMSERVE_T512 static Vec512 exp(Vec512 a) { return {exp_(a.v)}; }
  LLMSERVE_T512 static float reduce_add(Vec512 a) { return _mm512_reduce_add_ps(a.v); }
  LLMSERVE_T512 static float reduce_max(Vec512 a) { return _mm512_reduce_max_ps(a.v); }
  // fold each to 8 lanes, then the 8-lane hadd tree
  LLMSERVE_T512 static __m256 half_sum(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  }
  LLMSERVE_T512 static void reduce4(Vec512 a0, Vec512 a1, Vec512 a2, Vec512 a3, float* out) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(half_sum(a0.v), half_sum(a1.v)),
                                    _mm256_hadd_ps(half_sum(a2.v), half_sum(a3.v)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
  }
};
#endif

// one element of fp32 or bf16 memory <-> fp32 (fp8: fp8.h)
inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t h) { return bf16_to_float(h); }
inline void put_f32(float* p, float x) { *p = x; }
inline void put_f32(uint16_t* p, float x) { *p = float_to_bf16(x); }
