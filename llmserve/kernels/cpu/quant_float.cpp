// Fused dequantize-matmul with float32 activations (W4A32 / W8A32): the accurate CPU path.
//
// The weight values are decoded to float in registers, 32 columns (one packing block) at a
// time, scaled and shifted by their group's scale and min, and multiplied with float
// activations: the result is the dequantize-then-matmul reference up to summation order.
//
//   decode shape (M < kTileRows): one pass over the weights, each decoded block reused for
//     every row of x; threads split the output rows N.
//   prefill shape, fp32: the weight is decoded to float in chunks of at most kChunkValues
//     values (16 MB: every SmolLM2 layer but the LM head in one chunk), all threads decoding,
//     and each chunk is multiplied by all of x with one multi-threaded ATen GEMM. The decode
//     is paid once per call, so at hundreds of rows the cost is the fp32 GEMM's; the chunk is
//     scratch memory freed after the call, never a resident float copy.
//   prefill shape, bf16_gemm (CPUs with AVX512_BF16, the caller decides): threads take tiles
//     of rows sized for L2 (kTileBytes), decode them to bf16 and multiply x (rounded to bf16
//     once) with ATen's bf16 GEMM (oneDNN: AMX or AVX512_BF16), 2-6x the fp32 rate; weights,
//     activations and outputs carry bf16's 8-bit mantissa, as bf16 inference does.
//
// No -march: the hot loops are compiled for x86-64-v4 (AVX-512), v3 (AVX2+FMA) and the
// baseline by GCC's target_clones, which picks one when the library loads.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_ops.h"

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTileRows = 16;  // M at and above which the decode + GEMM path runs
constexpr int64_t kChunkValues = int64_t{4} << 20;  // weight values decoded per GEMM
constexpr int64_t kTileBytes = 512 << 10;  // bf16 tile of weight rows, L2-resident
constexpr int kMaxRows = 4;  // rows of x accumulated together in the decode path

#if defined(__x86_64__) && !defined(__clang__)
#define LLMSERVE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define LLMSERVE_CLONES
#endif

struct Weight {
  const uint8_t* q4 = nullptr;  // bits 4: [N, K/2]
  const int8_t* q8 = nullptr;   // bits 8: [N, K]
  const float* scales = nullptr;
  const float* mins = nullptr;
  float lut[16];
  bool has_lut = false;
  int64_t k = 0, group = 0, groups_per_row = 0;
};

// Decode block b of row n into out[32] (float, scaled, shifted).
LLMSERVE_CLONES
void decode_block(const Weight& w, int64_t n, int64_t b, float* out) {
  float v[kBlock];
  if (w.q4 != nullptr) {
    const uint8_t* p = w.q4 + n * (w.k / 2) + b * 16;
    if (w.has_lut) {
      for (int j = 0; j < 16; ++j) {
        v[j] = w.lut[p[j] & 15];
        v[j + 16] = w.lut[p[j] >> 4];
      }
    } else {
      for (int j = 0; j < 16; ++j) {
        v[j] = static_cast<float>(p[j] & 15);
        v[j + 16] = static_cast<float>(p[j] >> 4);
      }
    }
  } else {
    const int8_t* p = w.q8 + n * w.k + b * kBlock;
    for (int j = 0; j < kBlock; ++j) v[j] = static_cast<float>(p[j]);
  }
  const int64_t row = n * w.groups_per_row;
  const int64_t per_group = std::min<int64_t>(w.group, kBlock);  // 16 or 32
  for (int64_t h = 0; h < kBlock; h += per_group) {
    const int64_t g = row + (b * kBlock + h) / w.group;
    const float s = w.scales[g];
    const float m = w.mins != nullptr ? w.mins[g] : 0.0f;
    for (int64_t j = h; j < h + per_group; ++j) out[j] = v[j] * s + m;
  }
}

