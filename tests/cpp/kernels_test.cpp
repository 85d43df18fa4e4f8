// The push-sum ops, called through the dispatcher as the engine calls them, against naive loops
// that accumulate in double and round once. Sizes straddle the 512-element block and the
// 32768-element parallel grain so that tails and thread splits are exercised.
#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "kernels/push_sum.h"

namespace gossip {
namespace {

constexpr at::ScalarType kDtypes[] = {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16};
constexpr int64_t kSizes[] = {1, 7, 1023, 100003};
constexpr int kReceivedCounts[] = {0, 1, 3};

// Relative tolerances: a few roundings of the storage type (16-bit types accumulate in fp32).
double tolerance(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble:
      return 1e-12;
    case at::kFloat:
      return 1e-6;
    case at::kHalf:
      return 1e-3;
    default:
      return 1e-2;
  }
}

// Random values of magnitude in [0.25, 2) with random signs: far from the subnormal range of
// float16, while signed sums still cancel.
at::Tensor random_buffer(int64_t n, at::ScalarType dtype, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> magnitude(0.25, 2.0);
  std::bernoulli_distribution negative(0.5);
  at::Tensor values = at::empty({n}, at::kDouble);
  double* data = values.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) data[i] = negative(rng) ? -magnitude(rng) : magnitude(rng);
  return values.to(dtype);
}

std::vector<double> values_of(const at::Tensor& t) {
  const at::Tensor d = t.to(at::kDouble).contiguous();
  return std::vector<double>(d.const_data_ptr<double>(), d.const_data_ptr<double>() + d.numel());
}

// Rounds each double to `dtype` once, as a kernel with a wider accumulator should.
std::vector<double> round_to(const std::vector<double>& exact, at::ScalarType dtype) {
  at::Tensor t = at::empty({static_cast<int64_t>(exact.size())}, at::kDouble);
  std::copy(exact.begin(), exact.end(), t.data_ptr<double>());
  return values_of(t.to(dtype));
}

double weight_of(const std::optional<at::Tensor>& weight) {
  return weight.has_value() ? weight->item<double>() : 1.0;
}

// Checks got[i] == expected[i] within tol * scale[i], where scale is the sum of the magnitudes of
// the terms (a bound that stays meaningful when signed terms cancel). Reports the worst element.
void expect_close(const std::vector<double>& got, const std::vector<double>& expected,
                  const std::vector<double>& scale, double tol) {
  ASSERT_EQ(got.size(), expected.size());
  size_t worst = 0;
  double worst_ratio = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double ratio = std::abs(got[i] - expected[i]) / (tol * scale[i]);
    if (!(ratio <= worst_ratio)) {  // also catches NaN
      worst_ratio = ratio;
      worst = i;
    }
  }
  EXPECT_LE(worst_ratio, 1.0) << "element " << worst << ": got " << got[worst] << ", expected "
                              << expected[worst];
}

std::string dtype_name(at::ScalarType dtype) { return c10::toString(dtype); }

// Expects body() to throw Error (a c10::Error subclass) and returns its message.
template <typename Error>
std::string error_message(const std::function<void()>& body) {
  try {
    body();
  } catch (const Error& e) {
    return e.what_without_backtrace();
  }
  ADD_FAILURE() << "expected an exception of the requested c10::Error subclass";
  return "";
}

::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << text << "' does not mention '" << part << "'";
}

}  // namespace

TEST(PushSumKernels, ScaleIntoMatchesNaiveLoop) {
  std::mt19937_64 rng(7);
  for (at::ScalarType dtype : kDtypes) {
    for (int64_t n : kSizes) {
      for (std::optional<at::ScalarType> weight_dtype :
           {std::optional<at::ScalarType>(), std::optional(at::kFloat),
            std::optional(at::kDouble)}) {
        for (double alpha : {0.37, -1.25}) {
          SCOPED_TRACE(dtype_name(dtype) + " n=" + std::to_string(n) +
                       " alpha=" + std::to_string(alpha) +
                       " weight=" + (weight_dtype ? dtype_name(*weight_dtype) : "none"));
          const at::Tensor src = random_buffer(n, dtype, rng);
          const at::Tensor out = at::full({n}, 99.0, at::TensorOptions().dtype(dtype));
          std::optional<at::Tensor> weight;
          if (weight_dtype) weight = at::full({1}, 0.61, at::TensorOptions().dtype(*weight_dtype));
          const std::vector<double> x = values_of(src);

          ops::scale_into(src, out, alpha, weight);

          const double w = weight_of(weight);
          std::vector<double> exact(n), scale(n);
          for (int64_t i = 0; i < n; ++i) {
            exact[i] = alpha * w * x[i];
            scale[i] = std::abs(exact[i]);
          }
          expect_close(values_of(out), round_to(exact, dtype), scale, tolerance(dtype));
          EXPECT_EQ(values_of(src), x) << "scale_into wrote its source";
        }
      }
    }
  }
}

