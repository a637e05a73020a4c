// The fp32 linear for the CPU: y = x w^T (+ bias) on a weight packed once at load.
//
//   linear_f32_pack(w [N, K])                             -> packed [ceil(N / 48) * 48 * K]
//   linear_f32(x [M, K], packed, N, bias?, whole_panels)  -> y [M, N]
//
// Why our own: at decode shapes (M = one row per running sequence, 1-128) the weight streams
// from memory once per step, and oneDNN's fp32 kernel waits on those loads (measured on Zen 5,
// 30 layers' weights so they come from DRAM, M = 64: 310-410 GFLOP/s against 390-480 with the
// weight in cache). Here the weight is packed so that the whole call reads it front to back
// (gemm_impl.h: 48-column panels, [k][48] each); each thread asks for its next panel
// slice while it multiplies the current one, and a register tile of 8 rows x 48 columns
// (AVX-512; 4 x 24 with AVX2) keeps the FMA units busy. One or two rows (batch 1 or 2) take
// each panel whole over all of K instead, one stream. whole_panels: decode-sized M (up to 256
// rows) takes each panel whole too, tile by tile (gemm_panels_whole: faster on AMD Zen 4, the
// caller's choice). Prompt-sized M is taken 256 rows at a time. The result is the plain fp32
// product: each output is one sum over k in order.
//
// The body (gemm_impl.h) is compiled for AVX-512, AVX2 and plain C++; isa.h picks one at run
// time.

#include <algorithm>
#include <cstdint>

#include "isa.h"
#include "kernels_ops.h"
#include "linear_io.h"
#include "parallel.h"
#include "vec.h"

namespace {
constexpr int64_t kPanel = 48;      // output columns per packed panel (3 x 16 = 6 x 8 lanes)
constexpr int64_t kSlice = 128;     // k per slice: one panel's slice is 24 KB, L1-resident
constexpr int64_t kRowBlock = 256;  // rows of x per pass over the weight
constexpr int64_t kChunksPerThread = 4;  // panel chunks per thread, taken as threads come free
// Most bytes of y a decode-size chunk of panels writes (its columns capped to fit). Measured
// on an AVX2 Zen 3 host, the LM head's shape (49152 x 576) through linear_f32, in one process
// against no cap, five alternated rounds: 5-43% faster at M = 64, 13-36% at M = 128 (with no
// cap a chunk's y was 1.5 MB, re-read from memory per slice of K); 64-512 KB measured alike.
constexpr int64_t kChunkOutputBytes = 256 << 10;
}  // namespace

#define LLMSERVE_ISA_IMPL "gemm_impl.h"
#include "per_isa.h"

namespace llmserve::gemm {

int64_t num_panels(int64_t n) { return (n + kPanel - 1) / kPanel; }

at::Tensor linear_f32_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
              "linear_f32_pack: the weight must be a float32 CPU matrix [out_features, in_features]");
  const int64_t N = w.size(0), K = w.size(1), np = num_panels(N);
  at::Tensor padded = at::zeros({np * kPanel, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  // [np, 48, K] -> [np, K, 48]
  at::Tensor packed = padded.view({np, kPanel, K}).transpose(1, 2).contiguous().view({-1});
  return packed;
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                      const c10::optional<at::Tensor>& bias, bool whole_panels) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() >= 1,
              "linear_f32: x must be a float32 CPU tensor [..., in_features]");
  const int64_t K = x.size(-1), np = num_panels(n), padded_n = np * kPanel;
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  packed.numel() == padded_n * K,
              "linear_f32: packed does not hold a [", n, ", ", K,
              "] weight (pack it with linear_f32_pack)");
  const at::Tensor xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  const at::Tensor padded_bias = ::llmserve::padded_linear_bias(bias, n, padded_n, "linear_f32");
  at::Tensor y = at::empty({M, padded_n}, xc.options());
  if (M > 0) {
    const float* b = padded_bias.defined() ? padded_bias.data_ptr<float>() : nullptr;
    LLMSERVE_DISPATCH(linear_f32(xc.data_ptr<float>(), M, K, packed.data_ptr<float>(), np, b,
                                 y.data_ptr<float>(), padded_n, whole_panels));
  }
  return ::llmserve::linear_output(y, x, n);
}

}  // namespace llmserve::gemm
