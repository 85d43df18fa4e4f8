"""fairscale's SlowMo tests, run against gossip_ext.compat.fairscale on CPU processes over gloo.

Adapted from fairscale (https://github.com/facebookresearch/fairscale),
tests/experimental/nn/data_parallel/test_gossip.py, under the BSD license:
Copyright (c) Facebook, Inc. and its affiliates. All rights reserved.

What changed: the import (``gossip`` is :mod:`gossip_ext.compat.fairscale`); NCCL with one GPU
per rank became gloo on the CPU, with the ranks run by tests/multiprocess.py ``run_ranks``
(which sets up the process group, so the rank functions no longer do) at world size 2, each
rank seeded with ``torch.manual_seed(1357)`` as fairscale's ``spawn_for_all_world_sizes(...,
deterministic=True)`` seeds them. The model, inputs, reference computations and tolerances are
upstream's; the rank functions assert inside, as upstream's do. The memory tests are not
ported (benchmarks/memory.py measures memory). Added: the signature, a checkpoint round trip
in fairscale's format, and the errors of arguments that cannot work here.
"""

from __future__ import annotations

import copy
import inspect
import traceback
import types
from typing import Any

import pytest
import torch
import torch.distributed
import torch.nn.functional as F
from multiprocess import run_ranks
from torch import nn

import gossip_ext.compat.fairscale as gossip

WORLD_SIZE = 2


def step_model(model: nn.Module, input: torch.Tensor, target: torch.Tensor) -> None:
    model.train()
    output = model(input)
    loss = F.mse_loss(output, target.to(output.device))
    loss.backward()


def update_parameters(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()
    optimizer.zero_grad()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=False)
        self.fc3 = nn.Linear(50, 4, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x: Any) -> torch.Tensor:
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        x = self.fc3(x)
        return F.softmax(x, dim=1)


def _prepare_single_device_module(
    rank: int,
    world_size: int,
    devices: list[torch.device],
    slowmo_init_dict: dict[str, Any],
    global_batch_size: int,
) -> tuple[nn.Module, gossip.SlowMoDistributedDataParallel, torch.Tensor, torch.Tensor]:
    model = Net()
    slowmo_model = gossip.SlowMoDistributedDataParallel(
        copy.deepcopy(model).to(devices[0]),
        comm_device=devices[0],
        process_rank=rank,
        process_world_size=world_size,
        **slowmo_init_dict,
    )

    model.to(devices[0])

    input = torch.randn(global_batch_size, 2).to(devices[0])
    target = torch.randn(global_batch_size, 4).to(devices[0])

    return model, slowmo_model, input, target


def run_test_slowmo_with_slowmo_freq_1(
    rank: int, world_size: int, slowmo_init_dict: dict[str, Any]
) -> None:
    devices = [torch.device("cpu")]
    local_batch_size = len(devices)
    global_batch_size = world_size * local_batch_size

    model, slowmo_model, input, target = _prepare_single_device_module(
        rank, world_size, devices, slowmo_init_dict, global_batch_size
    )
    model_optimizer = torch.optim.SGD(
        model.parameters(),
        lr=slowmo_model.slowmo_lr,
        momentum=slowmo_model.slowmo_momentum,
    )
    slowmo_model_optimizer = torch.optim.SGD(slowmo_model.module.parameters(), lr=1, momentum=0)
    slowmo_model._init_global_momentum_buffers(slowmo_model_optimizer)

    # check two model parameters over 3 iterations
    for iteration in range(3):
        # single cpu/gpu training
        step_model(model, input, target)

        # SlowMo training, SlowMo scatters subsets of input_cpu to nodes/GPUs
        step_model(
            slowmo_model,
            input[rank * local_batch_size : (rank + 1) * local_batch_size],
            target[rank * local_batch_size : (rank + 1) * local_batch_size],
        )

        # Update weights and run a second iteration to shake out errors
        update_parameters(model_optimizer)
        update_parameters(slowmo_model_optimizer)
        slowmo_model.perform_slowmo(slowmo_model_optimizer)

        for a, b in zip(model.parameters(), slowmo_model.module.parameters()):
            assert torch.allclose(a, b)

        # Shuffle the input so that DDP input is different
        torch.manual_seed(1337 + iteration)
        input = input[torch.randperm(global_batch_size)]


