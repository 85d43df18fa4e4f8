#include "topology/mixing.h"

#include <cmath>

#include "common/error.h"
#include "common/limits.h"

namespace gossip {

void validate(const MixingOptions& options) {
  GOSSIP_CHECK_ARG(options.kind == MixingKind::kUniform || options.kind == MixingKind::kSelfWeight,
                   "MixingOptions: kind must be one of MixingKind's values, got ",
                   static_cast<int>(options.kind));
  if (options.kind == MixingKind::kSelfWeight) {
    GOSSIP_CHECK_ARG(std::isfinite(options.self_weight) && options.self_weight > 0.0 &&
                         options.self_weight < 1.0,
                     "SelfWeightMixing: self_weight must be in (0, 1), got ", options.self_weight);
  }
}

MixingWeights mixing_weights(const MixingOptions& options, int num_out_peers) {
  validate(options);
  GOSSIP_CHECK_ARG(num_out_peers >= 0, "num_out_peers must be >= 0, got ", num_out_peers);
  // Out-peers are other ranks of one world; the bound also keeps num_out_peers + 1 an int.
  GOSSIP_CHECK_ARG(num_out_peers < kMaxWorldSize, "num_out_peers must be < ", kMaxWorldSize,
                   " (the largest world size), got ", num_out_peers);
  if (num_out_peers == 0) return {1.0, 0.0};
  if (options.kind == MixingKind::kUniform) {
    const double share = 1.0 / (num_out_peers + 1);
    return {share, share};
  }
  return {options.self_weight, (1.0 - options.self_weight) / num_out_peers};
}

}  // namespace gossip
