// The Python face of llmserve_cpu_kernels: every function of kernels_ops.h bound twice.
//   - torch.ops.llmserve_cpu.<name>, through torch's dispatcher (schemas below);
//   - direct pybind11 bindings (NativeLibrary.direct()): the dispatcher's route (boxed
//     arguments) costs about 1.5 us more per call, and a decode step of a small model makes a
//     few hundred such calls.
// This file alone includes torch/library.h and pybind11 (about 10 s each to compile), so the
// kernel files do not (aten.h).
#include <torch/library.h>

#include "bindings.h"
#include "isa.h"
#include "kernels_ops.h"

namespace fused = llmserve::fused;
namespace attention = llmserve::attention;
namespace gemm = llmserve::gemm;
namespace gemm_bf16 = llmserve::gemm_bf16;
namespace gemm_amx = llmserve::gemm_amx;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &fused::rms_norm, ReleaseGil());
  m.def("fused_add_rms_norm_", &fused::fused_add_rms_norm_, ReleaseGil());
  m.def("silu_and_mul", &fused::silu_and_mul, ReleaseGil());
  m.def("gelu_tanh_and_mul", &fused::gelu_tanh_and_mul, ReleaseGil());
  m.def("rotary_interleaved", &fused::rotary_interleaved, ReleaseGil());
  m.def("rotary_neox", &fused::rotary_neox, ReleaseGil());
  m.def("argmax_rows", &fused::argmax_rows, ReleaseGil());
  m.def("draw_rows", &fused::draw_rows, ReleaseGil());

  m.def("paged_decode_attention", &attention::paged_decode_attention, ReleaseGil());
  m.def("decode_attention", &attention::decode_attention, ReleaseGil());
  m.def("paged_attention", &attention::paged_attention, ReleaseGil());
  m.def("amd_family", &llmserve::amd_family);
  m.def("widens_bf16", &llmserve::widens_bf16);

  m.def("linear_f32_pack", &gemm::linear_f32_pack, ReleaseGil());
  m.def("linear_f32", &gemm::linear_f32, ReleaseGil());
  m.def("linear_bf16_pack", &gemm_bf16::linear_bf16_pack, ReleaseGil());
  m.def("linear_bf16", &gemm_bf16::linear_bf16, ReleaseGil());
  m.def("amx_ready", &gemm_amx::amx_ready);
  m.def("linear_bf16_amx", &gemm_amx::linear_bf16_amx, ReleaseGil());

  m.def("bind_threads", &llmserve::threads::bind_threads, ReleaseGil());
}

TORCH_LIBRARY(llmserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor x) -> Tensor");
  m.def("rotary_interleaved(Tensor x, Tensor positions, Tensor cis, int head_dim) -> Tensor");
  m.def("rotary_neox(Tensor x, Tensor positions, Tensor cos, Tensor sin, int head_dim, "
        "int rotary_dim) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("draw_rows(Tensor x, Tensor inv_temperature, Tensor u, Tensor top_p, Tensor min_p)"
        " -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &fused::rms_norm);
  m.impl("fused_add_rms_norm_", c10::DispatchKey::CPU, &fused::fused_add_rms_norm_);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &fused::silu_and_mul);
  m.impl("gelu_tanh_and_mul", c10::DispatchKey::CPU, &fused::gelu_tanh_and_mul);
  m.impl("rotary_interleaved", c10::DispatchKey::CPU, &fused::rotary_interleaved);
  m.impl("rotary_neox", c10::DispatchKey::CPU, &fused::rotary_neox);
  m.impl("argmax_rows", c10::DispatchKey::CPU, &fused::argmax_rows);
  m.impl("draw_rows", c10::DispatchKey::CPU, &fused::draw_rows);

  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, Tensor(a!) out, int window=0, float k_scale=1.0, "
      "float v_scale=1.0) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &attention::paged_decode_attention);
  m.def("set_isa(str name) -> str", &attention::set_isa);

  m.def("linear_f32_pack(Tensor w) -> Tensor");
  m.def(
      "linear_f32(Tensor x, Tensor packed, int n, Tensor? bias, bool whole_panels=False) -> "
      "Tensor");
  m.impl("linear_f32_pack", c10::DispatchKey::CPU, &gemm::linear_f32_pack);
  m.impl("linear_f32", c10::DispatchKey::CPU, &gemm::linear_f32);

  m.def("linear_bf16_pack(Tensor w) -> Tensor");
  m.def(
      "linear_bf16(Tensor x, Tensor packed, int n, Tensor? bias, bool widen=False) -> Tensor");
  m.impl("linear_bf16_pack", c10::DispatchKey::CPU, &gemm_bf16::linear_bf16_pack);
  m.impl("linear_bf16", c10::DispatchKey::CPU, &gemm_bf16::linear_bf16);

  m.def(
      "linear_bf16_amx(Tensor x, Tensor packed, int n, Tensor? bias, bool emulate=False) -> "
      "Tensor");
  m.impl("linear_bf16_amx", c10::DispatchKey::CPU, &gemm_amx::linear_bf16_amx);
}
