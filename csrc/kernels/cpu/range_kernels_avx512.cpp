// gossip::cpu::avx512: the CPU range kernels for torch's AVX512 capability, AVX-512 F, BW, VL and
// DQ with FMA and F16C (Intel Xeons from Skylake to Ice Lake among others), run only where the CPU
// has those instructions (cpu_has_avx512()). bfloat16 rounds with integer instructions here.
#define GOSSIP_RANGE_KERNELS_ISA avx512
#define GOSSIP_AVX512_BF16 0
#define GOSSIP_FLOAT16_STATE_256 0
#include "kernels/cpu/range_kernels_avx512.inc"
