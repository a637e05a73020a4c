// Run-time choice of the instruction set for the kernels of llmserve_cpu_kernels.
//
// Each kernel body (``*_impl.h``) is compiled three times, into namespaces isa_avx512,
// isa_avx2 and isa_scalar, under a ``#pragma GCC target`` of that ISA, while the library is
// built for the baseline x86-64 target; ``current_isa()`` picks one per call: the best this
// CPU runs, or the one forced by ``set_isa`` (tests, and ``LLMSERVE_CPU_ISA`` at load time).
// avx512_bf16 runs the isa_avx512 code, plus the few functions that use AVX512_BF16's
// dot-product instruction (vdpbf16ps) for bf16 data (attention scores over a transposed K).
// avx2_w16 is never chosen on its own: it runs the AVX-512 code's 16-lane shape on AVX2
// instructions (vec.h: Vec256x2), so the tests check that code's logic on any AVX2 host.
#pragma once

#include "aten.h"

#include <string>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

namespace llmserve {

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAvx2W16 = 4 };

inline bool cpu_supports(Isa isa) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (isa == Isa::kAvx2 || isa == Isa::kAvx2W16) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  if (isa == Isa::kAvx512) return avx512;
  if (isa == Isa::kAvx512Bf16) return avx512 && __builtin_cpu_supports("avx512bf16");
#endif
  return isa == Isa::kScalar;
}

// AMD's and Intel's cores answer software prefetch hints differently (attend_chunk,
// attention_chunk_impl.h)
inline bool cpu_is_amd() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  return amd;
#else
  return false;
#endif
}

// An AMD CPU's family (cpuid leaf 1: base + extended family; 0x19 Zen 3/4, 0x1A Zen 5); 0 on
// other vendors and architectures
inline unsigned amd_family() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const unsigned family = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!cpu_is_amd() || !__get_cpuid(1, &a, &b, &c, &d)) return 0u;
    const unsigned base = (a >> 8) & 0xF;
    return base == 0xF ? base + ((a >> 20) & 0xFF) : base;
  }();
  return family;
#else
  return 0;
#endif
}

// Whether bf16 products run faster as fp32 FMAs on values widened in registers than by
// vdpbf16ps here: Intel CPUs with AVX512_BF16 and no AMX-BF16 (cpuid 7.0 EDX bit 22).
// Measured on one (family 6 model 207, AMX hidden by its VM, 2 threads): vdpbf16ps ran the
// bf16 GEMM at 180-200 GFLOP/s from 64 rows up, widened 240-285 (the FMA peak: 410);
// prompt attention (8 x 256, the default model's heads) 4.3-4.7 ms with vdpbf16ps, 3.7-3.9
// widened. best_isa then takes the AVX-512 code without vdpbf16ps, and PackedLinear the bf16
// GEMM's widened path (gemm_bf16.cpp). Intel's other CPUs without AMX but with AVX512_BF16
// (Cooper Lake) follow the same rule unmeasured.
inline bool widens_bf16() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool widen = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    __builtin_cpu_init();
    if (__builtin_cpu_is("intel") == 0 || !cpu_supports(Isa::kAvx512Bf16)) return false;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    return ((d >> 22) & 1u) == 0;  // no AMX-BF16
  }();
  return widen;
#else
  return false;
#endif
}

inline Isa best_isa() {
  if (cpu_supports(Isa::kAvx512Bf16) && !widens_bf16()) return Isa::kAvx512Bf16;
  if (cpu_supports(Isa::kAvx512)) return Isa::kAvx512;
  if (cpu_supports(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kScalar;
}

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx2W16: return "avx2_w16";
    default: return "scalar";
  }
}

// "auto", "avx512_bf16", "avx512", "avx2", "avx2_w16" or "scalar" -> the ISA; forcing one
// this CPU lacks raises
inline Isa parse_isa(const std::string& name) {
  if (name == "auto") return best_isa();
  for (Isa isa : {Isa::kAvx512Bf16, Isa::kAvx512, Isa::kAvx2, Isa::kAvx2W16, Isa::kScalar}) {
    if (name == isa_name(isa)) {
      TORCH_CHECK(cpu_supports(isa), "this CPU cannot run the ", name, " kernels");
      return isa;
    }
  }
  TORCH_CHECK(false, "isa must be one of auto, avx512_bf16, avx512, avx2, avx2_w16, scalar; got '", name, "'");
}

Isa current_isa();             // defined in paged_attention.cpp
void set_current_isa(Isa isa);

}  // namespace llmserve
