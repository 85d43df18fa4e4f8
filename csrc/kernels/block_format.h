// Block-quantized messages: int8, int4 and float8 e4m3 with one float32 scale per block of
// kQuantBlock values. Shared by the CPU range kernels, the CUDA twins, the op checks and the
// engine, so it includes no torch header; every function has internal linkage (static), so that
// no copy compiled for one instruction set can be merged by the linker into another's code
// (kernels/cpu/range_kernels.h).
//
// Note [Quantized messages]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A message of n values is one byte buffer: [scales: float32 x blocks | payload], blocks =
// ceil(n / kQuantBlock). Value i belongs to block i / kQuantBlock, whose scale is
//   s = float(amax / Q),  amax = max |v| over the block,  Q = the format's largest level,
// and is sent as the code of v / s (clamped to [-Q, Q]): the integer nearest to it, ties to even,
// for int8 (Q = 127, one byte a value) and int4 (Q = 7, two values a byte, the even one in the
// low nibble, two's complement); float8 e4m3fn rounded to nearest even (Q = 448, one byte). The
// receiver reads code * s in float32. A block of zeros has s = 0 and codes 0; a block holding NaN
// or Inf has s = NaN and codes 0, so that every value the receiver reads of it is NaN and its
// check names the sender (Note [Non-finite messages] in the engine), while the sender's own state
// keeps its values.
//
// Why a block of 128: a block's outlier costs precision to its block only, and the scale adds 4
// bytes a block: int8 then sends 0.258 of float32's bytes and int4 0.133, where blocks of 64
// would send 0.266 and 0.141, and blocks of 256 would let one outlier flatten twice as many
// values to zero. Blocks start at multiples of 128, so int4's bytes never straddle two blocks or
// two threads' ranges.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define GOSSIP_BLOCK_FN static inline __host__ __device__
#else
#define GOSSIP_BLOCK_FN static inline
#endif

namespace gossip {

enum class BlockFormat : int32_t { kInt8 = 0, kInt4 = 1, kFloat8E4M3 = 2 };

constexpr int64_t kQuantBlock = 128;

GOSSIP_BLOCK_FN int64_t quant_blocks(int64_t numel) {
  return (numel + kQuantBlock - 1) / kQuantBlock;
}

// Payload bytes of `numel` values.
GOSSIP_BLOCK_FN int64_t quant_payload_bytes(int64_t numel, BlockFormat format) {
  return format == BlockFormat::kInt4 ? (numel + 1) / 2 : numel;
}

// Bytes of a whole message of `numel` values: scales, then payload.
GOSSIP_BLOCK_FN int64_t quant_message_bytes(int64_t numel, BlockFormat format) {
  return quant_blocks(numel) * static_cast<int64_t>(sizeof(float)) +
         quant_payload_bytes(numel, format);
}

// The largest level, Q.
GOSSIP_BLOCK_FN float quant_max_level(BlockFormat format) {
  switch (format) {
    case BlockFormat::kInt8:
      return 127.0f;
    case BlockFormat::kInt4:
      return 7.0f;
    default:
      return 448.0f;
  }
}

GOSSIP_BLOCK_FN uint32_t quant_float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
#endif
}

GOSSIP_BLOCK_FN float quant_bits_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// y rounded to an integer, ties to even, for |y| <= 2^22: adding and subtracting 1.5 * 2^23
// rounds with the FPU's own rounding, branch-free, so the loops vectorize on every instruction set
// (SSE2 has no rounding instruction) and agree bit for bit.
// (Without -ffast-math, which the build never uses, the compiler keeps both operations.)
GOSSIP_BLOCK_FN float quant_round_even(float y) { return (y + 0x1.8p23f) - 0x1.8p23f; }

// The float8 e4m3fn code of y, |y| <= 448, rounded to nearest even, as c10::Float8_e4m3fn: normal
// numbers round the float's mantissa to 3 bits; below 2^-6 the code is the integer nearest to
// y * 2^9 (the subnormal codes 0..7, and 8, which is 2^-6's code).
// Signed 32-bit arithmetic throughout (a magnitude's bits fit): x86 has no vector conversion or
// comparison of unsigned 32-bit integers before AVX-512, and the loop would stay scalar.
GOSSIP_BLOCK_FN uint8_t quant_float8_code(float y) {
  const int32_t bits = static_cast<int32_t>(quant_float_bits(y));
  const int32_t sign = (bits >> 24) & 0x80;
  const int32_t magnitude = bits & 0x7FFFFFFF;
  const int32_t normal = (magnitude + 0x7FFFF + ((magnitude >> 20) & 1) - (120 << 23)) >> 20;
  const float scaled = quant_bits_float(static_cast<uint32_t>(magnitude)) * 512.0f;
  const int32_t subnormal = static_cast<int32_t>(quant_round_even(scaled));
  const int32_t is_subnormal = -static_cast<int32_t>(magnitude < (121 << 23));
  return static_cast<uint8_t>(sign | (subnormal & is_subnormal) | (normal & ~is_subnormal));
}

GOSSIP_BLOCK_FN float quant_float8_value(uint8_t code) {
  const uint32_t c = code;
  const uint32_t sign = (c & 0x80u) << 24;
  const float normal = quant_bits_float(((c & 0x7Fu) << 20) + (120u << 23));
  const float subnormal = static_cast<float>(c & 7u) * 0x1.0p-9f;
  const uint32_t is_subnormal = 0u - static_cast<uint32_t>((c & 0x78u) == 0);
  const uint32_t magnitude = (quant_float_bits(subnormal) & is_subnormal) |
                             (quant_float_bits(normal) & ~is_subnormal);
  return quant_bits_float(sign | magnitude);
}

// The value of int4 code `nibble` (two's complement in the low 4 bits).
GOSSIP_BLOCK_FN float quant_int4_value(uint32_t nibble) {
  return static_cast<float>(static_cast<int32_t>((nibble & 0xFu) ^ 0x8u) - 8);
}

}  // namespace gossip

#undef GOSSIP_BLOCK_FN
