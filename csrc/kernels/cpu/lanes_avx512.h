// The AVX-512 lanes of the CPU range kernels: float32 values in __m512 registers, and the loads
// and stores that convert float16 (F16C at 512 bits) and bfloat16 into and out of them. Included
// only by range_kernels_avx512.inc, inside its `#pragma GCC target(...)` and after <immintrin.h>,
// so nothing here is compiled for a CPU that lacks those instructions; GOSSIP_AVX512_BF16 says
// whether that target has AVX512_BF16, GOSSIP_FLOAT16_STATE_256 whether kernels whose every
// operand is float16 convert 256 bits at a time (the zen4 set), and GOSSIP_RANGE_KERNELS_ISA names
// the namespace.
//
// The conversions are bit-exact with convert.h, and so with c10::BFloat16 and c10::Half, as in
// lanes_avx2.h: round to nearest even, subnormals kept, a bfloat16 NaN stored as 0x7FC0; a
// float16 NaN keeps its sign (tests/cpp/range_kernels_test.cpp). bfloat16 rounds with integer
// instructions, as convert.h does, or with AVX512_BF16 where the target has it. AVX512_BF16
// rounds every other float exactly so; it flushes float32 subnormals to zero and keeps a NaN's
// payload, so a vector that holds either takes the integer rounding instead (a branch never taken
// on ordinary data). The interface is lanes_avx2.h's; the layouts:
//   float32, float16, and bfloat16 under float32   sixteen lanes in memory order
//   bfloat16 with bfloat16                          thirty-two, even and odd elements apart
//   float16 with float16, in the zen4 set           sixteen in memory order, as two halves
#pragma once

#include "kernels/cpu/lane_pairs.h"

namespace gossip::cpu::GOSSIP_RANGE_KERNELS_ISA {
namespace {

// The register of kWidth float32 values. (A vector type as a template argument would lose its
// attributes, -Wignored-attributes: the width is the argument instead.)
template <int kWidth>
struct FloatRegister;
template <>
struct FloatRegister<16> {
  using type = __m512;
};
template <>
struct FloatRegister<8> {
  using type = __m256;
};

// kLanes float32 values in one register: sixteen (FloatLanes), or eight (the zen4 set's float16
// layout, HalfPairLanes), classified into mask registers at either width.
template <int kLanes>
struct FloatRegisterLanes {
  using Vec = typename FloatRegister<kLanes>::type;
  static constexpr int kWidth = kLanes;
  static constexpr bool kWide = kWidth == 16;
  static Vec broadcast(float v) {
    if constexpr (kWide) {
      return _mm512_set1_ps(v);
    } else {
      return _mm256_set1_ps(v);
    }
  }
  // GCC's vector operators, which its intrinsics are made of: vaddps, vsubps, vmulps.
  static Vec add(Vec a, Vec b) { return a + b; }
  static Vec sub(Vec a, Vec b) { return a - b; }
  static Vec mul(Vec a, Vec b) { return a * b; }
  // fpclass 0x01 | 0x08 | 0x10 | 0x80: a quiet NaN, +Inf, -Inf or a signalling NaN.
  static auto nonfinite(Vec v) {
    if constexpr (kWide) {
      return _mm512_fpclass_ps_mask(v, 0x99);
    } else {
      return _mm256_fpclass_ps_mask(v, 0x99);
    }
  }
  static bool any_nonfinite(Vec v) { return nonfinite(v) != 0; }
  // Sixty-four results, one branch: a branch per vector took a quarter of float16 absorb's time.
  // Each result is classified into a mask register and the masks are OR'ed. Adding the results
  // and classifying their sum (lanes_avx2.h) made the check cost float16 absorb 14-15% of its
  // time, the masks 9-10% (measured side by side, Zen 4, sixteen lanes); float32 and bfloat16 see
  // no difference.
  static constexpr int kCheckGroup = 64 / kWidth;
  template <int N>
  static bool may_be_nonfinite(const Vec (&results)[N]) {
    auto found = nonfinite(results[0]);
#pragma GCC unroll 8
    for (int g = 1; g < N; ++g) found |= nonfinite(results[g]);
    return found != 0;
  }
};

using FloatLanes = FloatRegisterLanes<16>;

// float_to_bfloat16 on sixteen floats that are not NaN, up to the final shift: each 32-bit lane
// holds its rounded bfloat16 in its top half (add 0x7FFF plus the lowest kept bit, bit 16). A mask
// register picks 0x7FFF or 0x8000: three instructions and no shift, where the shift and mask that
// bring bit 16 down take four, one of them on the shift units.
__m512i bfloat16_rounded_in_top_halves(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __mmask16 odd = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x10000));
  const __m512i bias =
      _mm512_mask_blend_epi32(odd, _mm512_set1_epi32(0x7FFF), _mm512_set1_epi32(0x8000));
  return _mm512_add_epi32(bits, bias);
}

