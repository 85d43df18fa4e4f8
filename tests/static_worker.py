"""A worker of a static job as a user writes one, for the exit tests: init_process_group, the
wrapper, a few steps, optionally destroy_process_group(), and main() returns; no leave(), no
os._exit. Writes ``OUT/rankR.done`` when its work is done, so a test can tell an abort at exit
from a failure during training."""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import gossip_ext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from membership_worker import MODES, batch  # noqa: E402 - the elastic tests' modes and data

# A static job runs every elastic mode, and asynchronous gossip, which elastic jobs refuse.
STATIC_MODES = {**MODES, "async": {"gossip": gossip_ext.AsyncSGP(message_dtype="int8")}}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--init-file", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--mode", default="sync", choices=sorted(STATIC_MODES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--rank0-steps", type=int, default=None, help="rank 0 stops after these (default: --steps)"
    )
    parser.add_argument("--destroy", action="store_true", help="destroy_process_group() at the end")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{args.init_file}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=30),
    )
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    model = gossip_ext.GossipDataParallel(
        net, timeout=timedelta(seconds=10), **STATIC_MODES[args.mode]
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.register_optimizer(opt)
    steps = args.rank0_steps if args.rank == 0 and args.rank0_steps is not None else args.steps
    for step in range(steps):
        x, y = batch(step, args.rank)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.sync_comms()
    finite = all(bool(p.isfinite().all()) for p in model.module.parameters())
    if args.destroy:
        dist.destroy_process_group()
    with open(os.path.join(args.out, f"rank{args.rank}.done"), "w") as f:
        f.write(f"finite={finite}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
