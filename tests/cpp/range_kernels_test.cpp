// The CPU range kernels (kernels/cpu/range_kernels.h) below the dispatcher: the scalar
// conversions of convert.h and each vector instruction set's conversions (avx2, avx512,
// avx512_bf16, zen4) against c10's own, bit for bit (a float16 NaN's payload aside), and each
// instruction set's kernels against the baseline ones, bit for bit, on data full of the values
// that conversions get wrong: NaN, infinities, signed zeros, subnormals, ties, overflow. An
// instruction set this CPU lacks is skipped, visibly.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/range_kernels.h"

namespace gossip {
namespace {

using cpu::BFloat16Bits;
using cpu::HalfBits;

// Floats that probe conversions to 16 bits: every 16-bit value, the midpoints between neighbours
// (ties round to even), their neighbouring floats, and a sweep of random bit patterns.
std::vector<float> conversion_probes(float (*to_float)(uint16_t)) {
  std::vector<float> probes;
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = to_float(static_cast<uint16_t>(h));
    const float next = to_float(static_cast<uint16_t>(h + 1));
    const float mid = f + (next - f) / 2;
    for (float p : {f, mid, std::nextafter(mid, -INFINITY), std::nextafter(mid, INFINITY)}) {
      probes.push_back(p);
    }
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 1'000'000; ++i) probes.push_back(cpu::bits_to_float(rng()));
  return probes;
}

bool same_bits_or_both_nan(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || cpu::float_to_bits(a) == cpu::float_to_bits(b);
}

float c10_to_float(BFloat16Bits h) {
  return static_cast<float>(c10::BFloat16(h.bits, c10::BFloat16::from_bits()));
}
float c10_to_float(HalfBits h) {
  return static_cast<float>(c10::Half(h.bits, c10::Half::from_bits()));
}
uint16_t c10_bits(float f, BFloat16Bits) { return c10::BFloat16(f).x; }
uint16_t c10_bits(float f, HalfBits) { return c10::Half(f).x; }

bool is_nan(float v) { return std::isnan(v); }
bool is_nan(BFloat16Bits v) { return (v.bits & 0x7FFF) > 0x7F80; }
bool is_nan(HalfBits v) { return (v.bits & 0x7FFF) > 0x7C00; }

// One vector instruction set's range kernels, for the typed tests below.
#define GOSSIP_RANGE_KERNELS(Name, isa, has, lacks)                                             \
  struct Name {                                                                                 \
    static bool available() { return cpu::has(); }                                             \
    static constexpr const char* kLacks = lacks;                                                \
    template <typename T>                                                                       \
    static void scale_into(const T* src, T* out, int64_t begin, int64_t end, float scale) {     \
      cpu::isa::scale_into<T>(src, out, begin, end, scale);                                     \
    }                                                                                           \
    template <typename T, typename M, bool kCheckFinite>                                        \
    static bool absorb(T* x, const M* const* received, int num_received, const M* sent,         \
                       int64_t begin, int64_t end, float self_scale, float sent_scale,          \
                       float out_scale) {                                                       \
      return cpu::isa::absorb<T, M, kCheckFinite>(x, received, num_received, sent, begin, end,  \
                                                  self_scale, sent_scale, out_scale);           \
    }                                                                                           \
    template <typename T, typename M>                                                           \
    static void compress_into(T* src, M* out, int64_t begin, int64_t end, float scale,          \
                              float fold) {                                                     \
      cpu::isa::compress_into<T, M>(src, out, begin, end, scale, fold);                         \
    }                                                                                           \
  };
GOSSIP_RANGE_KERNELS(Avx2, avx2, cpu_has_avx2, "this CPU lacks AVX2, FMA or F16C")
GOSSIP_RANGE_KERNELS(Avx512, avx512, cpu_has_avx512, "this CPU lacks AVX-512 F/BW/VL/DQ")
GOSSIP_RANGE_KERNELS(Avx512Bf16, avx512_bf16, cpu_has_avx512_bf16, "this CPU lacks AVX512_BF16")
// Picked only on Zen 4, but its instructions are avx512_bf16's: tested wherever those run.
GOSSIP_RANGE_KERNELS(Zen4, zen4, cpu_has_avx512_bf16, "this CPU lacks AVX512_BF16")
#undef GOSSIP_RANGE_KERNELS

}  // namespace

TEST(CpuConvertTest, BFloat16MatchesC10BitForBit) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float want = c10_to_float(BFloat16Bits{static_cast<uint16_t>(h)});
    ASSERT_TRUE(same_bits_or_both_nan(cpu::bfloat16_to_float(static_cast<uint16_t>(h)), want)) << h;
  }
  for (float f : conversion_probes(&cpu::bfloat16_to_float)) {
    ASSERT_EQ(cpu::float_to_bfloat16(f), c10::BFloat16(f).x) << f;
  }
}

