// The bf16 linear on CPUs with AVX512_BF16: y = x w^T (+ bias), x and w bf16, fp32 sums
// (vdpbf16ps, or fp32 FMAs with ``widen``), y rounded to bf16 once. PackedLinear
// (layers/cpu_linear.py) hands it decode-sized calls on AMD Zen 4, every call on Zen 5 and on
// Intel CPUs without AMX (widened there from more than 4 rows).
//
//   linear_bf16_pack(w [N, K])  -> packed [ceil(N / 48)][K / 2][48][2] bf16
//   linear_bf16(x [M, K], packed, N, bias?, widen)  -> y [M, N]
//
// ``widen``: the same product in fp32 FMAs instead of vdpbf16ps, x widened to fp32 once per
// call and each 32-bit pair of the packed weight split in registers (the even k's bf16 is the
// pair shifted left by 16, the odd k's the pair with its low half masked off). For CPUs whose
// vdpbf16ps runs slower than their fp32 FMAs: an Intel Xeon VM with AVX512_BF16 and no AMX
// (family 6 model 207, 2 threads, the default model's shapes, 30 weight copies) ran
// vdpbf16ps, ours and oneDNN's alike, at 180-200 GFLOP/s from 64 rows up against 356 for
// fp32 FMAs. Its sums are the fp32 GEMM's: in order over k, each product exact.
//
// Why our own: at a decode step's rows (M = one per running sequence) oneDNN's bf16 kernel
// leaves a two-core AMD Zen 4 idle. Timed per layer inside the engine (SmolLM2 bf16, batch
// 64), the o and down projections (576 outputs) and q|k|v (960) ran at 220-270 GFLOP/s and
// the MLP's gate|up (3072) at 335, against about 410 at prompt sizes, and a py-spy profile
// put 11% of the linears' main-thread samples in OpenMP's barrier; at one or two rows it
// streamed the weight at half the rate this kernel does. Here, as in the fp32 GEMM
// (gemm_impl.h), the weight is packed so a call reads it front to back: panels of 48
// columns, each k pair of a column next to each other (what vdpbf16ps multiplies: one 32-bit
// lane = two bf16), panels taken by the threads as they come free (parallel.h). A register
// tile is 8 rows x 48 columns (24 accumulators) and takes a panel whole, over all of K (55-147
// KB for the default model: from L2 after the first tile), its sums never leaving the
// registers; each tile asks for its share of the chunk's next panel while it multiplies.
// Each output is one in-order fp32 sum over k, so a row's result does not depend on the rows
// beside it. Measured in docs/bench/journal.md (Zen 4, 2026-11-27). The first version walked a
// panel slice by slice of K (64 pairs, L1-resident across the row tiles) with the tiles' sums
// in a per-thread scratch between slices, as the fp32 GEMM does by default; whole panels
// measured faster (Zen 4, the default model's four layer shapes, 30 weight copies, one
// process, seven alternated rounds, medians): 64 rows 0.98-1.10x (344-356 -> 348-380
// GFLOP/s), 16 rows 1.05-1.40x, 128 rows 1.05-1.12x (up to 421), the same bits.

// Only the AVX512_BF16 code exists: PackedLinear packs for it only where the CPU has it.

#include <algorithm>
#include <cstdint>

#include "isa.h"
#include "kernels_ops.h"
#include "linear_io.h"
#include "parallel.h"
#include "vec.h"  // LLMSERVE_X86 (and immintrin.h there)

