"""The first line a GossipDataParallel logs at rank 0 (and keeps as ``wire_summary``): the mode,
the graph, the message format and the bytes per step, each figure read back against what the
job then sends (the engine's ``bytes_sent``; the outer step's all-reduce on the wire is
tests/test_message_bytes.py's)."""

from __future__ import annotations

import functools
import logging
import re

import pytest
import torch
from multiprocess import run_ranks
from torch import nn

import gossip_ext

STEPS = 8
FEATURES = 96  # 96 * 96 + 96 + 96 * 4 + 4 = 9,700 float32 values


UNITS = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}


def _figure(line: str, after: str) -> pytest.approx:
    """The bytes ``line`` says right after ``after``, to the three figures it gives."""
    match = re.search(re.escape(after) + r"([0-9.e+-]+) (B|kB|MB|GB)\b", line)
    assert match, (after, line)
    return pytest.approx(float(match.group(1)) * UNITS[match.group(2)], rel=5e-3)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _run(rank: int, world_size: int, which: str) -> dict:
    lines = _Lines()
    logger = logging.getLogger("gossip_ext")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    kwargs = {
        "sgp": {"gossip": gossip_ext.SGP()},
        "int8": {"gossip": gossip_ext.SGP(overlap=True, message_dtype="int8")},
        "two_peers": {
            "gossip": gossip_ext.SGP(graph=gossip_ext.NPeerDynamicDirectedExponentialGraph(2))
        },
        "async": {"gossip": gossip_ext.AsyncSGP()},
        "diloco": {
            "gossip": None,
            "outer": gossip_ext.DiLoCo(functools.partial(torch.optim.SGD, lr=0.7), every=4),
        },
    }[which]
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Linear(FEATURES, 4))
    model = gossip_ext.GossipDataParallel(module, **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model.register_optimizer(optimizer)
    for _ in range(STEPS):
        model(torch.randn(2, FEATURES)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    model.settle()  # every message delivered: AsyncSGP's peers may then exit
    return {"logged": lines.lines, "summary": model.wire_summary, "sent": model.bytes_sent}


PARAM_BYTES = 4 * (FEATURES * FEATURES + FEATURES + FEATURES * 4 + 4)


def _check_logged_once_at_rank_0(results: dict) -> str:
    assert results[0]["logged"] == [results[0]["summary"]]
    assert all(results[r]["logged"] == [] for r in range(1, len(results)))
    return results[0]["summary"]


def test_sgp_names_its_mode_graph_format_and_sends_exactly_its_bytes_per_step():
    for which, peers in (("sgp", 1), ("two_peers", 2)):
        results = run_ranks(4, _run, which)
        line = _check_logged_once_at_rank_0(results)
        assert "4 workers" in line and "mode SGP(" in line, line
        assert f"NPeerDynamicDirectedExponentialGraph(peers_per_itr={peers})" in line, line
        assert "messages in the parameters' dtype" in line, line
        # A float32 message is the parameters' bytes; one to each out-peer, every step.
        assert PARAM_BYTES == _figure(line, "messages in the parameters' dtype, ")
        assert peers * PARAM_BYTES == _figure(line, "at most ")
        for r in range(len(results)):
            assert results[r]["sent"] == STEPS * peers * PARAM_BYTES, (which, r)


def test_int8_overlap_names_the_format_and_its_fraction_of_the_parameters():
    results = run_ranks(2, _run, "int8")
    line = _check_logged_once_at_rank_0(results)
    assert "mode SGP(overlap=True, message_dtype='int8')" in line, line
    assert "messages in int8" in line, line
    # One byte a value and a float32 scale per block of 128 values: about 0.258 of float32's
    # 4 bytes a value.
    values = PARAM_BYTES // 4
    message = values + 4 * -(-values // 128)
    assert message == _figure(line, "messages in int8, ")
    assert "(0.258x the parameters'" in line, line
    for r in range(len(results)):
        # Overlap: the last step's round was absorbed by sync_comms, every step sent one.
        assert results[r]["sent"] == STEPS * message


def test_asynchronous_gossip_sends_at_most_what_it_logs():
    results = run_ranks(3, _run, "async")
    line = _check_logged_once_at_rank_0(results)
    assert "mode AsyncSGP()" in line, line
    # Each message carries a 24-byte header: the graph's one out-peer a step at most.
    per_step = PARAM_BYTES + 24
    assert per_step == _figure(line, "at most ")
    assert all(r["sent"] <= STEPS * per_step for r in results), [r["sent"] for r in results]
    assert sum(r["sent"] for r in results) > 0


def test_diloco_counts_its_all_reduce_over_the_period():
    results = run_ranks(3, _run, "diloco")
    line = _check_logged_once_at_rank_0(results)
    assert "mode DiLoCo(" in line and "every=4" in line and "graph" not in line, line
    # A ring all-reduce of the float32 bucket and its weight: 2 (n - 1) / n of it from each worker,
    # once every 4 steps.
    message = PARAM_BYTES + 4
    assert 2 * 2 * message // 3 / 4 == _figure(line, "outer steps ") == _figure(line, "at most ")
    assert all(r["sent"] == 0 for r in results)  # no gossip engine
