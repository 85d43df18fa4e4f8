"""Elastic jobs (membership="HOST:PORT"; gossip_ext.membership.elastic) with real processes over
gloo: a membership service (python -m gossip_ext.membership) and workers launched each on its own
(tests/membership_worker.py), as a user launches them. Workers are killed, stopped, leave and
join; the survivors must finish every step with a valid model, the newcomers must start from a
live member's state."""

from __future__ import annotations

import re
import signal
import sys
import time
import types
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from multiprocess import run_ranks
from torch import nn

import gossip_ext
from gossip_ext.membership import epochs, runtime

sys.path.insert(0, str(Path(__file__).parent))
from elastic_job import SILENT_S, STEPS, TIMEOUT_S, Job, free_port  # noqa: E402
from exiting_processes import Parent  # noqa: E402
from membership_worker import MODES, batch  # noqa: E402

WORKERS = 4  # the most workers of any test job
MEMBER_STEPS = STEPS + 20  # the first workers' of a job that a replacement joins


@pytest.fixture
def job(tmp_path):
    job = Job(tmp_path)
    yield job
    job.close()


def _assert_finished(job: Job, name: str, mode: str = "sync", steps: int = STEPS) -> dict:
    result = job.result(name)
    assert result["error"] is None, (name, result["error"], job.log(name))
    assert result["final_step"] == steps, (name, result["final_step"])
    assert all(s["finite"] for s in result["steps"]), name
    # Every step counted: consecutive within an epoch. At an epoch change a worker that noticed
    # it before the others goes on from the most advanced survivor's count (skipped numbers, not
    # skipped steps); how far that one can be ahead is bounded by the schedule: with gossip every
    # step, one step per hop of the graph, synch_freq more under bounded asynchrony; without
    # (LocalSGD, DiLoCo), the workers meet only at outer steps, so one may be a whole period
    # ahead of another (waiting at the next outer step while the other has just left the last).
    counted = [s["step"] for s in result["steps"]]
    assert counted == sorted(set(counted)) and counted[-1] == steps, (name, counted)
    settings = MODES.get(mode, {})
    lead = 1 + settings.get("synch_freq", 0)
    most = 1 + (WORKERS - 1) * lead
    if settings.get("base_algorithm") == "localsgd":
        most = max(most, 1 + settings["sync_every"])
    for before, after in zip(result["steps"], result["steps"][1:]):
        jump = after["step"] - before["step"]
        if after["epoch"] == before["epoch"]:
            assert jump == 1, (name, before, after)
        else:
            assert 1 <= jump <= most, (name, counted)
    return result


def _gap_s(result: dict) -> float:
    times = [s["time"] for s in result["steps"]]
    return max(b - a for a, b in zip(times, times[1:]))


def _bytes_per_step(result: dict, epoch: int) -> float:
    steps = [s for s in result["steps"] if s["epoch"] == epoch]
    return (steps[-1]["bytes_sent"] - steps[0]["bytes_sent"]) / (len(steps) - 1)


def _spread(results: list[dict], step: int) -> float:
    """The largest distance of a worker's model from the workers' mean after ``step``, relative
    to the mean's norm."""
    models = [s["params"] for r in results for s in r["steps"] if s["step"] == step]
    mean = torch.stack(models).mean(0)
    return max((m - mean).norm().item() for m in models) / mean.norm().item()


# ----------------------------------------------------------------------------- failures


@pytest.fixture(scope="module")
def parent():
    """The parent that forks workers which exit as a script does (tests/exiting_processes.py)."""
    parent = Parent()
    yield parent
    parent.close()


