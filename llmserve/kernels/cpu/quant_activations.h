// The activations of quant_gemm.cpp's fused dequantize-matmul (included by it alone): each
// row of x quantized to int8 per block of 32 columns (absmax scale, round-half-even; with
// act_digits = 2 a second int8 digit), in the natural column order for the scalar path or in
// quant_gemm.h's pair layout for the SIMD tiles (AVX-512 and AVX2 versions first, then the
// portable code and the per-call drivers), with the group sums the mins term needs.
#pragma once

#include "aten.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "quant_gemm.h"

// ---------------------------------------------------------------------------------------------
// Activation quantization straight into the pair layout. Bit for bit the xq / xs of the
// portable quantize_row (below): exact absmax, one multiply by 127 / absmax, a clamp,
// round half to even (the default MXCSR mode of cvtps2dq). gsum: float sums per weight group.

namespace llmserve_quant {

struct PairOut {
  int8_t* xq;        // [64 * num_pairs] (the hi digit when xq2 is set)
  int8_t* xq2;       // [64 * num_pairs] the lo digit (two-digit activations) or nullptr
  float* xsv;        // [16 * num_pairs]
  int32_t* corr;     // [16 * num_pairs] or nullptr
  float* gsum;       // [num_groups] (zeroed) or nullptr
  int64_t group_size;
};

LLMSERVE_AVX512_TARGET inline float block_scale512(__m512 a, __m512 b, float* inv) {
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  *inv = amax > 0.f ? 127.f / amax : 0.f;
  return amax / 127.f;
}

// 16 values -> int8 digit(s): hi = round(t), and with lo set, *lo = round(128 * (t - hi))
LLMSERVE_AVX512_TARGET inline __m128i quantize16(__m512 v, float inv, __m128i* lo) {
  const __m512 t = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v, _mm512_set1_ps(inv)),
                                               _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
  const __m512i hi = _mm512_cvtps_epi32(t);
  if (lo != nullptr) {
    const __m512 rest = _mm512_sub_ps(t, _mm512_cvtepi32_ps(hi));  // in [-0.5, 0.5], exact
    *lo = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(rest, _mm512_set1_ps(128.f))));
  }
  return _mm512_cvtsepi32_epi8(hi);
}

// four 16-column pieces of a pair in register order: natural (8-bit weights), or b0 cols 0..15,
// b1 cols 0..15, b0 cols 16..31, b1 cols 16..31 (4-bit weights)
LLMSERVE_AVX512_TARGET inline __m512i pack_pair512(const __m128i* parts, bool nibbles) {
  const __m512i q = _mm512_inserti32x4(_mm512_castsi128_si512(parts[0]), parts[1], 1);
  const __m512i all = _mm512_inserti32x4(_mm512_inserti32x4(q, parts[2], 2), parts[3], 3);
  return nibbles ? _mm512_shuffle_i64x2(all, all, _MM_SHUFFLE(3, 1, 2, 0)) : all;
}

// one activation row x [K] (K = 32 * num_blocks) into out
LLMSERVE_AVX512_TARGET inline void quantize_pairs512(const float* x, int64_t num_blocks, bool nibbles,
                                                     const PairOut& out) {
  for (int64_t p = 0; 2 * p < num_blocks; ++p) {
    const bool both = 2 * p + 1 < num_blocks;
    const float* xp = x + 64 * p;
    const __m512 v0 = _mm512_loadu_ps(xp), v1 = _mm512_loadu_ps(xp + 16);
    const __m512 v2 = both ? _mm512_loadu_ps(xp + 32) : _mm512_setzero_ps();
    const __m512 v3 = both ? _mm512_loadu_ps(xp + 48) : _mm512_setzero_ps();
    float inv0, inv1;
    float d0 = block_scale512(v0, v1, &inv0), d1 = block_scale512(v2, v3, &inv1);
    const bool split = out.xq2 != nullptr;
    __m128i lo[4];
    const __m128i hi[4] = {quantize16(v0, inv0, split ? &lo[0] : nullptr),
                           quantize16(v1, inv0, split ? &lo[1] : nullptr),
                           quantize16(v2, inv1, split ? &lo[2] : nullptr),
                           quantize16(v3, inv1, split ? &lo[3] : nullptr)};
    const __m512i ones = _mm512_set1_epi8(1);
    const __m512i q = pack_pair512(hi, nibbles);
    _mm512_storeu_si512(out.xq + 64 * p, q);
    __m512i corr = _mm512_mullo_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, q),
                                      _mm512_set1_epi32(-128));
    if (split) {
      const __m512i q2 = pack_pair512(lo, nibbles);
      _mm512_storeu_si512(out.xq2 + 64 * p, q2);
      corr = _mm512_sub_epi32(corr, _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, q2));
      d0 /= 128.f;  // the combined dot counts in units of 1/128
      d1 /= 128.f;
    }
    const __mmask16 second = nibbles ? 0xF0F0 : 0xFF00;
    _mm512_storeu_ps(out.xsv + 16 * p, _mm512_mask_blend_ps(second, _mm512_set1_ps(d0), _mm512_set1_ps(d1)));
    if (out.corr) _mm512_storeu_si512(out.corr + 16 * p, corr);
    if (out.gsum) {
      const __m512 halves[4] = {v0, v1, v2, v3};
      for (int h = 0; h < (both ? 4 : 2); ++h)
        out.gsum[(64 * p + 16 * h) / out.group_size] += _mm512_reduce_add_ps(halves[h]);
    }
  }
}

