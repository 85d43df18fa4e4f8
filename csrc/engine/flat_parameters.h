// Flat parameter buffers: the parameters of each dtype moved into one contiguous buffer, each
// parameter becoming a view of it (as FSDP's flat parameters and DDP's gradient_as_bucket_view).
//
// A gossip round then reads and writes one buffer per dtype with no gather/scatter copies, and the
// optimizer, which holds the same Parameter objects, updates the buffer through the views.
// Replacing a parameter's storage afterwards (param.data = t) would silently detach it from
// gossip; check_views() detects that and fails loudly.
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace gossip {

struct FlatParameterGroup {
  at::Tensor flat;                    // 1-D, contiguous, the group's dtype and device
  std::vector<at::Tensor> params;     // each a view of `flat` after flattening
  std::vector<std::string> names;
  std::vector<int64_t> offsets;       // element offset of params[i] in `flat`

  // Throws if a parameter no longer views `flat` at its offset, naming the parameter.
  void check_views() const;
};

// Groups `params` by dtype in order of first appearance, copies their values into one flat buffer
// per group and makes every parameter a view of it. Validates the arguments: at least one
// parameter, floating dtypes only, one device, dense, no tensor listed twice, none overlapping
// another (check_disjoint_parameters).
std::vector<FlatParameterGroup> flatten_parameters(const std::vector<at::Tensor>& params,
                                                   const std::vector<std::string>& names);

// Throws ValueError naming two of `params` (by name, when `names` has one per parameter, and by
// index) that share a byte of memory: two Parameters over one storage, or one a view of the other.
// Flattening gives each parameter a slot of its own, which would silently untie them, so they are
// refused. Weight tying as modules do it (one Parameter object in two places) lists the
// parameter once and is fine. Disjoint parts of one storage are fine too, and common: a model
// flattened before (an engine of an earlier elastic epoch) holds every parameter as a part of
// that engine's flat buffer. Views that interleave without sharing a byte (the columns of one
// matrix) are told apart from overlapping ones exactly.
void check_disjoint_parameters(const std::vector<at::Tensor>& params,
                               const std::vector<std::string>& names);

}  // namespace gossip