TEST(CpuConvertTest, HalfMatchesC10BitForBit) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float want = c10_to_float(HalfBits{static_cast<uint16_t>(h)});
    ASSERT_TRUE(same_bits_or_both_nan(cpu::half_to_float(static_cast<uint16_t>(h)), want)) << h;
  }
  for (float f : conversion_probes(&cpu::half_to_float)) {
    ASSERT_EQ(cpu::float_to_half(f), c10::Half(f).x) << f;
  }
}

namespace {

// An instruction set's conversions, through kernels that do nothing else: compress_into with
// scale 1 and no fold stores each float rounded, and absorb of one received message into -0 * x
// loads each message value exactly (-0 + v is v for every v, -0 and +0 included).
template <typename Kernels, typename M>
void expect_vector_conversions_match_c10(float (*to_float)(uint16_t)) {
  std::vector<M> patterns(65536);
  for (uint32_t h = 0; h < 65536; ++h) patterns[h].bits = static_cast<uint16_t>(h);
  std::vector<float> loaded(patterns.size(), 0.0f);
  const M* received[] = {patterns.data()};
  Kernels::template absorb<float, M, false>(loaded.data(), received, 1, nullptr, 0,
                                            static_cast<int64_t>(loaded.size()), -0.0f, 0.0f,
                                            1.0f);
  for (uint32_t h = 0; h < 65536; ++h) {
    ASSERT_TRUE(same_bits_or_both_nan(loaded[h], c10_to_float(patterns[h]))) << h;
  }

  std::vector<float> probes = conversion_probes(to_float);
  std::vector<M> stored(probes.size());
  Kernels::template compress_into<float, M>(probes.data(), stored.data(), 0,
                                            static_cast<int64_t>(probes.size()), 1.0f, 0.0f);
  for (size_t i = 0; i < probes.size(); ++i) {
    const uint16_t want = c10_bits(probes[i], M{});
    if (is_nan(M{want})) {
      // float16 keeps a NaN's payload where c10 writes 0x7E00 (lanes_avx2.h): a NaN of the same
      // sign is the contract.
      ASSERT_TRUE(is_nan(stored[i]) && (stored[i].bits & 0x8000) == (want & 0x8000)) << i;
    } else {
      ASSERT_EQ(stored[i].bits, want) << probes[i];
    }
  }
}

}  // namespace

template <typename Kernels>
class RangeKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!Kernels::available()) GTEST_SKIP() << Kernels::kLacks;
  }
};
using InstructionSets = ::testing::Types<Avx2, Avx512, Avx512Bf16, Zen4>;
TYPED_TEST_SUITE(RangeKernelsTest, InstructionSets);

TYPED_TEST(RangeKernelsTest, ConversionsMatchC10BitForBit) {
  expect_vector_conversions_match_c10<TypeParam, BFloat16Bits>(&cpu::bfloat16_to_float);
  expect_vector_conversions_match_c10<TypeParam, HalfBits>(&cpu::half_to_float);
}

namespace {

constexpr int64_t kLength = 1000;  // not a multiple of any vector width: a tail is left
constexpr int64_t kBegins[] = {0, 3};  // 3: a range that starts off the vector alignment

// Values that every kernel should carry through both instruction sets alike: ordinary ones over
// a wide range of magnitudes, and specials.
std::vector<float> float_values(std::mt19937_64& rng) {
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            -std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            0.0f,
                            -0.0f,
                            1e-40f,       // float32 subnormal
                            -3e-8f,       // float16 subnormal
                            65504.0f,     // float16 maximum
                            65520.0f,     // rounds to float16 infinity
                            1.00390625f,  // a bfloat16 tie (1 + 2^-8)
                            std::numeric_limits<float>::max()};
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> exponent(-40, 40);
  std::uniform_int_distribution<int> pick(0, 9);
  std::vector<float> values(kLength);
  for (float& v : values) {
    if (pick(rng) == 0) {
      v = specials[std::uniform_int_distribution<size_t>(0, std::size(specials) - 1)(rng)];
    } else {
      v = std::ldexp(normal(rng), exponent(rng));
    }
  }
  return values;
}

template <typename T>
std::vector<T> values_of_type(std::mt19937_64& rng) {
  if constexpr (std::is_same_v<T, float>) {
    return float_values(rng);
  } else {
    // Every 16-bit pattern is a value: NaNs, infinities and subnormals among them.
    std::uniform_int_distribution<uint32_t> bits(0, 65535);
    std::vector<T> values(kLength);
    for (T& v : values) v.bits = static_cast<uint16_t>(bits(rng));
    return values;
  }
}

