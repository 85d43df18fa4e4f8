"""Every entry of gossip_ext._C refuses what it cannot take: None, a huge or negative size, a
wrong type, parameters that overlap in memory. Each is refused with a TypeError or ValueError whose
message names the argument (and the value, for a size), never a segfault, a hang or a run on
memory.

The cases run in child processes, so that a crash fails its case instead of killing pytest: a
child runs the cases in order and prints each outcome; one that dies or hangs is blamed on the
first case it printed nothing for, and a new child goes on after it. The child's address space is
capped a few GiB above what the imports took, so an allocation sized by a huge argument fails in
it instead of taking the machine's memory. CASES has an entry for every function, class and method
bound in _C; test_every_binding_has_cases fails when a new binding has none.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gossip_ext._torch_check import _C

pytestmark = pytest.mark.extension  # the compiled extension's own tests (pyproject.toml)

# Ready-made objects the cases use, built once per child.
PRELUDE = """
import datetime, math, torch
import torch.distributed as dist
from gossip_ext._torch_check import _C
K, M = _C.GraphKind, _C.MixingKind
ring = _C.GraphOptions(K.Ring)
linear = _C.GraphOptions(K.DynamicDirectedLinear)
uniform = _C.MixingOptions(M.Uniform)
def options(**kw):
    return _C.EngineOptions(ring, uniform, **kw)
graph = _C.Graph(ring, 4)
hub1, hub2 = _C.InProcHub(1), _C.InProcHub(2)
inproc = _C.InProcTransport(hub1, 0)
t = torch.zeros(4)
strided = torch.zeros(4, 2)[:, 0]
engine = _C.GossipEngine([torch.zeros(3)], ["w"], _C.InProcTransport(hub2, 0), options())
loopback = _C.LoopbackTransport(inproc, 0, 2)
work = inproc.exchange([], [], 0)
p2p = _C.InProcTransport(_C.InProcHub(2), 0)
departures = _C.Departures(dist.HashStore(), 0)
mailbox = _C.Mailbox(p2p, departures, 1, 0, datetime.timedelta(days=1), 64, [True], 0)
outbox = _C.Outbox(p2p, departures, 1, 0, datetime.timedelta(days=1))
async_options = _C.AsyncOptions(ring)
codec = _C.MessageCodec([(4, torch.float32)])
message = codec.encode([t], 1.0, 0)
async_engine = _C.AsyncPushSum(
    [torch.zeros(3)], ["w"], _C.InProcTransport(_C.InProcHub(2), 0),
    _C.Departures(dist.HashStore(), 0), async_options)
