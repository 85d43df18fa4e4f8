"""Elastic sharded replicas (gossip_ext.sharded.elastic) with real processes over gloo: replicas of
2 shard processes each, every replica its own world (init_process_group over its own rendezvous)
sharding the model with FSDP2, joined through a membership service (tests/sharded_member.py).
A shard process is killed, a whole replica is killed, a replica joins; the survivors must finish
every step with finite shards, a joiner's shards must be its donor's, and a replica of another
number of shards is refused."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from elastic_job import STEPS, Job, free_port  # noqa: E402
from membership_worker import batch  # noqa: E402
from sharded_member import net  # noqa: E402

SHARDS = 2


@pytest.fixture
def job(tmp_path):
    job = Job(tmp_path)
    yield job
    job.close()


def _start_replica(job: Job, replica: int, *args: str, kill=()) -> None:
    """Replica ``replica``'s processes r{replica}s{shard}; those in ``kill`` get ``--kill-at``."""
    port = free_port()
    for shard in range(SHARDS):
        extra = list(kill[1]) if shard in kill[:1] else []
        job.start(
            f"r{replica}s{shard}",
            "--replica-port",
            str(port),
            "--shard",
            str(shard),
            "--replica",
            str(replica),
            *args,
            *extra,
            script="sharded_member",
        )


def _finished(job: Job, replica: int) -> list[dict]:
    results = []
    for shard in range(SHARDS):
        name = f"r{replica}s{shard}"
        result = job.result(name)
        assert result["error"] is None, (name, result["error"], job.log(name))
        assert result["final_step"] == STEPS, (name, result["final_step"])
        assert all(s["finite"] for s in result["steps"]), name
        results.append(result)
    return results


def _model(shard_results: list[dict], step: int | None = None) -> torch.Tensor:
    """A replica's whole model after ``step`` (None: its final one), from its processes' shards
    (FSDP2 cuts each parameter in chunks along dim 0, in shard order)."""
    parts = []
    for r in shard_results:
        if step is None:
            parts.append(r["final_shards"])
        else:
            parts.append(next(s["shards"] for s in r["steps"] if s["step"] == step))
    return torch.cat([torch.cat(chunks).flatten() for chunks in zip(*parts)])


def _momentum(shard_results: list[dict], step: int) -> torch.Tensor:
    parts = [next(s["momentum"] for s in r["steps"] if s["step"] == step) for r in shard_results]
    return torch.cat([torch.cat(chunks).flatten() for chunks in zip(*parts)])


def _assert_trains_as_ddp_after_the_change(replicas: dict[int, list[dict]]) -> None:
    """The reference: two replicas under synchronous SGP average exactly every round (each
    keeps half its mass and sends half to the other), so the mean of their models and momenta
    moves as DDP's single model does on the mean gradient of all their batches (each replica's
    gradient the mean of its shard processes' batches, as FSDP2 reduces them). Replayed in
    float64 from the first step both replicas took in the new epoch (the round of that step
    between them alone), against every later step's mean."""
    results = list(replicas.values())
    epochs = [{s["step"]: s["epoch"] for s in r[0]["steps"]} for r in results]
    last = max(e for e in epochs[0].values())
    start = min(k for k in epochs[0] if all(e.get(k) == last for e in epochs))
    steps = [k for k in range(start, STEPS + 1) if all(k in e for e in epochs)]
    assert len(steps) >= 5, (start, steps)
    model = net().double()
    params = list(model.parameters())
    mean = torch.stack([_model(r, start) for r in results]).double().mean(0)
    velocity = torch.stack([_momentum(r, start) for r in results]).double().mean(0)
    for step in range(start, STEPS):
        torch.nn.utils.vector_to_parameters(mean, params)
        losses = []
        for replica in replicas:
            for shard in range(SHARDS):
                x, y = batch(step, 10 * replica + shard)
                losses.append(nn.functional.mse_loss(model(x.double()), y.double()))
        gradient = torch.autograd.grad(torch.stack(losses).mean(), params)
        velocity = 0.9 * velocity + torch.cat([g.flatten() for g in gradient])
        mean = mean - 0.05 * velocity
        measured = torch.stack([_model(r, step + 1) for r in results]).double().mean(0)
        assert torch.allclose(measured, mean, rtol=1e-4, atol=1e-5), (
            step + 1,
            (measured - mean).abs().max(),
        )


