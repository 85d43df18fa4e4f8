"""examples/train.py on GPUs, launched as docs/gpus.md launches it: CUDA parameters over NCCL, one
process per GPU, and several processes sharing one GPU over gloo through host buffers
(--comm-device cpu). Skipped, visibly, without a CUDA build and a GPU; the run over several
GPUs skips below two. Its argument handling is tested without a GPU: tests/test_train_devices.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gossip_ext._torch_check import _C

pytestmark = [
    pytest.mark.extension,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and hasattr(_C, "NcclTransport")),
        reason="needs a CUDA GPU and a CUDA build of gossip_ext",
    ),
]

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "train.py"
CHANCE = 0.25  # four classes


def _torchrun(tmp_path: Path, processes: int, *args: str) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(processes), str(TRAIN), "--steps", "100", *args]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=50, cwd=tmp_path)
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-4000:])
    assert float(re.search(r"accuracy (\d\.\d+)", done.stdout).group(1)) > 2 * CHANCE, done.stdout
    return done.stdout


@pytest.mark.parametrize("mode", ["sgp", "overlap", "ddp"])
def test_one_process_on_its_gpu_over_nccl(tmp_path, mode):
    out = _torchrun(tmp_path, 1, "--device", "cuda", "--mode", mode)
    assert "world_size=1 nprocs_per_node=1 device=cuda:0 over nccl" in out, out


def test_three_processes_share_one_gpu_through_host_buffers_over_gloo(tmp_path):
    out = _torchrun(tmp_path, 3, "--device", "cuda", "--comm-device", "cpu")
    assert "world_size=3 nprocs_per_node=1 device=cuda:0 over gloo, comm_device=cpu" in out, out
    distance = float(re.search(r"relative consensus distance (\S+)", out).group(1))
    assert 0.0 < distance < 0.1, out  # gossip, not all-reduce: close, not identical


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one process per GPU needs two GPUs")
def test_one_process_per_gpu_over_nccl(tmp_path):
    processes = min(torch.cuda.device_count(), 4)
    out = _torchrun(tmp_path, processes, "--device", "cuda")
    assert f"world_size={processes} nprocs_per_node=1 device=cuda:0 over nccl" in out, out
    assert "gossip bytes sent per step" in out, out
