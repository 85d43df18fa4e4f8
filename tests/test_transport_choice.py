"""Which transport GossipDataParallel picks for the parameters' device, and its errors."""

import pytest
import torch

from gossip_ext._torch_check import _C
from gossip_ext.gossip.transport import HOST_STAGING, NCCL, PROCESS_GROUP, choose_transport

pytestmark = pytest.mark.extension  # the compiled extension's own tests (pyproject.toml)

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


def test_cpu_parameters_gossip_over_the_process_group():
    assert choose_transport(CPU, None, "gloo") == PROCESS_GROUP
    assert choose_transport(CPU, "cpu", "gloo") == PROCESS_GROUP
    assert choose_transport(CPU, None, "cpu:gloo,cuda:nccl") == PROCESS_GROUP


def test_cpu_parameters_refuse_a_cuda_comm_device():
    with pytest.raises(ValueError, match="comm_device='cuda'"):
        choose_transport(CPU, "cuda", "gloo")


def test_cpu_parameters_refuse_an_nccl_only_group():
    with pytest.raises(ValueError, match="CPU parameters .* backend 'nccl' cannot carry"):
        choose_transport(CPU, None, "nccl")


def test_cuda_parameters_with_a_cpu_comm_device_stage_through_host_buffers():
    assert choose_transport(CUDA, "cpu", "gloo") == HOST_STAGING
    assert choose_transport(CUDA, torch.device("cpu"), "cpu:gloo,cuda:nccl") == HOST_STAGING
    with pytest.raises(ValueError, match=r"comm_device='cpu' .* backend 'nccl' cannot carry"):
        choose_transport(CUDA, "cpu", "nccl")


def test_other_devices_are_refused():
    with pytest.raises(ValueError, match="meta"):
        choose_transport(torch.device("meta"), None, "gloo")


@pytest.mark.skipif(not hasattr(_C, "NcclTransport"), reason="needs a CUDA build of gossip_ext")
def test_cuda_parameters_gossip_over_nccl_in_a_cuda_build():
    assert choose_transport(CUDA, None, "nccl") == NCCL
    assert choose_transport(CUDA, "cuda", "cpu:gloo,cuda:nccl") == NCCL


@pytest.mark.skipif(hasattr(_C, "NcclTransport"), reason="a CUDA build has the NCCL transport")
def test_cuda_parameters_in_a_cpu_build_say_so():
    with pytest.raises(ValueError, match="no CUDA support"):
        choose_transport(CUDA, None, "nccl")


def _unique_id_keys(rank: int, world_size: int) -> list[str]:
    import torch.distributed as dist

    from gossip_ext.gossip import transport

    # Every rank creates every group, in the same order, as torch requires.
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = halves[rank // 2]
    keys = [transport.nccl_unique_id_key(mine), transport.nccl_unique_id_key(mine)]
    # No rank leaves while another still connects its group: a peer that exits mid-handshake
    # fails the other's new_group ("Connection closed by peer").
    dist.barrier()
    return keys


def test_nccl_unique_id_keys_differ_between_groups_and_wrappers_and_agree_within_a_group():
    from multiprocess import run_ranks

    keys = run_ranks(4, _unique_id_keys)
    assert keys[0] == keys[1] and keys[2] == keys[3]  # the ranks of one group agree
    assert set(keys[0]).isdisjoint(keys[2])  # groups {0, 1} and {2, 3} never collide
    assert keys[0][0] != keys[0][1]  # two wrappers on one group neither
