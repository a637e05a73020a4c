// Fused element-wise ops for the CPU, fp32 or bf16 (fp32 arithmetic, one rounding at the
// store): each reads its inputs once and writes once, where torch would run several passes
// (x*x, mean, rsqrt, mul, mul, ...) over memory.
//
//   rms_norm(x, w, eps)                 out = x / sqrt(mean(x^2) + eps) * w          [T, d]
//                                       (w in x's dtype, or fp32: Gemma's 1 + w unrounded)
//   fused_add_rms_norm_(x, r, w, eps)   r += x;  x = rms_norm(r, w, eps)     (both in place)
//   silu_and_mul(x)                     out = silu(x[:, :d]) * x[:, d:]        [T, 2d] -> [T, d]
//   gelu_tanh_and_mul(x)                the same with GELU's tanh form (Gemma's GeGLU)
//   rotary_interleaved(x, pos, cis)     pairs (x[2i], x[2i+1]) of every head, rotated by the
//                                       angle of their position: out = x * (cos + i sin)
//   rotary_neox(x, pos, cos, sin, D, rd)  the same for pairs (x[i], x[i + rd/2]), i < rd/2 (NeoX's
//                                       split halves; channels rd..D copied)
//   argmax_rows(x)                      out[r] = the first index of row r's largest value, as
//                                       torch.max(x, -1).indices              [R, n] -> [R]
//   draw_rows(x, inv_t, u, p, m)        out[r] = a draw from softmax(x[r] * inv_t[r]) at the
//                                       uniform u[r] (inverse CDF), after top-p p[r] and
//                                       min-p m[r]                            [R, n] -> [R]
//
// The bodies (fused_impl.h) are compiled for AVX-512, AVX2 and plain C++; isa.h picks one at
// run time. Rows are spread over torch's intra-op threads with at::parallel_for (argmax_rows and
// draw_rows: parallel_take, a row per chunk).

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "isa.h"
#include "kernels_ops.h"
#include "parallel.h"
#include "vec.h"

namespace {
constexpr int64_t kGrain = 16;  // rows per task at least: a row is a few microseconds
constexpr int64_t kArgmaxBlock = 256;  // values a block max covers (argmax_row)
enum class Act { kSilu, kGeluTanh };   // the gate of act_and_mul (fused_impl.h)
}  // namespace

#define LLMSERVE_ISA_IMPL "fused_impl.h"
#include "per_isa.h"

namespace llmserve::fused {

using bf16 = uint16_t;  // raw bf16 bits; at::BFloat16 has the same layout

void check_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16 (the C++ CPU kernels' dtypes)");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

void check_same_dtype(const at::Tensor& x, const at::Tensor& other, const char* name) {
  TORCH_CHECK(other.scalar_type() == x.scalar_type(), name, " must have x's dtype (",
              x.scalar_type(), "), got ", other.scalar_type());
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_dtype(x, "x");
  if (weight.scalar_type() != at::kFloat) check_same_dtype(x, weight, "weight");
  const int64_t d = weight.numel();
  TORCH_CHECK(x.size(-1) == d, "rms_norm: x's last dimension ", x.size(-1), " != weight's ", d);
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t rows = xc.numel() / d;
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kFloat) {
    LLMSERVE_DISPATCH(
        rms_norm_rows(ptr<const bf16>(xc), ptr<const float>(wc), ptr<bf16>(out), rows, d, e));
  } else if (x.scalar_type() == at::kBFloat16) {
    LLMSERVE_DISPATCH(
        rms_norm_rows(ptr<const bf16>(xc), ptr<const bf16>(wc), ptr<bf16>(out), rows, d, e));
  } else {
    LLMSERVE_DISPATCH(
        rms_norm_rows(ptr<const float>(xc), ptr<const float>(wc), ptr<float>(out), rows, d, e));
  }
  return out;
}

void fused_add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_dtype(x, "x");
  check_same_dtype(x, residual, "residual");
  check_same_dtype(x, weight, "weight");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes(),
              "fused_add_rms_norm_: x and residual must be contiguous and of the same shape");
  const int64_t d = weight.numel();
  TORCH_CHECK(x.size(-1) == d, "fused_add_rms_norm_: x's last dimension ", x.size(-1), " != weight's ", d);
  const at::Tensor wc = weight.contiguous();
  const int64_t rows = x.numel() / d;
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kBFloat16) {
    LLMSERVE_DISPATCH(
        add_rms_norm_rows(ptr<bf16>(x), ptr<bf16>(residual), ptr<const bf16>(wc), rows, d, e));
  } else {
    LLMSERVE_DISPATCH(
        add_rms_norm_rows(ptr<float>(x), ptr<float>(residual), ptr<const float>(wc), rows, d, e));
  }
}

