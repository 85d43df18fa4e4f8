// gossip::cpu::zen4: the avx512_bf16 kernels as AMD Zen 4 runs them best, run only on Zen 4
// (cpu_is_zen4()). They differ in one layout: kernels whose every operand is float16 convert 256
// bits at a time (lanes_avx512.h, HalfPairLanes), as Zen 4 runs a 512-bit conversion on two 256-bit
// halves and is faster without them.
#define GOSSIP_RANGE_KERNELS_ISA zen4
#define GOSSIP_AVX512_BF16 1
#define GOSSIP_FLOAT16_STATE_256 1
#include "kernels/cpu/range_kernels_avx512.inc"