// The same for any sixteen floats: a NaN becomes 0x7FC0.
__m512i bfloat16_in_top_halves(__m512 v) {
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(bfloat16_rounded_in_top_halves(v), nan,
                               _mm512_set1_epi32(0x7FC00000));
}

#if GOSSIP_AVX512_BF16
// fpclass 0x01 | 0x08 | 0x10 | 0x20 | 0x80. AVX512_BF16 rounds NaNs and subnormals unlike
// float_to_bfloat16, so lanes of those take the exact rounding; Infs it rounds alike, but absorb's
// non-finite check must see them, so one test serves the store and the check
// (BFloat16EvenOddLanes::may_be_nonfinite), and the exact rounding is as right for an Inf.
__mmask16 nan_inf_or_subnormal(__m512 v) { return _mm512_fpclass_ps_mask(v, 0xB9); }
#endif

template <typename T>
struct Lanes {
  static constexpr bool kEnabled = false;
};

template <>
struct Lanes<float> : FloatLanes {
  static constexpr bool kEnabled = true;
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
};

// Sixteen 16-bit values of type T in memory order, one __m256i of bits: what float16 and
// bfloat16 share. Convert (the derived Lanes<T>) has widen(__m256i) -> __m512 and
// narrow(__m512) -> __m256i.
template <typename T, typename Convert>
struct SixteenWords : FloatLanes {
  static constexpr bool kEnabled = true;
  using Narrow = __m256i;
  static __m512 load(const T* p) {
    return Convert::widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(T* p, __m256i h) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h); }
  static void store(T* p, __m512 v) { store(p, Convert::narrow(v)); }
};

template <>
struct Lanes<HalfBits> : SixteenWords<HalfBits, Lanes<HalfBits>> {
  static __m512 widen(__m256i h) { return _mm512_cvtph_ps(h); }
  // As lanes_avx2.h: F16C's rounding, a NaN's sign and payload kept.
  static __m256i narrow(__m512 v) {
    return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
};

__m512 bfloat16_words_to_floats(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#if GOSSIP_AVX512_BF16
template <>
struct Lanes<BFloat16Bits> : SixteenWords<BFloat16Bits, Lanes<BFloat16Bits>> {
  static __m512 widen(__m256i h) { return bfloat16_words_to_floats(h); }
  static __m256i narrow(__m512 v) {
    if (__builtin_expect(nan_inf_or_subnormal(v) == 0, 1)) {
      return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
    }
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bfloat16_in_top_halves(v), 16));
  }
};
#else
// Rounded with integer instructions, a message stays in the top halves of its 32-bit lanes until
// it is stored, so compress_into reads its value back with a mask, where sixteen words would take
// a narrowing and a widening shuffle (lanes_avx2.h's BFloat16SixteenLanes).
template <>
struct Lanes<BFloat16Bits> : FloatLanes {
  static constexpr bool kEnabled = true;
  using Narrow = __m512i;
  static __m512 load(const BFloat16Bits* p) {
    return bfloat16_words_to_floats(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __m512i narrow(__m512 v) { return bfloat16_in_top_halves(v); }
  static __m512 widen(__m512i top) {
    return _mm512_castsi512_ps(_mm512_and_si512(top, _mm512_set1_epi32(-0x10000)));
  }
  static void store(BFloat16Bits* p, __m512i top) {
    const __m256i words = _mm512_cvtepi32_epi16(_mm512_srli_epi32(top, 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), words);
  }
  static void store(BFloat16Bits* p, __m512 v) { store(p, narrow(v)); }
};
#endif

// Thirty-two bfloat16 values as the even (first) and the odd (second) elements of one 512-bit
// load, for kernels whose every operand is bfloat16: a shift and a mask make them floats, and one
// two-register rounding and one word permute store them, where memory order takes a widening
// shuffle per load and a rounding per sixteen values (lanes_avx2.h's layout of the same name).
struct BFloat16EvenOddLanes : LanePairs<FloatLanes> {
  static constexpr bool kEnabled = true;
  static Vec load(const BFloat16Bits* p) {
    const __m512i pairs = _mm512_loadu_si512(p);
    return {_mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(-0x10000)))};
  }
  // The rounded even elements in words 2j, the odd ones in words 2j + 1.
  static __m512i interleave(__m512i even_top_halves, __m512i odd_top_halves) {
    return _mm512_mask_blend_epi16(0xAAAAAAAA, _mm512_srli_epi32(even_top_halves, 16),
                                   odd_top_halves);
  }
#if GOSSIP_AVX512_BF16
  // The store's own test, which also takes subnormals: the check shares its instructions, one
  // vector at a time.
  static constexpr int kCheckGroup = 1;
  static bool may_be_nonfinite(const Vec (&results)[1]) {
    const Vec v = results[0];
    return (nan_inf_or_subnormal(v.first) | nan_inf_or_subnormal(v.second)) != 0;
  }
  static void store(BFloat16Bits* p, Vec v) {
    const __mmask16 differs =
        nan_inf_or_subnormal(v.first) | nan_inf_or_subnormal(v.second);
    __m512i pairs;
    if (__builtin_expect(differs == 0, 1)) {
      // The even elements rounded into words 0-15, the odd ones into 16-31; word 2j takes word j
      // and word 2j + 1 word 16 + j.
      const __m512i halves = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v.second, v.first));
      const __m512i j = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512i words =
          _mm512_or_si512(j, _mm512_slli_epi32(_mm512_add_epi32(j, _mm512_set1_epi32(16)), 16));
      pairs = _mm512_permutexvar_epi16(words, halves);
    } else {
      pairs = interleave(bfloat16_in_top_halves(v.first), bfloat16_in_top_halves(v.second));
    }
    _mm512_storeu_si512(p, pairs);
  }