def run_test_localsgd_with_freq_ge_2(
    rank: int, world_size: int, slowmo_init_dict: dict[str, Any]
) -> None:
    devices = [torch.device("cpu")]
    local_batch_size = len(devices)
    global_batch_size = world_size * local_batch_size

    model, slowmo_model, input, target = _prepare_single_device_module(
        rank, world_size, devices, slowmo_init_dict, global_batch_size
    )
    assert not slowmo_model.slowmo

    model_optimizer = torch.optim.SGD(model.parameters(), lr=1, momentum=0)
    slowmo_model_optimizer = torch.optim.SGD(slowmo_model.module.parameters(), lr=1, momentum=0)

    # check two model parameters over 3 iterations
    for iteration in range(6):
        # single cpu/gpu training
        step_model(
            model,
            input[rank * local_batch_size : (rank + 1) * local_batch_size],
            target[rank * local_batch_size : (rank + 1) * local_batch_size],
        )

        # SlowMo training, SlowMo scatters subsets of input_cpu to nodes/GPUs
        step_model(
            slowmo_model,
            input[rank * local_batch_size : (rank + 1) * local_batch_size],
            target[rank * local_batch_size : (rank + 1) * local_batch_size],
        )

        # Update weights and run a second iteration to shake out errors
        update_parameters(model_optimizer)
        update_parameters(slowmo_model_optimizer)

        # This block simulates the behaviour of localsgd by doing an allreduce on
        # parameters of the regular model
        if (iteration + 1) % slowmo_model.localsgd_frequency == 0:
            for param in model.parameters():
                torch.distributed.all_reduce(param)
                with torch.no_grad():
                    param /= world_size
        slowmo_model.perform_slowmo(slowmo_model_optimizer)

        for a, b in zip(model.parameters(), slowmo_model.module.parameters()):
            assert torch.allclose(a, b)

        # Shuffle the input so that distributed input is different
        torch.manual_seed(1337 + iteration)
        input = input[torch.randperm(global_batch_size)]


def run_test_slowmo_with_slowmo_freq_ge_2(
    rank: int, world_size: int, slowmo_init_dict: dict[str, Any]
) -> None:
    devices = [torch.device("cpu")]
    local_batch_size = len(devices)
    global_batch_size = world_size * local_batch_size

    model, slowmo_model, input, target = _prepare_single_device_module(
        rank, world_size, devices, slowmo_init_dict, global_batch_size
    )
    base_lr, base_momentum = 1, 0
    model_optimizer = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=base_momentum)
    model_slow_momentum_optimizer = torch.optim.SGD(
        model.parameters(),
        lr=slowmo_model.slowmo_lr,
        momentum=slowmo_model.slowmo_momentum,
    )
    slowmo_model_optimizer = torch.optim.SGD(
        slowmo_model.module.parameters(), lr=base_lr, momentum=base_momentum
    )
    slowmo_model._init_global_momentum_buffers(slowmo_model_optimizer)

    old_parameters = [copy.deepcopy(params) for params in model.parameters()]

    # check two model parameters over 6 iterations
    for iteration in range(6):
        # single cpu/gpu training
        step_model(model, input, target)

        # SlowMo training, SlowMo scatters subsets of input_cpu to nodes/GPUs
        step_model(
            slowmo_model,
            input[rank * local_batch_size : (rank + 1) * local_batch_size],
            target[rank * local_batch_size : (rank + 1) * local_batch_size],
        )

        # Update weights and run a second iteration to shake out errors
        update_parameters(model_optimizer)
        update_parameters(slowmo_model_optimizer)
        slowmo_model.perform_slowmo(slowmo_model_optimizer)

        # This block simulates the behaviour of slow momentum by applying it manually
        # to the regular model
        if (iteration + 1) % slowmo_init_dict["slowmo_frequency"] == 0:
            for params, old_params in zip(model.parameters(), old_parameters):
                params.grad = -(params - old_params)
                with torch.no_grad():
                    params.copy_(old_params)
            update_parameters(model_slow_momentum_optimizer)
            for params, old_params in zip(model.parameters(), old_parameters):
                with torch.no_grad():
                    old_params.copy_(params)

        for a, b in zip(model.parameters(), slowmo_model.module.parameters()):
            assert torch.allclose(a, b, atol=1e-6), f"{a} = {b}"

        # Shuffle the input so that DDP input is different
        torch.manual_seed(1337 + iteration)
        input = input[torch.randperm(global_batch_size)]


