// The activations of quant_gemm.cpp's fused dequantize-matmul (included by it alone): each
// row of x quantized to int8 per block of 32 columns (absmax scale, round-half-even; with
// act_digits = 2 a second int8 digit), in the natural column order for the scalar path or in
// quant_gemm.h's pair layout for the SIMD tiles, with the group sums the mins term needs.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "quant_gemm.h"

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
