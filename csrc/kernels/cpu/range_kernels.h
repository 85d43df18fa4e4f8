// The per-range bodies of the CPU push-sum kernels. push_sum_cpu.cpp splits a buffer into ranges
// with at::parallel_for and calls these on each. They take raw pointers and include no torch
// header, so that each instruction set gets a translation unit of its own, as torch builds its
// CPU kernels once per capability and picks one at run time:
//   namespace base     range_kernels_base.cpp, the compiler's baseline (SSE2 on x86-64)
//   namespace avx2     range_kernels_avx2.cpp, AVX2 with FMA and F16C (x86-64 only)
//   namespace avx512   range_kernels_avx512.cpp, AVX-512 F/BW/VL/DQ with AVX512_BF16 (x86-64 only)
// Every namespace declares the same functions (range_kernels_decl.inc); cpu_has_avx2() and
// cpu_has_avx512() say which ones this CPU can run.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/cpu/convert.h"

namespace gossip::cpu {

namespace base {
#include "kernels/cpu/range_kernels_decl.inc"
}  // namespace base

namespace avx2 {
#include "kernels/cpu/range_kernels_decl.inc"
}  // namespace avx2

namespace avx512 {
#include "kernels/cpu/range_kernels_decl.inc"
}  // namespace avx512

// Whether this CPU runs the avx2 kernels (AVX2, FMA and F16C); decided once.
bool cpu_has_avx2();

// Whether this CPU runs the avx512 kernels (AVX-512 F, BW, VL, DQ and BF16, FMA, F16C); decided
// once.
bool cpu_has_avx512();

}  // namespace gossip::cpu
