"""A stalled or dead peer: every other rank raises an error naming the peer instead of hanging."""

import os
import re
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks, run_ranks_tolerating_deaths
from torch import nn

import gossip_ext
from gossip_ext.compat.fairscale import SlowMoDistributedDataParallel

# The wrapper's timeout in the tests that wait one out: a fraction of a second, as a job may set.
STALL_TIMEOUT = timedelta(seconds=0.5)


def _stall_until(path: str, at_most_s: float = 30.0) -> None:
    """A stalled worker: alive, connected, gossiping nothing, until ``path`` exists (the other
    rank has seen what it waited for) or ``at_most_s`` passed."""
    end = time.monotonic() + at_most_s
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.01)


def _one_rank_stalls(rank: int, world_size: int, sync_dir: str) -> dict:
    model = gossip_ext.GossipDataParallel(nn.Linear(3, 1), timeout=STALL_TIMEOUT)
    seen = os.path.join(sync_dir, "seen")
    if rank == 1:
        _stall_until(seen)  # never gossips
        return {}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    model.transfer_params()
    start = time.perf_counter()
    try:
        model(torch.ones(1, 3))
    except TimeoutError as error:
        elapsed = time.perf_counter() - start
        # The engine stays failed: the next call raises the same error instead of waiting again.
        try:
            model.transfer_params()
            repeated = None
        except TimeoutError as again:
            repeated = str(again)
        _touch(seen)
        return {
            "error": str(error),
            "elapsed": elapsed,
            "repeated": repeated,
            "type": type(error),
            "data": _failure_data(error),
        }
    _touch(seen)
    return {"error": None}


def _failure_data(error: BaseException) -> dict | None:
    """A typed peer failure's attributes (None for another error), for the test to compare."""
    if not isinstance(error, (gossip_ext.PeerTimeoutError, gossip_ext.NonFiniteError)):
        return None
    names = ("peers", "round", "transport", "timeout")
    return {name: getattr(error, name, None) for name in names}


def test_a_stalled_peer_raises_timeout_naming_the_peer_and_round(tmp_path):
    results = run_ranks(2, _one_rank_stalls, str(tmp_path))
    r = results[0]
    assert r["error"] is not None, "the forward did not time out"
    assert "peers [1]" in r["error"] and "round 0" in r["error"], r["error"]
    # The same as data: a TimeoutError whose attributes name the peer and the round.
    assert r["type"] is gossip_ext.PeerTimeoutError and issubclass(r["type"], TimeoutError)
    assert r["data"] == {
        "peers": (1,),
        "round": 0,
        "transport": "process_group(gloo)",
        "timeout": STALL_TIMEOUT,
    }, r["data"]
    # Within the timeout plus scheduling slack on a loaded machine: no hang.
    timeout_s = STALL_TIMEOUT.total_seconds()
    assert 0.9 * timeout_s <= r["elapsed"] < timeout_s + 9.0, r["elapsed"]
    assert r["repeated"] == r["error"]


def _a_round_given_up(rank: int, world_size: int, sync_dir: str) -> dict:
    """Rank 1 stalls; rank 0's round waiting for it is given up from another thread (what an
    elastic worker's watch does when a peer's heartbeat stops), long before the timeout."""
    import threading

    model = gossip_ext.GossipDataParallel(nn.Linear(3, 1), timeout=timedelta(seconds=60))
    seen = os.path.join(sync_dir, "seen")
    if rank == 1:
        _stall_until(seen)
        return {}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    model.transfer_params()
    before = [p.detach().clone() for p in model.module.parameters()]
    threading.Timer(0.5, model.runtime.mix.abandon, ["worker 1's heartbeat stopped"]).start()
    start = time.perf_counter()
    try:
        model(torch.ones(1, 3))
    except TimeoutError as error:
        elapsed = time.perf_counter() - start
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.module.parameters()))
        try:
            model.transfer_params()
            repeated = None
        except TimeoutError as again:
            repeated = str(again)
        _touch(seen)
        return {
            "error": str(error),
            "elapsed": elapsed,
            "unchanged": unchanged,
            "repeated": repeated,
        }
    _touch(seen)
    return {"error": None}