@pytest.mark.slow(
    "one job of five real processes per mode: a SIGKILL, a replacement, 50 paced steps and every "
    "worker exiting through interpreter finalization (what two jobs per mode asserted before)"
)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_survivors_of_a_sigkill_finish_every_step_and_every_worker_exits_0(parent, tmp_path, mode):
    """Four workers, w2 SIGKILLed after step 10, a replacement w4 started once w0 passed step 12;
    no worker calls leave(), and each exits as a script does (tests/exiting_processes.py: an
    abort at exit, a stuck thread or a late error shows as an exit status other than 0).

    The first workers run MEMBER_STEPS, past the replacement's STEPS, and slow down from the kill
    until it is in: it must be in the job before they finish (a run saw them take the 18 steps
    after step 12 in 1.6 s while the replacement, forked on a loaded machine, registered later and
    found them gone). The replacement, done first, leaves as a script's return does, and the
    three survivors end the job in an epoch of their own."""
    # What the survivors' consensus must come back to: a job of 3 that never lost a worker, run
    # as a static job (which an elastic job without failures trains as, bit for bit, below).
    reference = run_ranks(3, _static, mode, MEMBER_STEPS)
    job = Job(tmp_path, launch=parent.start)
    try:
        for name in ("w0", "w1", "w2", "w3"):
            kill = ["--kill-at", "10"] if name == "w2" else []
            pace = ["--step-seconds", "0.05", "--steps", str(MEMBER_STEPS)]
            pace += ["--hold-for-joiner", "0.3"]  # after the kill, until the replacement is in
            job.start(name, "--mode", mode, "--min-workers", "3", *pace, *kill)
        job.wait_for_step("w0", 12)
        job.start("w4", "--mode", mode, "--step-seconds", "0.05")
        job.wait()
    finally:
        job.close()
    for name, process in job.workers.items():
        expected = -signal.SIGKILL if name == "w2" else 0
        assert process.returncode == expected, (mode, name, process.returncode, job.log(name))
    joiner = job.result("w4")
    assert joiner["error"] is None, (joiner["error"], job.log("w4"))
    # At or past the job's last step: a worker that joins or notices a change late goes on from
    # the most advanced member's count (_assert_finished bounds the jump for the others).
    assert joiner["final_step"] >= STEPS and all(s["finite"] for s in joiner["steps"]), joiner
    # No one waited out the timeout: not for the killed worker (its heartbeat stopped), nor for
    # the replacement, the first to finish (it left as leave() leaves).
    assert _gap_s(joiner) < TIMEOUT_S / 2, _gap_s(joiner)
    survivors = [_assert_finished(job, n, mode, MEMBER_STEPS) for n in ("w0", "w1", "w3")]
    for result in survivors:
        last = next(s for s in result["steps"] if s["step"] == MEMBER_STEPS - 4)
        assert last["epoch"] >= 1 and last["world_size"] == 3, last
        # No step waited for the timeout (benchmarks/elastic.py measures how soon it is back).
        assert _gap_s(result) < TIMEOUT_S / 2, _gap_s(result)
        if mode in ("sync", "overlap", "bounded", "compressed"):
            # One message a round to one peer of the new graph, as before the kill (the engine
            # of each epoch counts from 0).
            per_step = [_bytes_per_step(result, epoch) for epoch in (0, last["epoch"])]
            assert per_step[0] > 0 and abs(per_step[1] / per_step[0] - 1) < 0.2, per_step
    # The survivors' models agree again (gossip, or the outer steps, pulled them together): about
    # as closely, some steps after the last change, as those of a job of 3 that lost no one. Each
    # spread is one run's, and which messages are in flight at a step depends on timing (bounded
    # asynchrony most: 1.06x on one machine, 1.50x on a slower one), so the margin is 2x.
    # Workers that stopped communicating at the kill would be 2.5-3x apart: trained apart from
    # step 10 on these batches, their spread is 0.16-0.23 over these steps, against the job of
    # 3's 0.03-0.075.
    late = range(MEMBER_STEPS - 8, MEMBER_STEPS - 3)
    after = max(_spread(survivors, step) for step in late)
    undisturbed_spread = max(_spread(reference, step) for step in late)
    assert after <= 2 * undisturbed_spread, (undisturbed_spread, after)


def test_two_of_four_killed_below_min_workers_raise_naming_both(job):
    for name in ["w0", "w1", "w2", "w3"]:
        job.start(
            name, "--min-workers", "3", *(["--kill-at", "10"] if name in ("w1", "w2") else [])
        )
    job.wait()
    dead = sorted(job.result(n)["worker_id"] for n in ("w1", "w2"))
    for name in ("w0", "w3"):
        error = job.result(name)["error"]
        assert error is not None and error.startswith("TimeoutError"), (name, error)
        assert "fewer than min_workers=3" in error, error
        for worker in dead:
            assert f"worker {worker} (" in error, (worker, error)