#else
  // One compare finds a NaN in either register (unordered), and as NaNs are rare, the rounding
  // without the NaN's mask serves unless one is there (lanes_avx2.h's BFloat16TopHalves).
  static void store(BFloat16Bits* p, Vec v) {
    __m512i pairs;
    if (__builtin_expect(_mm512_cmp_ps_mask(v.first, v.second, _CMP_UNORD_Q) == 0, 1)) {
      pairs = interleave(bfloat16_rounded_in_top_halves(v.first),
                         bfloat16_rounded_in_top_halves(v.second));
    } else {
      pairs = interleave(bfloat16_in_top_halves(v.first), bfloat16_in_top_halves(v.second));
    }
    _mm512_storeu_si512(p, pairs);
  }
#endif
};

// Sixteen float16 values in memory order, converted eight at a time, for kernels whose every
// operand is float16, in the zen4 set. Zen 4 runs a 512-bit instruction on two 256-bit halves, and
// there these 256-bit conversions made float16 scale_into, absorb and checked absorb take
// 0.73-0.88x the time of Lanes<HalfBits>'s 512-bit ones, from 16K to 1M elements
// (benchmarks/NOTES.md, "float16 in 256-bit halves on Zen 4"). On Intel's AVX-512 cores every
// F16C conversion also takes one uop on the shuffle port whatever its width, so halving the width
// would double that port's work: the other sets keep Lanes<HalfBits> (uops.info's port tables; not
// measured on an Intel CPU). A float32 state with float16 messages converts each message once, and
// keeps the 512-bit conversions on Zen 4 too: there the avx2 kernels' 256-bit layout was the slower
// (NOTES.md, same section).
struct HalfPairLanes : LanePairs<FloatRegisterLanes<8>> {
  static constexpr bool kEnabled = true;
  static __m256 load8(const HalfBits* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static Vec load(const HalfBits* p) { return {load8(p), load8(p + 8)}; }
  // As Lanes<HalfBits>::narrow, eight values.
  static __m128i narrow8(__m256 v) {
    return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static void store(HalfBits* p, Vec v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow8(v.first));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), narrow8(v.second));
  }
};

template <typename T, typename M>
struct KernelLanes {
  using State = Lanes<T>;
  using Message = Lanes<M>;
};

template <>
struct KernelLanes<BFloat16Bits, BFloat16Bits> {
  using State = BFloat16EvenOddLanes;
  using Message = BFloat16EvenOddLanes;
};

#if GOSSIP_FLOAT16_STATE_256
template <>
struct KernelLanes<HalfBits, HalfBits> {
  using State = HalfPairLanes;
  using Message = HalfPairLanes;
};
#endif

}  // namespace
}  // namespace gossip::cpu::GOSSIP_RANGE_KERNELS_ISA
