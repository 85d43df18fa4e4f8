// gossip::cpu::base: the CPU range kernels for the compiler's baseline instruction set.
#include "kernels/cpu/range_kernels.h"

namespace gossip::cpu::base {
namespace {

// No explicit vector lanes: the generic loops, vectorized by the compiler, serve every type.
template <typename T>
struct Lanes {
  static constexpr bool kEnabled = false;
};

}  // namespace
}  // namespace gossip::cpu::base

#define GOSSIP_RANGE_KERNELS_ISA base
#include "kernels/cpu/range_kernels.inc"
