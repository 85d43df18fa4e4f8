"""Asynchronous push-sum (gossip_ext.gossip.asynchronous) on real gloo processes, against the
references of async_reference.py: the same arrival order gives the same models, equal speeds and
no staleness give synchronous SGP, the mass is conserved at quiescence whatever the speeds, a
slow peer costs no error and a killed one is named."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from async_reference import quadratic_step, replay, synchronous_sgp
from multiprocess import run_ranks, run_ranks_tolerating_deaths

from gossip_ext.errors import NonFiniteError, PeerTimeoutError
from gossip_ext.gossip import messages
from gossip_ext.gossip.asynchronous import AsyncPushSum
from gossip_ext.gossip.messages import flatten
from gossip_ext.graphs import NPeerDynamicDirectedExponentialGraph

LR = 0.3
SIZE = 300  # three blocks of a quantized message, the last one partial


def initial(rank: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, SIZE) * (rank + 1) + rank


def target(rank: int) -> torch.Tensor:
    return torch.cos(torch.arange(SIZE, dtype=torch.float32) * (rank + 1))


def _engine(param, **options) -> AsyncPushSum:
    """This rank's asynchronous push-sum over ``param`` on the default group and graph."""
    return AsyncPushSum(
        [param], dist.group.WORLD, NPeerDynamicDirectedExponentialGraph(), **options
    )


def _train(rank, world_size, *, steps=None, seconds=None, delays, staleness, message_dtype=None):
    """Steps on a quadratic at this rank's pace (a sleep of ``delays[rank]`` before each step),
    gossiping asynchronously after each, for ``steps`` steps or ``seconds`` seconds; then
    settles. Returns what the assertions need: the history, z, w and the numerators added by
    the local steps."""
    param = torch.nn.Parameter(initial(rank))
    engine = _engine(
        param,
        staleness=staleness,
        message_dtype=message_dtype,
        timeout=timedelta(seconds=30),
        record=True,
    )
    added = torch.zeros(SIZE, dtype=torch.float64)
    begin, taken = time.monotonic(), 0
    while (taken < steps) if steps is not None else (time.monotonic() - begin < seconds):
        time.sleep(delays[rank])
        weight = float(engine.ps_weight())
        with torch.no_grad():
            stepped = quadratic_step(param, target(rank), LR)
            added += weight * (stepped.double() - param.double())
            param.copy_(stepped)
        engine.history.append(("step",))
        engine.start_round()
        taken += 1
    engine.settle()
    result = {
        "history": engine.history,
        "z": param.detach().clone(),
        "w": float(engine.ps_weight()),
        "added": added,
        "steps": taken,
        "statistics": engine.statistics(),
    }
    engine.close()
    return result


def test_with_equal_speeds_and_no_staleness_it_is_synchronous_sgp():
    results = run_ranks(4, _train_fixed, 6, [0.0] * 4, 0)
    expected = synchronous_sgp(
        [initial(r) for r in range(4)],
        [target(r) for r in range(4)],
        LR,
        6,
        NPeerDynamicDirectedExponentialGraph(),
    )
    for rank, result in enumerate(results):
        # Every absorb took exactly the round just sent, as the synchronous schedule does.
        absorbed = [event[1] for event in result["history"] if event[0] == "absorb"]
        assert [{r for _, r in a} for a in absorbed] == [{t} for t in range(6)], rank
        torch.testing.assert_close(result["z"].double(), expected[rank], rtol=1e-5, atol=1e-5)
        assert result["w"] == pytest.approx(1.0, abs=1e-12)


def _train_fixed(rank, world_size, steps, delays, staleness, message_dtype=None):
    return _train(
        rank,
        world_size,
        steps=steps,
        delays=delays,
        staleness=staleness,
        message_dtype=message_dtype,
    )


@pytest.mark.parametrize("staleness", [None, 2])
def test_at_unequal_speeds_it_ends_where_the_reference_fed_the_same_arrivals_ends(staleness):
    delays = [0.0, 0.01, 0.03, 0.0]  # rank 2 steps at a fraction of ranks 0 and 3's pace
    results = run_ranks(4, _train_fixed, 12, delays, staleness)
    z, w = _replayed(results)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["z"].double(), z[rank], rtol=1e-5, atol=1e-5)
        assert result["w"] == pytest.approx(w[rank], rel=1e-12)
    _assert_mass_conserved(results)
    # The run was asynchronous: some absorb took a round other than the receiver's own.
    assert any(
        r != event_round
        for result in results
        for event_round, event in _absorbs_with_own_round(result["history"])
        for _, r in event[1]
    )
    if staleness is not None:
        for result in results:  # no absorb ever took a round beyond its own + staleness
            for own, event in _absorbs_with_own_round(result["history"]):
                assert max(r for _, r in event[1]) <= own + staleness
    _assert_statistics_tell_the_history(results)


