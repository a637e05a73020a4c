// Fused dequantize-matmul for llmserve's quantized weight layout (quantization/layout.py), the
// technique of llama.cpp: activations are quantized on the fly to int8, one absmax scale per
// block of 32 columns, and each weight group is an integer dot product scaled once:
//
//   y[m, n] = sum_b  scales[n, g(b)] * xs[m, b] * sum_{k in b} value[n, k] * xq[m, k]
//           + sum_g  mins[n, g] * gsum[m, g]                                   (+ bias[n])
//
// gsum is the exact float sum of x over the group when the op quantizes x itself, and
// sum_b xs[m, b] * sum(xq) when the caller passes xq/xs. With act_digits = 2 ("int8x2") each
// activation is two int8 digits, x = xs * (hi + lo / 128): 15 bits per block instead of 8,
// for two integer dots per weight vector (quant_gemm.h). With G = 16 (8-bit only) a block has
// two groups; the kernels scale per int32 lane (4 columns), so any G works the same way.
//
// Ops (namespace llmserve_quant), all fp32 activations:
//   quantize_activations(x [M, K]) -> (xq int8 [M, K], xs fp32 [M, K / 32])
//   quant_gemm(xq, xs, qweight, scales, mins?, lut?, bits, group_size, bias?, isa) -> y [M, N]
//   quant_linear(x [..., K], qweight, scales, mins?, lut?, perm?, bits, group_size, bias?, isa,
//                act_digits=1) -> y [..., N]: both steps in one call (perm: x[..., perm] first)
//   resolve_isa(isa) -> the path "auto" (or a forced isa) runs; errors if the CPU lacks it
//
// The file is compiled for the baseline x86-64 target; the SIMD tiles (quant_gemm.h) carry
// their own target attributes and are chosen at run time by __builtin_cpu_supports, so one
// build runs on AVX2-only and AVX-512 hosts alike. "scalar" is portable C++.

#include "quant_gemm.h"
#include "quant_activations.h"
#include "quant_ops.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