// 4 x 8 int32 (each in [-127, 127]) -> 32 int8 in order
LLMSERVE_AVX2_TARGET inline __m256i pack32_256(const __m256i* d) {
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(d[0], d[1]), _mm256_packs_epi32(d[2], d[3]));
  return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// 32 values -> int8 digit(s) in column order (lo: the second digit, or nullptr)
LLMSERVE_AVX2_TARGET inline __m256i quantize32_256(const float* x, float* scale, __m256i* lo) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  *scale = amax / 127.f;
  __m256i q[4], r[4];
  for (int j = 0; j < 4; ++j) {
    const __m256 t = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)),
                                                 _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
    q[j] = _mm256_cvtps_epi32(t);
    const __m256 rest = _mm256_sub_ps(t, _mm256_cvtepi32_ps(q[j]));  // in [-0.5, 0.5], exact
    r[j] = _mm256_cvtps_epi32(_mm256_mul_ps(rest, _mm256_set1_ps(128.f)));
  }
  if (lo != nullptr) *lo = pack32_256(r);
  return pack32_256(q);
}

LLMSERVE_AVX2_TARGET inline float sum32_256(const float* x) {
  const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)),
                                 _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24)));
  return hsum256(s);
}

// blocks b0, b1 (32 int8 each, column order) stored in the pair layout at dst
LLMSERVE_AVX2_TARGET inline void store_pair256(int8_t* dst, __m256i b0, __m256i b1, bool nibbles) {
  if (nibbles) {
    const __m256i h0 = _mm256_permute2x128_si256(b0, b1, 0x20), h1 = _mm256_permute2x128_si256(b0, b1, 0x31);
    b0 = h0;
    b1 = h1;
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), b0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32), b1);
}

// as quantize_pairs512, without corr (the AVX2 tiles use the sign trick)
LLMSERVE_AVX2_TARGET inline void quantize_pairs256(const float* x, int64_t num_blocks, bool nibbles,
                                                   const PairOut& out) {
  for (int64_t p = 0; 2 * p < num_blocks; ++p) {
    const bool both = 2 * p + 1 < num_blocks;
    float d0, d1 = 0.f;
    const bool split = out.xq2 != nullptr;
    __m256i l0 = _mm256_setzero_si256(), l1 = _mm256_setzero_si256();
    const __m256i b0 = quantize32_256(x + 64 * p, &d0, split ? &l0 : nullptr);
    const __m256i b1 = both ? quantize32_256(x + 64 * p + 32, &d1, split ? &l1 : nullptr) : _mm256_setzero_si256();
    store_pair256(out.xq + 64 * p, b0, b1, nibbles);
    if (split) {
      store_pair256(out.xq2 + 64 * p, l0, l1, nibbles);
      d0 /= 128.f;  // the combined dot counts in units of 1/128
      d1 /= 128.f;
    }
    const __m256 s0 = _mm256_set1_ps(d0), s1 = _mm256_set1_ps(d1);
    const __m256 mixed = _mm256_blend_ps(s0, s1, 0xF0);
    _mm256_storeu_ps(out.xsv + 16 * p, nibbles ? mixed : s0);
    _mm256_storeu_ps(out.xsv + 16 * p + 8, nibbles ? mixed : s1);
    if (!out.gsum) continue;
    for (int64_t b = 2 * p; b < 2 * p + (both ? 2 : 1); ++b) {
      const float* xb = x + 32 * b;
      if (out.group_size == 16) {
        out.gsum[2 * b] += hsum256(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)));
        out.gsum[2 * b + 1] += hsum256(_mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
      } else {
        out.gsum[32 * b / out.group_size] += sum32_256(xb);
      }
    }
  }
}

}  // namespace llmserve_quant