@pytest.mark.slow(
    "a worker stopped past its 5 s timeout while the others take 45 steps paced at 0.3 s, so "
    "that they still train when it comes back and rejoins"
)
def test_a_stalled_worker_is_removed_told_so_and_rejoins_as_new(job):
    # Stopped past the timeout, while the others train on: they are still at it (45 steps of
    # 0.3 s) when it comes back. A timeout shorter than the other tests' keeps the stop short; it
    # is still well above the silence after which the watch gives up on the stalled worker, and
    # the 3 s of slack the others' longest step is allowed beyond it.
    steps, timeout_s = 45, 5.0
    for name in ["w0", "w1", "w2", "w3"]:
        job.start(
            name,
            "--min-workers",
            "3",
            "--step-seconds",
            "0.3",
            "--steps",
            str(steps),
            "--timeout",
            str(timeout_s),
            *(["--stop-at", "8", "--rejoin"] if name == "w2" else []),
        )
    job.wait_for_step("w2", 8)
    time.sleep(timeout_s + 1.0)
    job.workers["w2"].send_signal(signal.SIGCONT)
    job.wait()
    for name in ("w0", "w1", "w3"):
        result = _assert_finished(job, name, steps=steps)
        # Not the timeout: the watch gives up on a member whose heartbeat stopped for the job's
        # silence, and the change takes well under a second more (3 s of slack for a loaded
        # machine), plus this step's sleep.
        assert _gap_s(result) < SILENT_S + 3.0 + 0.3 < timeout_s, _gap_s(result)
    stalled = job.result("w2")
    assert stalled["error"] is None, (stalled["error"], job.log("w2"))
    assert stalled["removed"] is not None and "was removed from the job" in stalled["removed"]
    reads = stalled["removed_reads"]
    assert reads["finite"] and reads["state_dict_agrees"] and reads["unchanged_after"], reads
    if reads["raised_in"] == "forward":
        assert reads["equals_before_forward"], reads
    assert stalled["removed_again"] == stalled["removed"]
    assert f"worker {stalled['worker_id']} " in stalled["removed"]
    assert stalled["rejoined_as"] != stalled["worker_id"]
    assert stalled["final_step"] == steps
    assert stalled["rejoined_at_step"] > 8


# ----------------------------------------------------------------------------- joining


def _assert_started_from_a_donor(
    joiner: dict, members: list[dict], part: slice = slice(None)
) -> None:
    """The joiner's parameters and momentum before its first forward are exactly those one
    member held when the joiner's epoch began: after the optimizer step whose transfer_params()
    noticed the change, or, where its forward did (the round it was absorbing failed because the
    others had moved on), after the step before. The step count handed on is that of the last
    completed transfer_params(). ``part``: the parameters to compare (the flattened model's),
    where the step's own outer actions, which the donor ran after the handoff, changed others."""
    first = torch.cat([p.flatten() for p in joiner["first_params"]])[part]
    for member in members:
        for held in member["steps"]:
            if held["step"] in (joiner["first_step"], joiner["first_step"] + 1) and torch.equal(
                held["params"][part], first
            ):
                for a, b in zip(held["momentum"], joiner["first_momentum"]):
                    assert torch.equal(a, b)
                return
    pytest.fail(f"no member held the joiner's first model at step {joiner['first_step']}")


def test_a_replacement_starts_from_a_live_members_state(job):
    # The members move to 2 peers per round first: they keep it across the change, and the
    # joiner takes it on.
    for name in ["w0", "w1", "w2"]:
        job.start(name, "--min-workers", "3", "--step-seconds", "0.3", "--peers-at", "2:2")
    job.wait_for_step("w0", 6)
    joiner = job.start("w3", "--init-seed", "7", "--step-seconds", "0.3")
    job.wait()
    assert joiner.returncode == 0
    members = [_assert_finished(job, n) for n in ("w0", "w1", "w2")]
    new = _assert_finished(job, "w3")
    for result in [*members, new]:
        assert {s["peers_per_itr"] for s in result["steps"] if s["step"] > 2} == {2}
    # It was started once w0 had finished step 6: it goes on from a member's count, not from 0.
    assert new["first_step"] >= 6
    torch.manual_seed(7)
    own = list(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).parameters())
    assert not torch.equal(own[0], new["first_params"][0]), "it kept its own initialisation"
    _assert_started_from_a_donor(new, members)