_SLOWMO_TEST_SETTINGS = [
    {
        "slowmo_settings": {
            "slowmo_base_algorithm": gossip.SlowMoBaseAlgorithm.LOCALSGD,
            "localsgd_frequency": 1,
            "nprocs_per_node": 1,
            "slowmo_momentum": 0.0,
        },
        "test_function": run_test_slowmo_with_slowmo_freq_1,
        "test_name": "nccl_backend_device_ids_torch_device_list",
    },
    {
        "slowmo_settings": {
            "slowmo_base_algorithm": gossip.SlowMoBaseAlgorithm.LOCALSGD,
            # Upstream disables LocalSGD here because it failed in the one-node case; with one
            # node LocalSGD is off anyway, and this class does not fail either way.
            "localsgd_frequency": 100,
            "nprocs_per_node": 2,
            "slowmo_momentum": 0.0,
        },
        "test_function": run_test_slowmo_with_slowmo_freq_1,
        "test_name": "nccl_backend_2_proc_1_node",
    },
    {
        "slowmo_settings": {
            "slowmo_base_algorithm": gossip.SlowMoBaseAlgorithm.LOCALSGD,
            "localsgd_frequency": 1,
            "nprocs_per_node": 1,
            "slowmo_momentum": 0.5,
            "slowmo_frequency": 1,
            "slowmo_memory_efficient": True,
        },
        "test_function": run_test_slowmo_with_slowmo_freq_1,
        "test_name": "localsgd_slowmo_freq_1",
    },
    {
        "slowmo_settings": {
            "slowmo_base_algorithm": gossip.SlowMoBaseAlgorithm.SGP,
            "nprocs_per_node": 1,
            "slowmo_momentum": 0.5,
            "slowmo_frequency": 1,
            "slowmo_memory_efficient": False,
        },
        "test_function": run_test_slowmo_with_slowmo_freq_1,
        "test_name": "sgp_slowmo_freq_1",
    },
    {
        "slowmo_settings": {
            "slowmo_base_algorithm": gossip.SlowMoBaseAlgorithm.LOCALSGD,
            "localsgd_frequency": 1,
            "nprocs_per_node": 1,
            "slowmo_momentum": 0.5,
            "slowmo_frequency": 2,
            "slowmo_memory_efficient": True,
        },
        "test_function": run_test_slowmo_with_slowmo_freq_ge_2,
        "test_name": "localsgd_slowmo",
    },
    {
        "slowmo_settings": {
            "slowmo_base_algorithm": gossip.SlowMoBaseAlgorithm.LOCALSGD,
            "localsgd_frequency": 1,
            "nprocs_per_node": 1,
            "slowmo_momentum": 0.5,
            "slowmo_frequency": 2,
            "slowmo_memory_efficient": False,
        },
        "test_function": run_test_slowmo_with_slowmo_freq_ge_2,
        "test_name": "localsgd_slowmo_no_sharding",
    },
    {
        "slowmo_settings": {
            "slowmo_base_algorithm": gossip.SlowMoBaseAlgorithm.SGP,
            "nprocs_per_node": 1,
            "slowmo_momentum": 0.5,
            "slowmo_frequency": 2,
            "slowmo_memory_efficient": True,
        },
        "test_function": run_test_slowmo_with_slowmo_freq_ge_2,
        "test_name": "sgp_slowmo",
    },
    {
        "slowmo_settings": {
            "slowmo_base_algorithm": gossip.SlowMoBaseAlgorithm.SGP,
            "nprocs_per_node": 1,
            "slowmo_momentum": 0.5,
            "slowmo_frequency": 2,
            "slowmo_memory_efficient": False,
        },
        "test_function": run_test_slowmo_with_slowmo_freq_ge_2,
        "test_name": "sgp_slowmo_no_sharding",
    },
    {
        "slowmo_settings": {
            "slowmo_base_algorithm": gossip.SlowMoBaseAlgorithm.LOCALSGD,
            "localsgd_frequency": 1,
            "nprocs_per_node": 1,
            "slowmo_momentum": 0.5,
            "slowmo_frequency": 2,
            "slowmo_num_shards": 1,
            "slowmo_memory_efficient": True,
        },
        "test_function": run_test_slowmo_with_slowmo_freq_ge_2,
        "test_name": "slowmo_small_worldsize",
    },
    {
        "slowmo_settings": {
            "slowmo_base_algorithm": gossip.SlowMoBaseAlgorithm.LOCALSGD,
            "localsgd_frequency": 2,
            "nprocs_per_node": 1,
            "slowmo_momentum": 0.0,
        },
        "test_name": "localsgd_freq2",
        "test_function": run_test_localsgd_with_freq_ge_2,
    },
]


