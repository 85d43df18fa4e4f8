"""examples/train.py's device arguments (examples/devices.py), decided without a GPU: what the
command line alone refuses, which device and backend each process gets for a given node, and the
error a node that cannot run them gives. Running the example on a GPU:
tests/gpu/test_train_example.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture
def train(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import train

    return train


def _choose(train, argv, local_rank=0, local_world_size=1, gpus=1, cuda_build=True):
    args = train.parse_args(argv)
    return train.devices.choose(args, local_rank, local_world_size, gpus, cuda_build)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--comm-device", "cpu"], "--comm-device cpu stages CUDA parameters through the host; "
                                   "it needs --device cuda"),
        (["--mode", "ddp", "--device", "cuda", "--comm-device", "cpu"],
         "--comm-device is for the gossip modes, not --mode ddp"),
        (["--device", "gpu"], "argument --device: invalid choice: 'gpu'"),
        (["--device", "cuda", "--comm-device", "cuda"], "argument --comm-device: invalid choice"),
    ],
)  # fmt: skip
def test_the_command_line_alone_refuses_naming_the_argument(train, capsys, argv, words):
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(argv)
    assert exit_info.value.code == 2
    assert words in capsys.readouterr().err


def test_the_default_is_the_cpu_over_gloo_whatever_the_gpus(train):
    assert _choose(train, [], gpus=0) == (torch.device("cpu"), "gloo")
    assert _choose(train, [], local_rank=3, local_world_size=4, gpus=8) == (
        torch.device("cpu"),
        "gloo",
    )


@pytest.mark.parametrize("mode", ["sgp", "ddp"])
def test_each_process_gets_the_gpu_of_its_local_rank_over_nccl(train, mode):
    for local_rank in range(4):
        device, backend = _choose(
            train, ["--device", "cuda", "--mode", mode], local_rank, local_world_size=4, gpus=4
        )
        assert (device, backend) == (torch.device("cuda", local_rank), "nccl")
    # Fewer processes than GPUs is fine: the first ones are used.
    assert _choose(train, ["--device", "cuda"], 1, local_world_size=2, gpus=8)[0].index == 1


def test_processes_sharing_gpus_go_round_them_over_gloo(train):
    argv = ["--device", "cuda", "--comm-device", "cpu"]
    on_one = [_choose(train, argv, r, local_world_size=3, gpus=1) for r in range(3)]
    assert on_one == [(torch.device("cuda", 0), "gloo")] * 3
    on_two = [_choose(train, argv, r, local_world_size=5, gpus=2)[0].index for r in range(5)]
    assert on_two == [0, 1, 0, 1, 0]


def test_no_visible_gpu_names_the_argument(train):
    for argv in (["--device", "cuda"], ["--device", "cuda", "--comm-device", "cpu"]):
        with pytest.raises(ValueError, match=r"^--device cuda: no CUDA device is visible"):
            _choose(train, argv, gpus=0)


def test_more_processes_than_gpus_over_nccl_says_so_and_what_to_do(train):
    with pytest.raises(ValueError) as error:
        _choose(train, ["--device", "cuda"], local_rank=0, local_world_size=4, gpus=1)
    message = str(error.value)
    assert message.startswith("--device cuda runs one process per GPU over NCCL"), message
    assert "starts 4 processes and sees 1 GPU:" in message, message
    assert "--nproc_per_node 1, or add --comm-device cpu" in message, message
    # DDP has no host-staged gossip to offer instead.
    with pytest.raises(ValueError) as error:
        _choose(train, ["--device", "cuda", "--mode", "ddp"], local_world_size=3, gpus=2)
    assert str(error.value).endswith("sees 2 GPUs: launch --nproc_per_node 2"), error.value


def test_a_build_without_cuda_kernels_is_named_for_gossip_not_for_ddp(train):
    with pytest.raises(ValueError, match="this build of gossip_ext has no CUDA kernels"):
        _choose(train, ["--device", "cuda"], cuda_build=False)
    assert _choose(train, ["--device", "cuda", "--mode", "ddp"], cuda_build=False)[1] == "nccl"


def test_under_torchrun_without_a_gpu_every_rank_stops_saying_why(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               "2", str(EXAMPLES / "train.py"), "--device", "cuda"]  # fmt: skip
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU, also on a machine that has one
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
    )
    assert done.returncode != 0, done.stdout
    reason = "train.py: error: --device cuda: no CUDA device is visible"
    # Each rank says it; torchrun may stop the others before they do once the first has exited.
    assert 1 <= done.stderr.count(reason) <= 2, done.stderr[-4000:]