template <Act A>
at::Tensor act_and_mul(const at::Tensor& x, const char* name) {
  check_dtype(x, "x");
  const int64_t d = x.size(-1) / 2;
  TORCH_CHECK(x.size(-1) == 2 * d, name, ": the last dimension must be even");
  const at::Tensor xc = x.contiguous();
  auto sizes = xc.sizes().vec();
  sizes.back() = d;
  at::Tensor out = at::empty(sizes, xc.options());
  const int64_t rows = xc.numel() / (2 * d);
  if (x.scalar_type() == at::kBFloat16) {
    LLMSERVE_DISPATCH(act_and_mul_rows<A>(ptr<const bf16>(xc), ptr<bf16>(out), rows, d));
  } else {
    LLMSERVE_DISPATCH(act_and_mul_rows<A>(ptr<const float>(xc), ptr<float>(out), rows, d));
  }
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  return act_and_mul<Act::kSilu>(x, "silu_and_mul");
}

at::Tensor gelu_tanh_and_mul(const at::Tensor& x) {
  return act_and_mul<Act::kGeluTanh>(x, "gelu_tanh_and_mul");
}

template <typename T>
void rotary_dispatch(const at::Tensor& x, const int64_t* positions, const at::Tensor& cis,
                     at::Tensor& out, int64_t heads, int64_t head_dim) {
  const int64_t tokens = x.size(0), stride = x.stride(0);
  if (cis.scalar_type() == at::kBFloat16) {
    LLMSERVE_DISPATCH(rotary_rows(ptr<const T>(x), stride, positions, ptr<const bf16>(cis),
                                  ptr<T>(out), tokens, heads, head_dim));
  } else {
    LLMSERVE_DISPATCH(rotary_rows(ptr<const T>(x), stride, positions, ptr<const float>(cis),
                                  ptr<T>(out), tokens, heads, head_dim));
  }
}

// positions [tokens] int64, each in 0..max_pos - 1 (a row of the rotary tables), contiguous
at::Tensor checked_positions(const char* op, const at::Tensor& positions, int64_t tokens,
                             int64_t max_pos) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == tokens, op,
              ": positions must be int64, one per token");
  at::Tensor pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, op, ": position ", pp[t], " outside 0..",
                max_pos - 1);
  }
  return pos;
}

at::Tensor rotary_interleaved(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cis,
                              int64_t head_dim) {
  check_dtype(x, "x");
  check_dtype(cis, "cis");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rotary_interleaved: x must be [tokens, heads * head_dim] with unit column stride");
  TORCH_CHECK(cis.dim() == 3 && cis.size(1) * 2 == head_dim && cis.size(2) == 2 && cis.is_contiguous(),
              "rotary_interleaved: cis must be [max_positions, head_dim / 2, 2]");
  TORCH_CHECK(x.size(1) % head_dim == 0, "rotary_interleaved: width is not a multiple of head_dim");
  const int64_t tokens = x.size(0), width = x.size(1);
  const int64_t heads = width / head_dim, max_pos = cis.size(0);
  at::Tensor out = at::empty({tokens, width}, x.options());
  const at::Tensor pos = checked_positions("rotary_interleaved", positions, tokens, max_pos);
  const int64_t* pp = pos.data_ptr<int64_t>();
  if (x.scalar_type() == at::kBFloat16) {
    rotary_dispatch<bf16>(x, pp, cis, out, heads, head_dim);
  } else {
    rotary_dispatch<float>(x, pp, cis, out, heads, head_dim);
  }
  return out;
}

