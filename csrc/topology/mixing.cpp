#include "topology/mixing.h"

#include <cmath>

#include "common/error.h"

namespace gossip {

void validate(const MixingOptions& options) {
  if (options.kind == MixingKind::kSelfWeight) {
    GOSSIP_CHECK_ARG(std::isfinite(options.self_weight) && options.self_weight > 0.0 &&
                         options.self_weight < 1.0,
                     "SelfWeightMixing: self_weight must be in (0, 1), got ", options.self_weight);
  }
}

MixingWeights mixing_weights(const MixingOptions& options, int num_out_peers) {
  GOSSIP_CHECK_ARG(num_out_peers >= 0, "num_out_peers must be >= 0, got ", num_out_peers);
  if (num_out_peers == 0) return {1.0, 0.0};
  if (options.kind == MixingKind::kUniform) {
    const double share = 1.0 / (num_out_peers + 1);
    return {share, share};
  }
  validate(options);
  return {options.self_weight, (1.0 - options.self_weight) / num_out_peers};
}

}  // namespace gossip
