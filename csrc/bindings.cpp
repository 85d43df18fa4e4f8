// The Python module gossip_ext._C. Thin: argument conversion only; the Python package builds the
// user-facing API on top. The torch ops (torch.ops.gossip_ext.*) register themselves when this
// library loads.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <string>

#include "common/error.h"
#include "common/limits.h"
#include "engine/flat_parameters.h"
#include "engine/gossip_engine.h"
#include "engine/simulate.h"
#include "kernels/push_sum.h"
#include "python/async_bindings.h"
#ifdef GOSSIP_WITH_OPENSSL
#include "python/sealed_bindings.h"
#endif
#include "python/message_type.h"
#include "topology/graph.h"
#include "topology/mixing.h"
#include "transport/host_staging/host_staging_transport.h"
#include "transport/inproc/inproc_transport.h"
#include "transport/loopback/loopback_transport.h"
#include "transport/message_tags.h"
#include "transport/process_group/liveness.h"
#include "transport/process_group/process_group_transport.h"
#ifdef GOSSIP_WITH_CUDA
#include "transport/nccl/nccl_bindings.h"
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

// torch.__version__ of the torch this module is compiled against, as a string literal: setup.py
// defines it. gossip_ext/_torch_check.py refuses to run the module under any other torch.
#ifndef GOSSIP_EXT_TORCH_VERSION
#error "GOSSIP_EXT_TORCH_VERSION is not defined: build gossip_ext._C with setup.py"
#endif

namespace py = pybind11;