def test_streaming_fragments_in_flight_cross_a_kill_and_a_join(job):
    # Killed after step 11, when fragment 1 is in flight (prepared at step 3 of each period of
    # 4): the survivors send it again over the new epoch; a replacement that joins later takes
    # its donor's outer state and fragments in flight.
    for name in ["w0", "w1", "w2"]:
        job.start(
            name,
            "--mode",
            "streaming_int8",
            "--min-workers",
            "2",
            "--step-seconds",
            "0.2",
            *(["--kill-at", "11"] if name == "w2" else []),
        )
    job.wait_for_step("w0", 16)
    joiner = job.start(
        "w3", "--mode", "streaming_int8", "--init-seed", "7", "--step-seconds", "0.2"
    )
    job.wait()
    assert joiner.returncode == 0 and job.workers["w2"].returncode == -signal.SIGKILL
    members = [_assert_finished(job, n, "streaming_int8") for n in ("w0", "w1")]
    new = _assert_finished(job, "w3", "streaming_int8")
    # Started once w0 had finished step 16: its donor (w0 or w1) hands on a count of 16 or more.
    assert new["first_step"] >= 16
    # The donor handed on its model after its optimizer step first_step + 1, then ran that step's
    # actions: an apply there (step 2 or 4 of a period) changed one fragment of its own record.
    applied = {2: slice(128, None), 0: slice(0, 128)}  # step within the period: what is left
    _assert_started_from_a_donor(
        new, members, applied.get((new["first_step"] + 1) % 4, slice(None))
    )
    # Fragment 0 (the first layer's weight, 8 x 16) was applied after step 30 (step 2 of its
    # period): every member then holds the same theta_global for it, bit for bit, only if each
    # epoch's outer steps ran alike on all of them, through the kill, the join and the resend.
    applied = [
        next(s for s in r["steps"] if s["step"] == STEPS)["params"][:128] for r in [*members, new]
    ]
    assert all(torch.equal(applied[0], a) for a in applied[1:])
    before = [
        next(s for s in r["steps"] if s["step"] == STEPS - 1)["params"][:128] for r in members
    ]
    assert not torch.equal(*before)  # local steps had moved them apart


def test_a_donor_killed_during_the_handoff_is_replaced_by_another(job):
    for name in ["w0", "w1", "w2"]:
        job.start(name, "--min-workers", "2", "--step-seconds", "0.3", "--die-as-donor")
    job.wait_for_step("w0", 6)
    job.start("w3", "--init-seed", "7", "--step-seconds", "0.3")
    job.wait()
    died = [n for n in ("w0", "w1", "w2") if job.workers[n].returncode == -signal.SIGKILL]
    assert len(died) == 1, [job.workers[n].returncode for n in ("w0", "w1", "w2")]
    members = [_assert_finished(job, n) for n in ("w0", "w1", "w2") if n not in died]
    _assert_started_from_a_donor(_assert_finished(job, "w3"), members)


# ----------------------------------------------------------------------------- leaving


def test_a_worker_that_leaves_is_dropped_without_a_timeout(job):
    for name in ["w0", "w1", "w2"]:
        job.start(
            name,
            "--min-workers",
            "3",
            "--timeout",
            "60",
            *(["--leave-at", "10"] if name == "w1" else []),
        )
    job.wait()
    leaver = job.result("w1")
    assert leaver["error"] is None and leaver["final_step"] == 10, leaver["error"]
    for name in ("w0", "w2"):
        result = _assert_finished(job, name)
        assert result["steps"][-1]["world_size"] == 2
        assert _gap_s(result) < 2.0, _gap_s(result)  # far below the 60 s timeout


# ----------------------------------------------------------------------------- unchanged