template <typename T>
void rotary_neox_dispatch(const at::Tensor& x, const int64_t* positions, const at::Tensor& cos,
                          const at::Tensor& sin, at::Tensor& out, int64_t heads, int64_t head_dim,
                          int64_t rotary_dim) {
  const int64_t tokens = x.size(0), stride = x.stride(0);
  if (cos.scalar_type() == at::kBFloat16) {
    LLMSERVE_DISPATCH(rotary_neox_rows(ptr<const T>(x), stride, positions, ptr<const bf16>(cos),
                                       ptr<const bf16>(sin), ptr<T>(out), tokens, heads, head_dim,
                                       rotary_dim));
  } else {
    LLMSERVE_DISPATCH(rotary_neox_rows(ptr<const T>(x), stride, positions, ptr<const float>(cos),
                                       ptr<const float>(sin), ptr<T>(out), tokens, heads,
                                       head_dim, rotary_dim));
  }
}

at::Tensor rotary_neox(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                       const at::Tensor& sin, int64_t head_dim, int64_t rotary_dim) {
  check_dtype(x, "x");
  check_dtype(cos, "cos");
  check_same_dtype(cos, sin, "sin");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % head_dim == 0,
              "rotary_neox: x must be [tokens, heads * head_dim] with unit column stride");
  TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim > 0 && rotary_dim <= head_dim,
              "rotary_neox: rotary_dim must be even, in 2..head_dim, got ", rotary_dim);
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) * 2 == rotary_dim && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.is_contiguous(),
              "rotary_neox: cos and sin must be [max_positions, rotary_dim / 2], contiguous");
  const int64_t tokens = x.size(0), width = x.size(1), max_pos = cos.size(0);
  at::Tensor out = at::empty({tokens, width}, x.options());
  const at::Tensor pos = checked_positions("rotary_neox", positions, tokens, max_pos);
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t heads = width / head_dim;
  if (x.scalar_type() == at::kBFloat16) {
    rotary_neox_dispatch<bf16>(x, pp, cos, sin, out, heads, head_dim, rotary_dim);
  } else {
    rotary_neox_dispatch<float>(x, pp, cos, sin, out, heads, head_dim, rotary_dim);
  }
  return out;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_dtype(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "argmax_rows: x must be [rows, n] with n > 0");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  at::Tensor out = at::empty({rows}, xc.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  if (x.scalar_type() == at::kBFloat16) {
    LLMSERVE_DISPATCH(argmax_rows(ptr<const bf16>(xc), o, rows, n));
  } else {
    LLMSERVE_DISPATCH(argmax_rows(ptr<const float>(xc), o, rows, n));
  }
  return out;
}

at::Tensor draw_rows(const at::Tensor& x, const at::Tensor& inv_temperature, const at::Tensor& u,
                     const at::Tensor& top_p, const at::Tensor& min_p) {
  check_dtype(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "draw_rows: x must be [rows, n] with n > 0");
  const int64_t rows = x.size(0), n = x.size(1);
  for (const at::Tensor* t : {&inv_temperature, &u, &top_p, &min_p}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == rows,
                "draw_rows: inv_temperature, u, top_p and min_p must be float32, one per row");
  }
  const at::Tensor xc = x.contiguous(), tc = inv_temperature.contiguous(), uc = u.contiguous();
  const at::Tensor pc = top_p.contiguous(), mc = min_p.contiguous();
  at::Tensor out = at::empty({rows}, xc.options().dtype(at::kLong));
  const float *t = tc.data_ptr<float>(), *uu = uc.data_ptr<float>();
  const float *p = pc.data_ptr<float>(), *m = mc.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  if (x.scalar_type() == at::kBFloat16) {
    LLMSERVE_DISPATCH(draw_rows(ptr<const bf16>(xc), t, uu, p, m, o, rows, n));
  } else {
    LLMSERVE_DISPATCH(draw_rows(ptr<const float>(xc), t, uu, p, m, o, rows, n));
  }
  return out;
}

}  // namespace llmserve::fused