def _deterministic(rank: int, world_size: int, test_function, *args: Any) -> str | None:
    """None once test_function passed; else what it raised, with its traceback."""
    # fairscale's test_runner(deterministic=True): every rank draws the same model and inputs.
    torch.manual_seed(1357)
    try:
        test_function(rank, world_size, *args)
    except Exception:  # noqa: BLE001 - handed to the test, which fails with it
        return traceback.format_exc()
    return None


def _two_ranks(rank: int, world_size: int) -> dict[str, Any]:
    """Every training test of 2 ranks, one after the other in one set of processes: upstream's
    settings, then the checkpoint round trips."""
    return {
        "settings": {
            s["test_name"]: _deterministic(
                rank, world_size, s["test_function"], s["slowmo_settings"]
            )
            for s in _SLOWMO_TEST_SETTINGS
        },
        "checkpoint": {a: _checkpoint_rank(rank, world_size, a) for a in ("localsgd", "sgp")},
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_ranks(WORLD_SIZE, _two_ranks)


def _attributes_then_errors(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "attributes": _attributes_rank(rank, world_size),
        "errors": _errors_rank(rank, world_size),
    }


@pytest.fixture(scope="module")
def built_on_two_ranks() -> list[dict[str, Any]]:
    """The attributes of built models, then the arguments that raise: one set of 2 processes
    that trains nothing (the quick loop runs these alone)."""
    return run_ranks(WORLD_SIZE, _attributes_then_errors)


@pytest.mark.parametrize(
    "test_settings", _SLOWMO_TEST_SETTINGS, ids=[s["test_name"] for s in _SLOWMO_TEST_SETTINGS]
)
def test_settings(test_settings, two_ranks) -> None:
    for ranks_run in two_ranks:
        failure = ranks_run["settings"][test_settings["test_name"]]
        assert failure is None, failure


# Upstream's 2-node test, commented out there for want of 4 GPUs: two nodes of two processes,
# with the node and master groups given. Each step averages exactly (LocalSGD every step, or one
# gossip round between two node leaders), so every process follows full-batch SGD.
_TWO_NODE_SETTINGS = {
    "localsgd": {"slowmo_base_algorithm": "localsgd", "localsgd_frequency": 1},
    "localsgd_slowmo_freq_1": {
        "slowmo_base_algorithm": "localsgd",
        "localsgd_frequency": 1,
        "slowmo_momentum": 0.5,
        "slowmo_frequency": 1,
    },
    "sgp_slowmo_freq_1": {
        "slowmo_base_algorithm": "sgp",
        "slowmo_momentum": 0.5,
        "slowmo_frequency": 1,
        "slowmo_memory_efficient": False,
    },
}


def _two_nodes_rank(rank: int, world_size: int, settings: dict[str, Any]) -> str | None:
    local_node_group = None
    for node in range(world_size // 2):
        group = torch.distributed.new_group([2 * node, 2 * node + 1])
        if rank // 2 == node:
            local_node_group = group
    master_group = torch.distributed.new_group(list(range(0, world_size, 2)))
    settings = {
        "nprocs_per_node": 2,
        "slowmo_momentum": 0.0,
        "local_node_group": local_node_group,
        "master_group": master_group,
        **settings,
    }
    return _deterministic(rank, world_size, run_test_slowmo_with_slowmo_freq_1, settings)


def _every_two_nodes_setting(rank: int, world_size: int) -> dict[str, str | None]:
    return {
        name: _two_nodes_rank(rank, world_size, settings)
        for name, settings in _TWO_NODE_SETTINGS.items()
    }


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, str | None]]:
    return run_ranks(4, _every_two_nodes_setting)


@pytest.mark.parametrize("name", _TWO_NODE_SETTINGS)
def test_nccl_backend_2_proc_2_node(name: str, four_ranks) -> None:
    for ranks_run in four_ranks:
        assert ranks_run[name] is None, ranks_run[name]


# ----------------------------------------------------------------------------- the signature


