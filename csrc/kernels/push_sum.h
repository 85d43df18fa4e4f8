// Fused push-sum kernels over flat contiguous buffers, registered as torch ops in the
// `gossip_ext` library so that tests and users can call them as torch.ops.gossip_ext.*.
//
//   scale_into(Tensor src, Tensor(a!) out, float alpha, Tensor? weight=None) -> ()
//       out = alpha * weight * src.
//       The send buffer of a round is scale_into(z, send, mixing peer weight, w); the push-sum
//       numerator ("re-bias") is scale_into(z, x, 1.0, w).
//   absorb_(Tensor(a!) x, Tensor[] received, float alpha, Tensor? self_weight=None,
//           Tensor? new_weight=None) -> ()
//       x = (alpha * self_weight * x + sum(received)) / new_weight, in one pass.
//       With x holding the de-biased parameters z, self_weight = the node's kept share of the
//       push-sum weight and new_weight = kept share + received weights, this is "absorb the
//       round and de-bias" fused; with no weights (lazy mixing) it is x = alpha * x + sum(received).
//
// Buffers are 1-D-compatible contiguous tensors of one floating dtype (float32, float64, float16,
// bfloat16) on one device; 16-bit types accumulate in float32. A weight is a one-element float32
// or float64 tensor on the buffers' device, so CUDA kernels read it without a host sync.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

namespace gossip {

// Argument checks shared by every backend (and the Meta kernels used for fake tensors).
void check_scale_into_args(const at::Tensor& src, const at::Tensor& out,
                           const std::optional<at::Tensor>& weight);
void check_absorb_args(const at::Tensor& x, at::TensorList received,
                       const std::optional<at::Tensor>& self_weight,
                       const std::optional<at::Tensor>& new_weight);

// Entry points through the dispatcher: they reach the kernel of the tensors' device.
namespace ops {
void scale_into(const at::Tensor& src, const at::Tensor& out, double alpha,
                const std::optional<at::Tensor>& weight);
void absorb_(const at::Tensor& x, at::TensorList received, double alpha,
             const std::optional<at::Tensor>& self_weight,
             const std::optional<at::Tensor>& new_weight);
}  // namespace ops

}  // namespace gossip
