"""GossipDataParallel(outer=AsyncDiLoCo(...)) as a user trains with it, on real processes over
gloo: at equal speeds with a grace long enough to hear everyone it trains as synchronous DiLoCo
with Nesterov momentum does; with a slow worker the others do not wait for it, every model a user
reads is a valid one and ``average_parameters()`` ends with one model; a user who catches a
dead peer's error (under AsyncDiLoCo or AsyncSGP) reads a valid model; the checkpoint holds the
outer state; bad arguments and combinations are named."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks, run_ranks_tolerating_deaths
from test_async_sgp import _batch, _net  # the same task, as the wrapper's AsyncSGP tests
from torch import nn

import gossip_ext
from gossip_ext.errors import PeerTimeoutError

INNER_LR = 0.05
EVERY = 4


def _step(model, opt, rank, step) -> None:
    x, y = _batch(rank, step)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    model.transfer_params()


def _train(rank, world_size, outer, steps, delays, group=None):
    model = gossip_ext.GossipDataParallel(_net(), gossip=None, outer=outer, process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    begin = time.monotonic()
    finite = True
    for step in range(steps):
        time.sleep(delays[rank])
        _step(model, opt, rank, step)
        # What a user reads between steps is a model: finite, and what the module computes with.
        finite &= all(bool(torch.isfinite(v).all()) for v in model.module.state_dict().values())
    elapsed = time.monotonic() - begin
    state = {k: v.clone() for k, v in model.module.state_dict().items()}
    if isinstance(outer, gossip_ext.AsyncDiLoCo):
        model.average_parameters()  # every pseudo-gradient merged, then one model
    averaged = {k: v.clone() for k, v in model.module.state_dict().items()}
    with torch.no_grad():
        x, y = _batch(world_size, 10_000)  # held out: no rank trained on it
        loss = float(nn.functional.mse_loss(model(x), y))
    return {
        "state": state,
        "averaged": averaged,
        "loss": loss,
        "elapsed": elapsed,
        "finite": finite,
    }


def _synchronous_and_both_asynchronous(rank, world_size, steps):
    synchronous = _train(
        rank,
        world_size,
        gossip_ext.DiLoCo(
            lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True), every=EVERY
        ),
        steps,
        [0.0] * world_size,
    )
    # A grace long enough to hear every worker: each outer step merges one whole round, as long
    # as no worker finishes its next period before a peer heard the last of this one. Equal
    # speeds, then, means steps (20 ms here) much longer than a message's trip under load: with
    # steps of a millisecond a worker may run a period ahead and merge two at once. Each on a
    # process group of its own, so that one's messages never reach the other.
    asynchronous = {}
    for delayed in (True, False):
        asynchronous[delayed] = _train(
            rank,
            world_size,
            gossip_ext.AsyncDiLoCo(every=EVERY, lr=0.7, momentum=0.9, delayed=delayed, grace=30.0),
            steps,
            [0.02] * world_size,
            group=dist.new_group(list(range(world_size))),
        )
    return synchronous, asynchronous


@pytest.fixture(scope="module")
def equal_speeds() -> list:
    return run_ranks(4, _synchronous_and_both_asynchronous, 4 * EVERY)


@pytest.mark.parametrize("delayed", [True, False])
def test_with_equal_speeds_and_a_grace_it_trains_as_synchronous_diloco(equal_speeds, delayed):
    for synchronous, both in equal_speeds:
        asynchronous = both[delayed]
        for name, value in synchronous["state"].items():
            torch.testing.assert_close(asynchronous["state"][name], value, rtol=1e-5, atol=1e-6)


def _untrained_loss() -> float:
    x, y = _batch(4, 10_000)
    with torch.no_grad():
        return float(nn.functional.mse_loss(_net()(x), y))


def test_with_a_slow_worker_no_one_waits_every_model_is_valid_and_the_average_is_one():
    delays = [0.005, 0.005, 0.02, 0.005]  # rank 2 four times slower
    outer = gossip_ext.AsyncDiLoCo(every=EVERY, lr=0.5, message_dtype="int8")
    results = run_ranks(4, _train, outer, 48, delays)
    slow = results[2]["elapsed"]
    for rank in (0, 1, 3):
        assert results[rank]["elapsed"] < 0.6 * slow, [r["elapsed"] for r in results]
    before = _untrained_loss()
    for result in results:
        assert result["finite"]
        assert result["loss"] < 0.5 * before, (result["loss"], before)
        for name, value in result["averaged"].items():
            torch.testing.assert_close(value, results[0]["averaged"][name], rtol=0, atol=0)


def _killed_while_training(rank, world_size, sync_dir, outer, gossip):
    # A process's first optimizer imports torch._dynamo (seconds): taken before the ranks start
    # together, so that a rank still importing is not taken for a stalled one.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=INNER_LR)
    dist.barrier()
    model = gossip_ext.GossipDataParallel(
        _net(), gossip=gossip, outer=outer, timeout=timedelta(seconds=1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    for step in range(100_000):
        if rank == 1 and step == 5:
            open(os.path.join(sync_dir, "killed"), "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.01)
        try:
            _step(model, opt, rank, step)
        except PeerTimeoutError as error:
            # What a user does next: read the module, evaluate it, save it (the wrapper's own
            # calls raise the error again, as after any failed round).
            state = model.module.state_dict()
            model.module.eval()
            with torch.no_grad():
                x, _ = _batch(world_size, 10_000)
                output = model.module(x)
            again = None
            try:
                _step(model, opt, rank, step + 1)
            except PeerTimeoutError as later:
                again = later.peers
            return {
                "peers": error.peers,
                "finite": all(bool(torch.isfinite(v).all()) for v in state.values())
                and bool(torch.isfinite(output).all()),
                "again": again,
            }
        if step > 3000:
            break
    return None


@pytest.mark.parametrize(
    "gossip,outer",
    [(None, gossip_ext.AsyncDiLoCo(every=2)), (gossip_ext.AsyncSGP(), None)],
    ids=["AsyncDiLoCo", "AsyncSGP"],
)
def test_a_user_who_catches_a_dead_peers_error_reads_a_valid_model(tmp_path, gossip, outer):
    outcomes = run_ranks_tolerating_deaths(
        4, _killed_while_training, str(tmp_path), outer, gossip, deadline_s=60.0
    )
    assert outcomes[1].exitcode == -signal.SIGKILL
    named = 0
    for rank in (0, 2, 3):
        result = outcomes[rank].result
        if result is None:  # under AsyncSGP, a rank that never hears from or sends to rank 1
            continue
        named += 1
        assert result["peers"] == (1,), (rank, result)
        assert result["finite"], rank
        assert result["again"] == (1,), rank  # the error stays raised
    assert named >= (3 if outer is not None else 2)


def _checkpointed(rank, world_size):
    # A grace to merge the peer's pseudo-gradients too, short: the last outer step may wait it
    # out in full (a worker that stopped stepping posts no more of what it owes).
    outer = gossip_ext.AsyncDiLoCo(every=2, grace=1.0)
    model = gossip_ext.GossipDataParallel(_net(), gossip=None, outer=outer)
    opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    for step in range(6):
        _step(model, opt, rank, step)
    saved = model.state_dict()
    resumed = gossip_ext.GossipDataParallel(_net(), gossip=None, outer=outer)
    resumed.load_state_dict(saved)
    dist.barrier()
    return saved["_extra_state"], resumed.state_dict()["_extra_state"], dist.get_rank()


def test_the_checkpoint_holds_the_outer_state_and_a_resumed_model_takes_it():
    for saved, resumed, _ in run_ranks(2, _checkpointed):
        state, again = saved["async_outer"], resumed["async_outer"]
        assert state["steps"] == 3  # three outer steps of two inner steps each
        for name in ("theta", "velocity", "accumulated"):
            torch.testing.assert_close(again[name], state[name], rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"every": 0}, ValueError, "AsyncDiLoCo(every=...): every must be >= 1"),
        ({"every": 4, "lr": -1.0}, ValueError, "AsyncDiLoCo(lr=...): lr must be positive"),
        ({"every": 4, "momentum": 1.0}, ValueError, "momentum must be in [0, 1), got 1.0"),
        ({"every": 4, "grace": -1.0}, ValueError, "grace must be >= 0 seconds"),
        ({"every": 4, "grace": "long"}, TypeError, 'grace must be a float or "learned"'),
        ({"every": 4, "paced": 1}, TypeError, "AsyncDiLoCo(paced=...): paced must be a bool"),
        ({"every": 4, "message_dtype": "int3"}, ValueError, "message_dtype must be"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, words):
    with pytest.raises(error) as raised:
        gossip_ext.AsyncDiLoCo(**kwargs)
    assert words in str(raised.value)


@pytest.mark.parametrize(
    "settings,words",
    [
        ({"gossip": gossip_ext.SGP()}, "gossip=SGP("),
        ({"gossip": gossip_ext.AsyncSGP()}, "gossip=AsyncSGP("),
        ({"gossip": None, "membership": gossip_ext.Elastic("127.0.0.1:1")}, "membership="),
        ({"gossip": None, "nprocs_per_node": 2}, "nprocs_per_node=2"),
    ],
)
def test_a_combination_it_cannot_run_beside_is_refused_naming_both(settings, words):
    with pytest.raises(ValueError) as raised:
        gossip_ext.algorithms.Configuration(outer=gossip_ext.AsyncDiLoCo(every=4), **settings)
    assert words in str(raised.value) and "AsyncDiLoCo(" in str(raised.value)
