// The bf16 linear by AMX tiles (Intel Sapphire Rapids and later: AMX-TILE, AMX-BF16):
// y = x w^T (+ bias), x and w bf16, fp32 sums (tdpbf16ps), y rounded to bf16 once, from the
// weight linear_bf16_pack lays out for gemm_bf16.cpp.
//
//   linear_bf16_amx(x [M, K], packed, N, bias?, emulate)  -> y [M, N]   (K a multiple of 32)
//   amx_ready()  -> whether this CPU has the tiles and the OS lets this process use them
//
// Why: on an AMX host (a Sapphire Rapids class VM, 2 cores, docs/bench/journal.md, 2026-11-27)
// oneDNN ran a bf16 decode step's linears (batch 64) at 272-929 GFLOP/s, its weights streaming
// at 4-14 GB/s, half the memory's rate at best, and slower inside the step than alone; our
// vdpbf16ps GEMM streams well but tops out at 175-194 GFLOP/s there, too little at 64 rows.
// This kernel streams the weight as gemm_bf16.cpp does and multiplies with tiles. Not yet
// measured on an AMX host: PackedLinear takes it only where LLMSERVE_CPU_AMX_GEMM=1.
//
// How. linear_bf16_pack's panels hold 48 columns as [K/2][48][2]: each k pair of a column next
// to each other, which is the layout tdpbf16ps wants for its second operand. So 16 k pairs
// of a 16-column slice of a panel are a B tile as they lie (16 rows of 64 bytes, 192 bytes
// apart: one pair row of the panel). x is taken in blocks of 16 rows (A tiles: 16 rows x 32
// k, straight from x with its row stride; the rows past the last whole block from a zeroed
// copy). For each panel, up to four row blocks at a time (64 rows) and each of the panel's
// three slices: tiles 0-3 hold the blocks' sums over all of K, tiles 4-5 take the x blocks in
// turn, tiles 6-7 the weight's k blocks in turn; each weight tile is loaded once per 64 rows
// (from memory for the first slice, the rest of the panel from L2), each x tile once per
// slice and k block (from L1/L2). The sums go to a per-thread fp32 scratch, then get the bias
// and are rounded to bf16 (vcvtneps2bf16) and stored. Panels are handed out in chunks as the
// threads come free (parallel.h), each thread configuring its tiles once per call.
//
// emulate: the same kernel with each tile instruction done in plain C++ as Intel's reference
// describes it (tileloadd, tilestored, tilezero, and tdpbf16ps: C[m][n] += A[m][2k] B[k][2n] +
// A[m][2k+1] B[k][2n+1] in fp32), so that any host tests the kernel's addressing, tails and
// threading; on AMX hosts the tests check the instructions against it.

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "isa.h"
#include "kernels_ops.h"
#include "linear_io.h"
#include "parallel.h"
#include "vec.h"  // LLMSERVE_X86 (and immintrin.h there)

namespace llmserve::gemm_amx {
constexpr int64_t kPanel = 48;              // linear_bf16_pack's columns per panel
constexpr int64_t kPairBytes = kPanel * 4;  // one k pair of a panel: 48 x 2 bf16
constexpr int64_t kSliceColumns = 16;       // columns of a B tile (and of a C tile)
constexpr int64_t kBlockRows = 16;          // rows of an A tile (and of a C tile)
constexpr int64_t kBlockK = 32;             // k of an A tile: 16 pairs, 64 bytes a row
constexpr int kGroupBlocks = 4;             // row blocks whose sums stay in tiles (0-3)
constexpr int64_t kGroupRows = kGroupBlocks * kBlockRows;
constexpr int64_t kChunksPerThread = 4;     // panel chunks per thread

int64_t num_panels(int64_t n) { return (n + kPanel - 1) / kPanel; }

// Whether this CPU has AMX-TILE and AMX-BF16 (cpuid 7.0 EDX bits 24 and 22), AVX512_BF16
// for the rounding, and Linux lets this process use the tile data (arch_prctl's
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: asked once, for the whole process)
bool amx_ready() {
#if defined(__linux__) && defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool ready = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!llmserve::cpu_supports(llmserve::Isa::kAvx512Bf16)) return false;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (((d >> 24) & 1u) == 0 || ((d >> 22) & 1u) == 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
#else
  return false;
#endif
}