def _assert_statistics_tell_the_history(results):
    """Each worker's counts are what its history shows: the shares its schedule named, those
    sent (the rest held back: nobody left), the messages absorbed and how stale they were."""
    graph, world_size = NPeerDynamicDirectedExponentialGraph(), len(results)
    for rank, result in enumerate(results):
        history, counts = result["history"], result["statistics"]
        sends = [event for event in history if event[0] == "send"]
        scheduled = sum(len(graph.out_peers(rank, world_size, event[1])) for event in sends)
        sent = sum(len(event[2]) for event in sends)
        lags = [own - r for own, event in _absorbs_with_own_round(history) for _, r in event[1]]
        assert counts["scheduled"] == scheduled, rank
        assert counts["sent"] == sent, rank
        assert counts["held_back"] == scheduled - sent, rank
        assert counts["messages"] == len(lags), rank
        assert counts["mean_staleness"] == pytest.approx(sum(lags) / len(lags)), rank
        assert counts["max_staleness"] == max(lags), rank


def _replayed(results):
    """The reference's (z, w) of every worker, fed the run's arrivals."""
    world_size = len(results)
    return replay(
        [initial(r) for r in range(world_size)],
        [target(r) for r in range(world_size)],
        LR,
        [result["history"] for result in results],
    )


def _absorbs_with_own_round(history):
    """Each absorb with the round its worker had sent last."""
    own = -1
    for event in history:
        if event[0] == "send":
            own = event[1]
        elif event[0] == "absorb":
            yield own, event


def _assert_mass_conserved(results, rtol=1e-5):
    world_size = len(results)
    assert sum(result["w"] for result in results) == pytest.approx(world_size, abs=1e-9)
    held = sum(result["w"] * result["z"].double() for result in results)
    start = sum(initial(r).double() for r in range(world_size))
    added = sum(result["added"] for result in results)
    torch.testing.assert_close(held, start + added, rtol=rtol, atol=rtol)


# What one message's rounding moves a model by, at most, after error feedback (measured over
# ten steps at |z| <= 2: 0.004, 0.010 and 0.076), with room for the arrival order's variation.
ROUNDING = {torch.bfloat16: 0.02, "int8": 0.04, torch.float8_e4m3fn: 0.25}


@pytest.mark.parametrize("message_dtype", list(ROUNDING))
def test_compressed_messages_conserve_the_mass_and_track_full_precision(message_dtype):
    results = run_ranks(4, _train_fixed, 10, [0.0, 0.004, 0.0, 0.0], None, message_dtype)
    _assert_mass_conserved(results)
    # The same arrivals in full precision: the rounding stays within a message's.
    z, _ = _replayed(results)
    for rank, result in enumerate(results):
        torch.testing.assert_close(
            result["z"].double(), z[rank], rtol=0, atol=ROUNDING[message_dtype]
        )


def _train_for(rank, world_size, seconds, delays):
    return _train(rank, world_size, seconds=seconds, delays=delays, staleness=None)


def test_a_peer_ten_times_slower_costs_no_error_no_mass_and_no_one_waits_for_it():
    delays = [0.005, 0.05, 0.005, 0.005]
    results = run_ranks(4, _train_for, 3.0, delays)
    _assert_mass_conserved(results)
    fast = min(results[r]["steps"] for r in (0, 2, 3))
    assert fast >= 4 * results[1]["steps"], [r["steps"] for r in results]


def _killed_midway(rank, world_size, sync_dir):
    param = torch.nn.Parameter(initial(rank))
    engine = _engine(param, staleness=None, timeout=timedelta(seconds=20))
    for step in range(400):
        if rank == 1 and step == 5:
            with open(os.path.join(sync_dir, "killed_at"), "w") as f:
                f.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.01)
        try:
            engine.start_round()
        except PeerTimeoutError as error:
            engine.close()
            return {
                "peers": error.peers,
                "raised_at": time.time(),
                "step": step,
                "timeout": error.timeout,
                "message": str(error),
            }
    engine.close()
    return None


def test_a_killed_peer_is_named_by_the_survivors_that_hear_from_it_or_send_to_it(tmp_path):
    outcomes = run_ranks_tolerating_deaths(4, _killed_midway, str(tmp_path), deadline_s=90.0)
    assert outcomes[1].exitcode == -signal.SIGKILL
    killed_at = float((tmp_path / "killed_at").read_text())
    for rank in (0, 2, 3):
        outcome = outcomes[rank]
        assert outcome.exitcode == 0, (rank, outcome)
        # Each survivor sends to or hears from rank 1 (the 1-peer exponential graph on 4).
        assert outcome.result is not None, rank
        assert outcome.result["peers"] == (1,), (rank, outcome.result)
        assert outcome.result["raised_at"] - killed_at < 20.0, rank
        # Seen before any 20 s wait ran out: the error says how (a connection that closed), and
        # claims no timeout it did not wait out.
        assert outcome.result["timeout"] is None, (rank, outcome.result)
        assert "saw its connection close" in outcome.result["message"], outcome.result
        assert "within 0:00:20" not in outcome.result["message"], outcome.result


