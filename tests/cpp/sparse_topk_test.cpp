// The sparse top-k ops (Note [Sparse top-k messages] in kernels/sparse_topk.h), called through the
// dispatcher, against a naive selection written here: every chunk's positions sorted by
// magnitude, larger first, then lower position (a stable sort), the first k kept in ascending
// order, the codes packed a code at a time. Data full of ties and zeros, chunks of 1, 7 and 4096
// with a short last chunk, both dtypes and both widths; and the argument checks.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "kernels/sparse_topk.h"

namespace gossip {
namespace {

at::Tensor encode(const at::Tensor& values, int64_t k, int64_t bits, int64_t chunk) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("gossip_ext::topk_encode", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, int64_t, int64_t)>();
  return op.call(values, k, bits, chunk);
}

void add_into(const at::Tensor& total, const at::Tensor& message, int64_t k, int64_t bits,
              int64_t chunk) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("gossip_ext::topk_add_into", "")
          .typed<void(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t)>();
  op.call(total, message, k, bits, chunk);
}

// Values in {0, -0, +-0.5, +-1, +-1.5} half the time (ties), normal otherwise.
template <typename T>
std::vector<T> tricky(int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal;
  std::uniform_int_distribution<int> pick(0, 5), level(-3, 3);
  std::vector<T> v(n);
  for (auto& x : v) {
    const int p = pick(rng);
    x = static_cast<T>(p == 0 ? 0.0 : p == 1 ? -0.0 : p == 2 ? level(rng) / 2.0 : normal(rng));
  }
  return v;
}

template <typename T>
std::vector<uint8_t> naive_message(const std::vector<T>& v, int64_t k, int64_t bits,
                                   int64_t chunk) {
  const int64_t n = static_cast<int64_t>(v.size());
  const int64_t chunks = (n + chunk - 1) / chunk;
  std::vector<uint8_t> out(topk_message_bytes(chunks, k, bits), 0);
  uint8_t* positions = out.data() + 4 * chunks;
  uint8_t* packed = positions + 2 * chunks * k;
  const T levels = static_cast<T>((1 << bits) - 1);
  const T half = levels / 2;
  for (int64_t c = 0; c < chunks; ++c) {
    std::vector<T> row(chunk, T(0));
    for (int64_t p = 0; p < chunk && c * chunk + p < n; ++p) row[p] = v[c * chunk + p];
    std::vector<int> order(chunk);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return std::fabs(row[a]) > std::fabs(row[b]); });
    order.resize(k);
    std::sort(order.begin(), order.end());
    T largest = 0;
    for (int p : order) largest = std::max(largest, static_cast<T>(std::fabs(row[p])));
    const float scale = static_cast<float>(largest);
    std::memcpy(out.data() + 4 * c, &scale, 4);
    const T safe = static_cast<T>(scale > 0 ? scale : 1.0f);
    for (int64_t j = 0; j < k; ++j) {
      const auto p = static_cast<int16_t>(order[j]);
      std::memcpy(positions + 2 * (c * k + j), &p, 2);
      const T y = std::nearbyint((row[order[j]] / safe + 1) * half);
      const int code = static_cast<int>(std::min(std::max(y, T(0)), levels));
      const int64_t i = c * k + j;
      packed[i / (8 / bits)] |= static_cast<uint8_t>(code << ((i % (8 / bits)) * bits));
    }
  }
  return out;
}

template <typename T>
void expect_encode_matches_naive(at::ScalarType dtype) {
  for (const auto& [n, chunk, k] : std::vector<std::array<int64_t, 3>>{
           {1, 1, 1}, {23, 1, 1}, {50, 7, 3}, {50, 7, 7}, {10000, 4096, 64}, {9000, 4096, 4096}}) {
    for (int64_t bits : {2, 4}) {
      auto v = tricky<T>(n, static_cast<unsigned>(n + k + bits));
      const at::Tensor values = at::empty({n}, at::TensorOptions().dtype(dtype));
      std::memcpy(values.data_ptr(), v.data(), n * sizeof(T));
      const at::Tensor message = encode(values, k, bits, chunk);
      const std::vector<uint8_t> want = naive_message(v, k, bits, chunk);
      ASSERT_EQ(message.numel(), static_cast<int64_t>(want.size()));
      EXPECT_EQ(std::memcmp(message.const_data_ptr<uint8_t>(), want.data(), want.size()), 0)
          << "n=" << n << " chunk=" << chunk << " k=" << k << " bits=" << bits;

      // Decoded: at most k values a chunk, each within half a level (scale / levels) of the value
      // it stands for (a kept zero of the last chunk's padding too: the caller drops those).
      const int64_t chunks = (n + chunk - 1) / chunk;
      const at::Tensor total = at::zeros({chunks * chunk}, at::TensorOptions().dtype(dtype));
      add_into(total, message, k, bits, chunk);
      const T* got = total.const_data_ptr<T>();
      int64_t decoded = 0;
      for (int64_t i = 0; i < chunks * chunk; ++i) {
        if (got[i] == T(0)) continue;  // never a decoded value: 2c / levels - 1 is never 0
        ++decoded;
        float scale;
        std::memcpy(&scale, want.data() + 4 * (i / chunk), 4);
        const double half_level = scale / ((1 << bits) - 1) * (1 + 1e-6) + 1e-12;
        EXPECT_LE(std::fabs(got[i] - (i < n ? v[i] : T(0))), half_level) << i;
      }
      EXPECT_LE(decoded, chunks * k);
    }
  }
}

TEST(SparseTopKTest, EncodeMatchesANaiveSelectionFloat) {
  expect_encode_matches_naive<float>(at::kFloat);
}

TEST(SparseTopKTest, EncodeMatchesANaiveSelectionDouble) {
  expect_encode_matches_naive<double>(at::kDouble);
}

TEST(SparseTopKTest, BadArgumentsNameTheirValues) {
  const at::Tensor v = at::zeros({8});
  auto message_of = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "no error";
  };
  EXPECT_NE(message_of([&] { encode(v, 1, 3, 4); }).find("bits must be 2 or 4, got 3"),
            std::string::npos);
  EXPECT_NE(message_of([&] { encode(v, 5, 2, 4); }).find("k must be in [1, chunk=4], got 5"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              add_into(v, at::zeros({14}, at::TensorOptions().dtype(at::kByte)), 1, 2, 4);
            }).find("message has 14 bytes"),
            std::string::npos);
  EXPECT_THROW(encode(at::zeros({8}, at::TensorOptions().dtype(at::kInt)), 1, 2, 4),
               c10::TypeError);
}

}  // namespace
}  // namespace gossip