TEST(PushSumKernels, AbsorbMatchesNaiveLoop) {
  struct Weights {
    std::optional<at::ScalarType> self, fresh;
  };
  const Weights weight_cases[] = {
      {std::nullopt, std::nullopt}, {at::kFloat, at::kFloat},    {at::kDouble, at::kDouble},
      {at::kFloat, std::nullopt},   {std::nullopt, at::kDouble},
  };
  std::mt19937_64 rng(11);
  for (at::ScalarType dtype : kDtypes) {
    for (int64_t n : kSizes) {
      for (int k : kReceivedCounts) {
        for (const Weights& wc : weight_cases) {
          SCOPED_TRACE(dtype_name(dtype) + " n=" + std::to_string(n) +
                       " received=" + std::to_string(k) +
                       " self_weight=" + (wc.self ? dtype_name(*wc.self) : "none") +
                       " new_weight=" + (wc.fresh ? dtype_name(*wc.fresh) : "none"));
          const double alpha = 0.83;
          const at::Tensor x = random_buffer(n, dtype, rng);
          std::vector<at::Tensor> received;
          for (int j = 0; j < k; ++j) received.push_back(random_buffer(n, dtype, rng));
          std::optional<at::Tensor> self_weight, new_weight;
          if (wc.self) self_weight = at::full({1}, 0.73, at::TensorOptions().dtype(*wc.self));
          if (wc.fresh) new_weight = at::full({1}, 1.37, at::TensorOptions().dtype(*wc.fresh));
          const std::vector<double> x0 = values_of(x);
          std::vector<std::vector<double>> r0;
          for (const at::Tensor& r : received) r0.push_back(values_of(r));

          ops::absorb_(x, received, alpha, self_weight, new_weight);

          const double a = alpha * weight_of(self_weight);
          const double d = weight_of(new_weight);
          std::vector<double> exact(n), scale(n);
          for (int64_t i = 0; i < n; ++i) {
            double sum = a * x0[i];
            double magnitude = std::abs(a * x0[i]);
            for (int j = 0; j < k; ++j) {
              sum += r0[j][i];
              magnitude += std::abs(r0[j][i]);
            }
            exact[i] = sum / d;
            scale[i] = magnitude / d;
          }
          expect_close(values_of(x), round_to(exact, dtype), scale, tolerance(dtype));
          for (int j = 0; j < k; ++j) EXPECT_EQ(values_of(received[j]), r0[j]) << "received " << j;
        }
      }
    }
  }
}

TEST(PushSumKernels, ScaleIntoRejectsBadArguments) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor src = at::zeros({7}, f32);
  std::string message = error_message<c10::ValueError>([&] {
    ops::scale_into(src, at::zeros({7}, at::TensorOptions().dtype(at::kDouble)), 1.0, {});
  });
  EXPECT_TRUE(Contains(message, "out"));
  EXPECT_TRUE(Contains(message, "Double"));
  message =
      error_message<c10::ValueError>([&] { ops::scale_into(src, at::zeros({8}, f32), 1.0, {}); });
  EXPECT_TRUE(Contains(message, "out"));
  EXPECT_TRUE(Contains(message, "8"));
  // Every other element of a [7, 2] buffer: 7 elements, not contiguous.
  const at::Tensor strided = at::zeros({7, 2}, f32).select(1, 0);
  message = error_message<c10::ValueError>(
      [&] { ops::scale_into(strided, at::zeros({7}, f32), 1.0, {}); });
  EXPECT_TRUE(Contains(message, "src"));
  EXPECT_TRUE(Contains(message, "contiguous"));
  const at::Tensor ints = at::zeros({7}, at::TensorOptions().dtype(at::kInt));
  message = error_message<c10::TypeError>([&] { ops::scale_into(ints, ints, 1.0, {}); });
  EXPECT_TRUE(Contains(message, "src"));
  EXPECT_TRUE(Contains(message, "Int"));
  message = error_message<c10::ValueError>(
      [&] { ops::scale_into(src, at::zeros({7}, f32), 1.0, at::full({2}, 1.0, f32)); });
  EXPECT_TRUE(Contains(message, "weight"));
  EXPECT_TRUE(Contains(message, "2"));
  message = error_message<c10::TypeError>([&] {
    ops::scale_into(src, at::zeros({7}, f32), 1.0,
                    at::full({1}, 1.0, at::TensorOptions().dtype(at::kHalf)));
  });
  EXPECT_TRUE(Contains(message, "weight"));
}

TEST(PushSumKernels, AbsorbRejectsBadArguments) {
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor x = at::full({7}, 3.0, f64);
  const at::Tensor good = at::full({7}, 1.0, f64);
  const at::Tensor before = x.clone();
  std::string message = error_message<c10::ValueError>([&] {
    ops::absorb_(x, {good, at::zeros({7}, at::TensorOptions().dtype(at::kFloat))}, 1.0, {}, {});
  });
  EXPECT_TRUE(Contains(message, "received"));
  message =
      error_message<c10::ValueError>([&] { ops::absorb_(x, {at::zeros({6}, f64)}, 1.0, {}, {}); });
  EXPECT_TRUE(Contains(message, "received"));
  EXPECT_TRUE(Contains(message, "6"));
  message = error_message<c10::ValueError>(
      [&] { ops::absorb_(at::zeros({7, 2}, f64).select(1, 1), {}, 1.0, {}, {}); });
  EXPECT_TRUE(Contains(message, "contiguous"));
  const at::Tensor ints = at::zeros({7}, at::TensorOptions().dtype(at::kLong));
  EXPECT_TRUE(
      Contains(error_message<c10::TypeError>([&] { ops::absorb_(ints, {}, 1.0, {}, {}); }), "x"));
  message = error_message<c10::ValueError>(
      [&] { ops::absorb_(x, {good}, 1.0, at::full({2}, 1.0, f64), {}); });
  EXPECT_TRUE(Contains(message, "self_weight"));
  message = error_message<c10::TypeError>([&] {
    ops::absorb_(x, {good}, 1.0, {}, at::full({1}, 1, at::TensorOptions().dtype(at::kInt)));
  });
  EXPECT_TRUE(Contains(message, "new_weight"));
  // A rejected call must not have touched x.
  EXPECT_EQ(values_of(x), values_of(before));
}

}  // namespace gossip
