"""The failure contract through the outer steps, under every averaging, whole and streamed: a
SIGKILLed peer and a SIGSTOPped peer give a PeerTimeoutError naming it within the timeout, a NaN
on one worker a NonFiniteError naming it on every worker; nothing is written, and the error stays
raised. Three real processes over gloo; rank 1 is the faulty one.

The fault comes at the start of step 3: DiLoCo's whole-model step runs at step 4 (``every=4``),
and a fragment of Streaming DiLoCo (``fragments=2, delay=1``) is prepared at step 3 and applied at
step 4, so the step that fails is the one that reads the faulty worker's contribution.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
from multiprocess import run_ranks, run_ranks_tolerating_deaths
from test_faults import _complete_graph, _touch
from torch import nn

import gossip_ext
from gossip_ext.averagings import failures, store_check_in

TIMEOUT_S = 2.0
SLACK_S = 8.0  # on top of the timeout: two cores shared by three ranks and other jobs
FAULTY = 1
FAULT_STEP = 3
STEPS = 5


def _outer_sgd(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


_TOPK = gossip_ext.TopK(density=1 / 8, bits=2, chunk=32)


def _by_gossip() -> gossip_ext.ByGossip:
    # Every worker exchanges with every other in every round, so every survivor depends on the
    # faulty one in the failing round (on a sparser graph, those that do not raise later).
    return gossip_ext.ByGossip(graph=_complete_graph(3))


AVERAGINGS = {
    "average": lambda: gossip_ext.Average(every=4),
    "slowmo": lambda: gossip_ext.SlowMo(every=4),
    "exact": lambda: gossip_ext.DiLoCo(_outer_sgd, every=4),
    "int8": lambda: gossip_ext.DiLoCo(_outer_sgd, every=4, average=gossip_ext.Exact("int8")),
    "topk": lambda: gossip_ext.DiLoCo(_outer_sgd, every=4, average=gossip_ext.Exact(_TOPK)),
    "by_gossip": lambda: gossip_ext.DiLoCo(_outer_sgd, every=4, average=_by_gossip()),
    "compressed_gossip": lambda: gossip_ext.DiLoCo(
        _outer_sgd, every=4, average=gossip_ext.ByCompressedGossip(_TOPK)
    ),
    # The other rules on the other averagings: the contract is the averaging's, whatever rule.
    "average_int8": lambda: gossip_ext.Average(every=4, average=gossip_ext.ByCollective("int8")),
    "slowmo_by_gossip": lambda: gossip_ext.SlowMo(every=4, average=_by_gossip()),
}
STREAMED = {
    f"streamed_{name}": (
        lambda average=average: gossip_ext.DiLoCo(
            _outer_sgd, every=4, average=average(), fragments=2, delay=1
        )
    )
    for name, average in {
        "exact": gossip_ext.Exact,
        "int8": lambda: gossip_ext.Exact("int8"),
        "topk": lambda: gossip_ext.Exact(_TOPK),
        "by_gossip": _by_gossip,
    }.items()
}
ALL = {**AVERAGINGS, **STREAMED}
# The averagings whose messages are collectives over every worker (the others gossip).
OVER_EVERY_WORKER = {
    "average",
    "slowmo",
    "exact",
    "int8",
    "topk",
    "average_int8",
    "streamed_exact",
    "streamed_int8",
    "streamed_topk",
}


def _a_worker_fails(rank: int, world_size: int, name: str, fault: str, sync_dir: str) -> dict:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model = gossip_ext.GossipDataParallel(
        module, gossip=None, outer=ALL[name](), timeout=timedelta(seconds=TIMEOUT_S)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    result = {"error": None}
    for step in range(1, STEPS + 1):
        if step == FAULT_STEP and rank == FAULTY:
            _touch(os.path.join(sync_dir, "fault_at"), repr(time.time()))
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "stop":
                _touch(os.path.join(sync_dir, "stopped_pid"), str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)
            if fault == "nan":
                with torch.no_grad():
                    module[0].weight[0, 0] = float("nan")  # a diverged step
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * step + rank))
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        last_model = [p.detach().clone() for p in module.parameters()]
        try:
            model.transfer_params(optimizer)
        except (gossip_ext.PeerTimeoutError, gossip_ext.NonFiniteError) as error:
            result = {
                "error": str(error),
                "type": type(error).__name__,
                "peers": error.peers,
                "raised_at": time.time(),
                "step": step,
                "unchanged": all(
                    torch.allclose(p, q, rtol=0, atol=0, equal_nan=True)
                    for p, q in zip(module.parameters(), last_model)
                ),
                "finite": all(bool(torch.isfinite(p).all()) for p in module.parameters()),
            }
            try:
                model.transfer_params()
                result["again"] = None
            except Exception as again:  # noqa: BLE001 - the test compares what it was
                result["again"] = type(again).__name__
            break
    _touch(os.path.join(sync_dir, f"done{rank}"))
    survivors = [r for r in range(world_size) if r != FAULTY or fault == "nan"]
    if fault == "stop":  # the last survivor to finish ends the stopped worker
        if all(os.path.exists(os.path.join(sync_dir, f"done{r}")) for r in survivors):
            with open(os.path.join(sync_dir, "stopped_pid")) as f:
                pid = int(f.read())
            os.kill(pid, signal.SIGKILL)
    # A survivor stays until every survivor has raised, as a job's survivors do: one that exited
    # at once would close its connections, and a survivor still waiting would name it instead of
    # the faulty worker.
    deadline = time.monotonic() + 2 * (TIMEOUT_S + SLACK_S)
    while time.monotonic() < deadline and not all(
        os.path.exists(os.path.join(sync_dir, f"done{r}")) for r in survivors
    ):
        time.sleep(0.05)
    return result


CASES = [(name, fault) for name in ALL for fault in ("kill", "stop", "nan")]


@pytest.mark.parametrize("name,fault", CASES)
def test_a_faulty_worker_gives_a_typed_error_within_the_timeout_and_changes_nothing(
    tmp_path, name, fault
):
    outcomes = run_ranks_tolerating_deaths(
        3, _a_worker_fails, name, fault, str(tmp_path), deadline_s=60.0
    )
    fault_at = float((tmp_path / "fault_at").read_text())
    ranks = [0, 2] if fault != "nan" else [0, 1, 2]
    for rank in ranks:
        outcome = outcomes[rank]
        assert outcome.exitcode == 0, (rank, outcome)  # None: it hung until the deadline
        result = outcome.result
        assert result["error"] is not None, f"rank {rank} never raised under {name}/{fault}"
        if fault == "nan":
            assert result["type"] == "NonFiniteError", (rank, result)
            assert result["peers"] == (() if rank == FAULTY else (FAULTY,)), (rank, result)
            if rank != FAULTY:
                assert result["finite"], (rank, result)  # the NaN did not spread
        else:
            assert result["type"] == "PeerTimeoutError", (rank, result)
            # A collective over every worker names the worker that did not check in at the
            # group's store after it failed; a message between peers names its peer (the
            # engine's round also names the peers whose sends it could not confirm).
            if name in OVER_EVERY_WORKER:
                assert result["peers"] == (FAULTY,), (rank, result)
            else:
                assert FAULTY in result["peers"], (rank, result)
            elapsed = result["raised_at"] - fault_at
            assert elapsed < TIMEOUT_S + SLACK_S, (rank, elapsed, result)
        assert result["step"] == FAULT_STEP + 1, (rank, result)
        assert result["unchanged"], (rank, result)  # nothing written
        assert result["again"] == result["type"], (rank, result)  # and it stays raised


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None])
def test_a_sparse_message_shows_a_nonfinite_value_in_its_chunk_scales(bad):
    from gossip_ext.averagings.sparse import _Codec

    codec = _Codec(_TOPK, 100)  # 4 chunks of 32, the last padded
    values = torch.randn(100, generator=torch.Generator().manual_seed(0))
    if bad is not None:
        values[70] = bad  # in the third chunk, whatever its rank among the kept magnitudes
    message = codec.encode(values)
    # At an offset that is no multiple of 4, as a bucket's message within a concatenation.
    shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), message])[3:]
    assert codec.holds_nonfinite(message) == (bad is not None)
    assert codec.holds_nonfinite(shifted) == (bad is not None)


def _given_up_while_waiting(rank: int, world_size: int) -> tuple[float, str] | None:
    # Rank 1 never joins the all-reduce (a worker paired with no dead peer sees no connection
    # close); rank 0's wait ends when its group is given up, long before the 60 s timeout.
    group = torch.distributed.group.WORLD
    if rank == 1:
        time.sleep(1.0)
        return None
    work = torch.distributed.all_reduce(torch.ones(4), group=group, async_op=True)
    threading.Timer(0.3, failures.give_up_waits_on, (group, "worker 1's heartbeat stopped")).start()
    started = time.monotonic()
    with pytest.raises(gossip_ext.PeerTimeoutError) as raised:
        failures.wait_for_every_worker([work], "the mean", group, timedelta(seconds=60))
    return time.monotonic() - started, str(raised.value)


def test_a_wait_for_a_collective_ends_when_its_group_is_given_up():
    waited_s, message = run_ranks(2, _given_up_while_waiting)[0]
    assert 0.3 <= waited_s < 2.0, waited_s
    assert "given up: worker 1's heartbeat stopped" in message, message


def _a_worker_dies_before_a_collective(rank: int, world_size: int, sync_dir: str) -> dict:
    group = torch.distributed.group.WORLD
    torch.distributed.barrier()
    if rank == FAULTY:
        os.kill(os.getpid(), signal.SIGKILL)
    # Large enough for gloo's ring: only the dead worker's neighbours see a connection close;
    # the others wait for neighbours that stopped, until the first to fail marks the failure.
    work = torch.distributed.all_reduce(torch.ones(1 << 18), group=group, async_op=True)
    started = time.monotonic()
    with pytest.raises(gossip_ext.PeerTimeoutError) as raised:
        failures.wait_for_every_worker([work], "the mean", group, timedelta(seconds=TIMEOUT_S))
    waited_s = time.monotonic() - started
    _touch(os.path.join(sync_dir, f"done{rank}"))
    survivors = [os.path.join(sync_dir, f"done{r}") for r in range(world_size) if r != FAULTY]
    deadline = time.monotonic() + TIMEOUT_S + SLACK_S
    while time.monotonic() < deadline and not all(os.path.exists(p) for p in survivors):
        time.sleep(0.05)
    return {"peers": raised.value.peers, "waited_s": waited_s, "error": str(raised.value)}


def test_every_survivor_names_the_dead_worker_even_when_it_is_not_its_neighbour(tmp_path):
    outcomes = run_ranks_tolerating_deaths(
        4, _a_worker_dies_before_a_collective, str(tmp_path), deadline_s=60.0
    )
    for rank in (0, 2, 3):
        result = outcomes[rank].result
        assert outcomes[rank].exitcode == 0, (rank, outcomes[rank])
        assert result["peers"] == (FAULTY,), (rank, result)
        assert "rank 1 died, stalled or left (not checked in at" in result["error"], result
        assert result["waited_s"] < TIMEOUT_S, (rank, result)


class _Group:
    """What the check-in asks of a process group: its rank, size and store."""

    def __init__(self, rank: int, size: int, store):
        self._rank, self._size, self._store = rank, size, store

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def get_group_store(self):
        return self._store


def test_the_ranks_that_do_not_check_in_are_named_and_each_wait_has_its_own_key():
    store = torch.distributed.HashStore()
    timeout = timedelta(seconds=1)  # a deadline of 0.25 s
    groups = [_Group(rank, 3, store) for rank in range(3)]
    first = [store_check_in.CollectiveCheckIn(g, timeout) for g in groups]
    with ThreadPoolExecutor(3) as pool:  # rank 1 never checks in
        assert list(pool.map(lambda c: c.missing(), [first[0], first[2]])) == [[1], [1]]
    # The next wait: every rank checks in under a key of its own, the first failure's not
    # counting, and a rank still waiting sees another's mark.
    second = [store_check_in.CollectiveCheckIn(g, timeout) for g in groups]
    assert not second[1].failed_elsewhere()
    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(lambda c: c.missing(), second)) == [[], [], []]
    assert second[1].failed_elsewhere()
    # No store: nothing is known.
    assert store_check_in.CollectiveCheckIn(_Group(0, 2, None), timeout).missing() is None
