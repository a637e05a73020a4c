// fp8 elements of a quantized KV cache (``--kv-cache-dtype fp8``): torch's float8_e4m3fn and
// float8_e5m2, one byte each, as two distinct types so the kernels' overloads tell them apart.
//
//   e4m3fn  sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, 0x7f / 0xff NaN;
//           largest finite 448, smallest normal 2^-6, subnormals in steps of 2^-9
//   e5m2    sign, 5 exponent bits (bias 15), 2 mantissa bits; IEEE-like (infinities, NaNs);
//           largest finite 57344, smallest normal 2^-14, subnormals in steps of 2^-16
//
// Both are a truncated fp16: e5m2 is an fp16's top byte, and e4m3fn's bits shifted by 7 into
// an fp16 are the value / 2^8 (exponent bias 15 against 7), subnormals included. So a vector
// widens by a byte-to-word extension, a shift and the F16C conversion (vec.h). The kernels
// read e4m3 as value / 2^8 (kE4m3Unit: one multiply fewer per vector) and fold 2^8 into the
// scales they apply (paged_attention.cpp: check_inputs). Writes
// round to nearest even and saturate at the largest finite value (what torch's own
// ``.to(torch.float8_e4m3fn)`` does), so a large key clips instead of turning into a NaN.
// (0x7f, never written but for a NaN input, reads back as 480 in the vector code.)
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

struct fp8_e4m3 {
  uint8_t bits;
};
struct fp8_e5m2 {
  uint8_t bits;
};

inline float fp8_bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// an e4m3 element as the kernels read it: its value / kE4m3Unit (see above)
constexpr float kE4m3Unit = 256.f;
inline float to_f32(fp8_e4m3 x) {
  const uint32_t sign = uint32_t(x.bits & 0x80) << 24, e = (x.bits >> 3) & 15, m = x.bits & 7;
  if (e == 0) return (x.bits & 0x80 ? -1.f : 1.f) * float(m) * (1.f / 512.f / kE4m3Unit);
  return fp8_bits_to_float(sign | ((e + 127 - 7 - 8) << 23) | (m << 20));
}

inline float to_f32(fp8_e5m2 x) {
  const uint32_t sign = uint32_t(x.bits & 0x80) << 24, e = (x.bits >> 2) & 31, m = x.bits & 3;
  if (e == 0) return (x.bits & 0x80 ? -1.f : 1.f) * float(m) * (1.f / 65536.f);
  if (e == 31) return fp8_bits_to_float(sign | 0x7f800000u | (m << 21));  // inf, NaN
  return fp8_bits_to_float(sign | ((e + 127 - 15) << 23) | (m << 21));
}

// f rounded to the nearest fp8 with M mantissa bits and exponent bias Bias (ties to even),
// saturated at max_bits (the largest finite code, max_f32 its fp32 bits), NaN to nan_bits.
// Normals round the fp32 mantissa at bit 23 - M; subnormals (below 2^(1 - Bias)) count their
// steps of 2^(1 - Bias - M), rounded by adding 2^23 (the fp32 add rounds to nearest even).
// Branch-free, so a loop of it vectorizes (encode_rows in paged_attention_impl.h).
template <int M, int Bias>
inline uint8_t encode_fp8(float f, uint32_t max_f32, uint32_t max_bits, uint32_t nan_bits) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 24) & 0x80, a = u & 0x7fffffffu;
  constexpr int kDrop = 23 - M;
  const uint32_t half_even = ((1u << (kDrop - 1)) - 1) + ((a >> kDrop) & 1u);
  const uint32_t normal = ((a + half_even) >> kDrop) - (uint32_t(127 - Bias) << M);
  const float steps = fp8_bits_to_float(a) * fp8_bits_to_float(uint32_t(127 - 1 + Bias + M) << 23);
  uint32_t sub;
  const float rounded = steps + 8388608.f;  // 2^23: the sum's last bit is the rounded count
  std::memcpy(&sub, &rounded, 4);
  sub &= 0x7fffffu;
  uint32_t code = a < (uint32_t(127 + 1 - Bias) << 23) ? sub : normal;
  code = a >= max_f32 ? max_bits : code;
  code = a > 0x7f800000u ? nan_bits : code;
  return static_cast<uint8_t>(sign | code);
}

inline uint8_t fp8_code(fp8_e4m3*, float x) {
  return encode_fp8<3, 7>(x, 0x43e00000u /* 448 */, 0x7e, 0x7f);
}
inline uint8_t fp8_code(fp8_e5m2*, float x) {
  return encode_fp8<2, 15>(x, 0x47600000u /* 57344 */, 0x7b, 0x7f);
}
inline void put_f32(fp8_e4m3* p, float x) { p->bits = fp8_code(p, x); }
inline void put_f32(fp8_e5m2* p, float x) { p->bits = fp8_code(p, x); }