namespace llmserve_quant {
namespace {

constexpr int64_t kBlock = 32;

enum class Isa { kScalar, kAvx2, kAvx512Vnni };

struct Problem {
  int64_t m, n, k, bits, group_size, num_groups;
};

constexpr float kMagic = 12582912.f;  // 1.5 * 2^23: (t + kMagic) - kMagic rounds t to even

float round_even(float t) { return (t + kMagic) - kMagic; }

// x [K] -> xq [K], xs [K / 32]: per block d = absmax / 127, xq = round-half-even(x / d); with
// xq2, also the second digit round-half-even(128 * (x / d - xq)).
// Portable code on purpose (no FMA contraction): every ISA path sees the same digits.
void quantize_row(const float* x, int64_t k, int8_t* xq, float* xs, int8_t* xq2 = nullptr) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    xs[b] = amax / 127.f;
    for (int j = 0; j < kBlock; ++j) {
      const float t = std::min(std::max(xb[j] * inv, -127.f), 127.f);
      const float hi = round_even(t);
      xq[b * kBlock + j] = static_cast<int8_t>(static_cast<int>(hi));
      if (xq2 != nullptr) xq2[b * kBlock + j] = static_cast<int8_t>(static_cast<int>(round_even((t - hi) * 128.f)));
    }
  }
}

// Activations of one call in the natural column order (what the scalar path reads).
struct Acts {
  int64_t m = 0, k = 0, num_groups = 0;
  std::vector<int8_t> xq;   // [M, K] (the hi digit with two digits)
  std::vector<int8_t> xq2;  // [M, K] the lo digit, or empty
  std::vector<float> xs;    // [M, K / 32]
  std::vector<float> gsum;  // [M, num_groups] (only with mins)
};

// Row i of x, its columns gathered through perm (act-order) into buf when perm is set.
const float* input_row(const float* x, const int64_t* perm, int64_t i, int64_t k,
                       std::vector<float>& buf) {
  const float* row = x + i * k;
  if (perm == nullptr) return row;
  for (int64_t c = 0; c < k; ++c) buf[c] = row[perm[c]];
  return buf.data();
}

Acts quantize_input(const float* x, const int64_t* perm, const Problem& pb, bool with_sums, bool split) {
  Acts a{pb.m, pb.k, pb.num_groups};
  a.xq.resize(pb.m * pb.k);
  if (split) a.xq2.resize(pb.m * pb.k);
  a.xs.resize(pb.m * (pb.k / kBlock));
  if (with_sums) a.gsum.assign(pb.m * pb.num_groups, 0.f);
  at::parallel_for(0, pb.m, std::max<int64_t>(1, 16384 / pb.k), [&](int64_t begin, int64_t end) {
    std::vector<float> gathered(perm ? pb.k : 0);
    for (int64_t i = begin; i < end; ++i) {
      const float* row = input_row(x, perm, i, pb.k, gathered);
      quantize_row(row, pb.k, a.xq.data() + i * pb.k, a.xs.data() + i * (pb.k / kBlock),
                   split ? a.xq2.data() + i * pb.k : nullptr);
      if (!with_sums) continue;
      for (int64_t c = 0; c < pb.k; ++c) a.gsum[i * pb.num_groups + c / pb.group_size] += row[c];
    }
  });
  return a;
}

Acts copy_quantized(const at::Tensor& xq, const at::Tensor& xs, const Problem& pb, bool with_sums) {
  Acts a{pb.m, pb.k, pb.num_groups};
  a.xq.assign(xq.data_ptr<int8_t>(), xq.data_ptr<int8_t>() + xq.numel());
  a.xs.assign(xs.data_ptr<float>(), xs.data_ptr<float>() + xs.numel());
  const bool has_min = std::any_of(a.xq.begin(), a.xq.end(), [](int8_t v) { return v == -128; });
  TORCH_CHECK(!has_min, "xq values must be in [-127, 127] (-128 is not allowed)");
  if (!with_sums) return a;
  a.gsum.assign(pb.m * pb.num_groups, 0.f);
  const int64_t sub = std::min<int64_t>(pb.group_size, kBlock);  // a block piece in one group
  for (int64_t i = 0; i < pb.m; ++i) {
    for (int64_t c0 = 0; c0 < pb.k; c0 += sub) {
      int32_t total = 0;
      for (int64_t c = c0; c < c0 + sub; ++c) total += a.xq[i * pb.k + c];
      a.gsum[i * pb.num_groups + c0 / pb.group_size] += a.xs[i * (pb.k / kBlock) + c0 / kBlock] * total;
    }
  }
  return a;
}