day = datetime.timedelta(days=1)
forever = datetime.timedelta(days=10**6)
back = datetime.timedelta(milliseconds=-1)
big = 10**8       # fits a C++ int, far above any world size or count
wide = 2**31      # does not fit a C++ int
"""

TE, VE = ("TypeError",), ("ValueError",)
EITHER = ("TypeError", "ValueError")

# binding -> [(code, error classes accepted (None: must succeed), words the message must hold)]
CASES: dict[str, list[tuple[str, tuple[str, ...] | None, tuple[str, ...]]]] = {
    "built_with_torch": [("_C.built_with_torch(None)", TE, ())],
    "cpu_kernels_isa": [("_C.cpu_kernels_isa(None)", TE, ())],
    "build_info": [("_C.build_info(None)", TE, ())],
    "mailbox_tag": [
        ("_C.mailbox_tag(None, 0)", TE, ("generation",)),
        ("_C.mailbox_tag(0, 'x')", TE, ("sequence",)),
        ("_C.mailbox_tag(-1, 2**62)", None, ()),  # wraps into its range (test_message_tags.py)
    ],
    "Departures": [
        ("_C.Departures(None, 0)", EITHER, ("store", "None")),
        ("_C.Departures('x', 0)", TE, ("store",)),
        ("_C.Departures(dist.HashStore(), -1)", VE, ("rank", "-1")),
        ("_C.Departures(dist.HashStore(), 0, back)", VE, ("leave_grace", "-1")),
        ("_C.Departures(dist.HashStore(), 0, forever)", VE, ("leave_grace",)),
    ],
    "Departures.announce": [("departures.announce('x')", TE, ("rank",))],
    "Departures.has_left": [("departures.has_left(None)", TE, ("rank",))],
    "PeerChannel": [("_C.PeerChannel()", TE, ())],
    "PeerChannel.raise_if_failed": [("_C.PeerChannel.raise_if_failed(None)", TE, ())],
    "PeerChannel.fail": [
        ("outbox.fail(None, 0)", TE, ("why",)),
        ("outbox.fail('x', 'y')", TE, ("round",)),
    ],
    "PeerChannel.close": [("_C.PeerChannel.close(None)", TE, ())],
    "PeerChannel.check_silence": [
        ("_C.PeerChannel.check_silence(None)", TE, ()),
        ("mailbox.check_silence()", None, ()),
    ],
    "Mailbox": [
        ("_C.Mailbox(None, departures, 1, 0, day, 64, [True], 0)", EITHER, ("transport",)),
        ("_C.Mailbox(p2p, None, 1, 0, day, 64, [True], 0)", EITHER, ("departures",)),
        ("_C.Mailbox(p2p, departures, 0, 0, day, 64, [True], 0)", VE, ("peer", "0")),
        ("_C.Mailbox(p2p, departures, big, 0, day, 64, [True], 0)", VE, ("peer", "100000000")),
        ("_C.Mailbox(p2p, departures, 1, 0, back, 64, [True], 0)", VE, ("timeout", "-1")),
        ("_C.Mailbox(p2p, departures, 1, 0, forever, 64, [True], 0)", VE, ("timeout",)),
        ("_C.Mailbox(p2p, departures, 1, 0, day, 8, [True], 0)", VE, ("nbytes", "8")),
        ("_C.Mailbox(p2p, departures, 1, 0, day, 2**60, [True], 0)", VE, ("nbytes",)),
        ("_C.Mailbox(p2p, departures, 1, 0, day, 64, [False], 0)", VE, ("sends_in_round",)),
        ("_C.Mailbox(p2p, departures, 1, 0, day, 64, [], 0)", VE, ("sends_in_round",)),
        ("_C.Mailbox(p2p, departures, 1, 0, day, 64, [True], -2)", VE, ("start", "-2")),
        ("_C.Mailbox(p2p, departures, 1, 0, day, 64, [True], 0, 0)", VE, ("held_limit", "0")),
    ],
    "Mailbox.take": [("mailbox.take('x')", TE, ("through",))],
    "Mailbox.arrival_times": [("_C.Mailbox.arrival_times(None)", TE, ())],
    "Mailbox.wait_until_past": [
        ("mailbox.wait_until_past(None)", TE, ("round",)),
        ("mailbox.wait_until_past(-1)", None, ()),  # round 0 is the first: nothing to wait for
    ],
    "Mailbox.wait_for": [
        ("mailbox.wait_for('x')", TE, ("count",)),
        ("mailbox.wait_for(0)", None, ()),
    ],
    "Mailbox.wait_for_before": [
        ("mailbox.wait_for_before(1, None)", TE, ("seconds",)),
        ("mailbox.wait_for_before(1, -5.0)", None, ()),  # a deadline passed: False at once
        ("mailbox.wait_for_before(0, 1e300)", None, ()),  # "never", capped: no overflow
    ],
    "AsyncOptions": [
        ("_C.AsyncOptions(None)", TE, ("graph",)),
        ("_C.AsyncOptions(ring, -1)", VE, ("staleness", "-1")),
        ("_C.AsyncOptions(ring, timeout=back)", VE, ("timeout", "-1")),
        ("_C.AsyncOptions(ring, timeout=forever)", VE, ("timeout",)),
        ("_C.AsyncOptions(ring, message_dtype='int3')", VE, ("message_dtype", "int3")),
        ("_C.AsyncOptions(ring, message_dtype=3)", TE, ("message_dtype",)),
        ("_C.AsyncOptions(ring, message_dtype=torch.float32)", VE, ("message_dtype",)),
    ],
    "AsyncPushSum": [
        ("_C.AsyncPushSum([t], ['w'], None, departures, async_options)", EITHER, ("transport",)),
        ("_C.AsyncPushSum([t], ['w'], p2p, None, async_options)", EITHER, ("departures",)),
        ("_C.AsyncPushSum([], [], p2p, departures, async_options)", VE, ("param",)),
        (
            "_C.AsyncPushSum([torch.zeros(2, dtype=torch.int64)], ['w'], p2p, departures, "
            "async_options)",
            EITHER,
            ("w",),
        ),
    ],  # fmt: skip
    "AsyncPushSum.start_round": [("_C.AsyncPushSum.start_round(None)", TE, ())],
    "AsyncPushSum.finish_round": [("_C.AsyncPushSum.finish_round(None)", TE, ())],
    "AsyncPushSum.sent_counts": [("_C.AsyncPushSum.sent_counts(None)", TE, ())],
    "AsyncPushSum.settle": [
        ("async_engine.settle(None)", TE, ("sent_to_me",)),
        ("async_engine.settle([0, 0, 0])", VE, ("sent_to_me", "3")),
    ],
    "AsyncPushSum.restore": [
        ("async_engine.restore(-1, 1.0, [0, 0])", VE, ("round", "-1")),
        ("async_engine.restore(0, 0.0, [0, 0])", VE, ("ps_weight", "0")),
        ("async_engine.restore(0, math.nan, [0, 0])", VE, ("ps_weight", "nan")),
        ("async_engine.restore(0, 1.0, [0])", VE, ("rounds", "1")),
    ],
    "AsyncPushSum.abandon": [("async_engine.abandon(None)", TE, ("why",))],
    "AsyncPushSum.raise_if_failed": [("_C.AsyncPushSum.raise_if_failed(None)", TE, ())],
    "AsyncPushSum.flat_buffers": [("_C.AsyncPushSum.flat_buffers(None)", TE, ())],
    "AsyncPushSum.statistics": [("_C.AsyncPushSum.statistics(None)", TE, ())],
    "AsyncPushSum.history": [
        ("async_engine.history('x')", TE, ("start",)),
        ("async_engine.history(10**6)", None, ()),  # past the end: nothing
    ],
    "MessageCodec": [
        ("_C.MessageCodec(None)", TE, ("parts",)),
        ("_C.MessageCodec([])", VE, ("parts",)),
        ("_C.MessageCodec([(4, torch.int64)])", VE, ("part 0", "Long")),
        ("_C.MessageCodec([(-1, torch.float32)])", VE, ("part 0", "-1")),
        ("_C.MessageCodec([(4, torch.float32)], 'int3')", VE, ("message_dtype", "int3")),
        ("_C.MessageCodec([(4, torch.float32)], torch.float32)", VE, ("message_dtype",)),
        ("_C.MessageCodec([(4, torch.float32)], device=None)", TE, ("device",)),
    ],
    "MessageCodec.encode": [
        ("codec.encode([t, t], 1.0, 0)", VE, ("values", "2")),
        ("codec.encode([torch.zeros(3)], 1.0, 0)", VE, ("values[0]", "4")),
        ("codec.encode([strided], 1.0, 0)", VE, ("values[0]", "contiguous")),
        ("codec.encode(None, 1.0, 0)", TE, ("values",)),
    ],
    "MessageCodec.read": [("codec.read(torch.zeros(3, dtype=torch.uint8))", VE, ("message", "3"))],
    "MessageCodec.absorb": [
        ("codec.absorb([t], torch.zeros(3, dtype=torch.uint8), 1.0, 2.0)", VE, ("message", "3")),
        ("codec.absorb([], message, 1.0, 2.0)", VE, ("values", "0")),
    ],
    "MessageCodec.values_finite": [
        ("codec.values_finite(torch.zeros(3, dtype=torch.uint8))", VE, ("message", "3")),
    ],
    "MessageCodec.weight_of": [("_C.MessageCodec.weight_of(torch.zeros(3))", VE, ("message",))],
    "MessageCodec.round_of": [("_C.MessageCodec.round_of(None)", TE, ("message",))],
    "MessageCodec.aux_of": [("_C.MessageCodec.aux_of('x')", TE, ("message",))],
    "Outbox": [
        ("_C.Outbox(None, departures, 1, 0, day)", EITHER, ("transport",)),
        ("_C.Outbox(p2p, departures, 2, 0, day)", VE, ("peer", "2")),
        ("_C.Outbox(p2p, departures, 1, 0, back)", VE, ("timeout", "-1")),
    ],
    "Outbox.post": [
        ("outbox.post(0, None)", TE, ("message",)),
        ("outbox.post(None, t)", TE, ("round",)),
    ],
    "Outbox.wait_until_past": [
        ("outbox.wait_until_past('x')", TE, ("round",)),
        ("outbox.wait_until_past()", None, ()),  # nothing posted: nothing to wait for
    ],
    "mixing_weights": [
        ("_C.mixing_weights(None, 1)", TE, ("options",)),
        ("_C.mixing_weights(uniform, -1)", VE, ("num_out_peers", "-1")),
        ("_C.mixing_weights(uniform, big)", VE, ("num_out_peers", "100000000")),
        ("_C.mixing_weights(uniform, wide)", TE, ("num_out_peers",)),
        ("_C.mixing_weights(uniform, 'x')", TE, ("num_out_peers",)),
    ],
    "quantized_message_bytes": [
        ("_C.quantized_message_bytes(None, 'int8')", TE, ("numel",)),
        ("_C.quantized_message_bytes(-1, 'int8')", VE, ("numel", "-1")),
        ("_C.quantized_message_bytes(2**63 - 1, 'int8')", VE, ("numel", str(2**63 - 1))),
        ("_C.quantized_message_bytes(2**64, 'int8')", TE, ("numel",)),
        ("_C.quantized_message_bytes(10, None)", TE, ("format",)),
        ("_C.quantized_message_bytes(10, 'int9')", VE, ("format", "int9")),
    ],
    "simulate": [
        ("_C.simulate(None, 1, options())", TE, ("values",)),
        ("_C.simulate(torch.zeros(2, 1), -1, options())", VE, ("rounds", "-1")),
        ("_C.simulate(torch.zeros(2, 1), 2**62, options())", VE, ("rounds", str(2**62))),
        ("_C.simulate(torch.zeros(2, 1), 2**64, options())", TE, ("rounds",)),
        ("_C.simulate(torch.zeros(2, 1), 1, None)", TE, ("options",)),
        ("_C.simulate(torch.zeros(5000, 1), 1, options())", VE, ("values", "5000")),
        ("_C.simulate(torch.zeros(2, 1, dtype=torch.int32), 1, options())", TE, ("values",)),
    ],
    "GraphKind": [
        ("_C.GraphKind(None)", TE, ()),
        ("_C.GraphOptions(_C.GraphKind(99))", VE, ("kind", "99")),
    ],
    "MixingKind": [
        ("_C.MixingKind(None)", TE, ()),
        ("_C.MixingOptions(_C.MixingKind(7))", VE, ("kind", "7")),
    ],
    "GraphOptions": [
        ("_C.GraphOptions(None)", TE, ("kind",)),
        ("_C.GraphOptions(K.Ring, None)", TE, ("peers_per_itr",)),
        ("_C.GraphOptions(K.Ring, 0)", VE, ("peers_per_itr", "0")),
        ("_C.GraphOptions(K.Ring, big)", VE, ("peers_per_itr", "100000000")),
        ("_C.GraphOptions(K.Ring, wide)", TE, ("peers_per_itr",)),
        ("_C.GraphOptions(K.Custom, 1, None)", TE, ("phone_books",)),
        ("_C.GraphOptions(K.Custom, 1, [[None]])", TE, ("phone_books",)),
        ("_C.GraphOptions(K.Custom, 1, [[]] * 70000)", VE, ("phone_books", "70000")),
    ],
    "Graph": [
        ("_C.Graph(None, 4)", TE, ("options",)),
        ("_C.Graph(ring, -1)", VE, ("world_size", "-1")),
        ("_C.Graph(ring, big)", VE, ("world_size", "100000000")),
        ("_C.Graph(ring, wide)", TE, ("world_size",)),
        ("_C.Graph(ring, '4')", TE, ("world_size",)),
        # A linear graph's schedule grows as the square of the world size.
        ("_C.Graph(linear, 8192)", VE, ("world_size", "8192")),
    ],
    "Graph.phone_book": [
        ("graph.phone_book(-1)", VE, ("rank", "-1")),
        ("graph.phone_book(big)", VE, ("rank", "100000000")),
        ("graph.phone_book(None)", TE, ("rank",)),
    ],
    "Graph.out_peers": [
        ("graph.out_peers(4, 0)", VE, ("rank", "4")),
        ("graph.out_peers(0, -1)", VE, ("round", "-1")),
        ("graph.out_peers(0, 2**63 - 1)", None, ()),
        ("graph.out_peers(0, None)", TE, ("round",)),
    ],
    "Graph.in_peers": [
        ("graph.in_peers(-1, 0)", VE, ("rank", "-1")),
        ("graph.in_peers(0, -5)", VE, ("round", "-5")),
        ("graph.in_peers(0, 2**63 - 1)", None, ()),
        ("graph.in_peers(None, 0)", TE, ("rank",)),
    ],
    "MixingOptions": [
        ("_C.MixingOptions(None)", TE, ("kind",)),
        ("_C.MixingOptions(M.SelfWeight, math.nan)", VE, ("self_weight", "nan")),
        ("_C.MixingOptions(M.SelfWeight, 'x')", TE, ("self_weight",)),
    ],
    "EngineOptions": [
        ("_C.EngineOptions(None, uniform)", TE, ("graph",)),
        ("_C.EngineOptions(ring, None)", TE, ("mixing",)),
        ("options(timeout=None)", TE, ("timeout",)),
        ("options(timeout=forever)", VE, ("timeout", "86400000000000")),
        ("options(message_dtype=5)", TE, ("message_dtype",)),
        ("options(message_dtype='int9')", VE, ("message_dtype", "int9")),
    ],
    "Work": [("_C.Work()", TE, ("Work",))],
    "Work.wait": [
        ("work.wait(None)", TE, ("timeout",)),
        ("work.wait(back)", VE, ("timeout", "-1")),
        ("work.wait(forever)", VE, ("timeout", "86400000000000")),
    ],
    "Work.synchronize": [
        ("work.synchronize(None)", TE, ("timeout",)),
        ("work.synchronize(back)", VE, ("timeout", "-1")),
        ("work.synchronize(forever)", VE, ("timeout",)),
    ],
    "Work.is_completed": [("work.is_completed(None)", TE, ())],
    "Transport": [("_C.Transport()", TE, ("Transport",))],
    "Transport.exchange": [
        ("inproc.exchange(None, [], 0)", TE, ("sends",)),
        ("inproc.exchange([(5, t)], [], 0)", VE, ("sends[0]", "5")),
        ("inproc.exchange([], [(-1, t)], 0)", VE, ("recvs[0]", "-1")),
        ("inproc.exchange([(0, None)], [], 0)", TE, ("sends",)),
        ("inproc.exchange([(0, strided)], [], 0)", VE, ("sends[0]", "contiguous")),
        ("inproc.exchange([], [], -1)", VE, ("round", "-1")),
        ("inproc.exchange([], [], 2**63)", TE, ("round",)),
        ("loopback.exchange([(2, t)], [(1, t)], 0)", VE, ("sends[0]", "2")),
    ],
    "Transport.connect_peers": [
        ("inproc.connect_peers([5])", VE, ("peers[0]", "5")),
        ("inproc.connect_peers(None)", TE, ("peers",)),
    ],
    "Transport.abandon": [("inproc.abandon(None)", TE, ("why",))],
    "InProcHub": [
        ("_C.InProcHub(-1)", VE, ("world_size", "-1")),
        ("_C.InProcHub(big)", VE, ("world_size", "100000000")),
        ("_C.InProcHub(wide)", TE, ("world_size",)),
        ("_C.InProcHub('2')", TE, ("world_size",)),
    ],
    "InProcHub.abort": [("hub1.abort(None)", TE, ("reason",))],
    "InProcTransport": [
        ("_C.InProcTransport(None, 0)", EITHER, ("hub", "None")),
        ("_C.InProcTransport(hub1, 1)", VE, ("rank", "1")),
        ("_C.InProcTransport(hub1, wide)", TE, ("rank",)),
        ("_C.InProcTransport('x', 0)", TE, ("hub",)),
    ],
    "ProcessGroupTransport": [
        ("_C.ProcessGroupTransport(None)", EITHER, ("process_group", "None")),
        ("_C.ProcessGroupTransport('x')", TE, ("process_group",)),
    ],
    "LivenessResponder": [
        ("_C.LivenessResponder(None)", EITHER, ("process_group", "None")),
        ("_C.LivenessResponder('x')", TE, ("process_group",)),
    ],
    "LivenessResponder.close": [("_C.LivenessResponder.close(None)", TE, ())],
    "ping": [
        ("_C.ping(None, 1, day)", EITHER, ("process_group", "None")),
        ("_C.ping('x', 1, day)", TE, ("process_group",)),
    ],
    "SealedTransport": [
        ("_C.SealedTransport(None, {}, False)", EITHER, ("inner", "None")),
        ("_C.SealedTransport(p2p, {1: (b'x', b'y')})", VE, ("32 bytes", "peer 1")),
        ("_C.SealedTransport(p2p, {0: (b'k' * 32, b'k' * 32)})", VE, ("peer 0",)),
        ("_C.SealedTransport(p2p, {1: (b'k' * 32, b'k' * 32)}, 'x')", TE, ("encrypt",)),
    ],
    "HostStagingTransport": [
        ("_C.HostStagingTransport(None)", EITHER, ("inner", "None")),
        ("_C.HostStagingTransport(hub1)", TE, ("inner",)),
    ],
    "LoopbackTransport": [
        ("_C.LoopbackTransport(None, 0, 2)", EITHER, ("inner", "None")),
        ("_C.LoopbackTransport(inproc, 0, big)", VE, ("world_size", "100000000")),
        ("_C.LoopbackTransport(inproc, 3, 2)", VE, ("rank", "3")),
        ("_C.LoopbackTransport(inproc, 0, wide)", TE, ("world_size",)),
    ],
    "LoopbackTransport.drop_sends": [
        ("loopback.drop_sends(-1)", VE, ("count", "-1")),
        ("loopback.drop_sends(wide)", TE, ("count",)),
        ("loopback.drop_sends(None)", TE, ("count",)),
    ],
    "GossipEngine": [
        ("_C.GossipEngine([], [], inproc, options())", VE, ("parameters",)),
        ("_C.GossipEngine([None], ['w'], inproc, options())", TE, ("params",)),
        ("_C.GossipEngine(None, [], inproc, options())", TE, ("params",)),
        ("_C.GossipEngine([t.clone()], None, inproc, options())", TE, ("names",)),
        ("_C.GossipEngine([t.clone()], ['w'], None, options())", EITHER, ("transport", "None")),
        ("_C.GossipEngine([t.clone()], ['w'], inproc, None)", TE, ("options",)),
        ("_C.GossipEngine([t.clone()], ['a', 'b'], inproc, options())", VE, ("names",)),
        ("_C.GossipEngine([t.int()], ['w'], inproc, options())", TE, ("'w'", "Int")),
        ("_C.GossipEngine([t.clone()], ['w'], inproc, options(timeout=back))", VE, ("timeout",)),
        # Two tensors over one storage, and one a view of the other: flattening would untie them.
        (
            "p = torch.zeros(6); _C.GossipEngine([torch.zeros(2), p, p.view(2, 3)],"
            " ['a', 'b', 'c'], inproc, options())",
            VE,
            ("'b' (parameters[1])", "'c' (parameters[2])"),
        ),
        (
            "p = torch.zeros(6); _C.GossipEngine([p[1:4], p[3:]], [], inproc, options())",
            VE,
            ("parameters[0]", "parameters[1]"),
        ),
        # Disjoint parts of one storage are no tie: a model flattened before is flattened again.
        ("p = torch.zeros(6); _C.GossipEngine([p[:3], p[3:]], [], inproc, options())", None, ()),
        # Interleaved but disjoint: the columns of one matrix.
        (
            "p = torch.zeros(3, 2); _C.GossipEngine([p[:, 0], p[:, 1]], [], inproc, options())",
            None,
            (),
        ),
    ],
    "check_disjoint_parameters": [
        ("_C.check_disjoint_parameters(None, [])", TE, ("params",)),
        ("_C.check_disjoint_parameters([t], None)", TE, ("names",)),
        ("_C.check_disjoint_parameters([t, t], ['a', 'b'])", VE, ("'b'", "listed twice")),
        (
            "p = torch.zeros(3, 2);"
            " _C.check_disjoint_parameters([p[:, 0], p[2], p[1]], ['c', 'r', 'q'])",
            VE,
            ("'c' (parameters[0])", "'q' (parameters[2])"),
        ),
        (
            "p = torch.zeros(1); _C.check_disjoint_parameters([p.expand(4), p], [])",
            VE,
            ("parameters[1]",),
        ),
        ("p = torch.zeros(3, 2); _C.check_disjoint_parameters([p[:, 1], p[:, 0]], [])", None, ()),
    ],
    "GossipEngine.start_round": [("engine.start_round(None)", TE, ())],
    "GossipEngine.finish_round": [("engine.finish_round(None)", TE, ())],
    "GossipEngine.try_finish_round": [("engine.try_finish_round(None)", TE, ())],
    "GossipEngine.synchronize": [("engine.synchronize(None)", TE, ())],
    "GossipEngine.settle": [("engine.settle(None)", TE, ())],
    "GossipEngine.raise_if_failed": [("engine.raise_if_failed(None)", TE, ())],
    "GossipEngine.abandon": [("engine.abandon(None)", TE, ("why",))],
    "GossipEngine.flat_buffers": [("engine.flat_buffers(None)", TE, ())],
    "GossipEngine.ps_weight": [("engine.ps_weight(None)", TE, ())],
    "GossipEngine.ps_numerators": [("engine.ps_numerators(None)", TE, ())],
    "GossipEngine.kept_ps_weight": [("engine.kept_ps_weight(None)", TE, ())],
    "GossipEngine.restore": [
        ("engine.restore(-1, 1.0)", VE, ("round", "-1")),
        ("engine.restore(0, math.nan)", VE, ("ps_weight", "nan")),
        ("engine.restore(2**63, 1.0)", TE, ("round",)),
        ("engine.restore(0, None)", TE, ("ps_weight",)),
    ],
    "GossipEngine.set_peers_per_itr": [
        ("engine.set_peers_per_itr(0)", VE, ("peers_per_itr", "0")),
        ("engine.set_peers_per_itr(big)", VE, ("peers_per_itr", "100000000")),
        ("engine.set_peers_per_itr(None)", TE, ("peers_per_itr",)),
    ],
    # CUDA builds only; every check runs before the transport touches a device or the store.
    "NcclTransport": [
        ("_C.NcclTransport(None, 'k', 0, 1, 0, day)", EITHER, ("store", "None")),
        (
            "_C.NcclTransport(dist.HashStore(), 'k', 0, big, 0, day)",
            VE,
            ("world_size", "100000000"),
        ),
        ("_C.NcclTransport(dist.HashStore(), 'k', 2, 2, 0, day)", VE, ("rank", "2")),
        ("_C.NcclTransport(dist.HashStore(), 'k', 0, 1, 300, day)", VE, ("device_index", "300")),
        ("_C.NcclTransport(dist.HashStore(), 'k', 0, 1, 0, forever)", VE, ("timeout",)),
    ],
}

# Runs the cases given as JSON [[index, code], ...] after PRELUDE, printing [index, error class
# name or None, message] for each as soon as it is known.
CHILD = """
import json, resource, sys
exec(PRELUDE)
# Huge arguments must fail fast: cap the address space a little above what the imports took.
size = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + (3 << 30), resource.RLIM_INFINITY))
print('ready', flush=True)
for index, code in json.loads(sys.argv[1]):
    try:
        exec(code, dict(globals()))
        outcome = [index, None, '']
    except Exception as error:
        outcome = [index, type(error).__name__, str(error)]
    print(json.dumps(outcome), flush=True)
