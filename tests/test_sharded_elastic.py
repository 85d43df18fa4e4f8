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

sys.path.insert(0, str(Path(__file__).parent))
from elastic_job import STEPS, Job, free_port  # noqa: E402

SHARDS = 2


@pytest.fixture
def job(tmp_path):
    job = Job(tmp_path)
    yield job
    job.close()


def _start_replica(job: Job, replica: int, *args: str, shards: int = SHARDS, kill=()) -> None:
    """Replica ``replica``'s processes r{replica}s{shard}; those in ``kill`` get ``--kill-at``."""
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


def test_replicas_train_and_agree(job):
    for replica in range(2):
        _start_replica(job, replica, "--min-workers", "2")
    job.wait()
    models = [_model(_finished(job, replica)) for replica in range(2)]
    assert torch.allclose(models[0], models[1], atol=1e-5), (models[0] - models[1]).abs().max()


def test_a_killed_shard_process_takes_its_replica_out_and_the_others_train_on(job):
    for replica in range(3):
        kill = (1, ["--kill-at", "10"]) if replica == 2 else ()
        _start_replica(job, replica, "--min-workers", "2", kill=kill)
    job.wait()
    assert job.workers["r2s1"].returncode == -signal.SIGKILL
    lost = job.result("r2s0")
    assert lost["error_type"] == "ReplicaLostError", (lost["error"], job.log("r2s0"))
    for replica in range(2):
        for result in _finished(job, replica):
            assert result["steps"][-1]["world_size"] == 2, result["steps"][-1]
