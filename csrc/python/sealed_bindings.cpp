#include "python/sealed_bindings.h"

#include <map>
#include <memory>
#include <string>
#include <utility>

#include <pybind11/stl.h>

#include "common/error.h"
#include "transport/sealed/sealed_transport.h"

namespace py = pybind11;

namespace gossip {

void bind_sealed_transport(py::module_& m) {
  py::class_<SealedTransport, Transport, std::shared_ptr<SealedTransport>>(m, "SealedTransport")
      .def(py::init([](std::shared_ptr<Transport> inner,
                       const std::map<int, std::pair<py::bytes, py::bytes>>& keys, bool encrypt) {
             std::map<int, LinkKeys> links;
             for (const auto& [peer, pair] : keys) {
               const std::string send = pair.first, receive = pair.second;
               links[peer] = {{send.begin(), send.end()}, {receive.begin(), receive.end()}};
             }
             return std::make_shared<SealedTransport>(std::move(inner), std::move(links),
                                                      encrypt);
           }),
           py::arg("inner"), py::arg("keys"), py::arg("encrypt") = false,
           "Seals every message of `inner` on the wire (AES-256-GCM: Note [Sealed messages] in "
           "csrc/transport/sealed/sealed_transport.h): `keys` maps each peer to (the key of this "
           "rank's messages to it, the key of its messages to this rank), 32 bytes each; "
           "`encrypt` encrypts the bodies too.")
      .def_readonly_static("TRAILER_BYTES", &SealedTransport::kTrailerBytes);
}

}  // namespace gossip
