// Fused element-wise ops for the CPU (fp32): each reads its inputs once and writes once,
// where torch would run several passes (x*x, mean, rsqrt, mul, mul, ...) over memory.
//
//   rms_norm(x, w, eps)                 out = x / sqrt(mean(x^2) + eps) * w          [T, d]
//   fused_add_rms_norm_(x, r, w, eps)   r += x;  x = rms_norm(r, w, eps)     (both in place)
//   silu_and_mul(x)                     out = silu(x[:, :d]) * x[:, d:]        [T, 2d] -> [T, d]
//   rotary_interleaved(x, pos, cis)     pairs (x[2i], x[2i+1]) of every head, rotated by the
//                                       angle of their position: out = x * (cos + i sin)
//
// Rows are spread over torch's intra-op threads with at::parallel_for.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "vec.h"

namespace {

constexpr int64_t kGrain = 16;  // rows per task at least: a row is a few microseconds

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32 (the C++ CPU kernels are fp32)");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

float sum_squares(const float* x, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef LLMSERVE_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  sum = hsum8(acc);
#endif
  for (; i < n; ++i) sum += x[i] * x[i];
  return sum;
}

// out[i] = x[i] * scale * w[i]
void scale_mul(float* out, const float* x, const float* w, float scale, int64_t n) {
  int64_t i = 0;
#ifdef LLMSERVE_AVX2
  const __m256 sv = _mm256_set1_ps(scale);
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), sv), _mm256_loadu_ps(w + i)));
  }
#endif
  for (; i < n; ++i) out[i] = x[i] * scale * w[i];
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float(x, "x");
  check_float(weight, "weight");
  const int64_t d = weight.numel();
  TORCH_CHECK(x.size(-1) == d, "rms_norm: x's last dimension ", x.size(-1), " != weight's ", d);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t rows = xc.numel() / d;
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.contiguous().data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * d;
      const float scale = 1.f / std::sqrt(sum_squares(row, d) / d + static_cast<float>(eps));
      scale_mul(op + r * d, row, wp, scale, d);
    }
  });
  return out;
}

void fused_add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_float(x, "x");
  check_float(residual, "residual");
  check_float(weight, "weight");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes(),
              "fused_add_rms_norm_: x and residual must be contiguous and of the same shape");
  const int64_t d = weight.numel();
  TORCH_CHECK(x.size(-1) == d, "fused_add_rms_norm_: x's last dimension ", x.size(-1), " != weight's ", d);
  const int64_t rows = x.numel() / d;
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.contiguous().data_ptr<float>();
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = xp + r * d;
      float* rr = rp + r * d;
      for (int64_t i = 0; i < d; ++i) rr[i] += xr[i];
      const float scale = 1.f / std::sqrt(sum_squares(rr, d) / d + static_cast<float>(eps));
      scale_mul(xr, rr, wp, scale, d);
    }
  });
}


at::Tensor silu_and_mul(const at::Tensor& x) {
  check_float(x, "x");
  const int64_t d = x.size(-1) / 2;
  TORCH_CHECK(x.size(-1) == 2 * d, "silu_and_mul: the last dimension must be even");
  const at::Tensor xc = x.contiguous();
  auto sizes = xc.sizes().vec();
  sizes.back() = d;
  at::Tensor out = at::empty(sizes, xc.options());
  const int64_t rows = xc.numel() / (2 * d);
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = xp + r * 2 * d;
      const float* up = gate + d;
      float* o = op + r * d;
      int64_t i = 0;
#ifdef LLMSERVE_AVX2
      const __m256 one = _mm256_set1_ps(1.f);
      for (; i + 8 <= d; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
      }
#endif
      for (; i < d; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

at::Tensor rotary_interleaved(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cis,
                              int64_t head_dim) {
  check_float(x, "x");
  check_float(cis, "cis");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rotary_interleaved: x must be [tokens, heads * head_dim] with unit column stride");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == x.size(0),
              "rotary_interleaved: positions must be int64, one per token");
  TORCH_CHECK(cis.dim() == 3 && cis.size(1) * 2 == head_dim && cis.size(2) == 2 && cis.is_contiguous(),
              "rotary_interleaved: cis must be [max_positions, head_dim / 2, 2]");
  TORCH_CHECK(x.size(1) % head_dim == 0, "rotary_interleaved: width is not a multiple of head_dim");
  const int64_t tokens = x.size(0), width = x.size(1), row_stride = x.stride(0);
  const int64_t heads = width / head_dim, max_pos = cis.size(0);
  at::Tensor out = at::empty({tokens, width}, x.options());
  const at::Tensor pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "rotary_interleaved: position ", pp[t], " outside 0..", max_pos - 1);
  }
  const float* xp = x.data_ptr<float>();
  const float* cp = cis.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tokens, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pp[t] * head_dim;  // (cos, sin) pairs of this position
      for (int64_t h = 0; h < heads; ++h) {
        const float* in = xp + t * row_stride + h * head_dim;
        float* o = op + t * width + h * head_dim;
        for (int64_t i = 0; i < head_dim; i += 2) {
          const float a = in[i], b = in[i + 1], cs = c[i], sn = c[i + 1];
          o[i] = a * cs - b * sn;
          o[i + 1] = a * sn + b * cs;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_interleaved(Tensor x, Tensor positions, Tensor cis, int head_dim) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("fused_add_rms_norm_", c10::DispatchKey::CPU, &fused_add_rms_norm_);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.impl("rotary_interleaved", c10::DispatchKey::CPU, &rotary_interleaved);
}
