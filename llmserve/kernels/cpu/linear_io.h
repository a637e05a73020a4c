// What the packed linears (gemm.cpp, gemm_bf16.cpp) do around their kernels alike: a bias
// padded to whole panels (fp32, added to the sums before the store), and the output cut back
// to the layer's width and x's leading dimensions.
#pragma once

#include "aten.h"

#include <cstdint>

namespace llmserve {

// ``bias`` (n values, or none) as fp32 padded with zeros to ``padded_n``; undefined when none
inline at::Tensor padded_linear_bias(const c10::optional<at::Tensor>& bias, int64_t n,
                                     int64_t padded_n, const char* op) {
  if (!bias.has_value() || !bias->defined()) return {};
  TORCH_CHECK(bias->numel() == n, op, ": bias must have ", n, " elements");
  at::Tensor padded = at::zeros({padded_n}, bias->options().dtype(at::kFloat));
  padded.narrow(0, 0, n).copy_(bias->reshape({-1}));
  return padded;
}

// y [M, padded_n] -> [..., n] with x's leading dimensions
inline at::Tensor linear_output(at::Tensor y, const at::Tensor& x, int64_t n) {
  if (y.size(1) != n) y = y.narrow(1, 0, n).contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return y.view(sizes);
}

}  // namespace llmserve
