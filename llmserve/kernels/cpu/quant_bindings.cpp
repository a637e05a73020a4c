// The Python face of llmserve_cpu_quant: every function of quant_ops.h bound twice, as
// kernels_bindings.cpp does for the other library (torch.ops.llmserve_quant, and pybind11 for
// the hot one).
#include <torch/library.h>

#include "bindings.h"
#include "quant_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &llmserve_quant::quant_linear, ReleaseGil());
  m.def("quant_linear_f32", &llmserve_quant::quant_linear_f32, ReleaseGil());
}

TORCH_LIBRARY(llmserve_quant, m) {
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor)");
  m.def(
      "quant_gemm(Tensor xq, Tensor xs, Tensor qweight, Tensor scales, Tensor? mins, Tensor? lut, "
      "int bits, int group_size, Tensor? bias, str isa) -> Tensor");
  m.def(
      "quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? lut, "
      "Tensor? perm, int bits, int group_size, Tensor? bias, str isa, int act_digits=1) -> Tensor");
  m.def("resolve_isa(str isa) -> str", &llmserve_quant::resolve_isa);
  m.impl("quantize_activations", c10::DispatchKey::CPU, &llmserve_quant::quantize_activations);
  m.impl("quant_gemm", c10::DispatchKey::CPU, &llmserve_quant::quant_gemm);
  m.impl("quant_linear", c10::DispatchKey::CPU, &llmserve_quant::quant_linear);
  m.def(
      "quant_linear_f32(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? lut, "
      "Tensor? perm, int bits, int group_size, Tensor? bias, str isa=\"auto\", "
      "bool bf16_gemm=False) -> Tensor");
  m.impl("quant_linear_f32", c10::DispatchKey::CPU, &llmserve_quant::quant_linear_f32);
}
