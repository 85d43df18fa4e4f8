"""The configurations benchmarks/memory.py measures, and the figures it holds them to.

Each configuration is a name -> (kind, options): the kind picks the wrapper that
memory_wrappers.wrap builds around the model, the options are passed to it. The constants here
set the run's shape (workers, layer width, batch) and the goals the report checks.
"""

from __future__ import annotations

import torch

WORLD_SIZE = 2
WIDTH = 2048  # features of every Linear layer
BATCH = 16
GOAL_COPIES = 1.1  # synchronous SGP's goal, in extra model copies
# glibc's malloc maps every block of at least this many bytes on its own, so that a freed layer
# buffer goes back to the system instead of staying in the heap (memory.py's docstring).
MMAP_THRESHOLD = "131072"

# name -> (kind, options); "bare" is the baseline every other row is measured against.
CONFIGS = {
    "bare model": ("bare", {}),
    "gossip_ext sync SGP": ("gossip", {}),
    "gossip_ext overlap SGP": ("gossip", {"overlap": True}),
    "gossip_ext push-pull (D-PSGD)": ("gossip", {"push_sum": False}),
    "DDP": ("ddp", {}),
    "DDP gradient_as_bucket_view": ("ddp", {"gradient_as_bucket_view": True}),
    "plain push-sum (SGP-style)": ("plain", {}),
}
# fairscale's SlowMoDistributedDataParallel through gossip_ext.compat.fairscale, in fairscale's own
# loop (step, zero_grad, perform_slowmo), beside the core wrapper with register_optimizer(), whose
# hook averages right after the step, while the gradients are still alive.
_SLOWMO = {"slowmo_momentum": 0.5, "slowmo_frequency": 1, "nprocs_per_node": 1}
CONFIGS.update(
    {
        "fairscale SlowMo memory-efficient": (
            "fairscale",
            {**_SLOWMO, "localsgd_frequency": 100, "slowmo_memory_efficient": True},
        ),
        "fairscale SlowMo no sharding": (
            "fairscale",
            {**_SLOWMO, "localsgd_frequency": 100, "slowmo_memory_efficient": False},
        ),
        "fairscale LocalSGD + SlowMo memory-efficient": (
            "fairscale",
            {**_SLOWMO, "localsgd_frequency": 1, "slowmo_memory_efficient": True},
        ),
        "fairscale LocalSGD": (
            "fairscale",
            {"slowmo_momentum": 0.0, "localsgd_frequency": 1, "nprocs_per_node": 1},
        ),
        "gossip_ext LocalSGD (hook)": (
            "hook",
            {"base_algorithm": "localsgd", "global_avg_freq": 1},
        ),
        "gossip_ext SlowMo memory-efficient (hook)": (
            "hook",
            {"base_algorithm": "localsgd", "slowmo_freq": 1, "slowmo_memory_efficient": True},
        ),
        "gossip_ext SlowMo (hook)": ("hook", {"base_algorithm": "localsgd", "slowmo_freq": 1}),
    }
)


def nesterov(params) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer (SGD with Nesterov momentum: one model copy of state)."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


# DiLoCo with an outer step after every inner step (sync_every=1), so that the steps measure its
# steady state with the outer momentum alive; torchft's DiLoCo beside it, the same outer SGD.
_DILOCO = {"base_algorithm": "localsgd", "sync_every": 1, "outer_optimizer": nesterov}
CONFIGS.update(
    {
        "gossip_ext DiLoCo (hook)": ("hook", _DILOCO),
        "gossip_ext DiLoCo gossip average (hook)": (
            "hook",
            {**_DILOCO, "outer_average": "gossip"},
        ),
        "gossip_ext DiLoCo outer_device=cpu (hook)": ("hook", {**_DILOCO, "outer_device": "cpu"}),
        "torchft DiLoCo": ("torchft", {"sync_every": 1}),
    }
)
DILOCO = ("gossip_ext DiLoCo (hook)", "torchft DiLoCo")
# The extra model copies fairscale's tests/experimental/nn/data_parallel/test_gossip.py expects at
# the peak (2 workers, so the memory-efficient state is split in halves) and this project's goals.
SLOWMO_GOALS = {
    "fairscale SlowMo memory-efficient": ("~1.0 (approx(1.0, rel 0.1))", 1.1),
    "fairscale SlowMo no sharding": ("~2.0 (approx(2.0, rel 0.1))", 2.1),
    "fairscale LocalSGD + SlowMo memory-efficient": ("1.0 + LocalSGD's < 0.3", 1.3),
    "fairscale LocalSGD": ("< 0.3", 0.3),
}
GOSSIP_SYNC = "gossip_ext sync SGP"
PEERS = ("DDP", "DDP gradient_as_bucket_view", "plain push-sum (SGP-style)")