def test_signature_is_fairscales() -> None:
    expected = [
        ("module", inspect.Parameter.empty),
        ("nprocs_per_node", inspect.Parameter.empty),
        ("broadcast_buffers", True),
        ("slowmo_base_algorithm", gossip.SlowMoBaseAlgorithm.LOCALSGD),
        ("slowmo_momentum", 0.5),
        ("slowmo_memory_efficient", True),
        ("slowmo_frequency", 48),
        ("slowmo_lr", 1.0),
        ("slowmo_num_shards", 32),
        ("localsgd_frequency", 3),
        ("graph", None),
        ("mixing", None),
        ("push_sum", True),
        ("overlap", False),
        ("synch_freq", 0),
        ("use_streams", True),
        ("slowmo_sgp_average_params", False),
        ("verbose", False),
        ("profile_mode", False),
        ("process_rank", None),
        ("process_world_size", None),
        ("global_group", None),
        ("master_group", None),
        ("local_node_group", None),
        ("comm_device", None),
    ]
    params = inspect.signature(gossip.SlowMoDistributedDataParallel).parameters.values()
    assert [(p.name, p.default) for p in params] == expected
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
    perform = inspect.signature(gossip.SlowMoDistributedDataParallel.perform_slowmo)
    assert [(p.name, p.default) for p in perform.parameters.values()] == [
        ("self", inspect.Parameter.empty),
        ("optimizer", inspect.Parameter.empty),
        ("fp32_params", None),
    ]
    assert gossip.SlowMoBaseAlgorithm("sgp") is gossip.SlowMoBaseAlgorithm.SGP
    assert gossip.SlowMoBaseAlgorithm.LOCALSGD == "localsgd"


# ----------------------------------------------------------------------------- checkpoints

_MODULE_KEYS = {"module.fc1.weight", "module.fc2.weight", "module.fc3.weight"}


def _train(model, optimizer, data, steps: range) -> None:
    for i in steps:
        x, y = data[i]
        step_model(model, x, y)
        update_parameters(optimizer)
        model.perform_slowmo(optimizer)


def _params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _checkpoint_rank(rank: int, world_size: int, algorithm: str) -> dict[str, Any]:
    torch.manual_seed(1357)
    settings = {
        "nprocs_per_node": 1,
        "slowmo_base_algorithm": algorithm,
        "slowmo_frequency": 3,
        "localsgd_frequency": 2,
        "slowmo_momentum": 0.5,
    }
    g = torch.Generator().manual_seed(100 + rank)
    data = [(torch.randn(2, 2, generator=g), torch.randn(2, 4, generator=g)) for _ in range(8)]
    model = gossip.SlowMoDistributedDataParallel(Net(), **settings)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    _train(model, optimizer, data, range(4))
    # state_dict() shares the parameters' storage, as nn.Module's does: a copy, as a file is.
    saved = copy.deepcopy(model.state_dict())
    _train(model, optimizer, data, range(4, 8))
    uninterrupted = _params(model.module)

    # A fresh process resumes from the checkpoint: the same steps give the same model, since the
    # step count and SlowMo's slow state come back with it.
    torch.manual_seed(7)
    resumed = gossip.SlowMoDistributedDataParallel(Net(), **settings)
    keys = set(saved)
    resumed.load_state_dict(saved)
    assert set(saved) == keys  # left unchanged
    loaded = _params(resumed.module)
    num_updates = resumed.num_updates
    resumed_optimizer = torch.optim.SGD(resumed.parameters(), lr=0.5)
    _train(resumed, resumed_optimizer, data, range(4, 8))

    # fairscale's own checkpoint (no _extra_state): with SGP, numerators x = w z and weight w.
    fairscale_state = {k: v for k, v in saved.items() if k in _MODULE_KEYS}
    if algorithm == "sgp":
        fairscale_state = {k: v * 0.5 for k, v in fairscale_state.items()}
        fairscale_state["ps_weight"] = torch.tensor([0.5])
        fairscale_state["is_sgp_ps_numerator"] = True
    foreign = gossip.SlowMoDistributedDataParallel(Net(), **settings)
    foreign.load_state_dict(fairscale_state)

    # The weights load into the plain model.
    plain = Net()
    plain.load_state_dict(
        {k.removeprefix("module."): v for k, v in saved.items() if k.startswith("module.")}
    )
    return {
        "keys": set(saved),
        "ps_weight": saved.get("ps_weight"),
        "is_sgp_ps_numerator": saved.get("is_sgp_ps_numerator"),
        "saved": [saved[k] for k in sorted(_MODULE_KEYS)],
        "loaded": loaded,
        "num_updates": num_updates,
        "uninterrupted": uninterrupted,
        "resumed": _params(resumed.module),
        "foreign": _params(foreign.module),
        "plain": _params(plain),
    }


