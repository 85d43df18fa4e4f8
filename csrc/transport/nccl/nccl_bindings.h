// Registers gossip_ext._C.NcclTransport (CUDA builds only).
#pragma once

#include <pybind11/pybind11.h>

namespace gossip {

void bind_nccl_transport(pybind11::module_& m);

}  // namespace gossip
