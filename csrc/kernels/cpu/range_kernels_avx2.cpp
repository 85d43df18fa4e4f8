// gossip::cpu::avx2: the CPU range kernels compiled for AVX2 with FMA and F16C, with explicit
// vector lanes for float32, bfloat16 and float16 (lanes_avx2.h), run only where the CPU has those
// instructions (cpu_has_avx2()). The target pragma covers this file's own code, after the
// standard headers, so nothing else in the library needs them.
#include <cstdint>
#include <cstring>

#include "kernels/cpu/range_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "kernels/cpu/lanes_avx2.h"
#define GOSSIP_RANGE_KERNELS_ISA avx2
#include "kernels/cpu/range_kernels.inc"
#pragma GCC pop_options

namespace gossip::cpu {

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
}

}  // namespace gossip::cpu

#else  // another architecture: the baseline kernels serve every call

#define GOSSIP_RANGE_KERNELS_ISA avx2
#include "kernels/cpu/range_kernels_without_lanes.inc"

namespace gossip::cpu {

bool cpu_has_avx2() { return false; }

}  // namespace gossip::cpu

#endif
