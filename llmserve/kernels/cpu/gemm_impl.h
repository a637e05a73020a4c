// The fp32 linear's body (gemm.cpp), included once per ISA inside a namespace that defines
// ``Vec`` (vec.h). y[M, N] = x[M, K] w[N, K]^T (+ bias), w packed by gemm.cpp's pack:
//
//   [panels of kPanel columns][k][kPanel]
//
// so a panel (K x 48 floats) is contiguous, and so is each of its slices of kSlice k's.
// (No include guard: this file is meant to be included several times.)

#include "prefetch_impl.h"  // Ahead

// Rows of x per register tile: with AVX-512, 8 rows x 48 columns = 24 accumulators (of 32
// registers), 3 weight vectors and 1 broadcast; with AVX2, 4 rows x 24 columns (of 16).
constexpr int kTileRows = Vec::W >= 16 ? 8 : 4;
constexpr int kTileVecs = 3;  // vectors of columns per tile
constexpr int64_t kTileCols = kTileVecs * Vec::W;
static_assert(kPanel % kTileCols == 0, "a panel must split into whole tiles");

// k's of a tile between its asks for its share of the next panel (or slice): Ahead spreads
// the share evenly over the tile's k's, where its first k's asked for three lines each
// before. Measured on an Intel Xeon VM (family 6 model 207) in a scratch harness
// (docs/bench/journal.md): one thread, 30+ weight copies from memory, the fastest of 3,000
// calls, M = 64 panel by panel, three layer shapes: 147-155 -> 185-196 GFLOP/s (the weight in
// L2: 195-212); slice by slice 143-146 -> 180-183; M = 32 109-117 -> 140-145; a group every
// 16 k's 161-181, every 64 156-191. The AVX2 path on the same host: 90-107 -> 98-108 at M =
// 64, 63-66 -> 83-84 at M = 16.
constexpr int64_t kAheadEvery = 32;

// y[r, c] (+)= sum_k x[r, k] w[k, c] for R rows, the V vectors of columns at w (panel rows of
// kPanel floats, kc of them); ``first``: start from zero, else add to y; ``bias`` (last slice
// only, else null) is added before the store. kAhead: ``ahead`` is this tile's share of the
// next panel slice the thread reads (``ahead_k`` rows), asked for a few lines every
// kAheadEvery k's beside the loads.
template <int R, bool kAhead, int V = kTileVecs>
inline void gemm_tile(const float* x, int64_t ldx, const float* w, int64_t kc, float* y,
                      int64_t ldy, bool first, const float* bias, const float* ahead,
                      int64_t ahead_k) {
  constexpr int64_t W = Vec::W;
  Vec acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) {
      acc[r][v] = first ? Vec::zero() : Vec::load(y + r * ldy + v * W);
    }
  }
  const auto step = [&](int64_t k) __attribute__((always_inline)) {
    Vec b[V];
    for (int v = 0; v < V; ++v) b[v] = Vec::load(w + k * kPanel + v * W);
    for (int r = 0; r < R; ++r) {
      const Vec a = Vec::set1(x[r * ldx + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = Vec::fma(a, b[v], acc[r][v]);
    }
  };
  Ahead next;  // this tile's share of what the thread reads next
  if constexpr (kAhead) next.spread(ahead, ahead_k * kPanel * sizeof(float), kc / kAheadEvery);
  over_groups<kAheadEvery, kAhead>(kc, next, step);
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) {
      if (bias != nullptr) acc[r][v] = Vec::add(acc[r][v], Vec::load(bias + v * W));
      acc[r][v].store(y + r * ldy + v * W);
    }
  }
}

template <int R>
inline void gemm_tile_ahead(const float* x, int64_t ldx, const float* w, int64_t kc, float* y,
                            int64_t ldy, bool first, const float* bias, const float* ahead,
                            int64_t ahead_k) {
  if (ahead != nullptr) {
    gemm_tile<R, true>(x, ldx, w, kc, y, ldy, first, bias, ahead, ahead_k);
  } else {
    gemm_tile<R, false>(x, ldx, w, kc, y, ldy, first, bias, nullptr, 0);
  }
}