namespace llmserve_quant {
namespace {

bool cpu_supports(Isa isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (isa == Isa::kAvx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == Isa::kAvx512Vnni) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
           cpu_supports(Isa::kAvx2);
  }
  return true;
#else
  return isa == Isa::kScalar;
#endif
}

const char* isa_name(Isa isa) {
  return isa == Isa::kAvx512Vnni ? "avx512_vnni" : isa == Isa::kAvx2 ? "avx2" : "scalar";
}

Isa parse_isa(const std::string& name) {
  if (name == "auto") {
    for (Isa isa : {Isa::kAvx512Vnni, Isa::kAvx2})
      if (cpu_supports(isa)) return isa;
    return Isa::kScalar;
  }
  for (Isa isa : {Isa::kAvx512Vnni, Isa::kAvx2, Isa::kScalar}) {
    if (name == isa_name(isa)) {
      TORCH_CHECK(cpu_supports(isa), "isa '", name, "' is not supported by this CPU; use 'auto'");
      return isa;
    }
  }
  TORCH_CHECK(false, "isa must be one of 'auto', 'avx512_vnni', 'avx2', 'scalar', got '", name, "'");
}

// ---------------------------------------------------------------------------------------------
// Inputs

void check_tensor(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_shape(const at::Tensor& t, at::IntArrayRef shape, const char* name) {
  TORCH_CHECK(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
}

Problem check_weights(int64_t m, int64_t k, const at::Tensor& qweight, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& lut,
                      int64_t bits, int64_t group_size, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(k > 0 && k % kBlock == 0, "in_features (K) must be a positive multiple of 32, got ", k);
  TORCH_CHECK(group_size > 0 && k % group_size == 0 &&
                  (group_size % kBlock == 0 || (group_size == 16 && bits == 8)),
              "group_size must divide K = ", k, " and be a multiple of 32 (or 16 with bits 8), got ",
              group_size);
  check_tensor(qweight, bits == 8 ? at::kChar : at::kByte, "qweight");
  TORCH_CHECK(qweight.dim() == 2 && qweight.size(1) * (bits == 4 ? 2 : 1) == k, "qweight must be ",
              bits == 8 ? "int8 [N, K]" : "uint8 [N, K / 2]", " with K = ", k, ", got ", qweight.sizes());
  const int64_t n = qweight.size(0), num_groups = k / group_size;
  check_tensor(scales, at::kFloat, "scales");
  check_shape(scales, {n, num_groups}, "scales ([N, K / group_size])");
  if (mins) {
    check_tensor(*mins, at::kFloat, "mins");
    check_shape(*mins, {n, num_groups}, "mins ([N, K / group_size])");
  }
  if (lut) {
    TORCH_CHECK(bits == 4, "lut is only allowed with bits 4");
    check_tensor(*lut, at::kChar, "lut");
    check_shape(*lut, {16}, "lut");
  }
  if (bias) {
    check_tensor(*bias, at::kFloat, "bias");
    check_shape(*bias, {n}, "bias");
  }
  return {m, n, k, bits, group_size, num_groups};
}

Mode mode_of(const Problem& pb, const c10::optional<at::Tensor>& lut) {
  return pb.bits == 8 ? Mode::kInt8 : lut ? Mode::kLut4 : Mode::kCodes4;
}

// ---------------------------------------------------------------------------------------------
// Scalar path: each weight row unpacked once to int8 values, then every activation row

void unpack_row(const uint8_t* row, const Problem& pb, const int8_t* lut, int8_t* values) {
  if (pb.bits == 8) {
    std::copy(row, row + pb.k, reinterpret_cast<uint8_t*>(values));
    return;
  }
  for (int64_t b = 0; b < pb.k / kBlock; ++b) {
    for (int j = 0; j < 16; ++j) {
      const uint8_t byte = row[16 * b + j];
      const int lo = byte & 0x0F, hi = byte >> 4;
      values[kBlock * b + j] = static_cast<int8_t>(lut ? lut[lo] : lo);
      values[kBlock * b + j + 16] = static_cast<int8_t>(lut ? lut[hi] : hi);
    }
  }
}

void rows_scalar(const WeightView& w, const Acts& a, const Problem& pb, int64_t n0, int64_t n1,
                 float* y) {
  const int64_t sub = std::min<int64_t>(pb.group_size, kBlock), nb = pb.k / kBlock;
  std::vector<int8_t> values(pb.k);
  for (int64_t n = n0; n < n1; ++n) {
    unpack_row(w.q + n * w.row_bytes, pb, w.lut, values.data());
    const float* scales = w.scales + n * pb.num_groups;
    const bool split = !a.xq2.empty();
    for (int64_t i = 0; i < pb.m; ++i) {
      const int8_t* xq = a.xq.data() + i * pb.k;
      const int8_t* xq2 = split ? a.xq2.data() + i * pb.k : nullptr;
      float acc = 0.f;
      for (int64_t c0 = 0; c0 < pb.k; c0 += sub) {
        int32_t dot = 0, dot2 = 0;
        for (int64_t c = c0; c < c0 + sub; ++c) dot += values[c] * xq[c];
        if (split)
          for (int64_t c = c0; c < c0 + sub; ++c) dot2 += values[c] * xq2[c];
        const float d = split ? static_cast<float>(128 * dot + dot2) / 128.f : static_cast<float>(dot);
        acc += scales[c0 / pb.group_size] * a.xs[i * nb + c0 / kBlock] * d;
      }
      if (w.mins)
        for (int64_t g = 0; g < pb.num_groups; ++g)
          acc += w.mins[n * pb.num_groups + g] * a.gsum[i * pb.num_groups + g];
      y[i * pb.n + n] = acc + (w.bias ? w.bias[n] : 0.f);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// SIMD paths: rows [n0, n1) in tiles of R output rows x MT activation rows; activations walked
// in blocks of rows that stay in L2 while the weight rows stream past

template <Mode kMode, bool kSplit, bool kAvx512, int R, int MT>
void tile(const WeightView& w, const ActView& a, const PairTable& t, int64_t n0, int64_t m0,
          float* y, int64_t ldy) {
  if constexpr (kAvx512) {
    tile512<kMode, kSplit, R, MT>(w, a, t, n0, m0, y, ldy);
  } else {
    tile256<kMode, kSplit, R, MT>(w, a, t, n0, m0, y, ldy);
  }
}

template <Mode kMode, bool kSplit, bool kAvx512, int R>
void row_tile(const WeightView& w, const ActView& a, const PairTable& t, int64_t n0, int64_t m0,
              int64_t m1, float* y, int64_t ldy) {
  constexpr int kMt = kAvx512 ? 4 : 2;
  int64_t m = m0;
  for (; m + kMt <= m1; m += kMt) tile<kMode, kSplit, kAvx512, R, kMt>(w, a, t, n0, m, y, ldy);
  const int64_t left = m1 - m;
  if (left == 1) tile<kMode, kSplit, kAvx512, R, 1>(w, a, t, n0, m, y, ldy);
  if constexpr (kAvx512) {
    if (left == 2) tile<kMode, kSplit, kAvx512, R, 2>(w, a, t, n0, m, y, ldy);
    if (left == 3) tile<kMode, kSplit, kAvx512, R, 3>(w, a, t, n0, m, y, ldy);
  }
}

template <Mode kMode, bool kSplit, bool kAvx512>
void rows_simd(const WeightView& w, const ActView& a, const PairTable& t, int64_t m_total,
               int64_t n0, int64_t n1, float* y, int64_t ldy) {
  constexpr int R = 4;
  const int64_t m_block = std::max<int64_t>(8, (256 << 10) / (64 * a.num_pairs));  // ~256 KB of xq
  for (int64_t m0 = 0; m0 < m_total; m0 += m_block) {
    const int64_t m1 = std::min(m_total, m0 + m_block);
    int64_t n = n0;
    for (; n + R <= n1; n += R) row_tile<kMode, kSplit, kAvx512, R>(w, a, t, n, m0, m1, y, ldy);
    for (; n < n1; ++n) row_tile<kMode, kSplit, kAvx512, 1>(w, a, t, n, m0, m1, y, ldy);
  }
}

template <bool kSplit, bool kAvx512>
void rows_simd_mode(Mode mode, const WeightView& w, const ActView& a, const PairTable& t,
                    int64_t m_total, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  if (mode == Mode::kInt8) rows_simd<Mode::kInt8, kSplit, kAvx512>(w, a, t, m_total, n0, n1, y, ldy);
  if (mode == Mode::kLut4) rows_simd<Mode::kLut4, kSplit, kAvx512>(w, a, t, m_total, n0, n1, y, ldy);
  if (mode == Mode::kCodes4) rows_simd<Mode::kCodes4, kSplit, kAvx512>(w, a, t, m_total, n0, n1, y, ldy);
}

template <bool kAvx512>
void rows_simd_any(Mode mode, const WeightView& w, const ActView& a, const PairTable& t,
                   int64_t m_total, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  if (a.xq2 != nullptr) return rows_simd_mode<true, kAvx512>(mode, w, a, t, m_total, n0, n1, y, ldy);
  rows_simd_mode<false, kAvx512>(mode, w, a, t, m_total, n0, n1, y, ldy);
}

// ---------------------------------------------------------------------------------------------
// Driver

WeightView weight_view(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                       const c10::optional<at::Tensor>& lut, const c10::optional<at::Tensor>& bias) {
  return {static_cast<const uint8_t*>(qweight.data_ptr()), qweight.size(1), scales.data_ptr<float>(),
          mins ? mins->data_ptr<float>() : nullptr, lut ? lut->data_ptr<int8_t>() : nullptr,
          bias ? bias->data_ptr<float>() : nullptr, scales.size(1)};
}

// rows per task: at least ~64k multiply-adds, a multiple of the 4-row tile
int64_t row_grain(const Problem& pb) {
  return std::max<int64_t>(4, (65536 / std::max<int64_t>(1, pb.m * pb.k) + 3) / 4 * 4);
}

at::Tensor run_scalar(const Acts& a, const Problem& pb, const WeightView& w) {
  at::Tensor y = at::empty({pb.m, pb.n}, at::kFloat);
  float* out = y.data_ptr<float>();
  at::parallel_for(0, pb.n, row_grain(pb), [&](int64_t n0, int64_t n1) { rows_scalar(w, a, pb, n0, n1, out); });
  return y;
}

at::Tensor run_simd(const PairActs& pairs, const Problem& pb, const WeightView& w, Mode mode, Isa isa) {
  at::Tensor y = at::empty({pb.m, pb.n}, at::kFloat);
  float* out = y.data_ptr<float>();
  const ActView av{pairs.xq.data(), pairs.xq2.empty() ? nullptr : pairs.xq2.data(), pairs.xsv.data(), pairs.corr.empty() ? nullptr : pairs.corr.data(),
                   pairs.gsum.empty() ? nullptr : pairs.gsum.data(), pairs.num_pairs, (pb.k / kBlock) % 2 == 1};
  const PairTable table{pairs.base.data(), pairs.count.data(), pairs.idx.data()};
  at::parallel_for(0, pb.n, row_grain(pb), [&](int64_t n0, int64_t n1) {
    if (isa == Isa::kAvx512Vnni) {
      rows_simd_any<true>(mode, w, av, table, pb.m, n0, n1, out, pb.n);
    } else {
      rows_simd_any<false>(mode, w, av, table, pb.m, n0, n1, out, pb.n);
    }
  });
  return y;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Ops (quant_ops.h)

std::tuple<at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x) {
  check_tensor(x, at::kFloat, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [M, K], got ", x.sizes());
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % kBlock == 0, "x's K must be a multiple of 32, got ", k);
  at::Tensor xq = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor xs = at::empty({m, k / kBlock}, x.options());
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      quantize_row(xp + i * k, k, xq.data_ptr<int8_t>() + i * k, xs.data_ptr<float>() + i * (k / kBlock));
  });
  return {xq, xs};
}

at::Tensor quant_gemm(const at::Tensor& xq, const at::Tensor& xs, const at::Tensor& qweight,
                      const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                      const c10::optional<at::Tensor>& lut, int64_t bits, int64_t group_size,
                      const c10::optional<at::Tensor>& bias, const std::string& isa) {
  check_tensor(xq, at::kChar, "xq");
  check_tensor(xs, at::kFloat, "xs");
  TORCH_CHECK(xq.dim() == 2, "xq must be int8 [M, K], got ", xq.sizes());
  const Problem pb = check_weights(xq.size(0), xq.size(1), qweight, scales, mins, lut, bits, group_size, bias);
  check_shape(xs, {pb.m, pb.k / kBlock}, "xs ([M, K / 32])");
  const Isa chosen = parse_isa(isa);
  Acts a = copy_quantized(xq, xs, pb, mins.has_value());
  const WeightView w = weight_view(qweight, scales, mins, lut, bias);
  if (chosen == Isa::kScalar) return run_scalar(a, pb, w);
  return run_simd(to_pairs(std::move(a), pb), pb, w, mode_of(pb, lut), chosen);
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& lut,
                        const c10::optional<at::Tensor>& perm, int64_t bits, int64_t group_size,
                        const c10::optional<at::Tensor>& bias, const std::string& isa, int64_t act_digits) {
  TORCH_CHECK(act_digits == 1 || act_digits == 2, "act_digits must be 1 (int8) or 2 (int8x2), got ", act_digits);
  const bool split = act_digits == 2;
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "x must be float32 on the CPU, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, "x must be [..., K]");
  const int64_t k = x.size(-1);
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();  // [M, K]
  const Problem pb = check_weights(x2.size(0), k, qweight, scales, mins, lut, bits, group_size, bias);
  const Isa chosen = parse_isa(isa);
  const int64_t* perm_ptr = nullptr;
  if (perm) {
    check_tensor(*perm, at::kLong, "perm");
    check_shape(*perm, {k}, "perm ([K])");
    perm_ptr = perm->data_ptr<int64_t>();
    for (int64_t c = 0; c < k; ++c)
      TORCH_CHECK(perm_ptr[c] >= 0 && perm_ptr[c] < k, "perm values must be in [0, K), got ", perm_ptr[c]);
  }
  const WeightView w = weight_view(qweight, scales, mins, lut, bias);
  const float* xp = x2.data_ptr<float>();
  at::Tensor y = chosen == Isa::kScalar  // [M, N]
                     ? run_scalar(quantize_input(xp, perm_ptr, pb, mins.has_value(), split), pb, w)
                     : run_simd(quantize_pairs(xp, perm_ptr, pb, chosen, mins.has_value(), split), pb, w,
                                mode_of(pb, lut), chosen);
  auto sizes = x.sizes().vec();
  sizes.back() = pb.n;
  return y.view(sizes);
}

std::string resolve_isa(const std::string& isa) { return isa_name(parse_isa(isa)); }

}  // namespace llmserve_quant
