"""The failure contract through the outer steps, under every averaging, whole and streamed: a
SIGKILLed peer and a SIGSTOPped peer give a PeerTimeoutError naming it within the timeout, a NaN
on one worker a NonFiniteError naming it on every worker; nothing is written, and the error stays
raised. Each averaging's job is three real processes over gloo on a process group of its own,
rank 1 of it the faulty one; the jobs of one fault run in turn in one launch (a launch per batch
of jobs where the faulty worker does not come back).

The fault comes at the start of step 3: DiLoCo's whole-model step runs at step 4 (``every=4``),
and a fragment of Streaming DiLoCo (``fragments=2, delay=1``) is prepared at step 3 and applied at
step 4, so the step that fails is the one that reads the faulty worker's contribution.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks, run_ranks_tolerating_deaths
from test_faults import _complete_graph, _touch
from torch import nn

import gossip_ext
from gossip_ext.averagings import failures, store_check_in

# The wrapper's timeout: a fraction of what a job would set, the survivors' check-in a quarter
# of it (gossip_ext/averagings/store_check_in.py).
TIMEOUT_S = 1.0
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


def _turn(sync_dir: str, name: str, fault: str, rank: int, what: str) -> str:
    return os.path.join(sync_dir, f"{fault}-{name}-{what}{rank}")


def _one_case(group, rank: int, name: str, fault: str, sync_dir: str) -> dict:
    """One averaging's job of three workers on ``group``: rank 1 of the group is the faulty one.
    Returns what a worker saw (nothing, on the faulty worker killed or stopped)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model = gossip_ext.GossipDataParallel(
        module,
        gossip=None,
        outer=ALL[name](),
        timeout=timedelta(seconds=TIMEOUT_S),
        process_group=group,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    result = {"error": None}
    for step in range(1, STEPS + 1):
        if step == FAULT_STEP and rank == FAULTY:
            _touch(os.path.join(sync_dir, f"{fault}-{name}-fault_at"), repr(time.time()))
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "stop":
                _touch(_turn(sync_dir, name, fault, FAULTY, "stopped"), str(os.getpid()))
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
    _touch(_turn(sync_dir, name, fault, rank, "done"))
    survivors = [r for r in range(3) if r != FAULTY or fault == "nan"]
    done = [_turn(sync_dir, name, fault, r, "done") for r in survivors]
    if fault == "stop" and all(os.path.exists(path) for path in done):
        # The last survivor to finish ends the stopped worker.
        with open(_turn(sync_dir, name, fault, FAULTY, "stopped")) as f:
            os.kill(int(f.read()), signal.SIGKILL)
    # A survivor stays until every survivor has raised, as a job's survivors do: one that went on
    # at once would close its connections, and a survivor still waiting would name it instead of
    # the faulty worker.
    deadline = time.monotonic() + 2 * (TIMEOUT_S + SLACK_S)
    while time.monotonic() < deadline and not all(os.path.exists(path) for path in done):
        time.sleep(0.01)
    return result


# The averagings each launch runs in turn: a NaN leaves its worker alive, so one launch runs
# them all; a killed or stopped worker does not come back, so each job needs one of its own, and
# the jobs are split over launches of at most JOBS_PER_LAUNCH, each well within a test's time.
JOBS_PER_LAUNCH = 5


def _batch_of(name: str, fault: str) -> tuple[str, ...]:
    names = list(ALL)
    if fault == "nan":
        return tuple(names)
    start = names.index(name) // JOBS_PER_LAUNCH * JOBS_PER_LAUNCH
    return tuple(names[start : start + JOBS_PER_LAUNCH])


def _members(names: tuple[str, ...], fault: str, world_size: int) -> dict[str, list[int]]:
    """The ranks of the launch that run each averaging's job, in the order of the job's group:
    the faulty worker is rank 1 of every group. Under a NaN every job runs on ranks 0, 1 and 2;
    otherwise job k runs on ranks 0, k + 1 and the last, which are the survivors of every job."""
    if fault == "nan":
        return {name: [0, 1, 2] for name in names}
    return {name: [0, k + 1, world_size - 1] for k, name in enumerate(names)}


def _every_averaging_fails(
    rank: int, world_size: int, names: tuple[str, ...], fault: str, sync_dir: str
) -> dict:
    """Each averaging of ``names`` in turn, each a job of three workers on a process group of its
    own, so that one job's failure cannot reach the next; a faulty worker waits for its job's
    turn."""
    members = _members(names, fault, world_size)
    groups = {name: dist.new_group(members[name]) for name in names}
    # A process's first optimizer imports torch._dynamo (seconds of CPU): every rank takes that
    # now, side by side, rather than each faulty worker on the jobs' path, one after another.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    results = {}
    for name in names:
        if rank not in members[name]:
            continue
        group_rank = members[name].index(rank)
        if group_rank == FAULTY and fault != "nan":
            while not os.path.exists(_turn(sync_dir, name, fault, 0, "turn")):
                time.sleep(0.01)
        elif group_rank == 0:
            _touch(_turn(sync_dir, name, fault, 0, "turn"))
        results[name] = _one_case(groups[name], group_rank, name, fault, sync_dir)
    return results


@functools.cache
def _launch(names: tuple[str, ...], fault: str, sync_dir: str) -> list:
    """The outcomes, by rank, of one launch running the jobs of ``names`` under ``fault``."""
    world_size = 3 if fault == "nan" else len(names) + 2
    return run_ranks_tolerating_deaths(
        world_size, _every_averaging_fails, names, fault, sync_dir, deadline_s=50.0
    )


@pytest.fixture(scope="module")
def sync_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("outer_failures"))


