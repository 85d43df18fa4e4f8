// How the Python layer names a message type: a 16-bit torch.dtype, torch.float8_e4m3fn, the name
// of a block format ("int8", "int4", "float8_e4m3fn"), or None for full precision. Shared by the
// bindings of every engine's options.
#pragma once

#include <optional>
#include <string>

#include <pybind11/pybind11.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/utils/pybind.h>

#include "kernels/block_format.h"
#include "kernels/push_sum.h"

namespace gossip {

struct MessageType {
  std::optional<at::ScalarType> dtype;   // a 16-bit dtype
  std::optional<BlockFormat> format;     // a block format
};

// `what` names the options class in the errors.
inline MessageType parse_message_type(const pybind11::object& message_dtype, const char* what) {
  MessageType type;
  if (pybind11::isinstance<pybind11::str>(message_dtype)) {
    type.format = parse_block_format(message_dtype.cast<std::string>(), "message_dtype");
  } else if (!message_dtype.is_none()) {
    TORCH_CHECK_TYPE(THPDtype_Check(message_dtype.ptr()), "gossip_ext: ", what,
                     ": message_dtype must be a torch.dtype, a block format's name or None, got ",
                     pybind11::str(pybind11::type::of(message_dtype)).cast<std::string>());
    const auto dtype = message_dtype.cast<at::ScalarType>();
    if (dtype == at::kFloat8_e4m3fn) {
      type.format = BlockFormat::kFloat8E4M3;
    } else {
      type.dtype = dtype;
    }
  }
  return type;
}

}  // namespace gossip
