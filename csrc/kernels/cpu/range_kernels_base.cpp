// gossip::cpu::base: the CPU range kernels for the compiler's baseline instruction set.
#include "kernels/cpu/range_kernels.h"

namespace gossip::cpu::base {
namespace {
#include "kernels/cpu/no_lanes.inc"
}  // namespace
}  // namespace gossip::cpu::base

#define GOSSIP_RANGE_KERNELS_ISA base
#include "kernels/cpu/range_kernels.inc"
