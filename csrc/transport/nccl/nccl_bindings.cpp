// Python binding of the NCCL transport, registered by bindings.cpp in CUDA builds.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "transport/nccl/nccl_bindings.h"
#include "transport/nccl/nccl_transport.h"

namespace gossip {

void bind_nccl_transport(pybind11::module_& m) {
  namespace py = pybind11;
  // Its destructor joins the watchdog thread, which never takes the GIL.
  py::class_<NcclTransport, Transport, std::shared_ptr<NcclTransport>>(m, "NcclTransport")
      .def(py::init([](c10::intrusive_ptr<c10d::Store> store, const std::string& key, int rank,
                       int world_size, int device_index, std::chrono::milliseconds timeout) {
             return std::make_shared<NcclTransport>(
                 std::move(store), key, rank, world_size,
                 c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index)),
                 timeout);
           }),
           py::arg("store"), py::arg("key"), py::arg("rank"), py::arg("world_size"),
           py::arg("device_index"), py::arg("timeout"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace gossip
