"""Elastic jobs with CUDA parameters: each epoch gossips over an NCCL communicator of its own, whose
ranks meet in the membership store; the epoch's gloo group carries the handoff and the exact
averages. Skipped, visibly, without a CUDA build and a GPU; jobs of several workers skip below two
GPUs (one GPU cannot hold two NCCL ranks)."""

from __future__ import annotations

import signal

import pytest
import torch
from elastic_job import STEPS, TIMEOUT_S, Job
from membership_worker import batch
from multiprocess import run_ranks
from nccl_rounds import held_round
from torch import nn

from gossip_ext._torch_check import _C
from gossip_ext.membership import epochs

pytestmark = [
    pytest.mark.extension,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and hasattr(_C, "NcclTransport")),
        reason="needs a CUDA GPU and a CUDA build of gossip_ext",
    ),
]
two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="an elastic job of two NCCL workers needs two GPUs"
)


@pytest.fixture
def job(tmp_path):
    job = Job(tmp_path)
    yield job
    job.close()


def _finished(job: Job, name: str) -> dict:
    result = job.result(name)
    assert result["error"] is None, (name, result["error"], job.log(name))
    assert result["final_step"] == STEPS, (name, result["final_step"], job.log(name))
    assert all(s["finite"] for s in result["steps"]), name
    return result


def test_an_elastic_worker_alone_on_its_gpu_trains_like_plain_sgd(job):
    # Before epochs had NCCL communicators, CUDA parameters in an elastic job were refused
    # (comm_device="cpu" was needed); the epoch's transport now meets in the membership store.
    job.start("w0", "--device", "cuda:0", "--init-seed", "3")
    job.wait()
    result = _finished(job, "w0")
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step, result["worker_id"])
        loss = nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for got, want in zip(result["final_params"], net.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-5)


@two_gpus
def test_a_survivor_goes_on_over_nccl_and_a_replacement_on_another_gpu_starts_from_it(job):
    job.start("w0", "--device", "cuda:0", "--step-seconds", "0.2")
    job.start("w1", "--device", "cuda:1", "--step-seconds", "0.2", "--kill-at", "8")
    job.wait_for_step("w0", 14)
    # The replacement takes the dead worker's GPU; its donor's tensors were on cuda:0.
    job.start("w2", "--device", "cuda:1", "--init-seed", "7", "--step-seconds", "0.2")
    job.wait()
    survivor, new = _finished(job, "w0"), _finished(job, "w2")
    assert job.workers["w1"].returncode == -signal.SIGKILL
    assert {s["world_size"] for s in survivor["steps"]} >= {1, 2}
    held = next(s for s in survivor["steps"] if s["step"] == new["first_step"])
    torch.testing.assert_close(
        torch.cat([p.flatten() for p in new["first_params"]]), held["params"]
    )


@two_gpus
def test_a_stalled_nccl_peer_is_given_up_after_its_heartbeat_stops(job):
    job.start("w0", "--device", "cuda:0", "--step-seconds", "0.2")
    job.start("w1", "--device", "cuda:1", "--step-seconds", "0.2", "--stop-at", "8")
    job.wait_for_step("w1", 8)
    job.wait_for_step("w0", STEPS, deadline_s=TIMEOUT_S * 4)
    job.workers["w1"].send_signal(signal.SIGCONT)
    job.wait()
    survivor = _finished(job, "w0")
    times = [s["time"] for s in survivor["steps"]]
    gap = max(b - a for a, b in zip(times, times[1:]))
    # The watch aborts the epoch's communicator (NcclTransport::abandon) once the heartbeat has
    # been silent for SILENT_S, well before the timeout.
    assert gap < epochs.SILENT_S + 3.0 + 0.2 < TIMEOUT_S, gap


def test_an_nccl_round_given_up_from_another_thread_raises_long_before_its_timeout():
    # The round waits behind a compute stream busy for 3 s: to the transport, a silent peer,
    # given up from another thread after 0.5 s as the watch gives up a silent member's rounds.
    give_up = (0.5, "worker 1 went silent")
    result = run_ranks(1, held_round, "test/abandon", 60.0, 3.0, 60.0, 4, give_up)[0]
    assert result["error"] is not None, "wait() returned for an abandoned round"
    assert "gave up" in result["error"] and "worker 1 went silent" in result["error"], result
    assert result["later"] == result["error"], result  # the communicator is gone for good
    assert result["elapsed"] < 30.0, result["elapsed"]
