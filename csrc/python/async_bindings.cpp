#include "python/async_bindings.h"

#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <string>

#include "common/error.h"
#include "common/limits.h"
#include "engine/async_push_sum.h"
#include "engine/message_codec.h"
#include "python/message_type.h"
#include "transport/mailbox/departures.h"
#include "transport/mailbox/mailbox.h"
#include "transport/message_tags.h"

namespace py = pybind11;

namespace gossip {
namespace {

// The channels of asynchronous gossip (transport/mailbox). Every call that can wait releases the
// interpreter's lock: the channels' own threads never take it. Methods take their object by
// reference, so that None for self is refused (as a pointer it would arrive as null).
void bind_mailboxes(py::module_& m) {
  using Release = py::call_guard<py::gil_scoped_release>;
  py::class_<Departures, std::shared_ptr<Departures>>(m, "Departures")
      .def(py::init<c10::intrusive_ptr<c10d::Store>, std::optional<int>,
                    std::chrono::milliseconds>(),
           py::arg("store"), py::arg("rank") = py::none(),
           py::arg("leave_grace") = Departures::kLeaveGrace)
      .def(
          "announce", [](Departures& d, int rank) { d.announce(rank); }, py::arg("rank"),
          Release())
      .def(
          "has_left", [](const Departures& d, int rank) { return d.has_left(rank); },
          py::arg("rank"), Release())
      .def_property_readonly("rank", [](const Departures& d) { return d.rank(); });

  py::class_<PeerChannel, std::shared_ptr<PeerChannel>>(m, "PeerChannel")
      .def_property_readonly("peer", [](const PeerChannel& c) { return c.peer(); })
      .def_property_readonly("ended", [](const PeerChannel& c) { return c.ended(); })
      .def("raise_if_failed", [](const PeerChannel& c) { c.raise_if_failed(); })
      // It may ask the store whether the peer left: without the interpreter's lock.
      .def("check_silence", [](PeerChannel& c) { c.check_silence(); }, Release())
      .def(
          "fail",
          [](PeerChannel& c, const std::string& why, std::optional<int64_t> round) {
            c.fail(why, round);
          },
          py::arg("why"), py::arg("round"), Release())
      .def("close", [](PeerChannel& c) { c.close(); }, Release());

  py::class_<Mailbox, PeerChannel, std::shared_ptr<Mailbox>>(m, "Mailbox")
      .def(py::init<std::shared_ptr<Transport>, std::shared_ptr<Departures>, int, int64_t,
                    std::chrono::milliseconds, int64_t, std::vector<bool>, int64_t,
                    std::optional<int64_t>>(),
           py::arg("transport"), py::arg("departures"), py::arg("peer"), py::arg("generation"),
           py::arg("timeout"), py::arg("nbytes"), py::arg("sends_in_round"), py::arg("start"),
           py::arg("held_limit") = py::none())
      .def(
          "take",
          [](Mailbox& box, std::optional<int64_t> through) {
            std::vector<Mailbox::Arrived> taken;
            {
              py::gil_scoped_release release;
              taken = box.take(through);
            }
            std::vector<std::pair<int64_t, at::Tensor>> pairs;
            for (Mailbox::Arrived& a : taken) pairs.emplace_back(a.round, std::move(a.message));
            return pairs;
          },
          py::arg("through") = py::none())
      .def("arrival_times", [](const Mailbox& box) { return box.arrival_times(); })
      .def(
          "wait_until_past", [](Mailbox& box, int64_t round) { box.wait_until_past(round); },
          py::arg("round"), Release())
      .def(
          "wait_for", [](Mailbox& box, int64_t count) { box.wait_for(count); }, py::arg("count"),
          Release())
      .def(
          "wait_for_before",
          [](Mailbox& box, int64_t count, double seconds) {
            // Past the longest timeout is as good as never (and would overflow the clock).
            const double capped = std::clamp(
                seconds, 0.0, std::chrono::duration<double>(kMaxTimeout).count());
            return box.wait_for_before(count,
                                       std::chrono::duration_cast<std::chrono::nanoseconds>(
                                           std::chrono::duration<double>(capped)));
          },
          py::arg("count"), py::arg("seconds"), Release())
      .def_property_readonly("received", [](const Mailbox& box) { return box.received(); })
      .def_property_readonly("expected", [](const Mailbox& box) { return box.expected(); });

  py::class_<Outbox, PeerChannel, std::shared_ptr<Outbox>>(m, "Outbox")
      .def(py::init<std::shared_ptr<Transport>, std::shared_ptr<Departures>, int, int64_t,
                    std::chrono::milliseconds>(),
           py::arg("transport"), py::arg("departures"), py::arg("peer"), py::arg("generation"),
           py::arg("timeout"))
      .def(
          "post",
          [](Outbox& box, int64_t round, at::Tensor message) {
            return box.post(round, std::move(message));
          },
          py::arg("round"), py::arg("message"), Release())
      .def(
          "wait_until_past",
          [](Outbox& box, std::optional<int64_t> round) { box.wait_until_past(round); },
          py::arg("round") = py::none(), Release())
      .def_property_readonly("backlog", [](const Outbox& box) { return box.backlog(); })
      .def_property_readonly("sent", [](const Outbox& box) { return box.sent(); });

  m.def("mailbox_tag", &tags::mailbox_tag, py::arg("generation"), py::arg("sequence"));
  py::dict header;
  header["weight"] = MessageHeader::kWeightOffset;
  header["round"] = MessageHeader::kRoundOffset;
  header["aux"] = MessageHeader::kAuxOffset;
  header["bytes"] = MessageHeader::kBytes;
  m.attr("MESSAGE_HEADER") = header;
}

// The messages both asynchronous modes send (AsyncPushSum's inside the engine, AsyncDiLoCo's
// pseudo-gradients from the Python layer).
void bind_message_codec(py::module_& m) {
  py::class_<MessageCodec>(m, "MessageCodec")
      .def(py::init([](const std::vector<std::pair<int64_t, at::ScalarType>>& parts,
                       const py::object& message_dtype, const c10::Device& device) {
             std::vector<MessageCodec::Part> list;
             for (const auto& [numel, dtype] : parts) list.push_back({numel, dtype});
             const MessageType type = parse_message_type(message_dtype, "MessageCodec");
             return MessageCodec(std::move(list), type.dtype, type.format, device);
           }),
           py::arg("parts"), py::arg("message_dtype") = py::none(),
           py::arg("device") = c10::Device(c10::kCPU))
      .def_property_readonly("nbytes", [](const MessageCodec& c) { return c.nbytes(); })
      .def_property_readonly("lossless", [](const MessageCodec& c) { return c.lossless(); })
      .def(
          "encode",
          [](const MessageCodec& c, const std::vector<at::Tensor>& values, double weight,
             int64_t round, double aux, double feedback) {
            GOSSIP_CHECK_ARG(values.size() == c.parts().size(),
                             "gossip_ext: MessageCodec.encode: values must hold one tensor per "
                             "part (", c.parts().size(), "), got ", values.size());
            for (size_t p = 0; p < values.size(); ++p) {
              GOSSIP_CHECK_ARG(values[p].numel() == c.parts()[p].numel &&
                                   values[p].scalar_type() == c.parts()[p].dtype &&
                                   values[p].is_contiguous(),
                               "gossip_ext: MessageCodec.encode: values[", p,
                               "] must be contiguous with ", c.parts()[p].numel, " values of ",
                               c10::toString(c.parts()[p].dtype));
            }
            return c.encode(values, weight, round, aux, feedback);
          },
          py::arg("values"), py::arg("weight"), py::arg("round"), py::arg("aux") = 0.0,
          py::arg("feedback") = 0.0, py::call_guard<py::gil_scoped_release>())
      .def(
          "read",
          [](const MessageCodec& c, const at::Tensor& message) {
            GOSSIP_CHECK_ARG(message.numel() == c.nbytes(), "gossip_ext: MessageCodec.read: ",
                             "message must have ", c.nbytes(), " bytes, got ", message.numel());
            return c.read(message);
          },
          py::arg("message"), py::call_guard<py::gil_scoped_release>())
      .def(
          "absorb",
          [](const MessageCodec& c, const std::vector<at::Tensor>& values,
             const at::Tensor& message, double alpha, double new_weight) {
            GOSSIP_CHECK_ARG(values.size() == c.parts().size(),
                             "gossip_ext: MessageCodec.absorb: values must hold one tensor per "
                             "part (", c.parts().size(), "), got ", values.size());
            GOSSIP_CHECK_ARG(message.numel() == c.nbytes(), "gossip_ext: MessageCodec.absorb: ",
                             "message must have ", c.nbytes(), " bytes, got ", message.numel());
            c.absorb(values, message, alpha, new_weight);
          },
          py::arg("values"), py::arg("message"), py::arg("alpha"), py::arg("new_weight"),
          py::call_guard<py::gil_scoped_release>())
      .def(
          "values_finite",
          [](const MessageCodec& c, const at::Tensor& message) {
            GOSSIP_CHECK_ARG(message.numel() == c.nbytes(), "gossip_ext: MessageCodec.",
                             "values_finite: message must have ", c.nbytes(), " bytes, got ",
                             message.numel());
            return c.values_finite(message);
          },
          py::arg("message"), py::call_guard<py::gil_scoped_release>())
      .def_static("weight_of", &MessageCodec::weight_of, py::arg("message"))
      .def_static("round_of", &MessageCodec::round_of, py::arg("message"))
      .def_static("aux_of", &MessageCodec::aux_of, py::arg("message"));
}

// The engine. Its calls release the interpreter's lock, as GossipEngine's do: they may wait for
// a peer (a staleness bound, settle) or absorb a model.
void bind_async_engine(py::module_& m) {
  using Release = py::call_guard<py::gil_scoped_release>;
  py::class_<AsyncOptions>(m, "AsyncOptions")
      .def(py::init([](GraphOptions graph, std::optional<int64_t> staleness, bool check_finite,
                       std::chrono::milliseconds timeout, const py::object& message_dtype,
                       int64_t generation, bool record) {
             check_timeout(timeout, "gossip_ext: AsyncOptions");
             GOSSIP_CHECK_ARG(!staleness || *staleness >= 0,
                              "gossip_ext: AsyncOptions: staleness must be >= 0 or None, got ",
                              staleness.value_or(0));
             AsyncOptions options;
             options.graph = std::move(graph);
             options.staleness = staleness;
             options.check_finite = check_finite;
             options.timeout = timeout;
             const MessageType type = parse_message_type(message_dtype, "AsyncOptions");
             GOSSIP_CHECK_ARG(!type.dtype || *type.dtype == at::kHalf ||
                                  *type.dtype == at::kBFloat16,
                              "gossip_ext: AsyncOptions: message_dtype must be torch.float16, "
                              "torch.bfloat16, torch.float8_e4m3fn, a block format's name or "
                              "None, got ",
                              c10::toString(type.dtype.value_or(at::kHalf)));
             options.message_dtype = type.dtype;
             options.message_format = type.format;
             options.generation = generation;
             options.record = record;
             return options;
           }),
           py::arg("graph"), py::arg("staleness") = py::none(), py::arg("check_finite") = true,
           py::arg("timeout") = std::chrono::milliseconds(std::chrono::minutes(5)),
           py::arg("message_dtype") = py::none(), py::arg("generation") = 0,
           py::arg("record") = false);

  py::class_<AsyncPushSum>(m, "AsyncPushSum")
      .def(py::init<const std::vector<at::Tensor>&, const std::vector<std::string>&,
                    std::shared_ptr<Transport>, std::shared_ptr<Departures>, AsyncOptions>(),
           py::arg("params"), py::arg("names"), py::arg("transport"), py::arg("departures"),
           py::arg("options"))
      .def("start_round", [](AsyncPushSum& e) { e.start_round(); }, Release())
      .def("finish_round", [](AsyncPushSum& e) { e.finish_round(); }, Release())
      .def("sent_counts", [](const AsyncPushSum& e) { return e.sent_counts(); })
      .def(
          "settle",
          [](AsyncPushSum& e, const std::vector<int64_t>& sent_to_me) { e.settle(sent_to_me); },
          py::arg("sent_to_me"), Release())
      .def(
          "restore",
          [](AsyncPushSum& e, int64_t round, double weight, const std::vector<int64_t>& rounds) {
            e.restore(round, weight, rounds);
          },
          py::arg("round"), py::arg("ps_weight"), py::arg("rounds"), Release())
      .def(
          "abandon", [](AsyncPushSum& e, const std::string& why) { e.abandon(why); },
          py::arg("why"), Release())
      .def("raise_if_failed", [](const AsyncPushSum& e) { e.raise_if_failed(); })
      .def_property_readonly("round", [](const AsyncPushSum& e) { return e.round(); })
      .def_property_readonly("weight", [](const AsyncPushSum& e) { return e.weight(); })
      .def_property_readonly("bytes_sent", [](const AsyncPushSum& e) { return e.bytes_sent(); })
      .def_property_readonly("message_bytes",
                             [](const AsyncPushSum& e) { return e.message_bytes(); })
      .def_property_readonly("rank", [](const AsyncPushSum& e) { return e.rank(); })
      .def_property_readonly("world_size", [](const AsyncPushSum& e) { return e.world_size(); })
      .def("flat_buffers",
           [](const AsyncPushSum& e) {
             std::vector<at::Tensor> flats;
             for (const FlatParameterGroup& group : e.groups()) flats.push_back(group.flat);
             return flats;
           })
      .def("statistics",
           [](const AsyncPushSum& e) {
             const AsyncCounts& c = e.counts();
             py::dict counts;
             counts["scheduled"] = c.scheduled;
             counts["held_back"] = c.held_back;
             counts["sent"] = c.sent;
             counts["messages"] = c.messages;
             counts["mean_staleness"] =
                 c.messages ? static_cast<double>(c.staleness_sum) / c.messages : 0.0;
             counts["max_staleness"] = py::cast(c.staleness_max);
             return counts;
           })
      .def(
          "history",
          [](const AsyncPushSum& e, size_t start) {
        // ("send", round, peers) and ("absorb", ((sender, round), ...)), in order, from the
        // `start`-th event on.
        py::list events;
        const std::vector<AsyncEvent>& history = e.history();
        for (size_t i = std::min(start, history.size()); i < history.size(); ++i) {
          const AsyncEvent& event = history[i];
          if (event.is_send) {
            py::list peers;
            for (const auto& [peer, round] : event.messages) peers.append(peer);
            events.append(py::make_tuple("send", event.round, py::tuple(peers)));
          } else {
            py::list messages;
            for (const auto& [peer, round] : event.messages) {
              messages.append(py::make_tuple(peer, round));
            }
            events.append(py::make_tuple("absorb", py::tuple(messages)));
          }
        }
        return events;
      },
      py::arg("start") = 0);
}

}  // namespace

void bind_asynchronous(py::module_& m) {
  bind_mailboxes(m);
  bind_message_codec(m);
  bind_async_engine(m);
}

}  // namespace gossip
