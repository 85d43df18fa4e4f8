// gossip::cpu::avx512_bf16: the CPU range kernels for AVX-512 with AVX512_BF16 (Intel from Cooper
// Lake and Sapphire Rapids, AMD from Zen 4), run only where the CPU has those instructions
// (cpu_has_avx512_bf16()). bfloat16 rounds with AVX512_BF16's conversions here.
#define GOSSIP_RANGE_KERNELS_ISA avx512_bf16
#define GOSSIP_AVX512_BF16 1
#define GOSSIP_FLOAT16_STATE_256 0
#include "kernels/cpu/range_kernels_avx512.inc"
