// What llmserve_cpu_kernels exports, declared for kernels_bindings.cpp, which binds each
// function twice (pybind11 for direct calls, torch.library for torch.ops.llmserve_cpu); each
// namespace's functions are defined in the .cpp file named beside it. The kernel files include
// aten.h and this header only, so they compile without the bindings' headers (aten.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "aten.h"

namespace llmserve::fused {  // fused.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                         double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor gelu_tanh_and_mul(const at::Tensor& x);
at::Tensor rotary_interleaved(const at::Tensor& x, const at::Tensor& positions,
                              const at::Tensor& cis, int64_t head_dim);
at::Tensor rotary_neox(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                       const at::Tensor& sin, int64_t head_dim, int64_t rotary_dim);
at::Tensor argmax_rows(const at::Tensor& x);
at::Tensor draw_rows(const at::Tensor& x, const at::Tensor& inv_temperature, const at::Tensor& u,
                     const at::Tensor& top_p, const at::Tensor& min_p);
}  // namespace llmserve::fused

namespace llmserve::attention {  // paged_attention.cpp
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, at::Tensor& out,
                            int64_t window, double k_scale, double v_scale);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            at::Tensor& k_cache, at::Tensor& v_cache,
                            const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, int64_t window,
                            double k_scale, double v_scale);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start,
                           double scale, int64_t sdpa_min_rows, int64_t window, double k_scale,
                           double v_scale);
std::string set_isa(const std::string& name);
}  // namespace llmserve::attention

namespace llmserve::gemm {  // gemm.cpp
at::Tensor linear_f32_pack(const at::Tensor& w);
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                      const c10::optional<at::Tensor>& bias, bool whole_panels);
}  // namespace llmserve::gemm

namespace llmserve::gemm_bf16 {  // gemm_bf16.cpp
at::Tensor linear_bf16_pack(const at::Tensor& w);
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                       const c10::optional<at::Tensor>& bias, bool widen);
}  // namespace llmserve::gemm_bf16

namespace llmserve::gemm_amx {  // gemm_amx.cpp
bool amx_ready();
at::Tensor linear_bf16_amx(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                           const c10::optional<at::Tensor>& bias, bool emulate);
}  // namespace llmserve::gemm_amx

namespace llmserve::threads {  // threads.cpp
int64_t bind_threads(const std::vector<int64_t>& cpus);
}  // namespace llmserve::threads
