// Loads and stores of the CPU kernels' element types, converting to and from their opmath type
// (float for 16-bit types) with plain integer and float arithmetic and no branches, so that the
// compiler vectorizes the kernels' loops. c10's own conversions go through BFloat16/Half objects
// and std::isnan, which leave those loops scalar: a 16-bit kernel then ran at a fifth of memory
// speed. The results are bit-exact with c10::BFloat16 and c10::Half (round to nearest even, NaN
// stays NaN, subnormals kept), which tests/cpp/kernels_test.cpp checks over every 16-bit pattern
// and more.
// float16 follows the branch-free algorithm of the FP16 library (M. Dukhan), as c10 does.
#pragma once

#include <cstdint>
#include <cstring>

namespace gossip::cpu {

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

// All ones where `condition` holds, else zero: selects written as masks, which the compiler keeps
// in vector registers where a conditional expression can become a branch.
inline uint32_t mask_if(bool condition) { return 0u - static_cast<uint32_t>(condition); }

inline float bfloat16_to_float(uint16_t bits) { return bits_to_float(uint32_t(bits) << 16); }

inline uint16_t float_to_bfloat16(float f) {
  const uint32_t bits = float_to_bits(f);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;  // to nearest even
  const uint32_t nan = mask_if((bits & 0x7FFFFFFFu) > 0x7F800000u);
  return static_cast<uint16_t>((0x7FC0u & nan) | (rounded & ~nan));
}

inline float half_to_float(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  // Normal numbers: move the exponent and mantissa into place and rescale the exponent bias.
  const float normalized = bits_to_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  // Subnormals: put the mantissa under an exponent of 2^-1 and subtract that 0.5 back out.
  const float denormalized = bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t subnormal = mask_if(two_w < (1u << 27));
  const uint32_t magnitude =
      (float_to_bits(denormalized) & subnormal) | (float_to_bits(normalized) & ~subnormal);
  return bits_to_float(sign | magnitude);
}

inline uint16_t float_to_half(float f) {
  // Scaling up then down rounds the mantissa to 10 bits with the FPU's own rounding (to nearest
  // even) and saturates to infinity exactly where float16 overflows.
  float base = (bits_to_float(float_to_bits(f) & 0x7FFFFFFFu) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = float_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t exponent = shl1_w & 0xFF000000u;
  const uint32_t small = mask_if(exponent < 0x71000000u);
  const uint32_t bias = (0x71000000u & small) | (exponent & ~small);
  base = bits_to_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_to_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  const uint32_t nan = mask_if(shl1_w > 0xFF000000u);
  return static_cast<uint16_t>((sign >> 16) | (0x7E00u & nan) | (nonsign & ~nan));
}

// The layouts of c10::BFloat16 and c10::Half (one uint16_t), without the torch headers: this file
// is compiled once per instruction set (kernels/cpu/range_kernels.h).
struct BFloat16Bits {
  uint16_t bits;
};
struct HalfBits {
  uint16_t bits;
};

// The arithmetic type of a stored type: float for the 16-bit ones, as at::opmath_type.
template <typename T>
struct Opmath {
  using type = T;
};
template <>
struct Opmath<BFloat16Bits> {
  using type = float;
};
template <>
struct Opmath<HalfBits> {
  using type = float;
};

// Element access in an opmath type. A 16-bit value read into a float64 opmath goes through float,
// exactly as c10's conversions do.
template <typename T>
struct Element {
  template <typename opmath_t>
  static opmath_t load(const T* p, int64_t i) {
    return static_cast<opmath_t>(p[i]);
  }
  template <typename opmath_t>
  static void store(T* p, int64_t i, opmath_t v) {
    p[i] = static_cast<T>(v);
  }
};

template <>
struct Element<BFloat16Bits> {
  template <typename opmath_t>
  static opmath_t load(const BFloat16Bits* p, int64_t i) {
    return static_cast<opmath_t>(bfloat16_to_float(p[i].bits));
  }
  template <typename opmath_t>
  static void store(BFloat16Bits* p, int64_t i, opmath_t v) {
    p[i].bits = float_to_bfloat16(static_cast<float>(v));
  }
};

template <>
struct Element<HalfBits> {
  template <typename opmath_t>
  static opmath_t load(const HalfBits* p, int64_t i) {
    return static_cast<opmath_t>(half_to_float(p[i].bits));
  }
  template <typename opmath_t>
  static void store(HalfBits* p, int64_t i, opmath_t v) {
    p[i].bits = float_to_half(static_cast<float>(v));
  }
};

}  // namespace gossip::cpu