def test_a_round_given_up_from_another_thread_raises_at_once_and_stays_failed(tmp_path):
    r = run_ranks(2, _a_round_given_up, str(tmp_path))[0]
    assert r["error"] is not None, "the forward did not raise"
    assert "gave up gossip round 0: worker 1's heartbeat stopped" in r["error"], r["error"]
    assert 0.4 <= r["elapsed"] < 5.0, r["elapsed"]  # the 60 s timeout never came into it
    assert r["unchanged"], "a given-up round changed the parameters"
    assert r["repeated"] == r["error"]


def _disagreeing_ranks(rank: int, world_size: int) -> str:
    graph = (
        gossip_ext.RingGraph() if rank == 2 else gossip_ext.NPeerDynamicDirectedExponentialGraph()
    )
    try:
        gossip_ext.GossipDataParallel(nn.Linear(3, 1), graph=graph)
    except ValueError as error:
        return str(error)
    return ""


def test_ranks_that_disagree_on_the_configuration_all_raise_naming_the_rank():
    errors = run_ranks(3, _disagreeing_ranks)
    for error in errors:  # every rank raises, before any gossip
        assert "rank 2 was configured differently" in error, error
        assert "RingGraph" in error and "NPeerDynamicDirectedExponentialGraph" in error, error


DEAD_PEER_TIMEOUT_S = 2.0
# On top of the timeout: two cores shared by every rank and by other jobs.
SCHEDULING_SLACK_S = 8.0


def _complete_graph(world_size: int) -> gossip_ext.CustomGraph:
    """Every rank sends to every other rank in every round, so every survivor waits for the dead
    rank in the very round it stops gossiping; on a sparser graph a survivor may first wait for
    another survivor that has already failed, and then rightly names that one."""
    books = [[(r + j) % world_size for j in range(1, world_size)] for r in range(world_size)]
    return gossip_ext.CustomGraph(books, peers_per_itr=world_size - 1)


def _all_exist(paths: list[str]) -> bool:
    return all(os.path.exists(p) for p in paths)


def _touch(path: str, text: str = "") -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _leave_with_the_survivors(sync_dir: str, rank: int, world_size: int, dead: int) -> None:
    """Returns once every survivor has raised: a survivor that tears its process group down
    early closes its connections, and a slower survivor still receiving from it would then
    rightly name that survivor rather than the dead rank."""
    _touch(os.path.join(sync_dir, f"raised{rank}"))
    survivors = [os.path.join(sync_dir, f"raised{r}") for r in range(world_size) if r != dead]
    end = time.monotonic() + 30.0
    while not _all_exist(survivors) and time.monotonic() < end:
        time.sleep(0.05)