@pytest.mark.parametrize("algorithm", ["localsgd", "sgp"])
def test_checkpoint_round_trip_in_fairscale_format(algorithm: str, two_ranks) -> None:
    for result in (ranks_run["checkpoint"][algorithm] for ranks_run in two_ranks):
        if algorithm == "sgp":
            assert result["keys"] == _MODULE_KEYS | {
                "_extra_state",
                "ps_weight",
                "is_sgp_ps_numerator",
            }
            weight = result["ps_weight"]
            assert isinstance(weight, torch.Tensor)
            assert weight.shape == (1,) and weight.dtype == torch.float32
            assert weight.device.type == "cpu" and weight.item() == 1.0
            assert result["is_sgp_ps_numerator"] is False
        else:
            assert result["keys"] == _MODULE_KEYS | {"_extra_state"}
        assert result["num_updates"] == 4
        for saved, loaded, foreign, plain in zip(
            result["saved"], result["loaded"], result["foreign"], result["plain"]
        ):
            assert torch.equal(saved, loaded)
            assert torch.allclose(saved, foreign)
            assert torch.equal(saved, plain)
        for a, b in zip(result["uninterrupted"], result["resumed"]):
            assert torch.equal(a, b)


# ----------------------------------------------------------------------------- errors


class _ApexLikeSGD(torch.optim.SGD):
    """What apex amp (O2) makes of an optimizer: fp16 groups with fp32 masters in _amp_stash."""

    def __init__(self, params, lr: float):
        super().__init__(params, lr=lr)
        self._amp_stash = types.SimpleNamespace(fp16_groups=[], fp32_from_fp16_groups=[])


def _error(build) -> tuple[str, str] | None:
    try:
        build()
    except (TypeError, ValueError) as error:
        return type(error).__name__, str(error)
    return None


