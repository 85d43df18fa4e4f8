"""An elastic job of sharded replicas with CUDA parameters on one GPU: replicas of one process
each, FSDP2 inside each replica over NCCL (a communicator of one process), gossip and handoffs
between the replicas over the epochs' gloo groups through host buffers (comm_device='cpu'). A
replica is killed and a replacement joins; the same checks as tests/test_sharded_elastic.py.
Skipped, visibly, without a GPU."""

from __future__ import annotations

import signal

import torch
from elastic_job import Job
from sharded_job import (
    assert_started_from_one_donor,
    assert_trains_as_ddp_after_the_change,
    finished,
    start_replica,
)
from small_task import needs_gpu

pytestmark = needs_gpu("sharded replicas in an elastic job, FSDP2 over NCCL")


def test_a_cuda_replica_killed_and_replaced_shard_by_shard(tmp_path):
    job = Job(tmp_path)
    try:
        _kill_and_replace(job)
    finally:
        job.close()


def _kill_and_replace(job: Job) -> None:
    common = ["--device", "cuda", "--step-seconds", "0.2"]
    for replica in range(2):
        kill = ["--kill-at", "8", "--kill-in-world", "2"] if replica == 1 else []
        start_replica(job, replica, "--min-workers", "1", *common, *kill, shards=1)
    job.wait_for_step("r0s0", 12)
    start_replica(job, 2, "--init-seed", "7", *common, shards=1)
    job.wait()
    assert job.workers["r1s0"].returncode == -signal.SIGKILL
    survivor, joiner = finished(job, 0, shards=1), finished(job, 2, shards=1)
    assert_started_from_one_donor(joiner, [survivor])
    assert torch.allclose(survivor[0]["final_shards"][0], joiner[0]["final_shards"][0], atol=1e-5)
    assert_trains_as_ddp_after_the_change({0: survivor, 2: joiner})