uint32_t bits_of(float v) { return cpu::float_to_bits(v); }
uint32_t bits_of(BFloat16Bits v) { return v.bits; }
uint32_t bits_of(HalfBits v) { return v.bits; }

template <typename T>
std::string hex(T v) {
  char text[16];
  std::snprintf(text, sizeof(text), "0x%08x", static_cast<unsigned>(bits_of(v)));
  return text;
}

// Equal bits, or NaN in both: which NaN an operation on two NaNs returns (so its sign, which a
// float16 store keeps) depends on the order of the operands, which the compiler may swap.
template <typename T>
::testing::AssertionResult same_bits(const std::vector<T>& vector, const std::vector<T>& base) {
  for (size_t i = 0; i < vector.size(); ++i) {
    if (bits_of(vector[i]) != bits_of(base[i]) && !(is_nan(vector[i]) && is_nan(base[i]))) {
      return ::testing::AssertionFailure() << "element " << i << ": vector bits "
                                           << hex(vector[i]) << ", base bits " << hex(base[i]);
    }
  }
  return ::testing::AssertionSuccess();
}

template <typename Kernels, typename T>
void expect_scale_into_agrees(std::mt19937_64& rng) {
  const std::vector<T> src = values_of_type<T>(rng);
  for (int64_t begin : kBegins) {
    std::vector<T> vector(kLength), base(kLength);
    Kernels::template scale_into<T>(src.data(), vector.data(), begin, kLength, 0.37f);
    cpu::base::scale_into<T>(src.data(), base.data(), begin, kLength, 0.37f);
    EXPECT_TRUE(same_bits(vector, base)) << "begin " << begin;
  }
}

template <typename Kernels, typename T, typename M, bool kCheckFinite>
void expect_absorb_agrees(std::mt19937_64& rng, int num_received, bool with_sent,
                          float out_scale) {
  SCOPED_TRACE("received " + std::to_string(num_received) + (with_sent ? ", sent" : "") +
               (kCheckFinite ? ", checked" : "") + ", out_scale " + std::to_string(out_scale));
  const std::vector<T> x = values_of_type<T>(rng);
  std::vector<std::vector<M>> received;
  std::vector<const M*> pointers;
  for (int k = 0; k < num_received; ++k) received.push_back(values_of_type<M>(rng));
  for (const std::vector<M>& r : received) pointers.push_back(r.data());
  const std::vector<M> sent = values_of_type<M>(rng);
  const M* own = with_sent ? sent.data() : nullptr;
  for (int64_t begin : kBegins) {
    std::vector<T> vector = x, base = x;
    const bool vector_nonfinite = Kernels::template absorb<T, M, kCheckFinite>(
        vector.data(), pointers.data(), num_received, own, begin, kLength, 0.83f, -0.5f,
        out_scale);
    const bool base_nonfinite = cpu::base::absorb<T, M, kCheckFinite>(
        base.data(), pointers.data(), num_received, own, begin, kLength, 0.83f, -0.5f, out_scale);
    EXPECT_TRUE(same_bits(vector, base)) << "begin " << begin;
    EXPECT_EQ(vector_nonfinite, base_nonfinite) << "begin " << begin;
  }
}

template <typename Kernels, typename T, typename M>
void expect_absorb_agrees(std::mt19937_64& rng) {
  for (int num_received : {0, 1, 2, 3, 5}) {  // 1-3 have kernels of their own (range_kernels.inc)
    for (bool with_sent : {false, true}) {
      for (float out_scale : {1.37f, 1.0f}) {  // 1: the vector part leaves out its multiply
        expect_absorb_agrees<Kernels, T, M, false>(rng, num_received, with_sent, out_scale);
        expect_absorb_agrees<Kernels, T, M, true>(rng, num_received, with_sent, out_scale);
      }
    }
  }
}

template <typename Kernels, typename M>
void expect_compress_into_agrees(std::mt19937_64& rng) {
  const std::vector<float> src = float_values(rng);
  for (float fold : {0.0f, 1.0f, 0.7f}) {
    for (int64_t begin : kBegins) {
      std::vector<float> vector_state = src, base_state = src;
      std::vector<M> vector(kLength), base(kLength);
      Kernels::template compress_into<float, M>(vector_state.data(), vector.data(), begin,
                                                kLength, 0.61f, fold);
      cpu::base::compress_into<float, M>(base_state.data(), base.data(), begin, kLength, 0.61f,
                                         fold);
      EXPECT_TRUE(same_bits(vector, base)) << "fold " << fold << ", begin " << begin;
      EXPECT_TRUE(same_bits(vector_state, base_state)) << "fold " << fold << ", begin " << begin;
    }
  }
}