// ldtilecfg's 64 bytes: palette 1, every tile used here 16 rows of 64 bytes
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = 16;
    }
  }
};

#ifdef LLMSERVE_X86
// The tile instructions, as inline assembly: GCC's _tile_* macros paste their tile numbers
// into the mnemonic's text and take no template parameter; "%c" prints an immediate bare.
struct AmxTiles {
  static void configure() {
    static const TileConfig config;
    asm volatile("ldtilecfg %0" ::"m"(config));
  }
  static void release() { asm volatile("tilerelease" ::: "memory"); }
  template <int T>
  static void zero() {
    asm volatile("tilezero %%tmm%c0" ::"i"(T));
  }
  template <int T>
  static void load(const void* p, int64_t stride) {
    asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(T) : "memory");
  }
  template <int C, int A, int B>  // C += A . B
  static void dot() {
    asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
};
#endif

// The same instructions in plain C++ on a per-thread file of eight 16 x 64-byte tiles
struct EmulatedTiles {
  struct File {
    alignas(64) uint8_t tile[8][16][64];
  };
  static File& file() {
    thread_local File f;
    return f;
  }
  static void configure() {}
  static void release() {}
  template <int T>
  static void zero() {
    std::memset(file().tile[T], 0, sizeof(file().tile[T]));
  }
  template <int T>
  static void load(const void* p, int64_t stride) {
    for (int r = 0; r < 16; ++r) {
      std::memcpy(file().tile[T][r], static_cast<const char*>(p) + r * stride, 64);
    }
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    for (int r = 0; r < 16; ++r) {
      std::memcpy(static_cast<char*>(p) + r * stride, file().tile[T][r], 64);
    }
  }
  static float widen(uint16_t v) {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  template <int C, int A, int B>
  static void dot() {
    float c[16][16];
    uint16_t a[16][32], b[16][32];
    std::memcpy(c, file().tile[C], sizeof(c));
    std::memcpy(a, file().tile[A], sizeof(a));
    std::memcpy(b, file().tile[B], sizeof(b));
    for (int m = 0; m < 16; ++m) {
      for (int k = 0; k < 16; ++k) {
        for (int n = 0; n < 16; ++n) {
          c[m][n] += widen(a[m][2 * k]) * widen(b[k][2 * n]);
          c[m][n] += widen(a[m][2 * k + 1]) * widen(b[k][2 * n + 1]);
        }
      }
    }
    std::memcpy(file().tile[C], c, sizeof(c));
  }
};

// x block ``X`` (tile 4 or 5) against weight tile W: sums of block ``Block`` (tile Block)
template <typename Tiles, int Blocks, int Block, int W>
__attribute__((always_inline)) inline void multiply_block(const uint16_t* const* blocks,
                                                          int64_t kb, int64_t ldx_bytes) {
  if constexpr (Block < Blocks) {
    constexpr int X = 4 + Block % 2;
    Tiles::template load<X>(blocks[Block] + kb * kBlockK, ldx_bytes);
    Tiles::template dot<Block, X, W>();
  }
}

// one k block: the weight's tile W, then each x block against it
template <typename Tiles, int Blocks, int W>
__attribute__((always_inline)) inline void multiply_k_block(const uint16_t* const* blocks,
                                                            int64_t ldx_bytes,
                                                            const uint16_t* slice, int64_t kb) {
  Tiles::template load<W>(slice + kb * kBlockK * kPanel, kPairBytes);
  multiply_block<Tiles, Blocks, 0, W>(blocks, kb, ldx_bytes);
  multiply_block<Tiles, Blocks, 1, W>(blocks, kb, ldx_bytes);
  multiply_block<Tiles, Blocks, 2, W>(blocks, kb, ldx_bytes);
  multiply_block<Tiles, Blocks, 3, W>(blocks, kb, ldx_bytes);
}

template <typename Tiles, int Block, int Blocks>
__attribute__((always_inline)) inline void zero_or_store(float* sums, bool store) {
  if constexpr (Block < Blocks) {
    if (store) {
      Tiles::template store<Block>(sums + Block * kBlockRows * kPanel, kPanel * 4);
    } else {
      Tiles::template zero<Block>();
    }
  }
}

// sums[r][c * 16 + j] (r < Blocks * 16, j < 16) = x block rows . the panel's 16-column slice
// ``slice`` over all of K (kblocks blocks of 32)
template <typename Tiles, int Blocks>
void multiply_slice(const uint16_t* const* blocks, int64_t ldx_bytes, const uint16_t* slice,
                    int64_t kblocks, float* sums) {
  zero_or_store<Tiles, 0, Blocks>(sums, false);
  zero_or_store<Tiles, 1, Blocks>(sums, false);
  zero_or_store<Tiles, 2, Blocks>(sums, false);
  zero_or_store<Tiles, 3, Blocks>(sums, false);
  int64_t kb = 0;
  for (; kb + 1 < kblocks; kb += 2) {  // the weight's k blocks in tiles 6 and 7 by turns
    multiply_k_block<Tiles, Blocks, 6>(blocks, ldx_bytes, slice, kb);
    multiply_k_block<Tiles, Blocks, 7>(blocks, ldx_bytes, slice, kb + 1);
  }
  if (kb < kblocks) multiply_k_block<Tiles, Blocks, 6>(blocks, ldx_bytes, slice, kb);
  zero_or_store<Tiles, 0, Blocks>(sums, true);
  zero_or_store<Tiles, 1, Blocks>(sums, true);
  zero_or_store<Tiles, 2, Blocks>(sums, true);
  zero_or_store<Tiles, 3, Blocks>(sums, true);
}

// rows x 48 sums (+ bias) rounded to bf16 and stored
void round_rows(const float* sums, int64_t rows, const float* bias, uint16_t* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < kPanel; ++j) {
      const float v = sums[r * kPanel + j] + (bias == nullptr ? 0.0f : bias[j]);
      y[r * ldy + j] = c10::BFloat16(v).x;  // round to nearest even
    }
  }
}