namespace llmserve::gemm_bf16 {
constexpr int64_t kPanel = 48;            // output columns per panel (3 vectors of 16)
constexpr int64_t kTileRows = 8;          // rows per register tile
constexpr int64_t kRowBlock = 256;        // rows of x per pass over the weight
constexpr int64_t kChunksPerThread = 4;   // panel chunks per thread
constexpr int64_t kPairBytes = kPanel * 4;  // one k pair of a panel: 48 x 2 bf16

int64_t num_panels(int64_t n) { return (n + kPanel - 1) / kPanel; }

#ifdef LLMSERVE_X86
// the x86 code for AVX512_BF16 (the lambdas inside take the target too, as an attribute they
// would not)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

#include "prefetch_impl.h"  // Ahead

// k pairs of a tile between its asks for its share of the next panel, as gemm_impl.h's
// kAheadEvery (one pair of a panel is 192 bytes, as one k of the fp32 GEMM's)
constexpr int64_t kAheadEvery = 32;

// step(k) for the k pairs [0, kc), asking for ``ahead`` (this tile's share of the next
// panel, ``ahead_pairs`` pairs) beside them. A share of half the pairs or more (one or two
// row tiles a panel: up to 16 rows) is asked for a pair (three lines) every pair from the
// first; a smaller one a few lines every kAheadEvery pairs (Ahead::spread), not all in the
// tile's first pairs. One thread, 40 weight copies from memory (huge pages), the default
// model's q|k|v, gate|up and down shapes, widened, on an Intel Xeon VM (family 6 model 207),
// the fastest of 3,000 calls, alternated: M = 64 155-175 -> 171-181 GFLOP/s; M = 8 (one tile
// a panel) in groups read 67-125 against 89-170 a pair every pair (docs/bench/journal.md).
template <typename Step>
__attribute__((always_inline)) inline void over_pairs(int64_t kc, const char* ahead,
                                                      int64_t ahead_pairs, const Step& step) {
  if (ahead_pairs * 2 >= kc) {
    for (int64_t k = 0; k < kc; ++k) {
      if (k < ahead_pairs) {  // three prefetches, not prefetch<3>'s loop: faster at 8 rows
        const char* pair = ahead + k * kPairBytes;
        _mm_prefetch(pair, _MM_HINT_T0);
        _mm_prefetch(pair + 64, _MM_HINT_T0);
        _mm_prefetch(pair + 128, _MM_HINT_T0);
      }
      step(k);
    }
    return;
  }
  Ahead next;
  next.spread(ahead, ahead_pairs * kPairBytes, kc / kAheadEvery);
  over_groups<kAheadEvery>(kc, next, step);
}

// a tile's sums (+ bias) rounded to bf16 once and stored: R rows x 48 columns
template <int R>
__attribute__((always_inline)) inline void store_tile(__m512 (&acc)[R][3], const float* bias,
                                                     uint16_t* y, int64_t ldy) {
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 3; ++v) {
      __m512 out = acc[r][v];
      if (bias != nullptr) out = _mm512_add_ps(out, _mm512_loadu_ps(bias + v * 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + v * 16),
                          (__m256i)_mm512_cvtneps_pbh(out));
    }
  }
}

// y[r, 48 columns] = bf16(x[r, pairs] . w[pairs, 48 columns] + bias) for R rows, kc pairs.
// ``ahead``/``ahead_pairs``: this tile's share of the next panel to fetch.
template <int R>
inline void tile(const uint32_t* x, int64_t ldx, const uint16_t* w, int64_t kc, const float* bias,
                 uint16_t* y, int64_t ldy, const char* ahead, int64_t ahead_pairs) {
  __m512 acc[R][3];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 3; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  over_pairs(kc, ahead, ahead_pairs, [&](int64_t k) __attribute__((always_inline)) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w + k * 2 * kPanel);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(w + k * 2 * kPanel + 32);
    const __m512bh b2 = (__m512bh)_mm512_loadu_si512(w + k * 2 * kPanel + 64);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + k]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
    }
  });
  store_tile<R>(acc, bias, y, ldy);
}

// x's pair k of a row widened to fp32 (the ``widen`` path's x)
struct F32Pair {
  float even, odd;
};

// The same tile in fp32 FMAs: x as widened pairs, each loaded weight vector (16 columns x one
// k pair) split into its even and odd k's fp32 values.
template <int R>
inline void tile(const F32Pair* x, int64_t ldx, const uint16_t* w, int64_t kc, const float* bias,
                 uint16_t* y, int64_t ldy, const char* ahead, int64_t ahead_pairs) {
  __m512 acc[R][3];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 3; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  over_pairs(kc, ahead, ahead_pairs, [&](int64_t k) __attribute__((always_inline)) {
    for (int v = 0; v < 3; ++v) {
      const __m512i pairs = _mm512_loadu_si512(w + k * 2 * kPanel + v * 32);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
      for (int r = 0; r < R; ++r) {
        const F32Pair a = x[r * ldx + k];
        acc[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(a.even), even, acc[r][v]);
        acc[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(a.odd), odd, acc[r][v]);
      }
    }
  });
  store_tile<R>(acc, bias, y, ldy);
}

// X: uint32_t (x's bf16 pairs, vdpbf16ps) or F32Pair (widened, fp32 FMAs)
template <typename X, int R = kTileRows>
inline void tile_of(int rows, const X* x, int64_t ldx, const uint16_t* w, int64_t kc,
                    const float* bias, uint16_t* y, int64_t ldy, const char* ahead,
                    int64_t ahead_pairs) {
  if constexpr (R >= 1) {
    if (rows == R) return tile<R>(x, ldx, w, kc, bias, y, ldy, ahead, ahead_pairs);
    tile_of<X, R - 1>(rows, x, ldx, w, kc, bias, y, ldy, ahead, ahead_pairs);
  }
}