def _one_finishes_early(rank, world_size):
    param = torch.nn.Parameter(initial(rank))
    engine = _engine(param, staleness=None, timeout=timedelta(seconds=20))
    steps = 3 if rank == 0 else 40
    for _ in range(steps):
        time.sleep(0.01)
        engine.start_round()
    engine.close()
    return steps


def test_a_worker_that_finishes_first_is_let_go_without_an_error():
    # Rank 0 leaves after 3 steps and its process exits; the others, which send to it and hear
    # from it, take 37 more steps without waiting for it or taking its exit for a failure.
    outcomes = run_ranks_tolerating_deaths(4, _one_finishes_early, deadline_s=60.0)
    assert [o.exitcode for o in outcomes] == [0] * 4, outcomes
    assert [o.result for o in outcomes] == [3, 40, 40, 40]


def _until_told(path: str, meanwhile) -> None:
    """Calls ``meanwhile`` every millisecond until another rank creates the file ``path``."""
    while not os.path.exists(path):
        time.sleep(0.001)
        meanwhile()


def _one_starts_late(rank, world_size, started_file):
    param = torch.nn.Parameter(initial(rank))
    engine = _engine(param, staleness=None, timeout=timedelta(seconds=20))
    weight_alone = None
    if rank == 0:  # 20 rounds while rank 1 receives but has not stepped yet
        for _ in range(20):
            time.sleep(0.005)
            engine.start_round()
        weight_alone = float(engine.ps_weight())
        open(started_file, "w").close()
    else:
        _until_told(started_file, lambda: None)
    dist.barrier()
    engine.settle()
    result = (weight_alone, float(engine.ps_weight()), param.detach().clone())
    engine.close()
    return result


def test_a_peer_that_has_not_started_does_not_collect_a_workers_weight(tmp_path):
    # Rank 1's mailbox takes rank 0's messages but rank 1 absorbs none: rank 0 sends one share
    # it holds and one on the link, then keeps its weight (1/4), where it used to halve it every
    # round (2^-20) and then take whatever stale message came next for its model (Note [Flow
    # control by absorption]).
    (alone, w0, z0), (_, w1, z1) = run_ranks(2, _one_starts_late, str(tmp_path / "started"))
    assert alone == pytest.approx(0.25), alone
    # Settled, nothing is lost: the weights sum to 2 and the numerators to the initial models.
    assert w0 + w1 == pytest.approx(2.0)
    torch.testing.assert_close(w0 * z0 + w1 * z1, initial(0) + initial(1), rtol=1e-5, atol=1e-5)


def _hears_from_nobody(rank, world_size, rounds, done_file):
    param = torch.nn.Parameter(initial(rank))
    engine = _engine(param, staleness=None, message_dtype="int8", timeout=timedelta(seconds=30))
    if rank == 1:  # rank 0 stopped sending but lives on, absorbing every message it is sent
        while engine.round < rounds and float(engine.ps_weight()) >= 1e-46:
            time.sleep(0.001)  # a step's compute
            engine.start_round()
        open(done_file, "w").close()
    else:
        # Absorbed, not only received: a sender's next share waits for its last to be absorbed
        # (Note [Flow control by absorption] in csrc/engine/async_push_sum.h).
        _until_told(done_file, engine.finish_round)
    dist.barrier()
    result = (param.detach().clone(), float(engine.ps_weight()), engine.round)
    engine.close()
    return result


def test_a_worker_whose_weight_underflows_keeps_a_finite_model(tmp_path):
    # Each round halves rank 1's weight and nothing comes back (rank 0 absorbs and sends
    # nothing): past 150 rounds it is below
    # what float32 holds, which scaled values would have underflowed with. Its model stays what
    # it was: z is never scaled by the weight (Note [Scale-free shares]).
    _, (z, weight, rounds) = run_ranks(2, _hears_from_nobody, 4000, str(tmp_path / "done"))
    assert weight < 1e-46, (weight, rounds)  # reached before the 4,000th round
    assert torch.isfinite(z).all()
    torch.testing.assert_close(z, initial(1), rtol=0, atol=0.05)  # int8 rounding, fed back


