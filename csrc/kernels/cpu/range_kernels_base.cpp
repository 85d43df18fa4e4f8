// gossip::cpu::base: the CPU range kernels for the compiler's baseline instruction set.
#include "kernels/cpu/range_kernels.h"

#define GOSSIP_RANGE_KERNELS_ISA base
#include "kernels/cpu/range_kernels_without_lanes.inc"