// rows [m0, m1) against panels [pb, pe): each panel whole, row tile by row tile (the panel
// stays in L2 across them), the next panel asked for by the tiles in shares: the chunk's
// next, after its last the first of the thread's next chunk (next_pb; -1: none), as
// gemm_impl.h's gemm_panels_whole (Zen 5, 30 weight copies, alternated per call: M = 64
// 16.15 -> 15.89 ms for the four layer shapes' 120 calls, 1-128 even or ahead by 1-2%).
template <typename X>
void linear_rows(const X* x, int64_t K2, const uint16_t* packed, const float* bias,
                 uint16_t* y, int64_t ldy, int64_t m0, int64_t m1, int64_t pb, int64_t pe,
                 int64_t next_pb) {
  const int64_t tiles = (m1 - m0 + kTileRows - 1) / kTileRows;
  for (int64_t p = pb; p < pe; ++p) {
    const uint16_t* panel = packed + p * K2 * 2 * kPanel;
    const int64_t ahead_p = p + 1 < pe ? p + 1 : next_pb;
    const uint16_t* ahead_panel = ahead_p >= 0 ? packed + ahead_p * K2 * 2 * kPanel : nullptr;
    const char* ahead = reinterpret_cast<const char*>(ahead_panel);
    const int64_t ahead_pairs = ahead == nullptr ? 0 : K2;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t m = m0 + t * kTileRows;
      const int rows = static_cast<int>(std::min(kTileRows, m1 - m));
      const int64_t kb = ahead_pairs * t / tiles, ke = ahead_pairs * (t + 1) / tiles;
      tile_of(rows, x + m * K2, K2, panel, K2, bias == nullptr ? nullptr : bias + p * kPanel,
              y + m * ldy + p * kPanel, ldy, ahead == nullptr ? nullptr : ahead + kb * kPairBytes,
              ke - kb);
    }
  }
}
#pragma GCC pop_options
#endif

at::Tensor linear_bf16_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(),
              "linear_bf16_pack: the weight must be a bfloat16 CPU matrix [out_features, "
              "in_features]");
  const int64_t N = w.size(0), K = w.size(1), np = num_panels(N);
  TORCH_CHECK(K % 2 == 0, "linear_bf16_pack: in_features must be even (got ", K, ")");
  at::Tensor padded = at::zeros({np * kPanel, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  // [np, 48, K/2, 2] -> [np, K/2, 48, 2]
  return padded.view({np, kPanel, K / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({-1});
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                       const c10::optional<at::Tensor>& bias, bool widen) {
  TORCH_CHECK(llmserve::cpu_supports(llmserve::Isa::kAvx512Bf16),
              "linear_bf16: this CPU has no AVX512_BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.device().is_cpu() && x.dim() >= 1,
              "linear_bf16: x must be a bfloat16 CPU tensor [..., in_features]");
  const int64_t K = x.size(-1), np = num_panels(n), padded_n = np * kPanel;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  K % 2 == 0 && packed.numel() == padded_n * K,
              "linear_bf16: packed does not hold a [", n, ", ", K,
              "] weight (pack it with linear_bf16_pack)");
  const at::Tensor xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  // fp32, added to the sums before the rounding
  const at::Tensor padded_bias = ::llmserve::padded_linear_bias(bias, n, padded_n, "linear_bf16");
  at::Tensor y = at::empty({M, padded_n}, xc.options());
#ifdef LLMSERVE_X86
  if (M > 0) {
    const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
    auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
    const float* b = padded_bias.defined() ? padded_bias.data_ptr<float>() : nullptr;
    const int64_t grain = ::llmserve::grain_for(np, kChunksPerThread);
    const at::Tensor xw = widen ? xc.to(at::kFloat) : xc;  // widened once for every panel
    // blocks of kRowBlock rows x chunks of panels, handed out block by block in one parallel
    // region: a thread done with its chunks of one block takes the next block's instead of
    // waiting at a barrier per block (prompt chunks of 2048 rows: 8 blocks)
    const int64_t chunks = (np + grain - 1) / grain, blocks = (M + kRowBlock - 1) / kRowBlock;
    auto run = [&](const auto* xp) {
      ::llmserve::parallel_take_ahead(blocks * chunks, 1, [&](int64_t i, int64_t, int64_t next) {
        const int64_t m0 = i / chunks * kRowBlock, pb = i % chunks * grain;
        linear_rows(xp, K / 2, wp, b, yp, padded_n, m0, std::min(M, m0 + kRowBlock), pb,
                    std::min(np, pb + grain), next < 0 ? -1 : next % chunks * grain);
      });
    };
    if (widen) {
      run(reinterpret_cast<const F32Pair*>(xw.data_ptr()));
    } else {
      run(reinterpret_cast<const uint32_t*>(xw.data_ptr()));
    }
  }
#endif
  return ::llmserve::linear_output(y, x, n);
}

}  // namespace llmserve::gemm_bf16