// The last R < kTileRows rows as one tile of R rows: R weight-vector loads feed R times as
// many FMAs as one-row tiles would (M = 51 on AVX2: one 3-row tile instead of three 1-row
// ones, whose 3 FMA chains each cannot fill the FMA pipes).
template <int R = kTileRows - 1>
inline void gemm_tail(int64_t r, const float* x, int64_t ldx, const float* w, int64_t kc,
                      float* y, int64_t ldy, bool first, const float* bias, const float* ahead,
                      int64_t ahead_k) {
  if constexpr (R >= 1) {
    if (r == R) return gemm_tile_ahead<R>(x, ldx, w, kc, y, ldy, first, bias, ahead, ahead_k);
    gemm_tail<R - 1>(r, x, ldx, w, kc, y, ldy, first, bias, ahead, ahead_k);
  }
}

// rows [m0, m1) of x, kTileRows at a time, then the rest as one smaller tile
inline void gemm_rows(const float* x, int64_t ldx, const float* w, int64_t kc, float* y,
                      int64_t ldy, int64_t m0, int64_t m1, bool first, const float* bias,
                      const float* ahead, int64_t ahead_k) {
  // Tile t asks for its share of the next slice's rows. Asked for all at once by the first
  // tile, ~400 lines are more than a core keeps in flight, so (most likely) that tile waits
  // on DRAM while the others have nothing to wait for. Measured on an AVX2 Zen 3 host, the
  // four layer shapes with 30 weight copies, in one process against the first-tile version,
  // five alternated rounds: +19-23% at M = 32-64, +11-14% at 96-128, even at 8 and 256.
  const int64_t tiles = (m1 - m0 + kTileRows - 1) / kTileRows * (kPanel / kTileCols);
  int64_t t = 0;
  for (int64_t c = 0; c < kPanel; c += kTileCols) {
    const float* bc = bias == nullptr ? nullptr : bias + c;
    for (int64_t m = m0; m < m1; m += kTileRows, ++t) {
      const int64_t kb = ahead_k * t / tiles, ke = ahead_k * (t + 1) / tiles;
      const float* a = ahead != nullptr && ke > kb ? ahead + kb * kPanel : nullptr;
      if (m + kTileRows <= m1) {
        gemm_tile_ahead<kTileRows>(x + m * ldx, ldx, w + c, kc, y + m * ldy + c, ldy, first, bc,
                                   a, ke - kb);
      } else {
        gemm_tail(m1 - m, x + m * ldx, ldx, w + c, kc, y + m * ldy + c, ldy, first, bc, a,
                  ke - kb);
      }
    }
  }
}

// y[m0:m1, panels pb..pe) over all of K: slice by slice, each slice's panels in memory order
// (the next one asked for while this one is multiplied); y's tile is stored per slice and
// added to by the next, the bias (padded to whole panels, or null) added on the last.
inline void gemm_panels(const float* x, int64_t K, const float* packed, int64_t num_panels,
                        float* y, int64_t ldy, const float* bias, int64_t m0, int64_t m1,
                        int64_t pb, int64_t pe) {
  for (int64_t k0 = 0; k0 < K; k0 += kSlice) {
    const int64_t kc = std::min(kSlice, K - k0);
    const bool last = k0 + kSlice >= K;
    for (int64_t p = pb; p < pe; ++p) {
      const float* w = packed + (p * K + k0) * kPanel;
      const float* ahead = nullptr;  // the next slice this thread reads
      int64_t ahead_k = kc;
      if (p + 1 < pe) {
        ahead = w + K * kPanel;
      } else if (!last) {
        ahead = packed + (pb * K + k0 + kSlice) * kPanel;
        ahead_k = std::min(kSlice, K - k0 - kSlice);
      }
      gemm_rows(x + k0, K, w, kc, y + p * kPanel, ldy, m0, m1, k0 == 0,
                last && bias != nullptr ? bias + p * kPanel : nullptr, ahead, ahead_k);
    }
  }
}

