"""A peer failure is a typed error whose attributes say what it is about: the peers and the round
(csrc/common/error.h's PeerFailure, set by csrc/bindings.cpp), so that nothing reads them out of
the message. Real multi-rank failures over gloo: tests/test_faults.py."""

import pickle
from datetime import timedelta

import pytest
import torch

import gossip_ext
from gossip_ext._torch_check import _C
from gossip_ext.membership.elastic import Failure

pytestmark = pytest.mark.extension  # the compiled extension's own tests (pyproject.toml)


def _two_engines(timeout: timedelta, check_finite: bool = True):
    """Two ranks of the in-process transport driven from one thread (a send never blocks)."""
    hub = _C.InProcHub(2)
    options = _C.EngineOptions(
        gossip_ext.NPeerDynamicDirectedExponentialGraph().compiled_options(),
        gossip_ext.UniformMixing().compiled_options(),
        timeout=timeout,
        check_finite=check_finite,
    )
    params = [torch.tensor([2.0, 4.0]), torch.tensor([6.0, 0.0])]
    engines = [
        _C.GossipEngine([p], [f"p{r}"], _C.InProcTransport(hub, r), options)
        for r, p in enumerate(params)
    ]
    return engines, params


def test_a_round_that_times_out_raises_a_peer_timeout_error_with_its_peers_and_round():
    engines, _ = _two_engines(timedelta(milliseconds=100))
    for engine in engines:
        engine.start_round()
    for engine in engines:
        engine.finish_round()
    engines[0].start_round()  # round 1; rank 1 never sends its message
    with pytest.raises(gossip_ext.PeerTimeoutError) as raised:
        engines[0].finish_round()
    error = raised.value
    assert isinstance(error, TimeoutError)
    assert error.peers == (1,)
    assert error.round == 1
    assert error.transport == "inproc"
    assert error.timeout == timedelta(milliseconds=100)
    # The message is as it was: the attributes say the same as data.
    assert str(error) == (
        "gossip_ext: rank 0 timed out after 100 ms in gossip round 1 waiting for messages from "
        "peers [1] (inproc transport)"
    )
    # Sticky: the same error, attributes included.
    with pytest.raises(gossip_ext.PeerTimeoutError) as again:
        engines[0].finish_round()
    assert (again.value.peers, again.value.round, str(again.value)) == (
        (1,),
        1,
        str(error),
    )


def test_a_nonfinite_message_raises_a_nonfinite_error_naming_the_sender():
    engines, params = _two_engines(timedelta(seconds=30))
    params[1][0] = float("nan")
    for engine in engines:
        engine.start_round()
    with pytest.raises(gossip_ext.NonFiniteError) as sender_named:
        engines[0].finish_round()
    with pytest.raises(gossip_ext.NonFiniteError) as own:
        engines[1].finish_round()
    for error in (sender_named.value, own.value):
        assert isinstance(error, FloatingPointError)
        assert error.round == 0
        assert error.transport == "inproc"
    assert sender_named.value.peers == (1,)
    assert "the messages from peers [1] hold NaN or Inf" in str(sender_named.value)
    assert own.value.peers == ()  # rank 1's own parameters diverged
    assert "the parameters of this rank (rank 1)" in str(own.value)


def test_the_errors_keep_their_attributes_through_pickle_and_name_each_peer_once():
    error = gossip_ext.PeerTimeoutError(
        "m", peers=[3, 1, 3], round=7, transport="nccl", timeout=timedelta(seconds=2)
    )
    assert error.peers == (3, 1)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is gossip_ext.PeerTimeoutError and str(again) == "m"
    assert (again.peers, again.round, again.transport, again.timeout) == (
        (3, 1),
        7,
        "nccl",
        timedelta(seconds=2),
    )
    bare = gossip_ext.PeerTimeoutError("m")
    assert (bare.peers, bare.round, bare.transport, bare.timeout) == ((), None, None, None)
    nonfinite = pickle.loads(pickle.dumps(gossip_ext.NonFiniteError("m", peers=[2], round=0)))
    assert (nonfinite.peers, nonfinite.round) == ((2,), 0)


def test_an_elastic_worker_takes_the_peers_from_the_attributes_not_the_text():
    typed = gossip_ext.PeerTimeoutError("no peer named in this text", peers=[2, 0], round=4)
    assert Failure.of(typed).peers == (2, 0)
    assert str(Failure.of(typed)) == "PeerTimeoutError: no peer named in this text"
    # An untyped error names no peer, whatever its text says (c10d's "peer [127.0.0.1]:...").
    untyped = RuntimeError("Connection closed by peer [127.0.0.1]:29500; peers [1, 3]")
    assert Failure.of(untyped).peers == ()
