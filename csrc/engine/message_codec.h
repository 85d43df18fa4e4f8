// MessageCodec: the messages of asynchronous gossip, as one host byte buffer of a size fixed for
// the job, which the mailboxes carry (transport/mailbox).
//
// Layout: MessageHeader (the share's weight, the sender's round, one more float64 of the
// sender's), then one body per part (a flat buffer: a dtype group of the parameters, or an outer
// step's pseudo-gradient), each at an 8-byte-aligned offset. A float32/float64 part travels as
// the codec's message dtype (16 bits) or block format (int8, int4, float8 e4m3fn: Note
// [Quantized messages] in kernels/block_format.h) where one is set; every other part, and every
// part when none is set, in its own dtype. The weight always travels in float64, so the mass of
// the weights is conserved to float64 rounding whatever the values travel in.
//
// A lossy message's rounding stays with its sender (error feedback, Note [Compressed messages] in
// gossip_engine.h): encode() keeps `feedback` times the rounding in the values it reads, in the
// same pass that writes the message. Every pass over the values is one of the fused kernels
// (kernels/push_sum.h), on the values' device; on a GPU only the message's bytes cross to the
// host and back (Note [Asynchronous gossip on GPUs] in gossip_ext/gossip/messages.py).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "kernels/block_format.h"

namespace gossip {

class MessageCodec {
 public:
  struct Part {
    int64_t numel;
    at::ScalarType dtype;
  };

  // Validates the parts (floating dtypes) and the message type (message_dtype float16 or
  // bfloat16, exclusive with format); ValueError naming the argument otherwise.
  MessageCodec(std::vector<Part> parts, std::optional<at::ScalarType> message_dtype,
               std::optional<BlockFormat> format, c10::Device device);

  int64_t nbytes() const { return nbytes_; }
  // No part travels rounded.
  bool lossless() const;
  const std::vector<Part>& parts() const { return parts_; }

  // The message of `values` (one flat tensor per part, on the codec's device) with `weight` and
  // `aux` from the sender's `round`, in a new host buffer. A lossy part also keeps `feedback`
  // times its rounding in its values: values += feedback * (values - what the receiver reads).
  at::Tensor encode(const std::vector<at::Tensor>& values, double weight, int64_t round,
                    double aux, double feedback) const;
  // The values a message carries, one tensor per part in its dtype on the codec's device (a view
  // of the message where a part travels in its own dtype on the CPU).
  std::vector<at::Tensor> read(const at::Tensor& message) const;
  // values = (alpha * values + the message's) / new_weight for every part, one pass each.
  void absorb(const std::vector<at::Tensor>& values, const at::Tensor& message, double alpha,
              double new_weight) const;
  // Whether the message's values hold no NaN or Inf: from the block scales alone where a part is
  // block-quantized (a block holding one has a NaN scale), else one reduction over the values.
  bool values_finite(const at::Tensor& message) const;

  static double weight_of(const at::Tensor& message);
  static int64_t round_of(const at::Tensor& message);
  static double aux_of(const at::Tensor& message);

 private:
  enum class Travel { kOwn, kSixteenBits, kBlocks };
  struct Slot {
    Travel travel;
    int64_t offset;  // in the message
    int64_t bytes;
  };
  // The bytes of part p's body, on the codec's device.
  at::Tensor body(const at::Tensor& message, size_t p) const;

  std::vector<Part> parts_;
  std::optional<at::ScalarType> message_dtype_;
  std::optional<BlockFormat> format_;
  c10::Device device_;
  std::vector<Slot> slots_;
  int64_t nbytes_ = 0;
};

}  // namespace gossip