template <typename V>
V from_float(float value) {
  if constexpr (std::is_same_v<V, float>) {
    return value;
  } else if constexpr (std::is_same_v<V, BFloat16Bits>) {
    return V{cpu::float_to_bfloat16(value)};
  } else {
    return V{cpu::float_to_half(value)};
  }
}

// One NaN or Inf anywhere among the values absorb reads (x, each received message, sent), in the
// vector part of the range or in its tail, and only there, makes the checked kernel report it.
// The positions fall in each vector of a group tested at once (absorb_lanes), in the vectors
// after the last group, and in the scalar tail.
// Values whose results overflow to Inf or fall to subnormals (where the vector part looks at the
// inputs again) are finite, and are not reported, before or after a NaN that is.
template <typename Kernels, typename T, typename M>
void expect_absorb_finds_each_nonfinite_value(float nonfinite, float magnitude) {
  constexpr int kReceived = 2;
  std::vector<T> x(kLength);
  std::vector<std::vector<M>> messages(kReceived + 1, std::vector<M>(kLength));  // then sent
  auto reset = [&] {
    for (int64_t i = 0; i < kLength; ++i) {
      const float value = magnitude * (0.25f + static_cast<float>(i % 7));
      x[i] = from_float<T>(value);
      for (std::vector<M>& message : messages) message[i] = from_float<M>(value);
    }
  };
  auto run = [&] {
    const M* received[kReceived] = {messages[0].data(), messages[1].data()};
    return Kernels::template absorb<T, M, true>(x.data(), received, kReceived,
                                                messages[kReceived].data(), 0, kLength, 0.5f,
                                                0.5f, 1.0f);
  };
  reset();
  EXPECT_FALSE(run()) << "every value finite, magnitude " << magnitude;
  for (int64_t position : {int64_t{0}, int64_t{13}, int64_t{25}, int64_t{53}, int64_t{100},
                           int64_t{970}, kLength - 1}) {
    reset();
    x[position] = from_float<T>(nonfinite);
    EXPECT_TRUE(run()) << nonfinite << " at " << position << " in x, magnitude " << magnitude;
    for (size_t m = 0; m < messages.size(); ++m) {
      reset();
      messages[m][position] = from_float<M>(nonfinite);
      EXPECT_TRUE(run()) << nonfinite << " at " << position << " in message " << m
                         << ", magnitude " << magnitude;
    }
  }
}

// Magnitudes of the values above (up to 6.25 times the magnitude; results 3 times a value):
// ordinary; large enough that most results overflow T (the largest float16 is 65504); small
// enough that results are float32 or float16 subnormals.
template <typename T>
std::vector<float> magnitudes() {
  if constexpr (std::is_same_v<T, HalfBits>) return {1.0f, 1e4f, 1e-6f};
  return {1.0f, 5e37f, 1e-39f};
}

}  // namespace

TYPED_TEST(RangeKernelsTest, AbsorbFindsEachNonFiniteValue) {
  for (float nonfinite : {std::numeric_limits<float>::quiet_NaN(),
                          -std::numeric_limits<float>::infinity()}) {
    for (float magnitude : magnitudes<float>()) {
      expect_absorb_finds_each_nonfinite_value<TypeParam, float, float>(nonfinite, magnitude);
      expect_absorb_finds_each_nonfinite_value<TypeParam, BFloat16Bits, BFloat16Bits>(nonfinite,
                                                                                       magnitude);
      expect_absorb_finds_each_nonfinite_value<TypeParam, float, BFloat16Bits>(nonfinite,
                                                                               magnitude);
    }
    for (float magnitude : magnitudes<HalfBits>()) {
      expect_absorb_finds_each_nonfinite_value<TypeParam, HalfBits, HalfBits>(nonfinite,
                                                                              magnitude);
      expect_absorb_finds_each_nonfinite_value<TypeParam, float, HalfBits>(nonfinite, magnitude);
    }
  }
}

TYPED_TEST(RangeKernelsTest, MatchesBaseBitForBit) {
  std::mt19937_64 rng(3);
  expect_scale_into_agrees<TypeParam, float>(rng);
  expect_scale_into_agrees<TypeParam, BFloat16Bits>(rng);
  expect_scale_into_agrees<TypeParam, HalfBits>(rng);
  expect_absorb_agrees<TypeParam, float, float>(rng);
  expect_absorb_agrees<TypeParam, BFloat16Bits, BFloat16Bits>(rng);
  expect_absorb_agrees<TypeParam, HalfBits, HalfBits>(rng);
  expect_absorb_agrees<TypeParam, float, BFloat16Bits>(rng);
  expect_absorb_agrees<TypeParam, float, HalfBits>(rng);
  expect_compress_into_agrees<TypeParam, BFloat16Bits>(rng);
  expect_compress_into_agrees<TypeParam, HalfBits>(rng);
}

}  // namespace gossip
