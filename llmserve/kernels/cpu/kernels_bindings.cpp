// Direct Python bindings of llmserve_cpu_kernels' hot functions. The torch.ops route (the
// dispatcher, boxed arguments) costs about 1.5 us more per call than a pybind11 call, and a
// decode step of a small model makes a few hundred such calls; the ops stay registered too.
#include "bindings.h"

void llmserve_bind_fused(pybind11::module_& m);
void llmserve_bind_paged_attention(pybind11::module_& m);
void llmserve_bind_gemm(pybind11::module_& m);
void llmserve_bind_gemm_bf16(pybind11::module_& m);
void llmserve_bind_gemm_amx(pybind11::module_& m);
void llmserve_bind_threads(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  llmserve_bind_fused(m);
  llmserve_bind_paged_attention(m);
  llmserve_bind_gemm(m);
  llmserve_bind_gemm_bf16(m);
  llmserve_bind_gemm_amx(m);
  llmserve_bind_threads(m);
}