def _errors_rank(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(1357)
    make = gossip.SlowMoDistributedDataParallel
    # Collective: every rank creates every group.
    rank1_only = torch.distributed.new_group([1])
    rank0_only = torch.distributed.new_group([0])
    errors = {
        "overlap": _error(lambda: make(Net(), 1, slowmo_base_algorithm="sgp", overlap=True)),
        "algorithm": _error(lambda: make(Net(), 1, slowmo_base_algorithm="gossip")),
        "process_rank": _error(lambda: make(Net(), 1, process_rank=0, process_world_size=2)),
        "process_world_size": _error(lambda: make(Net(), 1, process_world_size=4)),
        "nprocs_per_node": _error(lambda: make(Net(), 3)),
        "master_group": _error(lambda: make(Net(), 1, master_group=rank1_only)),
        "local_node_group": _error(lambda: make(Net(), 2, local_node_group=rank0_only)),
        "graph": _error(
            lambda: make(
                Net(),
                1,
                slowmo_base_algorithm="sgp",
                graph=gossip.NPeerDynamicDirectedExponentialGraph(0, 2),
            )
        ),
        "mixing": _error(lambda: make(Net(), 1, slowmo_base_algorithm="sgp", mixing="uniform")),
        "slowmo_frequency": _error(lambda: make(Net(), 1, slowmo_frequency=0)),
        "broadcast_buffers": _error(lambda: make(Net(), 1, broadcast_buffers=1)),
        "global_group": _error(lambda: make(Net(), 1, global_group="world")),
    }
    # Accepted, and without effect.
    model = make(
        Net(),
        1,
        slowmo_base_algorithm=gossip.SlowMoBaseAlgorithm.SGP,
        synch_freq=2,
        use_streams=False,
        profile_mode=True,
        slowmo_sgp_average_params=True,
        master_group=torch.distributed.group.WORLD,
        graph=gossip.NPeerDynamicDirectedExponentialGraph(rank, world_size),
        mixing=gossip.UniformMixing(gossip.NPeerDynamicDirectedExponentialGraph(rank, 2), "cpu"),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    errors["fp32_params"] = _error(
        lambda: model.perform_slowmo(optimizer, fp32_params=torch.zeros(3))
    )
    errors["apex"] = _error(lambda: model.perform_slowmo(_ApexLikeSGD(model.parameters(), lr=0.1)))
    errors["optimizer"] = _error(lambda: model.perform_slowmo("sgd"))
    model.perform_slowmo(optimizer)
    return {
        "errors": errors,
        "num_updates": model.num_updates,
        "sgp": model.sgp,
        "gossip_round": model.gossip_round,
    }


_EXPECTED_ERRORS = {
    "overlap": ("ValueError", "overlap=True"),
    "algorithm": ("ValueError", "slowmo_base_algorithm"),
    "process_rank": ("ValueError", "process_rank=0"),
    "process_world_size": ("ValueError", "process_world_size=4"),
    "nprocs_per_node": ("ValueError", "nprocs_per_node (3)"),
    "master_group": ("ValueError", "master_group"),
    "local_node_group": ("ValueError", "local_node_group"),
    "graph": ("ValueError", "graph="),
    "mixing": ("TypeError", "mixing"),
    "slowmo_frequency": ("ValueError", "slowmo_frequency must be >= 1, got 0"),
    "broadcast_buffers": ("TypeError", "broadcast_buffers"),
    "global_group": ("TypeError", "global_group"),
    "fp32_params": ("ValueError", "fp32_params"),
    "apex": ("ValueError", "apex"),
    "optimizer": ("TypeError", "optimizer"),
}


def test_arguments_that_cannot_work_raise_on_every_rank(built_on_two_ranks) -> None:
    for result in (ranks_run["errors"] for ranks_run in built_on_two_ranks):
        # One SGP round per perform_slowmo(), finished when it returns.
        assert result["num_updates"] == 1 and result["sgp"] and result["gossip_round"] == 1
        for name, (kind, words) in _EXPECTED_ERRORS.items():
            got = result["errors"][name]
            assert got is not None, f"{name}: nothing raised"
            assert got[0] == kind and words in got[1], f"{name}: {got}"


# ----------------------------------------------------------------------------- attributes


def _attributes_rank(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(1357)
    one_node = gossip.SlowMoDistributedDataParallel(
        Net(), 2, slowmo_base_algorithm=gossip.SlowMoBaseAlgorithm.SGP
    )
    two_nodes = gossip.SlowMoDistributedDataParallel(
        Net(), 1, slowmo_momentum=0.0, slowmo_lr=2.0, localsgd_frequency=5
    )
    names = (
        "slowmo",
        "slowmo_lr",
        "slowmo_momentum",
        "slowmo_frequency",
        "localsgd_frequency",
        "localsgd",
        "sgp",
        "num_updates",
        "logical_rank",
        "logical_world_size",
        "process_rank",
        "process_world_size",
    )
    return {
        "one_node": {n: getattr(one_node, n) for n in names},
        "two_nodes": {n: getattr(two_nodes, n) for n in names},
        "master_groups": (one_node.master_group is None, two_nodes.master_group is None),
        "one_node_keys": set(one_node.state_dict()),
    }


def test_fairscale_attributes(built_on_two_ranks) -> None:
    for rank, result in enumerate(ranks_run["attributes"] for ranks_run in built_on_two_ranks):
        one_node = result["one_node"]
        # One node: LocalSGD and SGP are off, gradients are averaged inside the node.
        assert not one_node["localsgd"] and not one_node["sgp"]
        assert one_node["logical_rank"] == 0 and one_node["logical_world_size"] == 1
        assert result["master_groups"] == (True, False)
        assert (one_node["slowmo"], one_node["slowmo_lr"], one_node["slowmo_momentum"]) == (
            True,
            1.0,
            0.5,
        )
        assert "ps_weight" not in result["one_node_keys"]
        two_nodes = result["two_nodes"]
        assert two_nodes["localsgd"] and not two_nodes["sgp"]
        # SlowMo is on iff slowmo_lr != 1 or slowmo_momentum != 0.
        assert (two_nodes["slowmo"], two_nodes["slowmo_lr"]) == (True, 2.0)
        assert two_nodes["slowmo_frequency"] == 48 and two_nodes["localsgd_frequency"] == 5
        assert two_nodes["num_updates"] == 0
        assert (two_nodes["logical_rank"], two_nodes["logical_world_size"]) == (rank, 2)
        assert (two_nodes["process_rank"], two_nodes["process_world_size"]) == (rank, 2)
