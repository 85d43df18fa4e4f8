// Mixing weights: how a node splits its value between itself and its out-peers in one round.
//
// Cross-rank contract: the weights are a pure function of (options, number of out-peers). Every
// out-peer of a node gets the same weight, so one scaled send buffer serves all of them.
//
//   UniformMixing:     self = peer = 1 / (num_out_peers + 1).
//   SelfWeightMixing:  self = a, peer = (1 - a) / num_out_peers; 0 < a < 1.
//
// Both are column-stochastic (self + num_out_peers * peer == 1), so push-sum conserves mass.
// Only uniform mixing on a regular graph is also row-stochastic, which keeps every push-sum
// weight at exactly 1 ("lazy mixing"): the weight then need not travel.
#pragma once

namespace gossip {

enum class MixingKind { kUniform, kSelfWeight };

struct MixingOptions {
  MixingKind kind = MixingKind::kUniform;
  double self_weight = 0.5;  // kSelfWeight only
};

struct MixingWeights {
  double self_weight;
  double peer_weight;  // for each out-peer
};

// Throws gossip::ValueError naming the bad field (a kind that is no MixingKind included: pybind11
// makes one from any int).
void validate(const MixingOptions& options);

// num_out_peers in [0, kMaxWorldSize).
MixingWeights mixing_weights(const MixingOptions& options, int num_out_peers);

}  // namespace gossip
