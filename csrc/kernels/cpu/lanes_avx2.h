// The AVX2 lanes of the CPU range kernels: float32 values in __m256 registers, and the loads and
// stores that convert float16 (F16C) and bfloat16 (integer shifts) into and out of them. Included
// only by range_kernels_avx2.cpp, inside its `#pragma GCC target("avx2,fma,f16c")` and after
// <immintrin.h>, so nothing here is compiled for a CPU that lacks those instructions.
//
// The conversions are bit-exact with convert.h, and so with c10::BFloat16 and c10::Half: round to
// nearest even, subnormals kept, a bfloat16 NaN stored as 0x7FC0; a float16 NaN keeps its sign
// (tests/cpp/range_kernels_test.cpp).
//
// The range kernels take KernelLanes<T, M> (state T, messages M) from here: its State and Message
// each have kEnabled and, where true, Vec, kWidth, broadcast, add, sub, mul (the float32
// arithmetic, the same for both), any_nonfinite(Vec) (exact), kCheckGroup and
// may_be_nonfinite(const Vec (&)[kCheckGroup]) (absorb's check: whether any of that many results
// may be NaN or Inf, a test that may also take values it need not), and load(const T*) -> Vec,
// store(T*, Vec) of kWidth elements. A 16-bit Message under a float32 State also has
// narrow(Vec) -> Narrow, store(M*, Narrow) and widen(Narrow) -> Vec: a rounded message and the
// float value it holds, without reading it back. The layouts:
//   float32 alone                                           eight lanes in memory order
//   float16 with float16 or under float32                   sixteen in memory order
//   bfloat16 with bfloat16                                  sixteen, even and odd elements apart
//   bfloat16 under float32                                  sixteen in memory order
#pragma once

#include "kernels/cpu/lane_pairs.h"

namespace gossip::cpu::avx2 {
namespace {

// Eight float32 values in their memory order.
struct FloatLanes {
  using Vec = __m256;
  static constexpr int kWidth = 8;
  static Vec broadcast(float v) { return _mm256_set1_ps(v); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  // v * 0 is +-0 where v is finite and NaN where it is NaN or Inf.
  static bool any_nonfinite(Vec v) {
    const Vec zero_or_nan = _mm256_mul_ps(v, _mm256_setzero_ps());
    return _mm256_movemask_ps(_mm256_cmp_ps(zero_or_nan, zero_or_nan, _CMP_UNORD_Q)) != 0;
  }
  // Four results, one test of their sum, which is NaN or Inf wherever one of them is (Inf - Inf is
  // NaN) and, rarely, where it overflows: a test per vector took a quarter of float16 absorb's
  // time (measured on AVX-512, before lanes_avx512.h's masks).
  static constexpr int kCheckGroup = 4;
  template <int N>
  static bool may_be_nonfinite(const Vec (&results)[N]) {
    Vec sum = results[0];
#pragma GCC unroll 8
    for (int g = 1; g < N; ++g) sum = add(sum, results[g]);
    return any_nonfinite(sum);
  }
};

// float_to_bfloat16 on eight floats that are not NaN, up to the final shift: each 32-bit lane
// holds its rounded bfloat16 in its top half (add 0x7FFF plus the lowest kept bit).
__m256i bfloat16_rounded_in_top_halves(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
}

// The same for any eight floats: a NaN becomes 0x7FC0.
__m256i bfloat16_in_top_halves(__m256 v) {
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(bfloat16_rounded_in_top_halves(v), _mm256_set1_epi32(0x7FC00000), nan);
}

// bfloat16_in_top_halves on sixteen floats in two registers. One compare finds a NaN in either
// (unordered), and as NaNs are rare, the rounding without a NaN blend serves unless one is there:
// two instructions for sixteen values where a blend per register takes four.
struct BFloat16TopHalves {
  __m256i first, second;
};
BFloat16TopHalves bfloat16_in_top_halves(__m256 first, __m256 second) {
  const __m256 unordered = _mm256_cmp_ps(first, second, _CMP_UNORD_Q);
  if (__builtin_expect(!_mm256_testz_ps(unordered, unordered), 0)) {
    return {bfloat16_in_top_halves(first), bfloat16_in_top_halves(second)};
  }
  return {bfloat16_rounded_in_top_halves(first), bfloat16_rounded_in_top_halves(second)};
}

template <typename T>
struct Lanes {
  static constexpr bool kEnabled = false;
};

template <>
struct Lanes<float> : FloatLanes {
  static constexpr bool kEnabled = true;
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
};

// Sixteen float32 values in two registers: the arithmetic of the lanes that come in sixteens.
struct FloatPairs : LanePairs<FloatLanes> {
  static constexpr bool kEnabled = true;
};

// Sixteen bfloat16 values as the even (first) and the odd (second) elements of one 256-bit load,
// for kernels whose every operand is bfloat16. Each 32-bit lane holds an even element in its low
// half and an odd one in its top half, so a shift and a mask make them floats, and a word blend
// puts the rounded results back in place: no widening or packing shuffle, which in memory order
// take about half of a conversion's vector instructions.
struct BFloat16EvenOddLanes : FloatPairs {
  static Vec load(const BFloat16Bits* p) {
    const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)),
            _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(-0x10000)))};
  }
  static void store(BFloat16Bits* p, Vec v) {
    const BFloat16TopHalves rounded = bfloat16_in_top_halves(v.first, v.second);
    const __m256i even = _mm256_srli_epi32(rounded.first, 16);
    const __m256i odd = rounded.second;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_blend_epi16(even, odd, 0xAA));
  }
};

