// gossip::cpu::avx512: the CPU range kernels compiled for AVX-512 (F, BW, VL, DQ) with AVX512_BF16,
// FMA and F16C, with explicit sixteen-lane vectors for float32, bfloat16 and float16
// (lanes_avx512.h), run only where the CPU has those instructions (cpu_has_avx512()). The target
// pragma covers this file's own code, after the standard headers, so nothing else in the library
// needs them.
#include <cstdint>
#include <cstring>

#include "kernels/cpu/range_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)

// GCC 12's avx512fintrin.h initializes its _mm512_undefined_* values from themselves, which
// -Wmaybe-uninitialized reports in every function that inlines one, and -Wuninitialized in a cold
// one (GCC bug 105593, fixed in GCC 13). The warnings are emitted at the header's lines, so they
// are silenced before the header.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#include "kernels/cpu/lanes_avx512.h"
#define GOSSIP_RANGE_KERNELS_ISA avx512
#include "kernels/cpu/range_kernels.inc"
#pragma GCC pop_options
#pragma GCC diagnostic pop

namespace gossip::cpu {

bool cpu_has_avx512() {
  static const bool has =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c");
  return has;
}

}  // namespace gossip::cpu

#else  // another architecture: the baseline kernels serve every call

#define GOSSIP_RANGE_KERNELS_ISA avx512
#include "kernels/cpu/range_kernels_without_lanes.inc"

namespace gossip::cpu {

bool cpu_has_avx512() { return false; }

}  // namespace gossip::cpu

#endif