def _static(rank: int, world_size: int, mode: str = "sync", steps: int = STEPS) -> dict:
    """membership_worker.py's loop as a static job in ``mode``: init_process_group, rank = worker
    id. Its record as the worker's: each step's model, and the final one after sync_comms()."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    model = gossip_ext.GossipDataParallel(net, timeout=timedelta(seconds=TIMEOUT_S), **MODES[mode])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.register_optimizer(opt)
    record = []
    for step in range(steps):
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        params = torch.cat([p.detach().flatten() for p in model.module.parameters()])
        record.append({"step": model.step_count, "params": params.clone()})
    model.sync_comms()
    return {
        "steps": record,
        "final_params": [p.detach().clone() for p in model.module.parameters()],
    }


def test_a_job_without_failures_trains_as_a_static_one_bit_for_bit(job):
    for name in ["w0", "w1", "w2"]:
        job.start(name, "--min-workers", "3")
    job.wait()
    static = run_ranks(3, _static)
    for name in ("w0", "w1", "w2"):
        result = _assert_finished(job, name)
        assert {s["epoch"] for s in result["steps"]} == {0}
        for got, want in zip(result["final_params"], static[result["worker_id"]]["final_params"]):
            assert torch.equal(got, want), name


# ----------------------------------------------------------------------------- bad input


def test_an_unreachable_membership_service_is_a_clear_error_within_the_timeout():
    port = free_port()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"membership='127.0.0.1:{port}': no membership"):
        gossip_ext.GossipDataParallel(
            nn.Linear(2, 1), membership=f"127.0.0.1:{port}", timeout=timedelta(seconds=2)
        )
    assert time.monotonic() - start < 10.0


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"membership": "no-port"}, ValueError, "membership must be 'HOST:PORT'"),
        ({"membership": 29400}, TypeError, "membership must be a str"),
        ({"membership": "h:1", "min_workers": 0}, ValueError, "min_workers must be >= 1, got 0"),
        ({"min_workers": 2}, ValueError, "min_workers=2 applies to an elastic job"),
        ({"membership": "h:1", "nprocs_per_node": 2}, ValueError, "nprocs_per_node=2"),
    ],
)
def test_bad_membership_arguments_name_the_argument(kwargs, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace("[", r"\[")):
        gossip_ext.GossipDataParallel(nn.Linear(2, 1), **kwargs)


@pytest.mark.parametrize(
    "timings, error, words",
    [
        ({"heartbeat_s": 0}, ValueError, "(heartbeat_s=...): heartbeat_s must be a positive "
         "number of seconds, got 0"),
        ({"heartbeat_s": True}, TypeError, "heartbeat_s must be a number of seconds, got True"),
        ({"silent_s": "1.5"}, TypeError, "silent_s must be a number of seconds, got str '1.5'"),
        ({"silent_s": float("inf")}, ValueError, "silent_s must be a positive number of "
         "seconds, got inf"),
        ({"heartbeat_s": 0.001}, ValueError, "heartbeat_s must be >= 0.01 s (each beat is a "
         "request to the membership service), got 0.001"),
        ({"heartbeat_s": 0.2, "silent_s": 0.5}, ValueError, "(silent_s=...): silent_s must be "
         "at least 5 heartbeats (5 x heartbeat_s=0.2 = 1 s), so that a late beat is not taken "
         "for a death, got 0.5"),
    ],
)  # fmt: skip
def test_bad_timings_name_the_argument_and_the_value(timings, error, words):
    with pytest.raises(error, match=re.escape(words)):
        gossip_ext.Elastic("h:1", **timings)


def test_the_timings_default_to_the_membership_constants_and_are_described():
    default = gossip_ext.Elastic("h:1")
    assert default.timings == epochs.Timings(heartbeat_s=0.1, silent_s=1.5)
    assert default.timings.confirm_s == epochs.CONFIRM_S == 0.5
    # Described, so that a worker with other timings is refused (tests/test_trust.py).
    described = gossip_ext.Elastic("h:1", heartbeat_s=0.05, silent_s=1).describe()
    assert (described["heartbeat_s"], described["silent_s"]) == (0.05, 1.0)
    assert gossip_ext.Elastic("h:1", heartbeat_s=0.05).timings.confirm_s == 0.25
    # A sharded replica's processes keep the defaults: other timings are refused, not ignored.
    odd = gossip_ext.Elastic("h:1", silent_s=0.8)
    with pytest.raises(ValueError, match="a sharded replica keeps the default heartbeat_s=0.1"):
        runtime.of_job(
            types.SimpleNamespace(shard_group=object()),  # a runtime's, of a sharded replica
            odd,
            None,
            timedelta(seconds=1),
            None,
            replica_membership=lambda *_: pytest.fail("built despite the timings"),
        )


def _with_a_process_group(rank: int, world_size: int) -> str:
    try:
        gossip_ext.GossipDataParallel(
            nn.Linear(2, 1), membership="h:1", process_group=torch.distributed.group.WORLD
        )
    except ValueError as error:
        return str(error)
    return ""


def test_membership_with_a_process_group_is_refused():
    (message,) = run_ranks(1, _with_a_process_group)
    assert "membership='h:1' with a process_group" in message, message
