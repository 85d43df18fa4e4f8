// Two registers of float32 lanes used as one vector of twice the width: the arithmetic of the
// layouts that convert 16-bit values two registers at a time (lanes_avx2.h, lanes_avx512.h).
// Included by those headers inside their instruction set's `#pragma GCC target(...)`; each
// translation unit's copy lives in its own anonymous namespace, so none is merged with another
// instruction set's.
#pragma once

namespace gossip::cpu {
namespace {

template <typename Lanes>
struct LanePairs {
  struct Vec {
    typename Lanes::Vec first, second;
  };
  static constexpr int kWidth = 2 * Lanes::kWidth;
  static Vec broadcast(float v) { return {Lanes::broadcast(v), Lanes::broadcast(v)}; }
  static Vec add(Vec a, Vec b) {
    return {Lanes::add(a.first, b.first), Lanes::add(a.second, b.second)};
  }
  static Vec sub(Vec a, Vec b) {
    return {Lanes::sub(a.first, b.first), Lanes::sub(a.second, b.second)};
  }
  static Vec mul(Vec a, Vec b) {
    return {Lanes::mul(a.first, b.first), Lanes::mul(a.second, b.second)};
  }
  static bool any_nonfinite(Vec v) {
    return Lanes::any_nonfinite(v.first) || Lanes::any_nonfinite(v.second);
  }
  // Two pairs are four registers, as many as FloatLanes' group of four, and are tested as one
  // group of Lanes.
  static constexpr int kCheckGroup = Lanes::kCheckGroup / 2;
  template <int N>
  static bool may_be_nonfinite(const Vec (&results)[N]) {
    typename Lanes::Vec halves[2 * N];
#pragma GCC unroll 8
    for (int g = 0; g < N; ++g) {
      halves[2 * g] = results[g].first;
      halves[2 * g + 1] = results[g].second;
    }
    return Lanes::may_be_nonfinite(halves);
  }
};

}  // namespace
}  // namespace gossip::cpu
