"""Which transport GossipDataParallel picks for the parameters' device, and its errors."""

import pytest
import torch

from gossip_ext import _C
from gossip_ext.distributed import _choose_nccl


def test_cpu_parameters_gossip_over_the_process_group():
    assert _choose_nccl(torch.device("cpu"), None) is False
    assert _choose_nccl(torch.device("cpu"), "cpu") is False


def test_cpu_parameters_refuse_a_cuda_comm_device():
    with pytest.raises(ValueError, match="comm_device='cuda'"):
        _choose_nccl(torch.device("cpu"), "cuda")


def test_cuda_parameters_refuse_cpu_staging_for_now():
    with pytest.raises(ValueError, match="comm_device='cpu'"):
        _choose_nccl(torch.device("cuda", 0), "cpu")


def test_other_devices_are_refused():
    with pytest.raises(ValueError, match="meta"):
        _choose_nccl(torch.device("meta"), None)


@pytest.mark.skipif(hasattr(_C, "NcclTransport"), reason="a CUDA build has the NCCL transport")
def test_cuda_parameters_in_a_cpu_build_say_so():
    with pytest.raises(ValueError, match="no CUDA support"):
        _choose_nccl(torch.device("cuda", 0), None)