#ifdef LLMSERVE_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
// the same with AVX512_BF16's vcvtneps2bf16 (AMX hosts have it; amx_ready checks)
void round_rows_avx512(const float* sums, int64_t rows, const float* bias, uint16_t* y,
                       int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t v = 0; v < kPanel / 16; ++v) {
      __m512 out = _mm512_loadu_ps(sums + r * kPanel + v * 16);
      if (bias != nullptr) out = _mm512_add_ps(out, _mm512_loadu_ps(bias + v * 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + v * 16),
                          (__m256i)_mm512_cvtneps_pbh(out));
    }
  }
}
#pragma GCC pop_options
#endif

// A thread's tiles, configured while it holds this, and its scratch of sums
template <typename Tiles>
struct TileScope {
  alignas(64) float sums[kGroupRows * kPanel];
  TileScope() { Tiles::configure(); }
  ~TileScope() { Tiles::release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// y[rows of x, panel p's 48 columns] for panels [pb, pe): x's row blocks (``blocks``, whole
// blocks of 16 rows of stride ldx_bytes; M rows in all) taken four at a time
template <typename Tiles>
void linear_panels(const std::vector<const uint16_t*>& blocks, int64_t M, int64_t ldx_bytes,
                   const uint16_t* packed, int64_t K, const float* bias, uint16_t* y,
                   int64_t ldy, int64_t pb, int64_t pe, float* sums, bool native_round) {
  const int64_t kblocks = K / kBlockK, nblocks = static_cast<int64_t>(blocks.size());
  for (int64_t p = pb; p < pe; ++p) {
    const uint16_t* panel = packed + p * K * kPanel;
    for (int64_t g = 0; g < nblocks; g += kGroupBlocks) {
      const uint16_t* const* group = blocks.data() + g;
      const int64_t count = std::min<int64_t>(kGroupBlocks, nblocks - g);
      for (int64_t c = 0; c < kPanel / kSliceColumns; ++c) {
        const uint16_t* slice = panel + c * kSliceColumns * 2;
        float* out = sums + c * kSliceColumns;
        switch (count) {
          case 1: multiply_slice<Tiles, 1>(group, ldx_bytes, slice, kblocks, out); break;
          case 2: multiply_slice<Tiles, 2>(group, ldx_bytes, slice, kblocks, out); break;
          case 3: multiply_slice<Tiles, 3>(group, ldx_bytes, slice, kblocks, out); break;
          default: multiply_slice<Tiles, 4>(group, ldx_bytes, slice, kblocks, out);
        }
      }
      const int64_t m0 = g * kBlockRows, rows = std::min(M - m0, count * kBlockRows);
      const float* panel_bias = bias == nullptr ? nullptr : bias + p * kPanel;
      uint16_t* out = y + m0 * ldy + p * kPanel;
#ifdef LLMSERVE_X86
      if (native_round) {
        round_rows_avx512(sums, rows, panel_bias, out, ldy);
        continue;
      }
#endif
      round_rows(sums, rows, panel_bias, out, ldy);
    }
  }
}

template <typename Tiles>
void run_linear(const std::vector<const uint16_t*>& blocks, int64_t M, int64_t ldx_bytes,
                const uint16_t* packed, int64_t K, const float* bias, uint16_t* y, int64_t ldy,
                int64_t np, bool native_round) {
  ::llmserve::parallel_take(
      np, ::llmserve::grain_for(np, kChunksPerThread),
      [] { return TileScope<Tiles>(); },
      [&](TileScope<Tiles>& scope, int64_t pb, int64_t pe) {
        linear_panels<Tiles>(blocks, M, ldx_bytes, packed, K, bias, y, ldy, pb, pe, scope.sums,
                             native_round);
      });
}

at::Tensor linear_bf16_amx(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                           const c10::optional<at::Tensor>& bias, bool emulate) {
  TORCH_CHECK(emulate || amx_ready(),
              "linear_bf16_amx: this CPU has no AMX-BF16 tiles (or the OS does not let this "
              "process use them)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.device().is_cpu() && x.dim() >= 1,
              "linear_bf16_amx: x must be a bfloat16 CPU tensor [..., in_features]");
  const int64_t K = x.size(-1), np = num_panels(n), padded_n = np * kPanel;
  TORCH_CHECK(K % kBlockK == 0, "linear_bf16_amx: in_features must be a multiple of 32 (got ",
              K, ")");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.numel() == padded_n * K,
              "linear_bf16_amx: packed does not hold a [", n, ", ", K,
              "] weight (pack it with linear_bf16_pack)");
  const at::Tensor xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  const at::Tensor padded_bias =
      ::llmserve::padded_linear_bias(bias, n, padded_n, "linear_bf16_amx");
  at::Tensor y = at::empty({M, padded_n}, xc.options());
  if (M == 0) return ::llmserve::linear_output(y, x, n);
  // x's whole blocks of 16 rows in place, the rest in a zeroed block
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const int64_t whole = M / kBlockRows, tail = M % kBlockRows;
  std::vector<const uint16_t*> blocks;
  for (int64_t b = 0; b < whole; ++b) blocks.push_back(xp + b * kBlockRows * K);
  at::Tensor last;
  if (tail > 0) {
    last = at::zeros({kBlockRows, K}, xc.options());
    last.narrow(0, 0, tail).copy_(xc.narrow(0, whole * kBlockRows, tail));
    blocks.push_back(reinterpret_cast<const uint16_t*>(last.data_ptr()));
  }
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const float* b = padded_bias.defined() ? padded_bias.data_ptr<float>() : nullptr;
#ifdef LLMSERVE_X86
  if (!emulate) {
    run_linear<AmxTiles>(blocks, M, K * 2, wp, K, b, yp, padded_n, np, true);
    return ::llmserve::linear_output(y, x, n);
  }
#endif
  run_linear<EmulatedTiles>(blocks, M, K * 2, wp, K, b, yp, padded_n, np, false);
  return ::llmserve::linear_output(y, x, n);
}

}  // namespace llmserve::gemm_amx