def _one_rank_is_killed(
    rank: int, world_size: int, dead: int, kill_step: int, when: str, sync_dir: str
) -> dict:
    model = gossip_ext.GossipDataParallel(
        nn.Linear(3, 1),
        graph=_complete_graph(world_size),
        timeout=timedelta(seconds=DEAD_PEER_TIMEOUT_S),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def die() -> None:
        _touch(os.path.join(sync_dir, "killed_at"), repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    result = {"error": None}
    try:
        # Step s gossips in round s; the forward of step s + 1 absorbs it. A survivor can get no
        # further than the forward of step kill_step + 2.
        for step in range(kill_step + 3):
            model(torch.ones(1, 3)).sum().backward()
            opt.step()
            if rank == dead and step == kill_step and when == "before_transfer":
                die()
            model.transfer_params()
            if rank == dead and step == kill_step and when == "after_transfer":
                die()
    except (RuntimeError, TimeoutError) as error:
        result = {
            "error": str(error),
            "type": type(error).__name__,
            "raised_at": time.time(),
            "data": _failure_data(error),
        }
    _leave_with_the_survivors(sync_dir, rank, world_size, dead)
    return result


def _named_peers(message: str) -> set[int]:
    """The peers the first "from/to peer(s) ..." of a gossip_ext error names."""
    match = re.search(r"(?:from|to) peers? (\[[\d, ]*\]|\d+)", message)
    return set() if match is None else {int(p) for p in re.findall(r"\d+", match.group(1))}


@pytest.mark.parametrize(
    "world_size,when",
    [(3, "before_transfer"), (4, "after_transfer")],
)
def test_a_killed_peer_makes_every_survivor_raise_naming_it_and_the_round(
    tmp_path, world_size, when
):
    dead, kill_step = 1, 3
    outcomes = run_ranks_tolerating_deaths(
        world_size,
        _one_rank_is_killed,
        dead,
        kill_step,
        when,
        str(tmp_path),
        deadline_s=120.0,
    )
    assert outcomes[dead].exitcode == -signal.SIGKILL, outcomes[dead]
    killed_at = float((tmp_path / "killed_at").read_text())
    # Killed before posting round kill_step, the dead rank fails that round; killed right after
    # posting it, its messages may or may not have left, so the survivors fail that round or the
    # next.
    rounds = {kill_step} if when == "before_transfer" else {kill_step, kill_step + 1}
    for rank, outcome in enumerate(outcomes):
        if rank == dead:
            continue
        # Exited by itself after catching the error (None: hung, killed at the deadline).
        assert outcome.exitcode == 0, (rank, outcome)
        error = outcome.result["error"]
        assert error is not None, f"rank {rank} never raised"
        # A dead peer and a silent one are one failure to the user: one type to catch (a
        # TimeoutError).
        assert outcome.result["type"] == "PeerTimeoutError", (rank, outcome.result)
        assert dead in _named_peers(error), (rank, error)
        round_named = re.search(r"gossip round (\d+)", error)
        assert round_named is not None and int(round_named.group(1)) in rounds, (rank, error)
        # The same as data: the peers the message names (those it waits for, then those whose
        # sends are unconfirmed), each once, and the round.
        data = outcome.result["data"]
        assert _named_peers(error) <= set(data["peers"]), (rank, data, error)
        assert len(set(data["peers"])) == len(data["peers"]), (rank, data)
        assert data["round"] == int(round_named.group(1)), (rank, data, error)
        assert f"rank {rank} " in error, (rank, error)
        elapsed = outcome.result["raised_at"] - killed_at
        assert elapsed < DEAD_PEER_TIMEOUT_S + SCHEDULING_SLACK_S, (rank, elapsed, error)


def _one_rank_diverges(rank: int, group, check_finite: bool, message_dtype) -> dict:
    # The default graph at n = 4 sends rank r's round-0 message to rank r + 1.
    module = nn.Linear(4, 1)
    model = gossip_ext.GossipDataParallel(
        module,
        check_finite=check_finite,
        timeout=timedelta(seconds=30),
        message_dtype=message_dtype,
        process_group=group,
    )
    if rank == 2:
        with torch.no_grad():
            module.weight[0, 1] = float("inf")  # a diverged optimizer step
    model.transfer_params()
    try:
        model(torch.ones(1, 4))  # absorbs round 0
    except FloatingPointError as error:
        return {"error": str(error), "data": _failure_data(error)}
    return {"error": None, "weight": module.weight.detach().clone()}


# A quantized message carries NaN and Inf as a NaN block scale (Note [Quantized messages]).
CHECKED_DTYPES = [None, torch.bfloat16, "int4", torch.float8_e4m3fn]
# (check_finite, message_dtype) of each job of the launch below.
DIVERGING_JOBS = [(True, dtype) for dtype in CHECKED_DTYPES] + [(False, None)]


def _every_job_has_a_rank_diverge(rank: int, world_size: int) -> list[dict]:
    """Each job of DIVERGING_JOBS in turn on the same four ranks, each on a process group of its
    own, so that one job's messages never reach the next."""
    groups = [dist.new_group(list(range(world_size))) for _ in DIVERGING_JOBS]
    return [_one_rank_diverges(rank, group, *job) for group, job in zip(groups, DIVERGING_JOBS)]


@pytest.fixture(scope="module")
def diverged() -> dict[tuple, list[dict]]:
    per_rank = run_ranks(4, _every_job_has_a_rank_diverge)
    return {job: [results[k] for results in per_rank] for k, job in enumerate(DIVERGING_JOBS)}


@pytest.mark.parametrize("message_dtype", CHECKED_DTYPES)
def test_a_nonfinite_message_raises_naming_the_sender_before_it_spreads(diverged, message_dtype):
    results = diverged[(True, message_dtype)]
    assert results[0]["error"] is None and results[1]["error"] is None
    assert torch.isfinite(results[0]["weight"]).all() and torch.isfinite(results[1]["weight"]).all()
    assert "round 0: the messages from peers [2] hold NaN or Inf" in results[3]["error"]
    assert "check_finite=False" in results[3]["error"]
    assert "the parameters of this rank (rank 2) hold NaN or Inf" in results[2]["error"]
    # The same as data (a gossip_ext.NonFiniteError): the sender, none for the diverged rank.
    round_0 = {"round": 0, "transport": "process_group(gloo)", "timeout": None}
    assert results[3]["data"] == {"peers": (2,), **round_0}, results[3]["data"]
    assert results[2]["data"] == {"peers": (), **round_0}, results[2]["data"]


def test_check_finite_false_lets_nonfinite_values_through(diverged):
    results = diverged[(False, None)]
    assert all(r["error"] is None for r in results)
    assert not torch.isfinite(results[3]["weight"]).all()
    assert torch.isfinite(results[1]["weight"]).all()


# Failure atomicity (Note [The parameters are the model]): a survivor that catches the error holds
# its last valid model, the z after its latest optimizer step, bit for bit, in the module and in
# its state_dict(); and every later call that would use the failed round raises the same error.
LATER_CALLS = (
    "forward",
    "transfer_params",
    "sync_comms",
    "state_dict",
    "eval",
    "average_parameters",
    "consensus_distance",
)


def _later_call(model, name: str) -> None:
    calls = {
        "forward": lambda: model(torch.ones(1, 3)),
        "transfer_params": model.transfer_params,
        "sync_comms": model.sync_comms,
        "state_dict": model.state_dict,
        "eval": model.eval,
        "average_parameters": model.average_parameters,
        "consensus_distance": model.consensus_distance,
    }
    calls[name]()


def _what_a_survivor_reads(model, module: nn.Module, last_model, error: Exception) -> dict:
    """What a rank that caught ``error`` reads: whether the module and its state_dict() are
    ``last_model`` bit for bit, then what each of LATER_CALLS raises (None if nothing)."""
    state = module.state_dict()
    result = {
        "error": str(error),
        "type": type(error).__name__,
        "data": _failure_data(error),
        "module_is_last_model": all(
            torch.equal(p, q) for p, q in zip(module.parameters(), last_model)
        ),
        "state_dict_is_last_model": all(
            torch.equal(state[name], q)
            for (name, _), q in zip(module.named_parameters(), last_model)
        ),
        "later": {},
    }
    for name in LATER_CALLS:
        try:
            _later_call(model, name)
            result["later"][name] = None
        except Exception as again:  # noqa: BLE001 - recorded for the test to judge
            result["later"][name] = (type(again).__name__, str(again))
    return result


def _survivor_keeps_its_last_model(
    rank: int, world_size: int, dead: int, kill_step: int, when: str, mode: str, sync_dir: str
) -> dict:
    module = nn.Linear(3, 1)
    model = gossip_ext.GossipDataParallel(
        module,
        graph=_complete_graph(world_size),
        timeout=timedelta(seconds=DEAD_PEER_TIMEOUT_S),
        overlap=mode == "overlap",
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    killed_at = os.path.join(sync_dir, "killed_at")

    def die() -> None:
        _touch(killed_at, repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    last_model = None
    result = {"error": None}
    try:
        for step in range(kill_step + 3):
            model(torch.full((1, 3), float(rank + 1))).sum().backward()
            if rank == dead and step == kill_step + 1 and when == "after_absorb":
                die()  # it absorbed round kill_step: every message it owed has left
            opt.step()
            opt.zero_grad()
            last_model = [p.detach().clone() for p in module.parameters()]
            if rank == dead and step == kill_step and when == "before_transfer":
                die()
            if rank != dead and step == kill_step + 1 and when == "after_absorb":
                # Post the next round only once the dead peer's connection is closed: posting
                # the send to it is what fails.
                while not os.path.exists(killed_at):
                    time.sleep(0.01)
                time.sleep(0.5)
            model.transfer_params()
            if rank == dead and step == kill_step and when == "after_transfer":
                die()
    except (RuntimeError, TimeoutError) as error:
        result = _what_a_survivor_reads(model, module, last_model, error)
        result["gossip_round"] = model.gossip_round
    _leave_with_the_survivors(sync_dir, rank, world_size, dead)
    return result


@pytest.mark.parametrize(
    "world_size,when,mode",
    [
        (3, "before_transfer", "sync"),  # the peer never posts: the wait fails
        (4, "after_transfer", "sync"),  # the peer dies mid-round
        (3, "after_absorb", "sync"),  # the peer dies after the wait: the next post fails
        (4, "after_absorb", "sync"),
        (4, "after_transfer", "overlap"),
    ],
)
def test_a_survivor_keeps_its_last_valid_model_and_the_failure_stays_raised(
    tmp_path, world_size, when, mode
):
    dead, kill_step = 1, 2
    outcomes = run_ranks_tolerating_deaths(
        world_size,
        _survivor_keeps_its_last_model,
        dead,
        kill_step,
        when,
        mode,
        str(tmp_path),
        deadline_s=120.0,
    )
    assert outcomes[dead].exitcode == -signal.SIGKILL, outcomes[dead]
    for rank, outcome in enumerate(outcomes):
        if rank == dead:
            continue
        assert outcome.exitcode == 0, (rank, outcome)
        result = outcome.result
        assert result["error"] is not None, f"rank {rank} never raised"
        assert result["type"] == "PeerTimeoutError", (rank, result)  # a TimeoutError
        assert dead in _named_peers(result["error"]), (rank, result["error"])
        assert dead in result["data"]["peers"], (rank, result)
        if when == "after_absorb":
            # gloo already knows the connection closed when the round is posted: the post fails,
            # and the receives posted before it are cancelled.
            assert "failed to post" in result["error"], (rank, result["error"])
        if mode == "overlap" and "failed to post" in result["error"]:
            # Under overlap, transfer_params() absorbs the last round, then posts the next. When
            # the dead peer's last message got out before it died (a matter of timing), the
            # absorb succeeds and the post fails: the parameters are then the absorbed model, as
            # valid as the one before it, but not the snapshot taken before the call: one round
            # more absorbed than where the failure is seen at the absorb.
            assert result["gossip_round"] == kill_step + 1, (rank, result)
            assert not result["module_is_last_model"], (rank, result["error"])
        else:
            assert result["module_is_last_model"], (rank, result["error"])
            assert result["state_dict_is_last_model"], (rank, result["error"])
        for name in LATER_CALLS:
            assert result["later"][name] == ("PeerTimeoutError", result["error"]), (rank, name)


def _survivor_of_a_failed_average(
    rank: int, world_size: int, dead: int, layer: str, sync_dir: str
) -> dict:
    """A peer dies right before the exact average of step 2 (LocalSGD's, or SlowMo's through
    the fairscale layer): the survivors' all-reduce fails, what they read then must be the
    model of their last optimizer step, and every later call raises the same error."""
    torch.manual_seed(0)
    module = nn.Linear(3, 1)
    if layer == "localsgd":
        model = gossip_ext.GossipDataParallel(
            module, base_algorithm="localsgd", global_avg_freq=2, timeout=timedelta(seconds=1)
        )
    else:
        model = SlowMoDistributedDataParallel(
            module, nprocs_per_node=1, slowmo_frequency=2, localsgd_frequency=100
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    result = {"error": None}
    try:
        for step in range(2):
            model(torch.full((1, 3), float(rank + 1))).sum().backward()
            opt.step()
            opt.zero_grad()
            last_model = [p.detach().clone() for p in module.parameters()]
            if step == 1 and rank == dead:
                os.kill(os.getpid(), signal.SIGKILL)
            if layer == "localsgd":
                model.transfer_params()
            else:
                model.perform_slowmo(opt)
    except gossip_ext.PeerTimeoutError as error:  # the typed error, not gloo's own
        result = _what_a_survivor_reads(model, module, last_model, error)
    _leave_with_the_survivors(sync_dir, rank, world_size, dead)
    return result


@pytest.mark.parametrize("layer", ["localsgd", "fairscale slowmo"])
def test_a_peer_dying_during_an_exact_average_leaves_the_survivors_last_model(tmp_path, layer):
    dead = 1
    outcomes = run_ranks_tolerating_deaths(
        3, _survivor_of_a_failed_average, dead, layer, str(tmp_path), deadline_s=150.0
    )
    assert outcomes[dead].exitcode == -signal.SIGKILL, outcomes[dead]
    for rank in (0, 2):
        result = outcomes[rank].result
        assert outcomes[rank].exitcode == 0 and result["error"] is not None, (rank, outcomes[rank])
        # The all-reduce names the rank that did not check in after it failed.
        assert result["data"]["peers"] == (dead,), (rank, result["error"])
        assert result["module_is_last_model"], (rank, result["error"])
        assert result["state_dict_is_last_model"], (rank, result["error"])
        # The ranks are at different collectives now: none may run another.
        for name in LATER_CALLS:
            assert result["later"][name] == (result["type"], result["error"]), (rank, name, result)