def _a_nan_arrives(rank, world_size):
    param = torch.nn.Parameter(initial(rank))
    engine = _engine(param, staleness=0, timeout=timedelta(seconds=20))
    if rank == 1:
        with torch.no_grad():
            param[7] = float("nan")
    errors = []
    for _ in range(2):  # the error is named once and stays raised
        try:
            engine.start_round()
        except NonFiniteError as error:
            errors.append((error.peers, error.round))
    before = param.detach().clone()
    engine.close()
    return errors, before


def test_a_nan_is_named_by_its_owner_and_never_sent():
    (errors0, model0), (errors1, _) = run_ranks(2, _a_nan_arrives)
    # Rank 1 names its own parameters before it sends them; nothing non-finite reaches rank 0.
    assert errors1 == [((), 0), ((), 0)]
    assert torch.isfinite(model0).all()


def _a_nan_is_sent(rank, world_size, message_dtype):
    # Rank 1 does not check its own parameters, so its NaN travels; rank 0 must catch it.
    param = torch.nn.Parameter(initial(rank))
    engine = _engine(
        param,
        staleness=0,
        message_dtype=message_dtype,
        check_finite=rank == 0,
        timeout=timedelta(seconds=20),
    )
    if rank == 1:
        with torch.no_grad():
            param[200] = float("inf")
    error = None
    try:
        engine.start_round()
    except NonFiniteError as caught:
        error = (caught.peers, caught.round)
    before = param.detach().clone()
    engine.close()
    return error, before


@pytest.mark.parametrize("message_dtype", [None, torch.bfloat16, "int8"])
def test_a_peers_nan_is_named_by_its_receiver_which_keeps_its_model(message_dtype):
    (error0, model0), (error1, _) = run_ranks(2, _a_nan_is_sent, message_dtype)
    assert error0 == ((1,), 1), error0
    assert error1 is None
    # What rank 0 held after its own send: its own model, untouched by the absorb it refused.
    assert torch.isfinite(model0).all()
    assert (model0 - initial(0)).abs().max() < 0.05  # its own send's rounding, kept


@pytest.mark.extension
@pytest.mark.parametrize("message_dtype", [None, torch.bfloat16, torch.float16, "int8", "int4"])
def test_every_codec_keeps_its_rounding_and_absorbs_as_its_formula_says(message_dtype):
    # The compiled kernels behind the asynchronous messages, against their formulas on what the
    # receiver reads: a send keeps f (v - q) in v; an absorb is (a x + q) / w'.
    codec = messages.codec(SIZE, torch.float32, message_dtype)
    values = torch.linspace(-3.0, 2.0, SIZE)
    kept = values.clone()
    message = codec.encode([kept], 0.25, 7, aux=1.5, feedback=2.0)
    assert message.numel() == codec.nbytes
    header = (messages.weight_of(message), messages.round_of(message), messages.aux_of(message))
    assert header == (0.25, 7, 1.5)
    (read,) = codec.read(message)
    torch.testing.assert_close(kept, values + 2.0 * (values - read), rtol=0, atol=1e-6)
    # Half a level of the largest block's scale (|v| <= 3): 3 / 14 for int4, 3 / 254 for int8.
    assert (read - values).abs().max() <= (3 / 14 if message_dtype == "int4" else 0.012) + 1e-6
    x = initial(0)
    expected = (3.0 * x + read) / 4.0
    codec.absorb([x], message, 3.0, 4.0)
    torch.testing.assert_close(x, expected, rtol=0, atol=1e-6)
    assert codec.values_finite(message)
    values[5] = float("nan")
    assert not codec.values_finite(codec.encode([values.clone()], 1.0, 0))


def test_a_message_dtype_the_codec_cannot_send_is_refused_by_name():
    for bad in (torch.float32, 3, "int3"):
        with pytest.raises(ValueError, match="message_dtype"):
            messages.codec(SIZE, torch.float32, bad)


def test_parameters_gathered_into_a_kept_buffer_equal_a_fresh_copy_whatever_their_dtypes():
    # AsyncPushSum's round gathers into one buffer it keeps; parameters of another dtype (a
    # bfloat16 layer beside float32 ones) are cast on the way in, as a fresh copy casts them.
    tensors = [torch.randn(3, 5), torch.randn(7).to(torch.bfloat16), torch.randn(2, 2)]
    expected = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])
    out = torch.full((26,), float("nan"))
    assert flatten(tensors, torch.float32, out) is out
    assert torch.equal(out, expected)
    same = [tensors[0], tensors[2]]
    out = torch.full((19,), float("nan"))
    assert flatten(same, torch.float32, out) is out
    assert torch.equal(out, torch.cat([t.reshape(-1) for t in same]))
    assert torch.equal(flatten(tensors, torch.float32), expected)