// y[m, n] for rows m0..m0+rows of x and output rows [n0, n1): one decode per block.
// Portable version (lut weights, and CPUs without AVX2).
void gemv_rows_generic(const Weight& w, const float* x, int64_t m0, int rows, int64_t n0,
                       int64_t n1, float* y, int64_t n_total) {
  float wb[kBlock];
  for (int64_t n = n0; n < n1; ++n) {
    float acc[kMaxRows][16] = {};
    for (int64_t b = 0; b < w.k / kBlock; ++b) {
      decode_block(w, n, b, wb);
      for (int r = 0; r < rows; ++r) {
        const float* xr = x + (m0 + r) * w.k + b * kBlock;
        for (int j = 0; j < 16; ++j) acc[r][j] += wb[j] * xr[j] + wb[j + 16] * xr[j + 16];
      }
    }
    for (int r = 0; r < rows; ++r) {
      float sum = 0.0f;
      for (int j = 0; j < 16; ++j) sum += acc[r][j];
      y[(m0 + r) * n_total + n] = sum;
    }
  }
}

#if defined(__x86_64__)
#include "quant_float_gemv_impl.h"  // gemv_avx512<R>, gemv_avx2<R>
#endif

enum class Path { kGeneric, kAvx2, kAvx512 };

// isa: "auto" (the best this CPU runs), "avx512", "avx2" or "scalar" (tests force each one).
Path pick_path(const Weight& w, const std::string& isa) {
  bool has512 = false, has2 = false;
#if defined(__x86_64__)
  __builtin_cpu_init();
  has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  TORCH_CHECK(isa == "auto" || isa == "avx512" || isa == "avx2" || isa == "scalar",
              "quant_linear_f32: isa must be auto, avx512, avx2 or scalar, got ", isa);
  TORCH_CHECK(isa != "avx512" || has512, "quant_linear_f32: this CPU has no AVX-512");
  TORCH_CHECK(isa != "avx2" || has2, "quant_linear_f32: this CPU has no AVX2/FMA");
  if (isa == "scalar") return Path::kGeneric;
  if (has512 && isa != "avx2") return Path::kAvx512;
  if (has2) return Path::kAvx2;
  return Path::kGeneric;
}

template <int R>
void gemv_dispatch(Path path, const Weight& w, const float* x, int64_t m0, int64_t n0, int64_t n1,
                   float* y, int64_t n_total) {
#if defined(__x86_64__)
  if (path == Path::kAvx512) return gemv_avx512<R>(w, x, m0, n0, n1, y, n_total);
  if (path == Path::kAvx2 && !w.has_lut) return gemv_avx2<R>(w, x, m0, n0, n1, y, n_total);
#endif
  gemv_rows_generic(w, x, m0, R, n0, n1, y, n_total);
}

void gemv_rows(Path path, const Weight& w, const float* x, int64_t m0, int rows, int64_t n0,
               int64_t n1, float* y, int64_t n_total) {
  switch (rows) {
    case 1: return gemv_dispatch<1>(path, w, x, m0, n0, n1, y, n_total);
    case 2: return gemv_dispatch<2>(path, w, x, m0, n0, n1, y, n_total);
    case 3: return gemv_dispatch<3>(path, w, x, m0, n0, n1, y, n_total);
    default: return gemv_dispatch<4>(path, w, x, m0, n0, n1, y, n_total);
  }
}

#if defined(__x86_64__)
// rows [n0, n1) of a 4-bit weight without lut, decoded to float: out[(n - n0) * K + k]
__attribute__((target("avx512f,avx512bw,avx512vl,fma")))
void decode_rows_avx512(const Weight& w, int64_t n0, int64_t n1, float* out) {
  const __m512i low4 = _mm512_set1_epi32(15);
  const int64_t num_blocks = w.k / kBlock;
  const int64_t bpg = w.group / kBlock;  // 4-bit groups are whole blocks
  for (int64_t n = n0; n < n1; ++n) {
    const float* sc = w.scales + n * w.groups_per_row;
    const float* mn = w.mins != nullptr ? w.mins + n * w.groups_per_row : nullptr;
    float* o = out + (n - n0) * w.k;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t g = b / bpg;
      const __m512 s = _mm512_set1_ps(sc[g]), m = _mm512_set1_ps(mn != nullptr ? mn[g] : 0.0f);
      const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(w.q4 + n * (w.k / 2) + b * 16)));
      _mm512_storeu_ps(o + b * kBlock, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, low4)), s, m));
      _mm512_storeu_ps(o + b * kBlock + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), s, m));
    }
  }
}
#endif

