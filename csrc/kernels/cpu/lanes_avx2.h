// The AVX2 lanes of the CPU range kernels: eight float32 values in one __m256, and the loads and
// stores that convert float16 (F16C) and bfloat16 (integer shifts) into and out of them. Included
// only by range_kernels_avx2.cpp, inside its `#pragma GCC target("avx2,fma,f16c")` and after
// <immintrin.h>, so nothing here is compiled for a CPU that lacks those instructions.
//
// The conversions are bit-exact with convert.h, and so with c10::BFloat16 and c10::Half: round to
// nearest even, subnormals kept, a bfloat16 NaN stored as 0x7FC0; a float16 NaN keeps its sign
// (tests/cpp/range_kernels_test.cpp). The range kernels take the interface from here:
//   Lanes<T>          kEnabled; where true, it is a FloatLanes (Vec, kWidth, broadcast, add, sub,
//                     mul, any_nan: the float32 arithmetic of T) with load(const T*) -> Vec and
//                     store(T*, Vec) of kWidth elements
//   Lanes<16-bit T>   also narrow(Vec) -> Narrow, store(T*, Narrow) and widen(Narrow) -> Vec: a
//                     rounded message and the float value it holds, without reading it back
#pragma once

namespace gossip::cpu::avx2 {
namespace {

struct FloatLanes {
  using Vec = __m256;
  static constexpr int kWidth = 8;
  static Vec broadcast(float v) { return _mm256_set1_ps(v); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  static bool any_nan(Vec v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }
};

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

template <>
struct Lanes<BFloat16Bits> : FloatLanes {
  static constexpr bool kEnabled = true;
  using Narrow = __m128i;
  static __m256 widen(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static __m128i narrow(__m256 v) {
    // float_to_bfloat16, eight at a time: add 0x7FFF plus the lowest kept bit, keep the top half.
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i value = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
    // Every value fits 16 bits, so the saturating pack only narrows.
    return _mm_packus_epi32(_mm256_castsi256_si128(value), _mm256_extracti128_si256(value, 1));
  }
  static __m256 load(const BFloat16Bits* p) {
    return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(BFloat16Bits* p, __m128i h) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  }
  static void store(BFloat16Bits* p, __m256 v) { store(p, narrow(v)); }
};

template <>
struct Lanes<HalfBits> : FloatLanes {
  static constexpr bool kEnabled = true;
  using Narrow = __m128i;
  static __m256 widen(__m128i h) { return _mm256_cvtph_ps(h); }
  // F16C rounds as c10 does. A NaN keeps its sign and the top of its payload, as in torch's own
  // vectorized float16 kernels, where c10's scalar conversion writes sign | 0x7E00: checking for
  // NaNs to match that would add a third to the cost of every store.
  static __m128i narrow(__m256 v) {
    return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static __m256 load(const HalfBits* p) {
    return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(HalfBits* p, __m128i h) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h); }
  static void store(HalfBits* p, __m256 v) { store(p, narrow(v)); }
};

}  // namespace
}  // namespace gossip::cpu::avx2
