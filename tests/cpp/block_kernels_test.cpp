// The block-quantized range kernels (kernels/cpu/block_kernels.inc) below the dispatcher: the
// float8 e4m3fn codes of block_format.h against c10::Float8_e4m3fn, bit for bit, and each vector
// instruction set's quantize_into and absorb_quantized against the baseline's, bit for bit, on
// blocks full of what quantizers get wrong: zeros, one outlier, subnormals, ties, NaN and Inf,
// a partial last block. An instruction set this CPU lacks is skipped, visibly.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <c10/util/Float8_e4m3fn.h>
#include <gtest/gtest.h>

#include "kernels/block_format.h"
#include "kernels/cpu/convert.h"
#include "kernels/cpu/range_kernels.h"
#include "kernels/push_sum.h"

namespace gossip {
namespace {

TEST(BlockFormatTest, Float8CodesMatchC10BitForBit) {
  // Every code decodes as c10 decodes it (0x7F and 0xFF are NaN, never written).
  for (uint32_t code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F) continue;
    const float want = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(code),
                                                             c10::Float8_e4m3fn::from_bits()));
    ASSERT_EQ(cpu::float_to_bits(quant_float8_value(static_cast<uint8_t>(code))),
              cpu::float_to_bits(want))
        << code;
  }
  // Every value in [-448, 448] encodes as c10 rounds it: every code's value, the midpoints
  // between neighbours and their neighbouring floats, and random floats.
  std::vector<float> probes;
  for (uint32_t code = 0; code < 0x7E; ++code) {
    const float f = quant_float8_value(static_cast<uint8_t>(code));
    const float mid = f + (quant_float8_value(static_cast<uint8_t>(code + 1)) - f) / 2;
    for (float p : {f, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1000.0f)}) {
      probes.push_back(p);
      probes.push_back(-p);
    }
  }
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> uniform(-448.0f, 448.0f);
  std::uniform_int_distribution<int> exponent(-12, 8);
  for (int i = 0; i < 200000; ++i) {
    probes.push_back(uniform(rng));
    probes.push_back(std::ldexp(uniform(rng) / 448.0f, exponent(rng)));
  }
  probes.push_back(448.0f);
  probes.push_back(-448.0f);
  for (float p : probes) {
    ASSERT_EQ(quant_float8_code(p), c10::Float8_e4m3fn(p).x) << p;
  }
}

TEST(BlockFormatTest, Int4CodesAreTwosComplementNibbles) {
  for (int level = -8; level < 8; ++level) {
    EXPECT_EQ(quant_int4_value(static_cast<uint32_t>(level) & 0xFu), static_cast<float>(level));
  }
}

TEST(BlockFormatTest, MessageSizes) {
  EXPECT_EQ(quant_message_bytes(0, BlockFormat::kInt8), 0);
  EXPECT_EQ(quant_message_bytes(1, BlockFormat::kInt4), 4 + 1);
  EXPECT_EQ(quant_message_bytes(128, BlockFormat::kInt8), 4 + 128);
  EXPECT_EQ(quant_message_bytes(129, BlockFormat::kInt4), 8 + 65);
  EXPECT_EQ(quant_message_bytes(1000, BlockFormat::kFloat8E4M3), 8 * 4 + 1000);
}

// One instruction set's block kernels, for the typed tests below.
#define GOSSIP_BLOCK_KERNELS(Name, isa, has, lacks)                                              \
  struct Name {                                                                                  \
    static bool available() { return cpu::has(); }                                              \
    static constexpr const char* kLacks = lacks;                                                 \
    template <typename T>                                                                        \
    static void quantize_into(T* src, uint8_t* message, int64_t numel, BlockFormat format,       \
                              int64_t begin, int64_t end, T scale, T fold) {                     \
      cpu::isa::quantize_into<T>(src, message, numel, format, begin, end, scale, fold);         \
    }                                                                                            \
    template <typename T>                                                                        \
    static bool absorb_quantized(T* x, const uint8_t* const* received, int num_received,        \
                                 const uint8_t* sent, int64_t numel, BlockFormat format,         \
                                 int64_t begin, int64_t end, T self_scale, T sent_scale,         \
                                 T out_scale) {                                                  \
      return cpu::isa::absorb_quantized<T, true>(x, received, num_received, sent, numel, format, \
                                                 begin, end, self_scale, sent_scale, out_scale); \
    }                                                                                            \
  };
GOSSIP_BLOCK_KERNELS(Base, base, cpu_has_avx2, "")
GOSSIP_BLOCK_KERNELS(Avx2, avx2, cpu_has_avx2, "this CPU lacks AVX2, FMA or F16C")
GOSSIP_BLOCK_KERNELS(Avx512, avx512, cpu_has_avx512, "this CPU lacks AVX-512 F/BW/VL/DQ")
GOSSIP_BLOCK_KERNELS(Avx512Bf16, avx512_bf16, cpu_has_avx512_bf16, "this CPU lacks AVX512_BF16")
GOSSIP_BLOCK_KERNELS(Zen4, zen4, cpu_has_avx512_bf16, "this CPU lacks AVX512_BF16")
#undef GOSSIP_BLOCK_KERNELS