// The pair layout of quant_gemm.h: which natural column each byte of a pair holds (-1: pad).
int64_t pair_column(int64_t p, int64_t byte, bool nibble_order, int64_t k) {
  int64_t col = 64 * p + byte;
  if (nibble_order) col = kBlock * (2 * p + byte / 16 % 2) + byte % 16 + 16 * (byte / 32);
  return col < k ? col : -1;
}

// Activations of one call in the pair layout (what the SIMD paths read), and the PairTable.
struct PairActs {
  int64_t num_pairs = 0;
  std::vector<int8_t> xq;                 // [M, 64 * num_pairs]
  std::vector<int8_t> xq2;                // [M, 64 * num_pairs] the lo digit, or empty
  std::vector<float> xsv;                 // [M, 16 * num_pairs]
  std::vector<int32_t> corr;              // [M, 16 * num_pairs]
  std::vector<float> gsum;                // [M, num_groups] (only with mins)
  std::vector<int32_t> base, count, idx;  // PairTable
};

PairActs pair_table(const Problem& pb) {
  PairActs out;
  const int64_t num_pairs = (pb.k / kBlock + 1) / 2;
  out.num_pairs = num_pairs;
  out.base.resize(num_pairs);
  out.count.resize(num_pairs);
  out.idx.assign(16 * num_pairs, 0);
  for (int64_t p = 0; p < num_pairs; ++p) {
    out.base[p] = static_cast<int32_t>(64 * p / pb.group_size);
    out.count[p] = static_cast<int32_t>(std::min<int64_t>(4, pb.num_groups - out.base[p]));
    for (int64_t lane = 0; lane < 16; ++lane) {
      const int64_t col = pair_column(p, 4 * lane, pb.bits == 4, pb.k);
      if (col >= 0) out.idx[16 * p + lane] = static_cast<int32_t>(col / pb.group_size - out.base[p]);
    }
  }
  return out;
}

// From caller-quantized activations (natural order) by a plain gather.
PairActs to_pairs(Acts&& a, const Problem& pb) {
  PairActs out = pair_table(pb);
  const int64_t num_pairs = out.num_pairs, nb = pb.k / kBlock;
  out.xq.assign(pb.m * 64 * num_pairs, 0);
  out.xsv.assign(pb.m * 16 * num_pairs, 0.f);
  out.corr.assign(pb.m * 16 * num_pairs, 0);
  out.gsum = std::move(a.gsum);
  for (int64_t pos = 0; pos < 64 * num_pairs; ++pos) {
    const int64_t col = pair_column(pos / 64, pos % 64, pb.bits == 4, pb.k);
    if (col < 0) continue;
    for (int64_t i = 0; i < pb.m; ++i) {
      const int8_t v = a.xq[i * pb.k + col];
      out.xq[i * 64 * num_pairs + pos] = v;
      out.corr[i * 16 * num_pairs + pos / 4] -= 128 * v;
      out.xsv[i * 16 * num_pairs + pos / 4] = a.xs[i * nb + col / kBlock];
    }
  }
  return out;
}

// From fp32 x [M, K] (x[:, perm] when perm is given), quantized straight into the pair layout.
PairActs quantize_pairs(const float* x, const int64_t* perm, const Problem& pb, Isa isa, bool with_sums,
                        bool split) {
  PairActs out = pair_table(pb);
  const int64_t num_pairs = out.num_pairs;
  out.xq.resize(pb.m * 64 * num_pairs);
  if (split) out.xq2.resize(pb.m * 64 * num_pairs);
  out.xsv.resize(pb.m * 16 * num_pairs);
  if (isa == Isa::kAvx512Vnni) out.corr.resize(pb.m * 16 * num_pairs);
  if (with_sums) out.gsum.assign(pb.m * pb.num_groups, 0.f);
  at::parallel_for(0, pb.m, std::max<int64_t>(1, 16384 / pb.k), [&](int64_t begin, int64_t end) {
    std::vector<float> gathered(perm ? pb.k : 0);
    for (int64_t i = begin; i < end; ++i) {
      const float* row = input_row(x, perm, i, pb.k, gathered);
      const PairOut dst{out.xq.data() + i * 64 * num_pairs,
                        split ? out.xq2.data() + i * 64 * num_pairs : nullptr,
                        out.xsv.data() + i * 16 * num_pairs,
                        out.corr.empty() ? nullptr : out.corr.data() + i * 16 * num_pairs,
                        with_sums ? out.gsum.data() + i * pb.num_groups : nullptr, pb.group_size};
      if (isa == Isa::kAvx512Vnni) {
        quantize_pairs512(row, pb.k / kBlock, pb.bits == 4, dst);
      } else {
        quantize_pairs256(row, pb.k / kBlock, pb.bits == 4, dst);
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace llmserve_quant
