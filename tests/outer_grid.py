"""Every outer rule x averaging x whole-or-streamed, trained for 22 steps on 3 gloo processes:
the digests of the parameters each rank ends with.

``tests/data/outer_grid_digests.json`` holds, per CPU vendor, what the code computed: on AMD
(Zen 4) machines the digests of the code before the averagings became objects of one interface
(commit 1f888ff); on Intel ones those of c3f2f5b, whose AMD digests are still 1f888ff's. The
bits depend on the CPU: torch's own matrix kernels (MKL, oneDNN) take other paths on Intel's
AMX and AVX-512 FP16 than on AMD, and a Linear layer's output differs in its last bits, while
gossip_ext's kernels give the same bits at every instruction set they allow.
``test_outer_grid.py`` checks that every configuration still ends with the same bits on a
machine of a vendor the file has; ``python3 tests/outer_grid.py`` writes this machine's vendor's
entry anew (only after a change that is meant to move the numbers).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
from torch import nn

import gossip_ext

STEPS = 22  # the last two inner steps leave the ranks apart
WORLD_SIZE = 3
DIGESTS = os.path.join(os.path.dirname(__file__), "data", "outer_grid_digests.json")


def _outer_sgd(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def configurations() -> dict[str, dict]:
    """Name -> GossipDataParallel keywords: every meaningful combination of the outer rule, the
    averaging and whole-or-streamed, with and without gossip between outer steps."""
    topk = gossip_ext.TopK(density=1 / 16, bits=2, chunk=64)
    whole = {
        "average": lambda: gossip_ext.Average(every=4),
        "slowmo": lambda: gossip_ext.SlowMo(every=4, momentum=0.5, lr=1.0),
        "slowmo_average_every": lambda: gossip_ext.SlowMo(every=6, average_every=2),
        "diloco_exact": lambda: gossip_ext.DiLoCo(_outer_sgd, every=4),
        "diloco_int8": lambda: gossip_ext.DiLoCo(
            _outer_sgd, every=4, average=gossip_ext.Exact(dtype="int8")
        ),
        "diloco_bf16": lambda: gossip_ext.DiLoCo(
            _outer_sgd, every=4, average=gossip_ext.Exact(dtype=torch.bfloat16)
        ),
        "diloco_topk": lambda: gossip_ext.DiLoCo(
            _outer_sgd, every=4, average=gossip_ext.Exact(dtype=topk)
        ),
        "diloco_gossip": lambda: gossip_ext.DiLoCo(
            _outer_sgd, every=4, average=gossip_ext.ByGossip()
        ),
        "diloco_compressed_gossip": lambda: gossip_ext.DiLoCo(
            _outer_sgd,
            every=4,
            average=gossip_ext.ByCompressedGossip(message=topk, consensus_step=0.5),
        ),
    }
    streamed = {
        f"streaming_{name}": (
            lambda average=average: gossip_ext.DiLoCo(
                _outer_sgd, every=4, average=average(), fragments=2, delay=1, alpha=0.5
            )
        )
        for name, average in {
            "exact": gossip_ext.Exact,
            "int8": lambda: gossip_ext.Exact(dtype="int8"),
            "topk": lambda: gossip_ext.Exact(dtype=topk),
            "gossip": gossip_ext.ByGossip,
        }.items()
    }
    grid = {}
    for name, outer in {**whole, **streamed}.items():
        grid[f"{name}/local"] = {"gossip": None, "outer": outer}
        grid[f"{name}/sgp"] = {"gossip": lambda: gossip_ext.SGP(), "outer": outer}
    return grid


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))


def _digest(module: nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in list(module.parameters()) + list(module.buffers()):
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def train_steps(model: gossip_ext.GossipDataParallel, rank: int, steps: int) -> None:
    """``steps`` optimizer steps of SGD on this rank's own regression batches, gossip and outer
    steps through the optimizer's hook."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model.register_optimizer(optimizer)
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def cpu_vendor() -> str:
    """This machine's CPU vendor as the kernel names it (GenuineIntel, AuthenticAMD)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def train_grid(rank: int, world_size: int) -> dict[str, str]:
    """Every configuration on this rank: name -> digest of the parameters and buffers."""
    digests = {}
    for name, spec in configurations().items():
        gossip = spec["gossip"]
        model = gossip_ext.GossipDataParallel(
            _net(), gossip=None if gossip is None else gossip(), outer=spec["outer"]()
        )
        train_steps(model, rank, STEPS)
        model.sync_comms()
        digests[name] = _digest(model.module)
    return digests


def main() -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from multiprocess import run_ranks

    results = run_ranks(WORLD_SIZE, train_grid)
    table = {name: [r[name] for r in results] for name in results[0]}
    every = {}
    if os.path.exists(DIGESTS):
        with open(DIGESTS) as f:
            every = json.load(f)
    every[cpu_vendor()] = table
    os.makedirs(os.path.dirname(DIGESTS), exist_ok=True)
    with open(DIGESTS, "w") as f:
        json.dump(every, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {len(table)} configurations for {cpu_vendor()} to {DIGESTS}")


if __name__ == "__main__":
    main()
