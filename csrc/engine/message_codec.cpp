#include "engine/message_codec.h"

#include <cmath>
#include <cstring>

#include <ATen/ATen.h>

#include "common/error.h"
#include "kernels/push_sum.h"
#include "transport/mailbox/mailbox.h"

namespace gossip {
namespace {

int64_t aligned_to(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

bool travels_compressed_if_asked(at::ScalarType dtype) { return dtype == at::kFloat || dtype == at::kDouble; }

template <typename T>
T read_header_field(const at::Tensor& message, int64_t offset) {
  TORCH_CHECK_VALUE(message.device().is_cpu() && message.scalar_type() == at::kByte &&
                        message.is_contiguous() && message.numel() >= MessageHeader::kBytes,
                    "gossip_ext: an asynchronous message must be a contiguous host uint8 tensor "
                    "of at least ", MessageHeader::kBytes, " bytes");
  T value;
  std::memcpy(&value, message.data_ptr<uint8_t>() + offset, sizeof(T));
  return value;
}

}  // namespace

MessageCodec::MessageCodec(std::vector<Part> parts, std::optional<at::ScalarType> message_dtype,
                           std::optional<BlockFormat> format, c10::Device device)
    : parts_(std::move(parts)), message_dtype_(message_dtype), format_(format), device_(device) {
  GOSSIP_CHECK_ARG(!parts_.empty(), "gossip_ext: MessageCodec: parts must not be empty");
  GOSSIP_CHECK_ARG(!message_dtype_ || *message_dtype_ == at::kHalf ||
                       *message_dtype_ == at::kBFloat16,
                   "gossip_ext: message_dtype must be torch.float16 or torch.bfloat16 (or None "
                   "for full precision), got ",
                   message_dtype_ ? c10::toString(*message_dtype_) : "None");
  GOSSIP_CHECK_ARG(!message_dtype_ || !format_,
                   "gossip_ext: message_dtype and message_format exclude each other");
  int64_t offset = MessageHeader::kBytes;
  for (size_t p = 0; p < parts_.size(); ++p) {
    const Part& part = parts_[p];
    GOSSIP_CHECK_ARG(part.numel >= 0, "gossip_ext: MessageCodec: part ", p,
                     " has numel ", part.numel);
    GOSSIP_CHECK_ARG(at::isFloatingType(part.dtype), "gossip_ext: MessageCodec: part ", p,
                     " must be of a floating dtype, got ", c10::toString(part.dtype));
    Slot slot{Travel::kOwn, aligned_to(offset, 8), 0};
    if (travels_compressed_if_asked(part.dtype) && format_) {
      slot.travel = Travel::kBlocks;
      slot.bytes = quant_message_bytes(part.numel, *format_);
    } else if (travels_compressed_if_asked(part.dtype) && message_dtype_) {
      slot.travel = Travel::kSixteenBits;
      slot.bytes = part.numel * 2;
    } else {
      slot.bytes = part.numel * static_cast<int64_t>(c10::elementSize(part.dtype));
    }
    offset = slot.offset + slot.bytes;
    slots_.push_back(slot);
  }
  nbytes_ = offset;
}

bool MessageCodec::lossless() const {
  for (const Slot& slot : slots_) {
    if (slot.travel != Travel::kOwn) return false;
  }
  return true;
}

at::Tensor MessageCodec::body(const at::Tensor& message, size_t p) const {
  at::Tensor bytes = message.narrow(0, slots_[p].offset, slots_[p].bytes);
  return device_.is_cpu() ? bytes : bytes.to(device_, /*non_blocking=*/false);
}

at::Tensor MessageCodec::encode(const std::vector<at::Tensor>& values, double weight,
                                int64_t round, double aux, double feedback) const {
  GOSSIP_INTERNAL_ASSERT(values.size() == parts_.size());
  at::Tensor message = at::empty({nbytes_}, at::kByte);
  uint8_t* head = message.data_ptr<uint8_t>();
  std::memset(head, 0, static_cast<size_t>(nbytes_));  // the padding goes out as zeros
  std::memcpy(head + MessageHeader::kWeightOffset, &weight, sizeof(weight));
  std::memcpy(head + MessageHeader::kRoundOffset, &round, sizeof(round));
  std::memcpy(head + MessageHeader::kAuxOffset, &aux, sizeof(aux));
  for (size_t p = 0; p < parts_.size(); ++p) {
    const Slot& slot = slots_[p];
    at::Tensor host = message.narrow(0, slot.offset, slot.bytes);
    at::Tensor out = device_.is_cpu() ? host : at::empty({slot.bytes}, host.options().device(device_));
    switch (slot.travel) {
      case Travel::kOwn:
        out.view(parts_[p].dtype).copy_(values[p]);
        break;
      case Travel::kSixteenBits:
        ops::compress_into_(values[p], out.view(*message_dtype_), 1.0, std::nullopt, feedback);
        break;
      case Travel::kBlocks:
        ops::quantize_into_(values[p], out, block_format_name(*format_), 1.0, std::nullopt,
                            feedback);
        break;
    }
    // Waits for the kernel: the bytes must be whole before the transport sends them.
    if (!device_.is_cpu()) host.copy_(out);
  }
  return message;
}

std::vector<at::Tensor> MessageCodec::read(const at::Tensor& message) const {
  std::vector<at::Tensor> values;
  for (size_t p = 0; p < parts_.size(); ++p) {
    at::Tensor bytes = body(message, p);
    switch (slots_[p].travel) {
      case Travel::kOwn:
        values.push_back(bytes.view(parts_[p].dtype));
        break;
      case Travel::kSixteenBits:
        values.push_back(bytes.view(*message_dtype_).to(parts_[p].dtype));
        break;
      case Travel::kBlocks: {
        at::Tensor read = at::zeros({parts_[p].numel}, bytes.options().dtype(parts_[p].dtype));
        ops::absorb_quantized_(read, {bytes}, block_format_name(*format_), 1.0, std::nullopt,
                               std::nullopt);
        values.push_back(read);
        break;
      }
    }
  }
  return values;
}

void MessageCodec::absorb(const std::vector<at::Tensor>& values, const at::Tensor& message,
                          double alpha, double new_weight) const {
  GOSSIP_INTERNAL_ASSERT(values.size() == parts_.size());
  const at::Tensor divisor = at::full({1}, new_weight, at::TensorOptions(at::kDouble).device(device_));
  for (size_t p = 0; p < parts_.size(); ++p) {
    at::Tensor bytes = body(message, p);
    switch (slots_[p].travel) {
      case Travel::kOwn:
        ops::absorb_(values[p], {bytes.view(parts_[p].dtype)}, alpha, std::nullopt, divisor);
        break;
      case Travel::kSixteenBits:
        ops::absorb_(values[p], {bytes.view(*message_dtype_)}, alpha, std::nullopt, divisor);
        break;
      case Travel::kBlocks:
        ops::absorb_quantized_(values[p], {bytes}, block_format_name(*format_), alpha,
                               std::nullopt, divisor);
        break;
    }
  }
}

bool MessageCodec::values_finite(const at::Tensor& message) const {
  for (size_t p = 0; p < parts_.size(); ++p) {
    const Slot& slot = slots_[p];
    at::Tensor bytes = message.narrow(0, slot.offset, slot.bytes);  // read on the host
    if (slot.travel == Travel::kBlocks) {
      const int64_t blocks = quant_blocks(parts_[p].numel);
      if (!at::isfinite(bytes.narrow(0, 0, 4 * blocks).view(at::kFloat)).all().item<bool>()) {
        return false;
      }
      continue;
    }
    const at::ScalarType dtype =
        slot.travel == Travel::kSixteenBits ? *message_dtype_ : parts_[p].dtype;
    // A float64 sum of 32- or 16-bit values cannot overflow (of float64 ones only near 1e300):
    // one reduction a NaN or an Inf turns to one.
    if (!std::isfinite(bytes.view(dtype).sum(at::kDouble).item<double>())) return false;
  }
  return true;
}

double MessageCodec::weight_of(const at::Tensor& message) {
  return read_header_field<double>(message, MessageHeader::kWeightOffset);
}

int64_t MessageCodec::round_of(const at::Tensor& message) {
  return read_header_field<int64_t>(message, MessageHeader::kRoundOffset);
}

double MessageCodec::aux_of(const at::Tensor& message) {
  return read_header_field<double>(message, MessageHeader::kAuxOffset);
}

}  // namespace gossip
