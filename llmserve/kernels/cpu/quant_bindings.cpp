// Direct Python bindings of the quantized linears (see kernels_bindings.cpp for why).
#include "bindings.h"

void llmserve_bind_quant_gemm(pybind11::module_& m);
void llmserve_bind_quant_float(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  llmserve_bind_quant_gemm(m);
  llmserve_bind_quant_float(m);
}