// rows [n0, n1) decoded to float: out[(n - n0) * K + k]
void decode_rows(Path path, const Weight& w, int64_t n0, int64_t n1, float* out) {
#if defined(__x86_64__)
  if (path == Path::kAvx512 && w.q4 != nullptr && !w.has_lut) return decode_rows_avx512(w, n0, n1, out);
#endif
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < w.k / kBlock; ++b) decode_block(w, n, b, out + (n - n0) * w.k + b * kBlock);
}

bool cpu_has_bf16() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
#else
  return false;
#endif
}

#if defined(__x86_64__)
// rows [n0, n1) decoded to bf16 (round to nearest even): out[(n - n0) * K + k]; row: K floats
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
void decode_rows_bf16(Path path, const Weight& w, int64_t n0, int64_t n1, uint16_t* out, float* row) {
  if (path == Path::kAvx512) {  // straight from the codes (4-bit, lut or 8-bit) to bf16
    const int64_t bpg = w.group >= kBlock ? w.group / kBlock : 0;
    for (int64_t n = n0; n < n1; ++n) {
      const float* sc = w.scales + n * w.groups_per_row;
      const float* mn = w.mins != nullptr ? w.mins + n * w.groups_per_row : nullptr;
      uint16_t* o = out + (n - n0) * w.k;
      for (int64_t b = 0; b < w.k / kBlock; ++b) {
        __m512 v0, v1;
        decode_halves512(w, n, b, half_scales(sc, mn, b, bpg), &v0, &v1);
        _mm512_storeu_si512(o + b * kBlock, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
      }
    }
    return;
  }
  for (int64_t n = n0; n < n1; ++n) {
    decode_rows(path, w, n, n + 1, row);
    uint16_t* o = out + (n - n0) * w.k;
    for (int64_t j = 0; j < w.k; j += 32) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + j + 16), _mm512_loadu_ps(row + j));
      _mm512_storeu_si512(o + j, (__m512i)v);
    }
  }
}
#endif

