// What llmserve_cpu_quant exports, declared for quant_bindings.cpp, which binds each function
// twice (pybind11 for direct calls, torch.library for torch.ops.llmserve_quant), as
// kernels_ops.h does for the other library; defined in quant_gemm.cpp and quant_float.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>

#include "aten.h"

namespace llmserve_quant {
// quant_gemm.cpp
std::tuple<at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x);
at::Tensor quant_gemm(const at::Tensor& xq, const at::Tensor& xs, const at::Tensor& qweight,
                      const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                      const c10::optional<at::Tensor>& lut, int64_t bits, int64_t group_size,
                      const c10::optional<at::Tensor>& bias, const std::string& isa);
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& lut,
                        const c10::optional<at::Tensor>& perm, int64_t bits, int64_t group_size,
                        const c10::optional<at::Tensor>& bias, const std::string& isa,
                        int64_t act_digits);
std::string resolve_isa(const std::string& isa);
// quant_float.cpp
at::Tensor quant_linear_f32(const at::Tensor& x_in, const at::Tensor& qweight,
                            const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                            const c10::optional<at::Tensor>& lut,
                            const c10::optional<at::Tensor>& perm, int64_t bits, int64_t group,
                            const c10::optional<at::Tensor>& bias, const std::string& isa,
                            bool bf16_gemm);
}  // namespace llmserve_quant
