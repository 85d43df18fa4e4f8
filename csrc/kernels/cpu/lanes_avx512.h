// The AVX-512 lanes of the CPU range kernels: sixteen float32 values in one __m512, and the loads
// and stores that convert float16 (F16C at 512 bits) and bfloat16 (AVX512_BF16's rounding
// conversion) into and out of them. Included only by range_kernels_avx512.cpp, inside its
// `#pragma GCC target(...)` and after <immintrin.h>, so nothing here is compiled for a CPU that
// lacks those instructions.
//
// The conversions are bit-exact with convert.h, and so with c10::BFloat16 and c10::Half, as in
// lanes_avx2.h: round to nearest even, subnormals kept, a bfloat16 NaN stored as 0x7FC0; a
// float16 NaN keeps its sign (tests/cpp/range_kernels_test.cpp). AVX512_BF16 rounds every other
// float exactly so; it flushes float32 subnormals to zero and keeps a NaN's payload, so a vector
// that holds either takes convert.h's integer rounding instead (a branch never taken on ordinary
// data). The interface is lanes_avx2.h's, every layout sixteen lanes in memory order.
#pragma once

namespace gossip::cpu::avx512 {
namespace {

struct FloatLanes {
  using Vec = __m512;
  static constexpr int kWidth = 16;
  static Vec broadcast(float v) { return _mm512_set1_ps(v); }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  // FiniteProbe's lane += v * 0 as a bitwise or (lanes_avx2.h says why).
  static Vec probe(Vec lanes, Vec v) {
    return _mm512_or_ps(lanes, _mm512_mul_ps(v, _mm512_setzero_ps()));
  }
  static bool any_nan(Vec v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }
};

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

template <>
struct Lanes<HalfBits> : FloatLanes {
  static constexpr bool kEnabled = true;
  using Narrow = __m256i;
  static __m512 widen(__m256i h) { return _mm512_cvtph_ps(h); }
  // As lanes_avx2.h: F16C's rounding, a NaN's sign and payload kept.
  static __m256i narrow(__m512 v) {
    return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static __m512 load(const HalfBits* p) {
    return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(HalfBits* p, __m256i h) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
  static void store(HalfBits* p, __m512 v) { store(p, narrow(v)); }
};

template <>
struct Lanes<BFloat16Bits> : FloatLanes {
  static constexpr bool kEnabled = true;
  using Narrow = __m256i;
  static __m512 widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static __m256i narrow(__m512 v) {
    const __m256i rounded = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
    // fpclass 0x01 | 0x20 | 0x80: quiet NaN, subnormal, signalling NaN.
    const __mmask16 special = _mm512_fpclass_ps_mask(v, 0xA1);
    if (__builtin_expect(special == 0, 1)) return rounded;
    return _mm256_mask_mov_epi16(rounded, special, narrow_exactly(v));
  }
  // float_to_bfloat16, sixteen at a time: add 0x7FFF plus the lowest kept bit, keep the top half.
  static __m256i narrow_exactly(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0)));
  }
  static __m512 load(const BFloat16Bits* p) {
    return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(BFloat16Bits* p, __m256i h) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
  static void store(BFloat16Bits* p, __m512 v) { store(p, narrow(v)); }
};

template <typename T, typename M>
struct KernelLanes {
  using State = Lanes<T>;
  using Message = Lanes<M>;
};

}  // namespace
}  // namespace gossip::cpu::avx512
