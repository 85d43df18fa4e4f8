// gossip::cpu::avx2: the CPU range kernels compiled for AVX2 with FMA and F16C, with explicit
// vector lanes for float32, bfloat16 and float16 (lanes_avx2.h), run only where the CPU has those
// instructions (cpu_has_avx2()). The target pragma covers this file's own code, after the
// standard headers, so nothing else in the library needs them.
#include <cstdint>
#include <cstring>

#include "kernels/cpu/range_kernels.h"

#define GOSSIP_RANGE_KERNELS_ISA avx2

#if defined(__x86_64__) && defined(__GNUC__)

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "kernels/cpu/lanes_avx2.h"
#include "kernels/cpu/range_kernels.inc"
#pragma GCC pop_options

#else  // another architecture: the baseline kernels serve every call

#include "kernels/cpu/range_kernels_without_lanes.inc"

#endif