"""

CHILD_TIMEOUT_S = 20

FLAT = [(key, *case) for key, cases in CASES.items() for case in cases]


def _run(todo: list[int]) -> dict[int, tuple[str | None, str]]:
    """The outcome of each case of `todo` (indices into FLAT); a case whose child died or hung
    gets ("crashed", how)."""
    outcomes: dict[int, tuple[str | None, str]] = {}
    while todo:
        argument = json.dumps([[i, FLAT[i][1]] for i in todo])
        code = CHILD.replace("exec(PRELUDE)", f"exec({PRELUDE!r})")
        try:
            child = subprocess.run(
                [sys.executable, "-c", code, argument],
                capture_output=True,
                text=True,
                timeout=CHILD_TIMEOUT_S,
            )
            stdout, how = child.stdout, f"exit status {child.returncode}: {child.stderr[-800:]}"
        except subprocess.TimeoutExpired as expired:
            out = expired.stdout or ""
            stdout = out.decode() if isinstance(out, bytes) else out
            how = f"no answer within {CHILD_TIMEOUT_S} s (a hang or a run on memory)"
        lines = stdout.splitlines()
        if lines[:1] != ["ready"]:  # PRELUDE failed: no case ran
            return dict.fromkeys(todo, ("crashed", f"before the first case, {how}")) | outcomes
        for line in lines[1:]:
            index, error, message = json.loads(line)
            outcomes[index] = (error, message)
        todo = [i for i in todo if i not in outcomes]
        if todo:
            outcomes[todo.pop(0)] = ("crashed", how)
    return outcomes


@pytest.fixture(scope="module")
def outcomes():
    present = [i for i, (key, *_) in enumerate(FLAT) if hasattr(_C, key.split(".")[0])]
    return _run(present)


def _bound_names() -> list[str]:
    """Every function, class and method of a class that _C binds, as CASES names them."""
    names = []
    for name, value in vars(_C).items():
        if name.startswith("_") or not callable(value):
            continue
        names.append(name)
        if isinstance(value, type) and not hasattr(value, "__members__"):  # not an enum
            for member, attribute in vars(value).items():
                if not member.startswith("_") and callable(attribute):
                    names.append(f"{name}.{member}")
    return names


def test_every_binding_has_cases():
    missing = [name for name in _bound_names() if name not in CASES]
    assert not missing, f"bindings with no case in CASES (add one for each): {missing}"


@pytest.mark.parametrize("index", range(len(FLAT)), ids=[f"{k}:{c}"[:90] for k, c, *_ in FLAT])
def test_refused(outcomes, index):
    key, code, errors, words = FLAT[index]
    if not hasattr(_C, key.split(".")[0]):
        pytest.skip(f"{key} is not bound in this build (CUDA builds only)")
    error, message = outcomes[index]
    assert error != "crashed", f"{code} crashed the process: {message}"
    if errors is None:
        assert error is None, f"{code} must succeed, raised {error}: {message}"
        return
    assert error in errors, f"{code} raised {error} ({message}), expected one of {errors}"
    for word in words:
        assert word in message, f"{code}: the message does not name {word!r}: {message}"


TIED = """
import warnings, torch, torch.nn as nn, torch.distributed as dist
import gossip_ext
warnings.simplefilter("ignore")  # one gossiping process
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
for share in ("object", "storage", "view"):
    module = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    if share == "object":
        module[1].weight = module[0].weight
    elif share == "storage":
        module[1].weight = nn.Parameter(module[0].weight.data)
    else:
        module[1].weight = nn.Parameter(module[0].weight.data[1:])
    try:
        model = gossip_ext.GossipDataParallel(module)
        model(torch.tensor([1, 2]))
        print(share, "tied" if module[1].weight is module[0].weight else "untied")
    except ValueError as error:
        print(share, "ValueError", str(error).replace(chr(10), " "))
"""


def test_tied_weights_gossip_and_parameters_over_one_storage_are_refused():
    """Weight tying as modules do it, one Parameter in two places, is listed once and stays tied;
    two Parameters over one storage, or one a view of the other, would be untied by flattening and
    are refused naming both."""
    child = subprocess.run(
        [sys.executable, "-c", TIED], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
    )
    assert child.returncode == 0, child.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in child.stdout.splitlines())
    assert lines["object"] == "tied"
    for share in ("storage", "view"):
        assert lines[share].startswith("ValueError"), lines[share]
        assert "'0.weight' (parameters[0]) and '1.weight' (parameters[1]) overlap" in lines[share]
