// Registers gossip_ext._C.SealedTransport (builds with OpenSSL's libcrypto only: tools/sources.py).
#pragma once

#include <pybind11/pybind11.h>

namespace gossip {

void bind_sealed_transport(pybind11::module_& m);

}  // namespace gossip
