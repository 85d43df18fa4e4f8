// Python binding of the NCCL transport, registered by bindings.cpp in CUDA builds.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <limits>

#include "common/error.h"
#include "common/limits.h"
#include "transport/nccl/nccl_bindings.h"
#include "transport/nccl/nccl_transport.h"

namespace gossip {

void bind_nccl_transport(pybind11::module_& m) {
  namespace py = pybind11;
  // Its destructor joins the watchdog thread, which never takes the GIL.
  py::class_<NcclTransport, Transport, std::shared_ptr<NcclTransport>>(m, "NcclTransport")
      .def(py::init([](c10::intrusive_ptr<c10d::Store> store, const std::string& key, int rank,
                       int world_size, int device_index, std::chrono::milliseconds timeout) {
             // Checked before the constructor, whose members take a stream of the device and
             // size a table by the world size before its body could check them.
             GOSSIP_CHECK_ARG(store, "NcclTransport: store must be a c10d Store, got None");
             GOSSIP_CHECK_ARG(world_size >= 1 && world_size <= kMaxWorldSize,
                              "NcclTransport: world_size must be in [1, ", kMaxWorldSize,
                              "], got ", world_size);
             GOSSIP_CHECK_ARG(rank >= 0 && rank < world_size,
                              "NcclTransport: rank must be in [0, world_size), got rank ", rank,
                              " and world_size ", world_size);
             // c10::DeviceIndex is 8 bits: a larger index would wrap to another device.
             GOSSIP_CHECK_ARG(device_index >= 0 &&
                                  device_index <= std::numeric_limits<c10::DeviceIndex>::max(),
                              "NcclTransport: device_index must be in [0, ",
                              static_cast<int>(std::numeric_limits<c10::DeviceIndex>::max()),
                              "], got ", device_index);
             check_timeout(timeout, "NcclTransport");
             return std::make_shared<NcclTransport>(
                 std::move(store), key, rank, world_size,
                 c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index)),
                 timeout);
           }),
           py::arg("store"), py::arg("key"), py::arg("rank"), py::arg("world_size"),
           py::arg("device_index"), py::arg("timeout"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace gossip