// y[m0:m1, panels pb..pe) for many rows: panel by panel, each over all of K, so the panel's
// y tile stays in the caches across its slices and x's rows (one block) are what is re-read.
inline void gemm_panels_outer(const float* x, int64_t K, const float* packed, int64_t num_panels,
                              float* y, int64_t ldy, const float* bias, int64_t m0, int64_t m1,
                              int64_t pb, int64_t pe) {
  for (int64_t p = pb; p < pe; ++p) {
    for (int64_t k0 = 0; k0 < K; k0 += kSlice) {
      const int64_t kc = std::min(kSlice, K - k0);
      const float* w = packed + (p * K + k0) * kPanel;
      const bool last = k0 + kSlice >= K;
      gemm_rows(x + k0, K, w, kc, y + p * kPanel, ldy, m0, m1, k0 == 0,
                last && bias != nullptr ? bias + p * kPanel : nullptr, nullptr, 0);
    }
  }
}

// y[0:M, panels pb..pe) for decode-sized M, panel by panel, each over all of K: every row tile
// takes the whole panel (K x kPanel floats, 110-295 KB for the default model: from L2 once
// the first tile has brought it in), and the tiles ask for the next panel between them: the
// chunk's next, or after its last the first of the chunk this thread takes next (``next_pb``,
// parallel_take_ahead; -1: none). Asking for that one too, measured on an AMD Zen 5 VM (the
// four layer shapes, 30 weight copies from memory, one process, alternated per call, ten
// rounds): M = 16 12.38 -> 11.31 ms for all 120 calls, 32 18.29 -> 17.40, 64 31.3-31.6 ->
// 30.4-30.6, 128 58.1 -> 57.8; the 576-wide layers (12 panels: one per chunk) gain most.
// gemm_panels' slices keep a panel's slice in L1 instead, but store and re-load y's tiles
// once a slice and walk the chunk's panels slice by slice. Measured on an AMD Zen 4 VM
// (AVX-512), the default model's four layer shapes, 30 weight copies (from memory), one
// process, three alternated rounds against gemm_panels: M = 64 1.05-1.41x (179-197 GFLOP/s,
// the host's fp32 peak is about 205), 32 1.28-1.35x, 8-16 1.1-1.4x, 128 1.05-1.15x; oneDNN
// there 167-190 at 64. Zen 5 takes it too (cpu_linear's whole_panel_rows, measured there);
// AVX2 and Intel hosts are not measured: a choice of the caller's (linear_f32's
// whole_panels). The sums over k run in the same order: identical results.
inline void gemm_panels_whole(const float* x, int64_t K, const float* packed, float* y,
                              int64_t ldy, const float* bias, int64_t M, int64_t pb, int64_t pe,
                              int64_t next_pb) {
  for (int64_t p = pb; p < pe; ++p) {
    const float* w = packed + p * K * kPanel;
    const int64_t ahead_p = p + 1 < pe ? p + 1 : next_pb;
    const float* ahead = ahead_p >= 0 ? packed + ahead_p * K * kPanel : nullptr;
    gemm_rows(x, K, w, K, y + p * kPanel, ldy, 0, M, true,
              bias == nullptr ? nullptr : bias + p * kPanel, ahead, K);
  }
}

