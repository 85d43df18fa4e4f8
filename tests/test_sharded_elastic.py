"""Elastic sharded replicas (gossip_ext.sharded.elastic) with real processes over gloo: replicas of
2 shard processes each, every replica its own world (init_process_group over its own rendezvous)
sharding the model with FSDP2, joined through a membership service (tests/sharded_member.py).
A shard process is killed, a whole replica is killed, a replica joins, a joiner dies while it
receives, a donor while it sends; the survivors must finish every step with finite shards, what
the lost replica's other process reads after its ReplicaLostError must be a model, a joiner's
shards must be one live replica's, every later step must agree with a DDP reference,
and a replica of another number of shards is refused."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from elastic_job import Job, free_port  # noqa: E402
from sharded_job import (  # noqa: E402
    SHARDS,
    assert_lost_its_replica,
    assert_started_from_one_donor,
    assert_trains_as_ddp_after_the_change,
    finished,
    model_of,
    start_replica,
)

# Two replicas that start together (the first epoch waits for both), paced so that a third
# joins while they train.
PACED = ["--min-workers", "2", "--step-seconds", "0.2"]


@pytest.fixture
def job(tmp_path):
    # At the membership's default timings: a sharded replica keeps them (gossip_ext.membership.
    # runtime.of_job refuses others).
    job = Job(tmp_path, timings=())
    yield job
    job.close()


@pytest.mark.parametrize("when", ["after_its_step", "in_its_backward"])
def test_a_killed_shard_process_takes_its_replica_out_and_the_others_train_on(job, when):
    for replica in range(3):
        # From step 10 on, once all three are in one epoch (however late one started); in its
        # backward, its sibling meets it in FSDP2's backward collectives.
        kill = ["--kill-at", "10", "--kill-in-world", "3"]
        kill += ["--kill-in-backward"] if when == "in_its_backward" else []
        start_replica(job, replica, "--min-workers", "2", kill=(1, kill) if replica == 2 else ())
    job.wait()
    assert job.workers["r2s1"].returncode == -signal.SIGKILL
    assert_lost_its_replica(job, "r2s0")
    if when == "in_its_backward":
        assert job.result("r2s0")["lost_reads"]["raised_in"] == "backward"
    survivors = {replica: finished(job, replica) for replica in range(2)}
    for results in survivors.values():
        for result in results:
            assert result["steps"][-1]["world_size"] == 2, result["steps"][-1]
    assert_trains_as_ddp_after_the_change(survivors)


def test_a_whole_replica_killed_then_a_replacement_joins_shard_by_shard(job):
    # Paced so that the replacement, whose two processes start Python and torch from nothing,
    # joins with steps to spare on a loaded machine (the last 18 steps take at least 5.4 s).
    for replica in range(2):
        kill = ["--kill-at", "8", "--kill-in-world", "2"] if replica == 1 else []
        start_replica(job, replica, "--min-workers", "1", "--step-seconds", "0.3", *kill)
    job.wait_for_step("r0s0", 12)
    start_replica(job, 2, "--init-seed", "7", "--step-seconds", "0.2")
    job.wait()
    assert all(job.workers[f"r1s{s}"].returncode == -signal.SIGKILL for s in range(SHARDS))
    survivor = finished(job, 0)
    joiner = finished(job, 2)
    # Started once the survivor had taken step 12, it enters at the survivor's next epoch
    # change: at 12 itself where that change was still under way after step 12 (a full run on
    # a loaded machine saw it), else later; never earlier.
    assert joiner[0]["first_step"] >= 12
    assert_started_from_one_donor(joiner, [survivor])
    # From then on two replicas gossip again: their models end equal (2 workers average exactly).
    assert torch.allclose(model_of(survivor), model_of(joiner), atol=1e-5)
    assert_trains_as_ddp_after_the_change({0: survivor, 2: joiner})


def test_a_replica_of_another_number_of_shards_is_refused_naming_both(job):
    start_replica(job, 0, "--min-workers", "1", "--step-seconds", "0.2")
    job.wait_for_step("r0s0", 3)
    job.start(
        "one",
        "--replica-port",
        str(free_port()),
        "--shard",
        "0",
        "--shards",
        "1",
        "--replica",
        "1",
        script="sharded_member",
    )
    job.wait()
    error = job.result("one")["error"]
    # Refused before it registered: the replica of 2 never saw it.
    assert error.startswith("JobMismatchError") and "shards: the job has 2, this worker has 1" in (
        error
    )
    assert "sharded over 1 process, the job's replicas over 2" in error
    finished(job, 0)


def test_a_joiner_that_dies_while_receiving_leaves_the_donors_untouched(job):
    for replica in range(2):
        start_replica(job, replica, *PACED)
    job.wait_for_step("r0s0", 6)
    # Its shard 1 dies once its donor began to send: its shard 0, which received all of its
    # own, must not count as a member, and the donors go on as if it never came.
    start_replica(job, 2, "--step-seconds", "0.2", kill=(1, ["--die-receiving"]))
    job.wait()
    assert job.workers["r2s1"].returncode == -signal.SIGKILL
    lost = job.result("r2s0")
    # Raised while it joined: its user never held a wrapper, nor a model to read.
    assert lost["error_type"] == "ReplicaLostError", (lost["error"], job.log("r2s0"))
    assert "joined_after_s" not in lost, lost
    members = {replica: finished(job, replica) for replica in range(2)}
    for results in members.values():
        for result in results:
            # The last steps between the two of them alone.
            assert result["steps"][-1]["world_size"] == 2
    assert_trains_as_ddp_after_the_change(members)


def test_a_donor_killed_during_the_handoff_is_replaced_by_another_replica(job):
    # The donor (the oldest replica, whichever registered first) loses its shard 1 process while
    # that one sends; the joiner's next epoch takes every shard from the other replica.
    dies_donating = (1, ["--die-donating"])
    for replica in range(2):
        start_replica(job, replica, *PACED, kill=dies_donating)
    job.wait_for_step("r1s0", 6)
    start_replica(job, 2, "--init-seed", "7", "--step-seconds", "0.2")
    job.wait()
    # One process died donating: the flag it made first, no final record of its own.
    assert (job.out / "died_donating").exists()
    donor = next(r for r in range(2) if job.result(f"r{r}s1").get("final_step") is None)
    assert_lost_its_replica(job, f"r{donor}s0")
    member, joiner = finished(job, 1 - donor), finished(job, 2)
    assert_started_from_one_donor(joiner, [member])
    assert_trains_as_ddp_after_the_change({1 - donor: member, 2: joiner})
