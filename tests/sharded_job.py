"""Elastic jobs of sharded replicas as tests launch them (tests/sharded_member.py, one process
per shard of each replica, every replica its own world), and what the tests check of them: the
replicas' whole models from their processes' shards, a joiner against its donor, and the DDP
reference of two replicas after a change."""

from __future__ import annotations

import pytest
import torch
from elastic_job import STEPS, Job, free_port
from membership_worker import batch
from sharded_member import net
from torch import nn

SHARDS = 2


def start_replica(job: Job, replica: int, *args: str, kill=(), shards: int = SHARDS) -> None:
    """Replica ``replica``'s ``shards`` processes r{replica}s{shard}; shard ``kill[0]`` gets the
    arguments ``kill[1]`` too."""
    port = free_port()
    for shard in range(shards):
        extra = list(kill[1]) if shard in kill[:1] else []
        job.start(
            f"r{replica}s{shard}",
            "--replica-port",
            str(port),
            "--shard",
            str(shard),
            "--shards",
            str(shards),
            "--replica",
            str(replica),
            *args,
            *extra,
            script="sharded_member",
        )


def finished(job: Job, replica: int, shards: int = SHARDS) -> list[dict]:
    results = []
    for shard in range(shards):
        name = f"r{replica}s{shard}"
        result = job.result(name)
        assert result["error"] is None, (name, result["error"], job.log(name))
        assert result["final_step"] == STEPS, (name, result["final_step"])
        assert all(s["finite"] for s in result["steps"]), name
        results.append(result)
    return results


def assert_lost_its_replica(job: Job, name: str) -> None:
    """Process ``name`` raised ReplicaLostError, and what its user read then was a model: raised
    by the forward or the backward, the shards the forward had read (the last step's model, its
    round absorbed); raised by the optimizer step's boundary, that step's; finite, the same in
    ``module.state_dict()``, unchanged by a later call, which raised again."""
    result = job.result(name)
    assert result["error_type"] == "ReplicaLostError", (result["error"], job.log(name))
    read = result["lost_reads"]
    assert read["finite"] and read["state_dict_agrees"], read
    assert read["raises_again"] and read["unchanged_after"], read
    assert read["raised_in"] == "step" or read["equals_forward_read"], read


def model_of(shard_results: list[dict], step: int | None = None) -> torch.Tensor:
    """A replica's whole model after ``step`` (None: its final one), from its processes' shards
    (FSDP2 cuts each parameter in chunks along dim 0, in shard order)."""
    parts = []
    for r in shard_results:
        if step is None:
            parts.append(r["final_shards"])
        else:
            parts.append(next(s["shards"] for s in r["steps"] if s["step"] == step))
    return torch.cat([torch.cat(chunks).flatten() for chunks in zip(*parts)])


def momentum_of(shard_results: list[dict], step: int) -> torch.Tensor:
    parts = [next(s["momentum"] for s in r["steps"] if s["step"] == step) for r in shard_results]
    return torch.cat([torch.cat(chunks).flatten() for chunks in zip(*parts)])


def assert_trains_as_ddp_after_the_change(replicas: dict[int, list[dict]]) -> None:
    """The reference: two replicas under synchronous SGP average exactly every round (each
    keeps half its mass and sends half to the other), so the mean of their models and momenta
    moves as DDP's single model does on the mean gradient of all their batches (each replica's
    gradient the mean of its shard processes' batches, as FSDP2 reduces them). Replayed in
    float64 from the first step both replicas took in the new epoch (the round of that step
    between them alone), against every later step's mean."""
    results = list(replicas.values())
    shards = len(results[0])
    epochs = [{s["step"]: s["epoch"] for s in r[0]["steps"]} for r in results]
    last = max(e for e in epochs[0].values())
    start = min(k for k in epochs[0] if all(e.get(k) == last for e in epochs))
    steps = [k for k in range(start, STEPS + 1) if all(k in e for e in epochs)]
    assert len(steps) >= 5, (start, steps)
    model = net().double()
    params = list(model.parameters())
    mean = torch.stack([model_of(r, start) for r in results]).double().mean(0)
    velocity = torch.stack([momentum_of(r, start) for r in results]).double().mean(0)
    for step in range(start, STEPS):
        torch.nn.utils.vector_to_parameters(mean, params)
        losses = []
        for replica in replicas:
            for shard in range(shards):
                x, y = batch(step, 10 * replica + shard)
                losses.append(nn.functional.mse_loss(model(x.double()), y.double()))
        gradient = torch.autograd.grad(torch.stack(losses).mean(), params)
        velocity = 0.9 * velocity + torch.cat([g.flatten() for g in gradient])
        mean = mean - 0.05 * velocity
        measured = torch.stack([model_of(r, step + 1) for r in results]).double().mean(0)
        assert torch.allclose(measured, mean, rtol=1e-4, atol=1e-5), (
            step + 1,
            (measured - mean).abs().max(),
        )


def assert_started_from_one_donor(joiner: list[dict], members: list[list[dict]]) -> None:
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
