// Compiles the kernel bodies of LLMSERVE_ISA_IMPL (a header name) once per instruction set,
// each in its own namespace, and defines LLMSERVE_DISPATCH(call) to run the one chosen at run
// time (isa.h). Include it once per .cpp, after defining LLMSERVE_ISA_IMPL:
//
//     #define LLMSERVE_ISA_IMPL "fused_impl.h"
//     #include "per_isa.h"
//     ... LLMSERVE_DISPATCH(act_and_mul_rows<Act::kSilu>(x, out, rows, d));

namespace {  // internal: each file compiles its own copies
namespace isa_scalar {
using Vec = VecScalar;
#include LLMSERVE_ISA_IMPL
}  // namespace isa_scalar
}  // namespace

#ifdef LLMSERVE_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace {
namespace isa_avx2 {
using Vec = Vec256;
#include LLMSERVE_ISA_IMPL
}  // namespace isa_avx2
namespace isa_avx2_w16 {  // the AVX-512 code's shape on AVX2, for tests (vec.h: Vec256x2)
using Vec = Vec256x2;
#include LLMSERVE_ISA_IMPL
}  // namespace isa_avx2_w16
}  // namespace
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
namespace {
namespace isa_avx512 {
using Vec = Vec512;
#include LLMSERVE_ISA_IMPL
}  // namespace isa_avx512
}  // namespace
#pragma GCC pop_options

#define LLMSERVE_DISPATCH(...)                                   \
  switch (llmserve::current_isa()) {                             \
    case llmserve::Isa::kAvx512Bf16:                             \
    case llmserve::Isa::kAvx512: isa_avx512::__VA_ARGS__; break; \
    case llmserve::Isa::kAvx2: isa_avx2::__VA_ARGS__; break;     \
    case llmserve::Isa::kAvx2W16: isa_avx2_w16::__VA_ARGS__; break; \
    default: isa_scalar::__VA_ARGS__;                            \
  }
#else
#define LLMSERVE_DISPATCH(...) isa_scalar::__VA_ARGS__
#endif