# Grouped by launch, so that each launch's time falls on one test: the first of its jobs.
CASES = [(name, fault) for fault in ("kill", "stop", "nan") for name in ALL]
# Over 15 s on the loaded 2-core machine: a stopped worker's launch waits out the timeout once
# per job, and the first launch also starts the server the ranks fork from.
_LAUNCH_WAITS = "a launch of five jobs, each waiting out a stopped worker's timeout"
SLOW = {
    ("average", "kill"): "the first launch: five jobs, and the server the ranks fork from",
    **{(names[0], "stop"): _LAUNCH_WAITS for names in {_batch_of(n, "stop") for n in ALL}},
}


@pytest.mark.parametrize(
    "name,fault",
    [
        pytest.param(*case, marks=pytest.mark.slow(SLOW[case])) if case in SLOW else case
        for case in CASES
    ],
)
def test_a_faulty_worker_gives_a_typed_error_within_the_timeout_and_changes_nothing(
    sync_dir, name, fault
):
    names = _batch_of(name, fault)
    outcomes = _launch(names, fault, sync_dir)
    members = _members(names, fault, len(outcomes))[name]
    if fault != "nan":  # killed, or stopped and then killed: never left behind
        faulty = outcomes[members[FAULTY]]
        assert faulty.exitcode == -signal.SIGKILL, (name, faulty)
    fault_at = float(open(os.path.join(sync_dir, f"{fault}-{name}-fault_at")).read())
    ranks = [0, 2] if fault != "nan" else [0, 1, 2]
    for rank in ranks:  # in the job's group
        outcome = outcomes[members[rank]]
        assert outcome.exitcode == 0, (rank, outcome)  # None: it hung until the deadline
        result = outcome.result[name]
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
        # The outer step after the fault raises; a streamed fragment is prepared at the fault's
        # own step and posts its messages then, so where the killed peer's connections are
        # already closed (a send to it fails as it is posted) that prepare raises first.
        raising = {FAULT_STEP + 1}
        if name in STREAMED and fault == "kill":
            raising.add(FAULT_STEP)
        assert result["step"] in raising, (rank, result)
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


# Longer than the jobs' timeout, at no cost: the test asserts that the ranks waiting on a survivor
# stop before it, once the dead worker's neighbours saw its connection close and marked the
# failure, which on a loaded machine has taken most of a second.
RING_TIMEOUT_S = 2.0


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
        failures.wait_for_every_worker([work], "the mean", group, timedelta(seconds=RING_TIMEOUT_S))
    waited_s = time.monotonic() - started
    _touch(os.path.join(sync_dir, f"done{rank}"))
    survivors = [os.path.join(sync_dir, f"done{r}") for r in range(world_size) if r != FAULTY]
    deadline = time.monotonic() + RING_TIMEOUT_S + SLACK_S
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
        assert result["waited_s"] < RING_TIMEOUT_S, (rank, result)


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
