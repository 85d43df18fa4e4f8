// Fused push-sum kernels over flat contiguous buffers, registered as torch ops in the
// `gossip_ext` library so that tests and users can call them as torch.ops.gossip_ext.*.
//
//   scale_into(Tensor src, Tensor(a!) out, float alpha, Tensor? weight=None) -> ()
//       out = alpha * weight * src.
//       The send buffer of a round is scale_into(z, send, mixing peer weight, w); the push-sum
//       numerator ("re-bias") is scale_into(z, x, 1.0, w).
//   compress_into_(Tensor(a!) src, Tensor(b!) out, float alpha, Tensor? weight=None,
//                  float feedback=0.) -> ()
//       v = alpha * weight * src; out = v rounded to out's 16-bit dtype; then
//       src += feedback * (v - out) / weight, in one pass.
//       The send of a compressed round (Note [Compressed messages] in the engine): out is the
//       float16/bfloat16 message, and with feedback = (number of peers) / (kept share) the
//       rounding error of every copy sent stays in the sender's own state, so no mass is lost.
//   absorb_(Tensor(a!) x, Tensor[] received, float alpha, Tensor? self_weight=None,
//           Tensor? new_weight=None, Tensor(b!)? nonfinite=None, Tensor? sent=None,
//           float sent_scale=0.) -> ()
//       x = (alpha * self_weight * x + sum(received) + sent_scale * sent) / new_weight, in one
//       pass. With x holding the de-biased parameters z, self_weight = the node's kept share of
//       the push-sum weight and new_weight = kept share + received weights, this is "absorb the
//       round and de-bias" fused; with no weights (lazy mixing) it is x = alpha * x + sum(received).
//       `sent`, a message this node sent in the round, lets a synchronous compressed round fold
//       its rounding error in here rather than at the send (Note [Compressed messages]):
//       x = (w * z - k * q + sum(received)) / new_weight with sent = q, sent_scale = -k.
//       nonfinite, a one-element int32 tensor on the buffers' device, is set to 1 when any value
//       read (x before the update, a received buffer or `sent`) is NaN or Inf, and never cleared,
//       so one flag can cover several calls. The check rides on the same pass: divergence is
//       caught where it arrives at no extra memory traffic, and the flag stays on the device until
//       the caller chooses to read it.
//
//   quantize_into_(Tensor(a!) src, Tensor(b!) out, str format, float alpha, Tensor? weight=None,
//                  float feedback=0.) -> ()
//       compress_into_ with a block-quantized message (Note [Quantized messages] in
//       block_format.h): format "int8", "int4" or "float8_e4m3fn"; out is a uint8 tensor of
//       exactly quantized_message_bytes(src.numel(), format) bytes; src float32 or float64.
//       v = alpha * weight * src is sent as block codes and scales, and with feedback the error
//       src += feedback * (v - sent value) / weight stays in the sender's state.
//   absorb_quantized_(Tensor(a!) x, Tensor[] received, str format, float alpha,
//                     Tensor? self_weight=None, Tensor? new_weight=None,
//                     Tensor(b!)? nonfinite=None, Tensor? sent=None, float sent_scale=0.) -> ()
//       absorb_ over quantized messages (uint8, as quantize_into_ writes them): each value read
//       in float32 (code * block scale) and accumulated in x's dtype. The non-finite flag is
//       raised by a NaN or Inf in x or in a block scale (a sender's NaN or Inf travels as a NaN
//       scale).
//
// Buffers are 1-D-compatible contiguous tensors of one floating dtype (float32, float64, float16,
// bfloat16) on one device; 16-bit types accumulate in float32. Messages (compress_into_'s out,
// absorb_'s received) may instead be float16 or bfloat16 when the state is float32 or float64;
// the received buffers of one call share one dtype. A weight is a one-element float32
// or float64 tensor on the buffers' device, so CUDA kernels read it without a host sync.
#pragma once

#include <optional>
#include <string>

#include <ATen/core/Tensor.h>

#include "kernels/block_format.h"

namespace gossip {

// The block format named `format` ("int8", "int4" or "float8_e4m3fn"); ValueError naming `arg`
// otherwise.
BlockFormat parse_block_format(const std::string& format, const char* arg = "format");
const char* block_format_name(BlockFormat format);
// Bytes of a quantized message of `numel` values (Note [Quantized messages]).
int64_t quantized_message_bytes(int64_t numel, const std::string& format);

// Argument checks shared by every backend (and the Meta kernels used for fake tensors).
void check_scale_into_args(const at::Tensor& src, const at::Tensor& out,
                           const std::optional<at::Tensor>& weight);
void check_compress_into_args(const at::Tensor& src, const at::Tensor& out,
                              const std::optional<at::Tensor>& weight);
void check_absorb_args(const at::Tensor& x, at::TensorList received,
                       const std::optional<at::Tensor>& self_weight,
                       const std::optional<at::Tensor>& new_weight,
                       const std::optional<at::Tensor>& nonfinite,
                       const std::optional<at::Tensor>& sent);
void check_quantize_into_args(const at::Tensor& src, const at::Tensor& out,
                              const std::string& format, const std::optional<at::Tensor>& weight);
void check_absorb_quantized_args(const at::Tensor& x, at::TensorList received,
                                 const std::string& format,
                                 const std::optional<at::Tensor>& self_weight,
                                 const std::optional<at::Tensor>& new_weight,
                                 const std::optional<at::Tensor>& nonfinite,
                                 const std::optional<at::Tensor>& sent);
// The dtype absorb_ reads its messages in: the received buffers', else `sent`'s, else x's.
at::ScalarType absorb_message_dtype(const at::Tensor& x, at::TensorList received,
                                    const std::optional<at::Tensor>& sent);

// The instruction set the CPU kernels run: "zen4" (avx512_bf16 as Zen 4 runs it best),
// "avx512_bf16", "avx512", "avx2" or "base" (kernels/cpu/range_kernels.h): the best this CPU has,
// capped by torch's CPU capability (so the environment variable ATEN_CPU_CAPABILITY=avx2 or
// =default lowers it, as it lowers torch's own kernels) and by GOSSIP_EXT_MAX_CPU_ISA, one of
// those five names.
std::string cpu_kernels_isa();

// Entry points through the dispatcher: they reach the kernel of the tensors' device.
namespace ops {
void scale_into(const at::Tensor& src, const at::Tensor& out, double alpha,
                const std::optional<at::Tensor>& weight);
void compress_into_(const at::Tensor& src, const at::Tensor& out, double alpha,
                    const std::optional<at::Tensor>& weight, double feedback);
void absorb_(const at::Tensor& x, at::TensorList received, double alpha,
             const std::optional<at::Tensor>& self_weight,
             const std::optional<at::Tensor>& new_weight,
             const std::optional<at::Tensor>& nonfinite = std::nullopt,
             const std::optional<at::Tensor>& sent = std::nullopt, double sent_scale = 0.0);
void quantize_into_(const at::Tensor& src, const at::Tensor& out, const std::string& format,
                    double alpha, const std::optional<at::Tensor>& weight, double feedback);
void absorb_quantized_(const at::Tensor& x, at::TensorList received, const std::string& format,
                       double alpha, const std::optional<at::Tensor>& self_weight,
                       const std::optional<at::Tensor>& new_weight,
                       const std::optional<at::Tensor>& nonfinite = std::nullopt,
                       const std::optional<at::Tensor>& sent = std::nullopt,
                       double sent_scale = 0.0);
}  // namespace ops

}  // namespace gossip