// y = x @ W^T through bf16 tiles of W (the bf16_gemm prefill path)
void gemm_bf16_tiles(Path path, const Weight& w, const at::Tensor& x, int64_t n, float* yp) {
#if defined(__x86_64__)
  const int64_t m = x.size(0), k = w.k;
  const int64_t tile_rows = std::min(n, std::max<int64_t>(16, kTileBytes / (2 * k) / 16 * 16));
  const int64_t num_tiles = (n + tile_rows - 1) / tile_rows;
  const at::Tensor xb = x.to(at::kBFloat16);
  at::parallel_for(0, num_tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint16_t> buf(tile_rows * k);
    std::vector<float> row(k);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * tile_rows, n1 = std::min(n, n0 + tile_rows);
      decode_rows_bf16(path, w, n0, n1, buf.data(), row.data());
      const at::Tensor tile = at::from_blob(buf.data(), {n1 - n0, k}, xb.options());
      // raw copy: worker threads do not inherit InferenceMode, so no in-place ATen op on y
      const at::Tensor part = at::mm(xb, tile.t()).contiguous();  // [M, n1 - n0] bf16
      const uint16_t* pp = reinterpret_cast<const uint16_t*>(part.data_ptr());
      for (int64_t i = 0; i < m; ++i) {
        float* dst = yp + i * n + n0;
        for (int64_t j = 0; j < n1 - n0; ++j) {
          const uint32_t bits = static_cast<uint32_t>(pp[i * (n1 - n0) + j]) << 16;
          std::memcpy(dst + j, &bits, 4);
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "quant_linear_f32: bf16_gemm needs an x86-64 CPU with AVX512_BF16");
#endif
}

void check(bool ok, const std::string& what) { TORCH_CHECK(ok, "quant_linear_f32: ", what); }

Weight make_weight(const at::Tensor& qweight, const at::Tensor& scales,
                   const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& lut,
                   int64_t bits, int64_t group, int64_t n, int64_t k) {
  check(bits == 4 || bits == 8, "bits must be 4 or 8, got " + std::to_string(bits));
  check(k % kBlock == 0, "in_features must be a multiple of 32, got " + std::to_string(k));
  check(group > 0 && k % group == 0 && (group % kBlock == 0 || (group == 16 && bits == 8)),
        "group_size must divide in_features and be a multiple of 32 (16 for 8-bit), got " +
            std::to_string(group));
  check(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
            scales.numel() == n * (k / group),
        "scales must be contiguous float32 [N, K / group_size]");
  Weight w;
  if (bits == 4) {
    check(qweight.scalar_type() == at::kByte && qweight.size(1) * 2 == k, "4-bit qweight must be uint8 [N, K/2]");
    w.q4 = qweight.data_ptr<uint8_t>();
  } else {
    check(qweight.scalar_type() == at::kChar && qweight.size(1) == k, "8-bit qweight must be int8 [N, K]");
    w.q8 = qweight.data_ptr<int8_t>();
  }
  check(qweight.is_contiguous(), "qweight must be contiguous");
  w.scales = scales.data_ptr<float>();
  if (mins.has_value() && mins->defined()) {
    check(mins->scalar_type() == at::kFloat && mins->is_contiguous() && mins->numel() == scales.numel(),
          "mins must be contiguous float32 shaped like scales");
    w.mins = mins->data_ptr<float>();
  }
  if (lut.has_value() && lut->defined()) {
    check(bits == 4 && lut->numel() == 16 && lut->scalar_type() == at::kChar, "lut must be int8 [16] (4-bit only)");
    const int8_t* l = lut->data_ptr<int8_t>();
    for (int i = 0; i < 16; ++i) w.lut[i] = static_cast<float>(l[i]);
    w.has_lut = true;
  }
  w.k = k;
  w.group = group;
  w.groups_per_row = k / group;
  return w;
}

}  // namespace

at::Tensor llmserve_quant::quant_linear_f32(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& lut,
                            const c10::optional<at::Tensor>& perm, int64_t bits, int64_t group,
                            const c10::optional<at::Tensor>& bias, const std::string& isa,
                            bool bf16_gemm) {
  check(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "x must be float32 [M, K]");
  const int64_t n = qweight.size(0);
  const int64_t k = x_in.size(1);
  Weight w = make_weight(qweight, scales, mins, lut, bits, group, n, k);
  at::Tensor x = (perm.has_value() && perm->defined()) ? x_in.index_select(1, *perm) : x_in.contiguous();
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const Path path = pick_path(w, isa);
  if (m < kTileRows) {
    const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(k / kBlock, 1));
    at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
      for (int64_t m0 = 0; m0 < m; m0 += kMaxRows)
        gemv_rows(path, w, xp, m0, static_cast<int>(std::min<int64_t>(kMaxRows, m - m0)), n0, n1, yp, n);
    });
  } else if (bf16_gemm && cpu_has_bf16()) {
    gemm_bf16_tiles(path, w, x, n, yp);
  } else {
    const int64_t chunk_rows = std::max<int64_t>(1, std::min(n, kChunkValues / k));
    at::Tensor chunk = at::empty({chunk_rows, k}, x.options());
    for (int64_t n0 = 0; n0 < n; n0 += chunk_rows) {
      const int64_t n1 = std::min(n, n0 + chunk_rows);
      float* cp = chunk.data_ptr<float>();
      at::parallel_for(n0, n1, 16, [&](int64_t r0, int64_t r1) { decode_rows(path, w, r0, r1, cp + (r0 - n0) * k); });
      const at::Tensor part = chunk.narrow(0, 0, n1 - n0);
      if (n1 - n0 == n) {
        at::mm_out(y, x, part.t());
      } else {
        y.narrow(1, n0, n1 - n0).copy_(at::mm(x, part.t()));
      }
    }
  }
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}
