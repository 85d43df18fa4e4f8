// simulate(): the real engine over the in-process transport, one thread per rank.
//
// values[i] is node i's initial parameter vector; the result holds the de-biased values after
// every round: result[0] == values, result[t + 1][i] == node i after round t. Studying a
// topology's consensus speed at n = 256 needs no cluster, and the tests use it to check the
// engine against an independent reference.
#pragma once

#include <chrono>
#include <cstdint>

#include <ATen/core/Tensor.h>

#include "engine/gossip_engine.h"

namespace gossip {

// One thread per simulated rank: at most this many.
constexpr int64_t kMaxSimulatedRanks = 4096;
// The most rounds one call runs.
constexpr int64_t kMaxSimulatedRounds = int64_t{1} << 24;

// `options.graph`, `options.mixing`, `options.push_sum` and `options.timeout` apply; values must
// be a 2-D floating CPU tensor [n, d] with 1 <= n <= kMaxSimulatedRanks and d >= 1;
// 0 <= rounds <= kMaxSimulatedRounds.
at::Tensor simulate(const at::Tensor& values, int64_t rounds, const EngineOptions& options);

}  // namespace gossip
