// simulate(): the real engine over the in-process transport, one thread per rank.
//
// values[i] is node i's initial parameter vector; the result holds the de-biased values after
// every round: result[0] == values, result[t + 1][i] == node i after round t. Studying a
// topology's consensus speed at n = 256 needs no cluster, and the tests use it to check the
// engine against an independent reference.
#pragma once

#include <chrono>

#include <ATen/core/Tensor.h>

#include "engine/gossip_engine.h"

namespace gossip {

// `options.graph`, `options.mixing`, `options.push_sum` and `options.timeout` apply; values must
// be a 2-D floating CPU tensor [n, d] with d >= 1; rounds >= 0.
at::Tensor simulate(const at::Tensor& values, int64_t rounds, const EngineOptions& options);

}  // namespace gossip
