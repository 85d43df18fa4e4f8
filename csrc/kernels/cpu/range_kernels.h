// The per-range bodies of the CPU push-sum kernels. push_sum_cpu.cpp splits a buffer into ranges
// with at::parallel_for and calls these on each. They take raw pointers and include no torch
// header, so that each instruction set gets a translation unit of its own, as torch builds its
// CPU kernels once per capability and picks one at run time:
//   namespace base          range_kernels_base.cpp, the compiler's baseline (SSE2 on x86-64)
//   namespace avx2          range_kernels_avx2.cpp, AVX2 with FMA and F16C
//   namespace avx512        range_kernels_avx512.cpp, AVX-512 F/BW/VL/DQ (torch's AVX512)
//   namespace avx512_bf16   range_kernels_avx512_bf16.cpp, the same with AVX512_BF16
//   namespace zen4          range_kernels_zen4.cpp, avx512_bf16 with float16 laid out for Zen 4
// Every namespace declares the same functions (range_kernels_decl.inc); on other architectures
// than x86-64 the vector ones compile the baseline code. cpu_features.cpp says which ones this CPU
// can run.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/block_format.h"
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

namespace avx512_bf16 {
#include "kernels/cpu/range_kernels_decl.inc"
}  // namespace avx512_bf16

namespace zen4 {
#include "kernels/cpu/range_kernels_decl.inc"
}  // namespace zen4

// Whether this CPU runs the avx2 kernels (AVX2, FMA and F16C); decided once.
bool cpu_has_avx2();

// Whether this CPU runs the avx512 kernels (AVX-512 F, BW, VL and DQ, with AVX2, FMA and F16C);
// decided once.
bool cpu_has_avx512();

// Whether this CPU runs the avx512_bf16 kernels (the avx512 ones' instructions and AVX512_BF16);
// decided once.
bool cpu_has_avx512_bf16();

// Whether this CPU is an AMD Zen 4, which runs the zen4 kernels (the avx512_bf16 ones tuned for
// it); decided once.
bool cpu_is_zen4();

}  // namespace gossip::cpu