def test_replicas_train_as_ddp_on_all_their_batches(job):
    for replica in range(2):
        _start_replica(job, replica, "--min-workers", "2")
    job.wait()
    replicas = {replica: _finished(job, replica) for replica in range(2)}
    models = [_model(results) for results in replicas.values()]
    assert torch.allclose(models[0], models[1], atol=1e-5), (models[0] - models[1]).abs().max()
    _assert_trains_as_ddp_after_the_change(replicas)


def test_a_killed_shard_process_takes_its_replica_out_and_the_others_train_on(job):
    for replica in range(3):
        kill = (1, ["--kill-at", "10"]) if replica == 2 else ()
        _start_replica(job, replica, "--min-workers", "2", kill=kill)
    job.wait()
    assert job.workers["r2s1"].returncode == -signal.SIGKILL
    lost = job.result("r2s0")
    assert lost["error_type"] == "ReplicaLostError", (lost["error"], job.log("r2s0"))
    survivors = {replica: _finished(job, replica) for replica in range(2)}
    for results in survivors.values():
        for result in results:
            assert result["steps"][-1]["world_size"] == 2, result["steps"][-1]
    _assert_trains_as_ddp_after_the_change(survivors)


def _assert_started_from_one_donor(joiner: list[dict], members: list[list[dict]]) -> None:
    """Each of the joiner's processes holds, before its first forward, exactly the shard and the
    momentum that the same process of one member replica held when the joiner's epoch began
    (after the optimizer step whose step boundary formed it, or the step before), all of its
    processes from the same replica."""
    first_step = joiner[0]["first_step"]
    assert all(r["first_step"] == first_step for r in joiner), [r["first_step"] for r in joiner]
    for member in members:
        for step in (first_step, first_step + 1):
            held = [next((s for s in r["steps"] if s["step"] == step), None) for r in member]
            if any(h is None for h in held):
                continue
            same = all(
                all(torch.equal(a, b) for a, b in zip(h["shards"], r["first_shards"]))
                for h, r in zip(held, joiner)
            )
            if same:
                for h, r in zip(held, joiner):
                    for a, b in zip(h["momentum"], r["first_momentum"]):
                        assert torch.equal(a, b)
                return
    pytest.fail(f"no member replica held the joiner's first shards at step {first_step}")


def test_a_whole_replica_killed_then_a_replacement_joins_shard_by_shard(job):
    for replica in range(2):
        kill = ["--kill-at", "8"] if replica == 1 else []
        _start_replica(job, replica, "--min-workers", "1", "--step-seconds", "0.2", *kill)
    job.wait_for_step("r0s0", 12)
    _start_replica(job, 2, "--init-seed", "7", "--step-seconds", "0.2")
    job.wait()
    assert all(job.workers[f"r1s{s}"].returncode == -signal.SIGKILL for s in range(SHARDS))
    survivor = _finished(job, 0)
    joiner = _finished(job, 2)
    assert joiner[0]["first_step"] > 12
    _assert_started_from_one_donor(joiner, [survivor])
    # From then on two replicas gossip again: their models end equal (2 workers average exactly).
    assert torch.allclose(_model(survivor), _model(joiner), atol=1e-5)
    _assert_trains_as_ddp_after_the_change({0: survivor, 2: joiner})


def test_a_replica_of_another_number_of_shards_is_refused_naming_both(job):
    _start_replica(job, 0, "--min-workers", "1", "--step-seconds", "0.2")
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
    assert error.startswith("ValueError") and "over 1 process" in error and "over 2" in error
    _finished(job, 0)


def test_a_joiner_that_dies_while_receiving_leaves_the_donors_untouched(job):
    for replica in range(2):
        _start_replica(job, replica, "--min-workers", "1", "--step-seconds", "0.2")
    job.wait_for_step("r0s0", 6)
    # Its shard 1 dies once its donor began to send: its shard 0, which received all of its
    # own, must not count as a member, and the donors go on as if it never came.
    _start_replica(job, 2, "--step-seconds", "0.2", kill=(1, ["--die-receiving"]))
    job.wait()
    assert job.workers["r2s1"].returncode == -signal.SIGKILL
    lost = job.result("r2s0")
    assert lost["error_type"] == "ReplicaLostError", (lost["error"], job.log("r2s0"))
    members = {replica: _finished(job, replica) for replica in range(2)}
    for results in members.values():
        for result in results:
            # The last steps between the two of them alone.
            assert result["steps"][-1]["world_size"] == 2
    _assert_trains_as_ddp_after_the_change(members)
