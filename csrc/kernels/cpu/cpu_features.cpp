// Which of the range kernels' instruction sets this CPU can run (range_kernels.h), asked of the
// CPU once. Plain code: the question needs none of the instructions it asks about.
#include "kernels/cpu/range_kernels.h"

namespace gossip::cpu {

#if defined(__x86_64__) && defined(__GNUC__)

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
}

bool cpu_has_avx512() {
  static const bool has = cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return has;
}

bool cpu_has_avx512_bf16() {
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return has;
}

// AMD's family 19h is Zen 3 and Zen 4, and only Zen 4 has AVX-512.
bool cpu_is_zen4() {
  static const bool is = cpu_has_avx512_bf16() && __builtin_cpu_is("amdfam19h");
  return is;
}

#else  // another architecture: the baseline kernels serve every call

bool cpu_has_avx2() { return false; }
bool cpu_has_avx512() { return false; }
bool cpu_has_avx512_bf16() { return false; }
bool cpu_is_zen4() { return false; }

#endif

}  // namespace gossip::cpu