constexpr int64_t kNumel = 1000;  // 7 whole blocks and a partial one of 104 values
constexpr BlockFormat kFormats[] = {BlockFormat::kInt8, BlockFormat::kInt4,
                                    BlockFormat::kFloat8E4M3};

// Blocks of several kinds, one kind per block: ordinary values over a wide range of magnitudes,
// zeros, one large outlier among small values, subnormals, values on int8's and int4's ties, and
// (where `specials`) a NaN or an Inf.
template <typename T>
std::vector<T> block_values(std::mt19937_64& rng, bool specials) {
  std::normal_distribution<double> normal;
  std::uniform_int_distribution<int> exponent(-30, 30);
  std::vector<T> values(kNumel);
  for (int64_t i = 0; i < kNumel; ++i) {
    const int64_t kind = i / kQuantBlock;
    T& v = values[i];
    switch (kind) {
      case 1:
        v = 0;
        break;
      case 2:
        v = static_cast<T>(i % kQuantBlock == 5 ? 1e6 : normal(rng) * 1e-3);
        break;
      case 3:
        v = static_cast<T>(std::numeric_limits<float>::denorm_min() * (i % 7));
        break;
      case 4:
        v = static_cast<T>((i % kQuantBlock == 0 ? 127.0 : (i % 255) - 127.0 + 0.5) / 64.0);
        break;
      case 5:
        v = static_cast<T>(i % kQuantBlock == 9 && specials
                               ? (i % 2 ? std::numeric_limits<T>::infinity()
                                        : std::numeric_limits<T>::quiet_NaN())
                               : normal(rng));
        break;
      default:
        v = static_cast<T>(std::ldexp(normal(rng), exponent(rng)));
    }
  }
  return values;
}

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <typename Kernels, typename T>
void expect_quantize_agrees(std::mt19937_64& rng, BlockFormat format) {
  const std::vector<T> values = block_values<T>(rng, true);
  const int64_t bytes = quant_message_bytes(kNumel, format);
  for (const T fold : {T(0), T(3.5)}) {
    std::vector<T> state = values, base_state = values;
    std::vector<uint8_t> message(bytes), base_message(bytes);
    // Two ranges, split at a block boundary, as two threads would run them.
    for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, 3 * kQuantBlock},
                              std::pair<int64_t, int64_t>{3 * kQuantBlock, kNumel}}) {
      Kernels::template quantize_into<T>(state.data(), message.data(), kNumel, format, begin, end,
                                         T(0.3), fold);
      Base::template quantize_into<T>(base_state.data(), base_message.data(), kNumel, format,
                                      begin, end, T(0.3), fold);
    }
    EXPECT_EQ(message, base_message) << block_format_name(format) << " fold " << fold;
    EXPECT_TRUE(same_bits(state, base_state)) << block_format_name(format) << " fold " << fold;
  }
}

template <typename Kernels, typename T>
void expect_absorb_agrees(std::mt19937_64& rng, BlockFormat format) {
  const int64_t bytes = quant_message_bytes(kNumel, format);
  std::vector<std::vector<uint8_t>> messages;
  for (int k = 0; k < 3; ++k) {
    std::vector<T> source = block_values<T>(rng, k == 1);
    messages.emplace_back(bytes);
    Base::template quantize_into<T>(source.data(), messages.back().data(), kNumel, format, 0,
                                    kNumel, T(1), T(0));
  }
  const uint8_t* received[] = {messages[0].data(), messages[1].data()};
  const std::vector<T> x = block_values<T>(rng, false);
  std::vector<T> state = x, base_state = x;
  const bool found = Kernels::template absorb_quantized<T>(
      state.data(), received, 2, messages[2].data(), kNumel, format, 0, kNumel, T(0.5), T(-2),
      T(0.25));
  const bool base_found = Base::template absorb_quantized<T>(
      base_state.data(), received, 2, messages[2].data(), kNumel, format, 0, kNumel, T(0.5),
      T(-2), T(0.25));
  EXPECT_TRUE(found);  // messages[1] holds a NaN and an Inf
  EXPECT_EQ(found, base_found);
  for (int64_t i = 0; i < kNumel; ++i) {
    const bool both_nan = std::isnan(state[i]) && std::isnan(base_state[i]);
    ASSERT_TRUE(both_nan || std::memcmp(&state[i], &base_state[i], sizeof(T)) == 0)
        << block_format_name(format) << " element " << i;
  }
}

}  // namespace

template <typename Kernels>
class BlockKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!Kernels::available()) GTEST_SKIP() << Kernels::kLacks;
  }
};
using InstructionSets = ::testing::Types<Avx2, Avx512, Avx512Bf16, Zen4>;
TYPED_TEST_SUITE(BlockKernelsTest, InstructionSets);

TYPED_TEST(BlockKernelsTest, MatchesBaseBitForBit) {
  std::mt19937_64 rng(5);
  for (BlockFormat format : kFormats) {
    expect_quantize_agrees<TypeParam, float>(rng, format);
    expect_quantize_agrees<TypeParam, double>(rng, format);
    expect_absorb_agrees<TypeParam, float>(rng, format);
    expect_absorb_agrees<TypeParam, double>(rng, format);
  }
}

}  // namespace gossip