// Sixteen float32 values in memory order: the state of a kernel with bfloat16 messages.
struct FloatSixteenLanes : FloatPairs {
  static Vec load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static void store(float* p, Vec v) {
    _mm256_storeu_ps(p, v.first);
    _mm256_storeu_ps(p + 8, v.second);
  }
};

// Sixteen bfloat16 messages in memory order, under a float32 state. Rounded sixteen at a time,
// they are stored by one pack and one permute, where eight at a time take a pack and an extract.
struct BFloat16SixteenLanes : FloatPairs {
  // The rounded values still in the top halves of 32-bit lanes: read back as floats by a mask,
  // without a shuffle (compress_into's error feedback).
  using Narrow = BFloat16TopHalves;
  static __m256 load8(const BFloat16Bits* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static Vec load(const BFloat16Bits* p) { return {load8(p), load8(p + 8)}; }
  static Narrow narrow(Vec v) {
    return bfloat16_in_top_halves(v.first, v.second);
  }
  static Vec widen(Narrow top) {
    const __m256i mask = _mm256_set1_epi32(-0x10000);
    return {_mm256_castsi256_ps(_mm256_and_si256(top.first, mask)),
            _mm256_castsi256_ps(_mm256_and_si256(top.second, mask))};
  }
  static void store(BFloat16Bits* p, Narrow top) {
    // Every value fits 16 bits, so the saturating pack only narrows; it packs within 128-bit
    // halves (0-3 8-11 | 4-7 12-15), and the permute puts the quarters in order.
    const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(top.first, 16),
                                               _mm256_srli_epi32(top.second, 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
  }
  static void store(BFloat16Bits* p, Vec v) { store(p, narrow(v)); }
};

// Sixteen float16 values in memory order, converted eight at a time by F16C: for kernels whose
// every operand is float16, and for float16 messages under a float32 state. Two conversions each
// way per step, not one: on Zen 4, float16 scale_into took 2.0 cycles per eight values converted
// eight a step, and 1.4 sixteen a step (benchmarks/range_kernels.cpp, best of five runs).
struct HalfSixteenLanes : FloatPairs {
  // The rounded values, and the float values they hold without reading them back (compress_into's
  // error feedback).
  struct Narrow {
    __m128i first, second;
  };
  // F16C rounds as c10 does. A NaN keeps its sign and the top of its payload, as in torch's own
  // vectorized float16 kernels, where c10's scalar conversion writes sign | 0x7E00: checking for
  // NaNs to match that would add a third to the cost of every store.
  static __m128i narrow8(__m256 v) {
    return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static Narrow narrow(Vec v) { return {narrow8(v.first), narrow8(v.second)}; }
  static Vec widen(Narrow h) { return {_mm256_cvtph_ps(h.first), _mm256_cvtph_ps(h.second)}; }
  static Vec load(const HalfBits* p) {
    return widen({_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)),
                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))});
  }
  static void store(HalfBits* p, Narrow h) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h.first);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), h.second);
  }
  static void store(HalfBits* p, Vec v) { store(p, narrow(v)); }
};

// The lanes of a kernel's state and of its messages.
template <typename S, typename M>
struct StateAndMessageLanes {
  using State = S;
  using Message = M;
};

template <typename T, typename M>
struct KernelLanes : StateAndMessageLanes<Lanes<T>, Lanes<M>> {};

template <>
struct KernelLanes<BFloat16Bits, BFloat16Bits>
    : StateAndMessageLanes<BFloat16EvenOddLanes, BFloat16EvenOddLanes> {};

template <>
struct KernelLanes<float, BFloat16Bits>
    : StateAndMessageLanes<FloatSixteenLanes, BFloat16SixteenLanes> {};

template <>
struct KernelLanes<HalfBits, HalfBits>
    : StateAndMessageLanes<HalfSixteenLanes, HalfSixteenLanes> {};

template <>
struct KernelLanes<float, HalfBits>
    : StateAndMessageLanes<FloatSixteenLanes, HalfSixteenLanes> {};

}  // namespace
}  // namespace gossip::cpu::avx2