namespace gossip {
namespace {

std::string built_with_torch() { return GOSSIP_EXT_TORCH_VERSION; }

// What this module was compiled with, for gossip_ext.info: the torch, and in a CUDA build the CUDA
// runtime, NCCL and the GPU architectures of its kernels (None in a CPU build).
py::dict build_info() {
  py::dict info;
  info["torch"] = std::string(GOSSIP_EXT_TORCH_VERSION);
#ifdef GOSSIP_WITH_CUDA
  info["cuda"] =
      std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
  info["nccl"] = std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR) + "." +
                 std::to_string(NCCL_PATCH);
  info["cuda_archs"] = std::string(GOSSIP_EXT_CUDA_ARCHS);
#else
  info["cuda"] = py::none();
  info["nccl"] = py::none();
  info["cuda_archs"] = py::none();
#endif
#ifdef GOSSIP_WITH_OPENSSL
  info["sealed_messages"] = true;  // csrc/transport/sealed: AES-256-GCM from libcrypto
#else
  info["sealed_messages"] = false;
#endif
  return info;
}

// Raises gossip_ext.errors.<name> with the message of `error` and its PeerFailure as the
// attributes (peers, round, transport, and timeout where one passed). If that class cannot be had
// (the interpreter is finalizing), the built-in `fallback` with the message.
void raise_peer_failure(const char* name, PyObject* fallback, const std::exception& error,
                        const PeerFailure& failure) {
  try {
    const py::object type = py::module_::import("gossip_ext.errors").attr(name);
    py::dict attributes;
    attributes["peers"] = py::tuple(py::cast(failure.peers));
    attributes["round"] = py::cast(failure.round);
    if (!failure.transport.empty()) attributes["transport"] = failure.transport;
    if (failure.timeout) attributes["timeout"] = *failure.timeout;  // a datetime.timedelta
    const py::object raised = type(error.what(), **attributes);
    PyErr_SetObject(type.ptr(), raised.ptr());
  } catch (const py::error_already_set&) {
    PyErr_SetString(fallback, error.what());
  }
}

void translate_peer_failures(std::exception_ptr error) {
  try {
    if (error) std::rethrow_exception(error);
  } catch (const TimeoutError& e) {
    raise_peer_failure("PeerTimeoutError", PyExc_TimeoutError, e, e.failure());
  } catch (const NonFiniteError& e) {
    raise_peer_failure("NonFiniteError", PyExc_FloatingPointError, e, e.failure());
  }
}

// Every entry below refuses what it cannot take with a TypeError or ValueError naming the argument
// (tests/test_bindings_refuse.py holds a case for each). pybind11 refuses a wrong type, and None
// for an argument taken by value, before the call; None for a smart pointer arrives as a null
// pointer, which the constructors taking one check. Sizes, ranks and
// timeouts are bounded where the C++ class takes them (common/limits.h); what only the binding
// sees (the messages of Transport.exchange, a Work's timeout) is checked here.

// A message's peer must be a rank of the transport's world, and its buffer contiguous: every
// transport sends a buffer's memory as it lies (gloo and NCCL refuse a strided one, and the
// process-group transport would report that as a peer failure).
std::vector<PeerMessage> checked_messages(const Transport& transport,
                                          const std::vector<std::pair<int, at::Tensor>>& pairs,
                                          const char* arg) {
  std::vector<PeerMessage> messages;
  const int world_size = transport.world_size();
  for (size_t i = 0; i < pairs.size(); ++i) {
    const auto& [peer, buffer] = pairs[i];
    TORCH_CHECK_VALUE(peer >= 0 && peer < world_size, "gossip_ext: Transport.exchange: ", arg, "[",
                      i, "] has peer ", peer, ", outside [0, ", world_size, ")");
    TORCH_CHECK_VALUE(buffer.is_contiguous(), "gossip_ext: Transport.exchange: ", arg, "[", i,
                      "] must be a contiguous tensor");
    messages.push_back({peer, buffer});
  }
  return messages;
}

void bind_topology(py::module_& m) {
  py::enum_<GraphKind>(m, "GraphKind")
      .value("NPeerDynamicDirectedExponential", GraphKind::kNPeerDynamicDirectedExponential)
      .value("DynamicDirectedExponential", GraphKind::kDynamicDirectedExponential)
      .value("DynamicBipartiteExponential", GraphKind::kDynamicBipartiteExponential)
      .value("DynamicDirectedLinear", GraphKind::kDynamicDirectedLinear)
      .value("DynamicBipartiteLinear", GraphKind::kDynamicBipartiteLinear)
      .value("Ring", GraphKind::kRing)
      .value("Hypercube", GraphKind::kHypercube)
      .value("Custom", GraphKind::kCustom);

  py::class_<GraphOptions>(m, "GraphOptions")
      .def(py::init([](GraphKind kind, int peers_per_itr,
                       std::vector<std::vector<int>> phone_books) {
             GraphOptions options{kind, peers_per_itr, std::move(phone_books)};
             validate(options);
             return options;
           }),
           py::arg("kind"), py::arg("peers_per_itr") = 1,
           py::arg("phone_books") = std::vector<std::vector<int>>{})
      .def_readonly("kind", &GraphOptions::kind)
      .def_readonly("peers_per_itr", &GraphOptions::peers_per_itr)
      .def_readonly("phone_books", &GraphOptions::phone_books);

  py::class_<Graph>(m, "Graph")
      .def(py::init<GraphOptions, int>(), py::arg("options"), py::arg("world_size"))
      .def_property_readonly("world_size", &Graph::world_size)
      .def_property_readonly("period", &Graph::period)
      .def_property_readonly("is_regular", &Graph::is_regular)
      .def_property_readonly("is_bipartite", &Graph::is_bipartite)
      .def_property_readonly("is_dynamic", &Graph::is_dynamic)
      .def_property_readonly("pairs_symmetrically", &Graph::pairs_symmetrically)
      .def("phone_book", &Graph::phone_book, py::arg("rank"))
      .def("out_peers", &Graph::out_peers, py::arg("rank"), py::arg("round"))
      .def("in_peers", &Graph::in_peers, py::arg("rank"), py::arg("round"));

  py::enum_<MixingKind>(m, "MixingKind")
      .value("Uniform", MixingKind::kUniform)
      .value("SelfWeight", MixingKind::kSelfWeight);

  py::class_<MixingOptions>(m, "MixingOptions")
      .def(py::init([](MixingKind kind, double self_weight) {
             MixingOptions options{kind, self_weight};
             validate(options);
             return options;
           }),
           py::arg("kind"), py::arg("self_weight") = 0.5)
      .def_readonly("kind", &MixingOptions::kind)
      .def_readonly("self_weight", &MixingOptions::self_weight);

  m.def(
      "mixing_weights",
      [](const MixingOptions& options, int num_out_peers) {
        const MixingWeights w = mixing_weights(options, num_out_peers);
        return py::make_tuple(w.self_weight, w.peer_weight);
      },
      py::arg("options"), py::arg("num_out_peers"));
}

void bind_engine(py::module_& m) {
  py::class_<EngineOptions>(m, "EngineOptions")
      .def(py::init([](GraphOptions graph, MixingOptions mixing, bool push_sum,
                       bool allow_lazy_mixing, bool synchronous,
                       std::chrono::milliseconds timeout, bool check_finite,
                       const py::object& message_dtype) {
             check_timeout(timeout, "gossip_ext: EngineOptions");
             EngineOptions options{std::move(graph), mixing,      push_sum, allow_lazy_mixing,
                                   synchronous,      timeout,     check_finite};
             const MessageType type = parse_message_type(message_dtype, "EngineOptions");
             options.message_dtype = type.dtype;
             options.message_format = type.format;
             return options;
           }),
           py::arg("graph"), py::arg("mixing"), py::arg("push_sum") = true,
           py::arg("allow_lazy_mixing") = true, py::arg("synchronous") = false,
           py::arg("timeout") = std::chrono::milliseconds(std::chrono::minutes(5)),
           py::arg("check_finite") = true, py::arg("message_dtype") = py::none());

  py::class_<Work, std::shared_ptr<Work>>(m, "Work")
      .def("is_completed", &Work::is_completed, py::call_guard<py::gil_scoped_release>())
      .def(
          "wait",
          [](Work& work, std::chrono::milliseconds timeout) {
            check_timeout(timeout, "gossip_ext: Work.wait", "timeout", /*may_be_zero=*/true);
            work.wait(timeout);
          },
          py::arg("timeout"), py::call_guard<py::gil_scoped_release>())
      .def(
          "synchronize",
          [](Work& work, std::chrono::milliseconds timeout) {
            check_timeout(timeout, "gossip_ext: Work.synchronize", "timeout",
                          /*may_be_zero=*/true);
            work.synchronize(timeout);
          },
          py::arg("timeout"), py::call_guard<py::gil_scoped_release>());

  py::class_<Transport, std::shared_ptr<Transport>>(m, "Transport")
      .def_property_readonly("rank", &Transport::rank)
      .def_property_readonly("world_size", &Transport::world_size)
      .def_property_readonly("name", &Transport::name)
      .def(
          "connect_peers",
          [](Transport& transport, const std::vector<int>& peers) {
            for (size_t i = 0; i < peers.size(); ++i) {
              TORCH_CHECK_VALUE(peers[i] >= 0 && peers[i] < transport.world_size(),
                                "gossip_ext: Transport.connect_peers: peers[", i, "] is ",
                                peers[i], ", outside [0, ", transport.world_size(), ")");
            }
            transport.connect_peers(peers);
          },
          py::arg("peers"), py::call_guard<py::gil_scoped_release>())
      .def("abandon", &Transport::abandon, py::arg("why"),
           py::call_guard<py::gil_scoped_release>())
      // One round of raw messages, (peer, tensor) pairs, as the engine posts them: for tests that
      // drive a transport directly (a receive from self whose send never comes, say).
      .def(
          "exchange",
          [](Transport& transport, const std::vector<std::pair<int, at::Tensor>>& sends,
             const std::vector<std::pair<int, at::Tensor>>& recvs, int64_t round) {
            TORCH_CHECK_VALUE(round >= 0,
                              "gossip_ext: Transport.exchange: round must be >= 0, got ", round);
            return transport.exchange(checked_messages(transport, sends, "sends"),
                                      checked_messages(transport, recvs, "recvs"), round);
          },
          py::arg("sends"), py::arg("recvs"), py::arg("round"),
          py::call_guard<py::gil_scoped_release>());

  py::class_<InProcHub, std::shared_ptr<InProcHub>>(m, "InProcHub")
      .def(py::init<int>(), py::arg("world_size"))
      .def_property_readonly("world_size", &InProcHub::world_size)
      // Wakes every rank blocked on the hub with `reason`: a failing thread calls it so that
      // the others stop at once instead of waiting for their timeout.
      .def("abort", &InProcHub::abort, py::arg("reason"));

  py::class_<InProcTransport, Transport, std::shared_ptr<InProcTransport>>(m, "InProcTransport")
      .def(py::init<std::shared_ptr<InProcHub>, int>(), py::arg("hub"), py::arg("rank"));

  // Its destructor joins the progress thread, which never takes the GIL.
  py::class_<ProcessGroupTransport, Transport, std::shared_ptr<ProcessGroupTransport>>(
      m, "ProcessGroupTransport")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>>(), py::arg("process_group"));

