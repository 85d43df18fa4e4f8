"""Asynchronous outer steps (gossip_ext.outer.asynchronous) on real gloo processes, against the
float64 replay of async_outer_reference.py: at unequal speeds every worker holds the theta_global
the reference computes from what it merged; every pseudo-gradient sent is merged exactly once by
every worker once they settle; a faster worker takes more steps when paced; a peer ten times
slower costs no error, a killed or stopped one is named, a NaN never leaves its owner."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from async_outer_reference import received_by, replay, sent_by
from multiprocess import run_ranks, run_ranks_tolerating_deaths

from gossip_ext.errors import NonFiniteError, PeerTimeoutError
from gossip_ext.outer.asynchronous import AsyncOuterSteps

SIZE = 300  # three blocks of a quantized message, the last one partial
INNER_LR = 0.2
EVERY = 3
OUTER = {"lr": 0.7, "momentum": 0.9}
# What a wrapper lends an outer step; these steps keep their failure themselves.
_CONTEXT = SimpleNamespace(mix=SimpleNamespace(fail=lambda error: None))


def initial() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, SIZE)


def target(rank: int) -> torch.Tensor:
    return torch.cos(torch.arange(SIZE, dtype=torch.float32) * (rank + 1))


def _engine(param, **options) -> AsyncOuterSteps:
    settings = dict(
        every=EVERY,
        delayed=True,
        grace=0.0,
        paced=False,
        timeout=timedelta(seconds=20),
        record=True,
        **OUTER,
    )
    settings.update(options)
    return AsyncOuterSteps([param], [], dist.group.WORLD, **settings)


def _inner_step(param, rank: int) -> None:
    with torch.no_grad():
        param -= INNER_LR * (param - target(rank))


def _train(rank, world_size, steps, delays, options, settle=False):
    """``steps`` inner steps at this rank's pace (a sleep of ``delays[rank]`` before each),
    the outer step every EVERY; then, ``settle``, every pseudo-gradient merged and averaged."""
    param = torch.nn.Parameter(initial())
    engine = _engine(param, **options)
    engine.start()
    begin = time.monotonic()
    for step in range(1, steps + 1):
        time.sleep(delays[rank])
        _inner_step(param, rank)
        engine.end_step(step, lambda: _CONTEXT)
    elapsed = time.monotonic() - begin
    theta = engine.outer.theta.clone()
    if settle:
        engine.average_now(steps, _CONTEXT)
    dist.barrier()
    engine.close()
    return {
        "history": engine.history,
        "theta": theta,
        "param": param.detach().clone(),
        "elapsed": elapsed,
        "period_steps": engine.period_steps,
    }


def _merged_keys(history) -> list[tuple[int, int]]:
    return [key for event in history if event[0] == "merge" for key in event[1]]


@pytest.mark.parametrize(
    "options",
    [{"delayed": True}, {"delayed": False}, {"message_dtype": "int8"}],
    ids=["delayed", "every-merge", "int8"],
)
def test_at_unequal_speeds_each_worker_holds_what_the_reference_merging_the_same_holds(options):
    delays = [0.002, 0.002, 0.02, 0.006]
    results = run_ranks(4, _train, 24, delays, options)
    delayed = options.get("delayed", True)
    for rank, result in enumerate(results):
        merges = [event for event in result["history"] if event[0] == "merge"]
        own = [key for _, keys, _, _ in merges for key in keys if key[0] == rank]
        assert own == [(rank, p) for p in range(24 // EVERY)], own  # one a merge, in order
        expected = replay(
            result["history"],
            initial(),
            world_size=4,
            every=EVERY,
            delayed=delayed,
            **OUTER,
        )
        torch.testing.assert_close(result["theta"].double(), expected, rtol=1e-5, atol=1e-5)
    # No one waited: the slow worker merged several of a fast peer's pseudo-gradients at once
    # (in one message or several).
    slow_merges = [event for event in results[2]["history"] if event[0] == "merge"]
    assert any(steps >= 3 * EVERY for _, _, steps, _ in slow_merges), slow_merges


def test_a_peer_ten_times_slower_costs_no_error_and_every_pseudo_gradient_counts_once():
    # Without momentum the rule is a sum, so once every worker merged everything they agree.
    delays = [0.003, 0.003, 0.03, 0.003]
    results = run_ranks(4, _train, 18, delays, {"momentum": 0.0}, True)
    sent = sent_by(results)
    thetas = []
    for result in results:
        received = received_by(result["history"])
        for peer in range(4):  # everything each worker sent, once, and nothing else
            torch.testing.assert_close(received[peer], sent[peer], rtol=0, atol=1e-5)
        thetas.append(
            replay(
                result["history"],
                initial(),
                world_size=4,
                every=EVERY,
                lr=OUTER["lr"],
                momentum=0.0,
                delayed=True,
            )
        )
    for theta in thetas[1:]:
        torch.testing.assert_close(theta, thetas[0], rtol=0, atol=1e-5)
    for result in results[1:]:  # average_now: one model everywhere
        torch.testing.assert_close(result["param"], results[0]["param"], rtol=0, atol=0)
    slow = results[2]["elapsed"]
    assert max(results[r]["elapsed"] for r in (0, 1, 3)) < 0.5 * slow


def test_paced_a_faster_worker_takes_more_inner_steps_between_outer_steps():
    delays = [0.01, 0.01, 0.03, 0.01]  # rank 2 three times slower
    results = run_ranks(4, _train, 60, delays, {"paced": True})
    assert results[2]["period_steps"] == EVERY
    for rank in (0, 1, 3):
        # As many steps as the slow worker's EVERY take: about 3 * EVERY (the sleep is most of
        # a step here).
        assert 2 * EVERY <= results[rank]["period_steps"] <= 4 * EVERY, results[rank]
        sends = [e for e in results[rank]["history"] if e[0] == "send"]
        assert sends[-1][3] == results[rank]["period_steps"] or sends[-1][3] >= 2 * EVERY


def test_a_learned_grace_makes_merges_whole_at_equal_speeds_and_never_waits_for_a_slow_peer():
    # Equal speeds: once each peer's pace is learned, an outer step waits for the peers whose
    # message is due and merges whole rounds.
    results = run_ranks(4, _train, 60, [0.01] * 4, {"grace": "learned"})
    for result in results:
        merges = [keys for kind, keys, *_ in result["history"] if kind == "merge"]
        whole = sum(len({peer for peer, _ in keys}) == 4 for keys in merges[6:])
        assert whole >= 0.6 * len(merges[6:]), merges
    # A peer four times slower is due far later than half a fast worker's period: no one waits.
    delays = [0.01, 0.01, 0.04, 0.01]
    results = run_ranks(4, _train, 36, delays, {"grace": "learned"})
    slow = results[2]["elapsed"]
    assert max(results[r]["elapsed"] for r in (0, 1, 3)) < 0.6 * slow, results


MIDWAY_TIMEOUT = timedelta(seconds=1)


def _fails_midway(rank, world_size, sync_dir, how):
    param = torch.nn.Parameter(initial())
    engine = _engine(param, timeout=MIDWAY_TIMEOUT)
    engine.start()
    begin = time.monotonic()
    for step in range(1, 100_000):
        if rank == 1 and step == 6:
            with open(os.path.join(sync_dir, "failed_at"), "w") as f:
                f.write(f"{time.time()} {os.getpid()}")
            os.kill(os.getpid(), how)
        time.sleep(0.01)
        _inner_step(param, rank)
        try:
            engine.end_step(step, lambda: _CONTEXT)
        except PeerTimeoutError as error:
            model = param.detach().clone()
            later = None
            try:
                engine.end_step(step + 1, lambda: _CONTEXT)
            except PeerTimeoutError as again:
                later = again.peers
            raised_at = time.time()
            # Every survivor names the failed peer before any of them leaves (a peer leaving
            # is a failure of its own, to those that have not yet raised).
            open(os.path.join(sync_dir, f"raised{rank}"), "w").close()
            while len([n for n in os.listdir(sync_dir) if n.startswith("raised")]) < 3:
                time.sleep(0.05)
            engine.close()
            if rank == 0 and how == signal.SIGSTOP:  # the stopped peer is not left behind
                os.kill(int(_failure(sync_dir)[1]), signal.SIGKILL)
            return {
                "peers": error.peers,
                "message": str(error)[:300],
                "raised_at": raised_at,
                "later": later,
                "finite": bool(torch.isfinite(model).all()),
            }
        if time.monotonic() - begin > 30:
            break
    engine.close()
    return None


def _failure(sync_dir) -> list[str]:
    with open(os.path.join(sync_dir, "failed_at")) as f:
        return f.read().split()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_killed_or_stopped_peer_is_named_by_every_survivor_within_the_timeout(tmp_path, how):
    outcomes = run_ranks_tolerating_deaths(4, _fails_midway, str(tmp_path), how, deadline_s=45.0)
    failed_at = float(_failure(tmp_path)[0])
    for rank in (0, 2, 3):
        outcome = outcomes[rank]
        assert outcome.exitcode == 0, (rank, outcome)
        assert outcome.result is not None, rank
        assert outcome.result["peers"] == (1,), (rank, outcome.result["message"])
        assert outcome.result["later"] == (1,), rank  # the error stays raised
        assert outcome.result["finite"], rank
        # The timeout, then at most the second a survivor looks whether a peer whose connection
        # closed said it left (Note [A failure closes more than its pair]), and slack for load.
        limit_s = MIDWAY_TIMEOUT.total_seconds() + 3.0
        assert outcome.result["raised_at"] - failed_at < limit_s, (rank, outcome.result)


def _a_nan_appears(rank, world_size):
    param = torch.nn.Parameter(initial())
    engine = _engine(param, grace=1.0, timeout=timedelta(seconds=20))
    engine.start()
    errors = []
    for step in range(1, 2 * EVERY + 1):
        _inner_step(param, rank)
        if rank == 1 and step == EVERY:
            with torch.no_grad():
                param[7] = float("nan")
        try:
            engine.end_step(step, lambda: _CONTEXT)
        except NonFiniteError as error:
            errors.append((error.peers, error.round))
    theta = engine.outer.theta.clone()
    dist.barrier()
    engine.close()
    return errors, theta


def test_a_nan_is_named_by_its_owner_and_never_sent():
    results = run_ranks(2, _a_nan_appears)
    # Rank 1 names its own parameters at its first outer step, before sending, and every later
    # call raises the same; rank 0 never receives a NaN (its grace runs out).
    assert results[1][0] == [((), 0)] * (EVERY + 1)
    assert results[0][0] == []
    assert torch.isfinite(results[0][1]).all()