// R <= kGemvRows rows of x (decode at batch 1 or 2) against panels [pb, pe), each over all of
// K: the chunk's panels lie back to back, so the weight is read as one stream front to back,
// and each k row of a panel (kPanel columns) is taken whole: gemm_tile with a whole panel's
// vectors (the same sum over k in order as the tiled path: the results are identical).
// The tiled path walks each slice of K twice with AVX2 (two tiles of 24 columns) and jumps
// between panels slice by slice. Measured on an AVX2 Zen 3 host, the default model's four
// layer shapes (30 weight copies, from memory) and its LM head, in one process against the
// tiled path, alternated rounds: M = 1 1.24-1.63x (14-16 -> 21-23 GB/s in a slow hour of the
// VM, 21-24 -> 27-32 in a fast one), M = 2 1.02-1.25x; M = 3 or 4 as two passes even or
// slower (0.75-1.01x), so they stay tiled. Batch-1 decode of the default model (LLM.generate,
// 128 tokens): in one process, alternated, 16-20 -> 24-28 tok/s; separate processes 21-23 ->
// 29-30. `llmserve bench latency` read level (29-31 both): the tiled path's speed at M = 1
// differs from process to process (it reached the stream's rate in some), this one's does not.
constexpr int64_t kGemvRows = 2;
template <int R>
inline void gemv_panels(const float* x, int64_t ldx, int64_t K, const float* packed, float* y,
                        int64_t ldy, const float* bias, int64_t pb, int64_t pe) {
  constexpr int NV = kPanel / Vec::W;  // a whole panel: 6 vectors with AVX2, 3 with AVX-512
  for (int64_t p = pb; p < pe; ++p) {
    gemm_tile<R, false, NV>(x, ldx, packed + p * K * kPanel, K, y + p * kPanel, ldy, true,
                            bias == nullptr ? nullptr : bias + p * kPanel, nullptr, 0);
  }
}

// One or two rows (decode at batch 1 or 2): gemv_panels over chunks of panels. Up to
// kRowBlock rows (decode steps): one pass over the weight, slice by slice over a chunk
// of panels at a time (or, with whole_panels, panel by panel: gemm_panels_whole), the chunks
// taken by the threads as they come free (parallel.h). More
// rows (prompt chunks): blocks of kRowBlock rows, one parallel region each, panel by panel
// (gemm_panels_outer), where the multiply, not the weight's loads, is what costs.
inline void linear_f32(const float* x, int64_t M, int64_t K, const float* packed,
                       int64_t num_panels, const float* bias, float* y, int64_t ldy,
                       bool whole_panels) {
  int64_t grain = ::llmserve::grain_for(num_panels, kChunksPerThread);
  if (M <= kGemvRows) {
    ::llmserve::parallel_take(num_panels, grain, [&](int64_t pb, int64_t pe) {
      if (M == 2) {
        gemv_panels<2>(x, K, K, packed, y, ldy, bias, pb, pe);
      } else {
        gemv_panels<1>(x, K, K, packed, y, ldy, bias, pb, pe);
      }
    });
    return;
  }
  if (M <= kRowBlock && whole_panels) {
    ::llmserve::parallel_take_ahead(num_panels, grain, [&](int64_t pb, int64_t pe, int64_t next) {
      gemm_panels_whole(x, K, packed, y, ldy, bias, M, pb, pe, next);
    });
    return;
  }
  if (M <= kRowBlock) {
    // a chunk's y [M, chunk columns] is re-read and re-written once per slice of K: kept to
    // what stays in L2 (the LM head's chunks were 1.5 MB at M = 64)
    grain = std::min(grain, std::max<int64_t>(1, kChunkOutputBytes / (M * kPanel * 4)));
    ::llmserve::parallel_take(num_panels, grain, [&](int64_t pb, int64_t pe) {
      gemm_panels(x, K, packed, num_panels, y, ldy, bias, 0, M, pb, pe);
    });
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t m1 = std::min(M, m0 + kRowBlock);
    ::llmserve::parallel_take(num_panels, grain, [&](int64_t pb, int64_t pe) {
      gemm_panels_outer(x, K, packed, num_panels, y, ldy, bias, m0, m1, pb, pe);
    });
  }
}