  // Note [A silence is confirmed over the group] (transport/process_group/liveness.h).
  py::class_<LivenessResponder, std::shared_ptr<LivenessResponder>>(m, "LivenessResponder")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>>(), py::arg("process_group"))
      // By reference: None for `self` is refused (a member pointer would take it as null).
      .def(
          "close", [](LivenessResponder& responder) { responder.close(); },
          py::call_guard<py::gil_scoped_release>());
  m.def("ping", &ping, py::arg("process_group"), py::arg("peer"), py::arg("timeout"),
        py::call_guard<py::gil_scoped_release>(),
        "Whether `peer` of `process_group` answers a ping within `timeout` (its "
        "LivenessResponder): Note [A silence is confirmed over the group].");

  py::class_<HostStagingTransport, Transport, std::shared_ptr<HostStagingTransport>>(
      m, "HostStagingTransport")
      .def(py::init<std::shared_ptr<Transport>>(), py::arg("inner"));

  // Tests: one process plays a rank of a larger world over a transport of world size one.
  py::class_<LoopbackTransport, Transport, std::shared_ptr<LoopbackTransport>>(
      m, "LoopbackTransport")
      .def(py::init<std::shared_ptr<Transport>, int, int>(), py::arg("inner"), py::arg("rank"),
           py::arg("world_size"))
      .def("drop_sends", &LoopbackTransport::drop_sends, py::arg("count"));

  py::class_<GossipEngine>(m, "GossipEngine")
      .def(py::init<const std::vector<at::Tensor>&, const std::vector<std::string>&,
                    std::shared_ptr<Transport>, EngineOptions>(),
           py::arg("params"), py::arg("names"), py::arg("transport"), py::arg("options"))
      .def("start_round", &GossipEngine::start_round, py::call_guard<py::gil_scoped_release>())
      .def("finish_round", &GossipEngine::finish_round, py::call_guard<py::gil_scoped_release>())
      .def("try_finish_round", &GossipEngine::try_finish_round,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("in_flight", &GossipEngine::in_flight)
      .def("synchronize", &GossipEngine::synchronize, py::call_guard<py::gil_scoped_release>())
      // Every round is absorbed whole, from every in-peer, by the call that finishes it: once the
      // round in flight is, nothing of this worker's gossip is on its way (the engine interface's
      // settle, gossip_ext/gossip/engine.py).
      .def("settle", &GossipEngine::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("raise_if_failed", &GossipEngine::raise_if_failed)
      .def("abandon", &GossipEngine::abandon, py::arg("why"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("round", &GossipEngine::round)
      .def_property_readonly("lazy_mixing", &GossipEngine::lazy_mixing)
      .def_property_readonly("bytes_sent", &GossipEngine::bytes_sent)
      .def_property_readonly("message_bytes", &GossipEngine::message_bytes)
      .def_property_readonly("rank", &GossipEngine::rank)
      .def_property_readonly("world_size", &GossipEngine::world_size)
      .def("flat_buffers",
           [](const GossipEngine& engine) {
             std::vector<at::Tensor> flats;
             for (const FlatParameterGroup& group : engine.groups()) flats.push_back(group.flat);
             return flats;
           })
      .def("ps_weight", &GossipEngine::ps_weight)
      .def("ps_numerators", &GossipEngine::ps_numerators)
      .def("kept_ps_weight", &GossipEngine::kept_ps_weight)
      .def("restore", &GossipEngine::restore, py::arg("round"), py::arg("ps_weight"))
      .def("set_peers_per_itr", &GossipEngine::set_peers_per_itr, py::arg("peers_per_itr"));

  m.def("simulate", &simulate, py::arg("values"), py::arg("rounds"), py::arg("options"),
        py::call_guard<py::gil_scoped_release>());
  m.def("cpu_kernels_isa", &cpu_kernels_isa);
  m.def("quantized_message_bytes", &quantized_message_bytes, py::arg("numel"), py::arg("format"));
  // What the engine's flattening refuses (flat_parameters.h), asked before anything is
  // communicated, so that every rank refuses parameters that overlap, not only those that build
  // an engine.
  m.def("check_disjoint_parameters", &check_disjoint_parameters, py::arg("params"),
        py::arg("names"));
}


}  // namespace
}  // namespace gossip

PYBIND11_MODULE(_C, m) {
  m.doc() = "gossip_ext compiled engine (see the gossip_ext package for the public API)";
  py::register_exception_translator(&gossip::translate_peer_failures);
  m.def("built_with_torch", &gossip::built_with_torch,
        "torch.__version__ of the torch this module was compiled against");
  m.def("build_info", &gossip::build_info,
        "what this module was compiled with: torch, and CUDA, NCCL and GPU architectures");
  gossip::bind_topology(m);
  gossip::bind_engine(m);
  gossip::bind_asynchronous(m);
#ifdef GOSSIP_WITH_OPENSSL
  // Sealed messages exist only where libcrypto was found at build time (tools/sources.py).
  gossip::bind_sealed_transport(m);
#endif
  // The tag registry (transport/message_tags.h): each kind of message's range, [base, base + span).
  py::dict tags;
  tags["round"] = py::make_tuple(gossip::tags::kRoundBase, gossip::tags::kRoundSpan);
  tags["outer_exchange"] =
      py::make_tuple(gossip::tags::kOuterExchangeBase, gossip::tags::kOuterExchangeSpan);
  tags["liveness"] = py::make_tuple(gossip::tags::kLivenessBase, gossip::tags::kLivenessSpan);
  tags["mailbox"] = py::make_tuple(gossip::tags::kMailboxBase, gossip::tags::kMailboxSpan);
  tags["mailbox_sequence_bits"] = gossip::tags::kMailboxSequenceBits;
  m.attr("MESSAGE_TAGS") = tags;
#ifdef GOSSIP_WITH_CUDA
  // The one backend switch of the module: the NCCL transport exists only in CUDA builds.
  gossip::bind_nccl_transport(m);
#endif
}
