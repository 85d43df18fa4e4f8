"""A torchrun worker for tests/test_checkpoint_resume.py: deterministic training with
GossipDataParallel (gloo, CPU) that checkpoints, is killed, and resumes.

    python3 -m torch.distributed.run --standalone --nproc-per-node 4 tests/checkpoint_worker.py \\
        --out DIR --steps 12 [--save-at 5 --save-modes sync,overlap --wait-for-kill] \\
        [--resume-from CKPT_DIR]

Every rank trains one small MLP per mode in --modes, side by side in one process, each wrapper on
its own process group so that their gossip messages never meet:
    sync       synchronous SGP (uniform mixing: the push-sum weight stays 1)
    overlap    overlap SGP
    weighted   synchronous SGP with a different self weight on every rank, so that the push-sum
               weight w moves away from 1 and the checkpoint must carry it
Batches come from a per-rank generator: its state is the data position, and it is checkpointed
with the model and the optimizer.

Files, under --out unless named otherwise:
    pid-rank{r}                  the worker's pid, written first (the test kills by pid)
    {mode}-rank{r}.pt            after the last step: the steps run and the flattened parameters
                                 after every optimizer step, and after a final sync_comms()
    CKPT/{mode}-rank{r}.pt       at step --save-at: model.state_dict(), optimizer state, data
                                 generator state and the step (CKPT: --out/ckpt)
    saved-rank{r}                once every checkpoint of this rank is on disk
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from multiprocess import exit_without_finalizing
from torch import nn

import gossip_ext

MODES = ("sync", "overlap", "weighted")
FEATURES = 8
BATCH = 16


def _atomic_save(obj, path: str) -> None:
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def _atomic_write(text: str, path: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


class Run:
    """One mode's model, optimizer, data generator and parameter log on this rank."""

    def __init__(self, mode: str, rank: int, seed: int):
        self.mode = mode
        torch.manual_seed(seed)  # the wrapper broadcasts rank 0's parameters anyway
        self.module = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
        self.model = gossip_ext.GossipDataParallel(
            self.module,
            mixing=gossip_ext.SelfWeightMixing(0.3 + 0.1 * rank) if mode == "weighted" else None,
            overlap=mode == "overlap",
            process_group=dist.new_group(),
            timeout=timedelta(seconds=60),
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.batches = torch.Generator().manual_seed(seed * 1000 + rank + 1)
        self.target = torch.linspace(-1.0, 1.0, FEATURES) * (rank + 1)  # a different task per rank
        self.step = 0
        self.log_steps: list[int] = []
        self.log_params: list[torch.Tensor] = []

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.module.parameters()]).clone()

    def train_step(self) -> None:
        self.step += 1
        x = torch.randn(BATCH, FEATURES, generator=self.batches)
        y = (x @ self.target).sin().unsqueeze(1)
        loss = nn.functional.mse_loss(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        # Before transfer_params: in every mode the parameters now hold the de-biased values.
        self.log_steps.append(self.step)
        self.log_params.append(self.flat_params())
        self.model.transfer_params()

    def checkpoint(self) -> dict:
        # state_dict() absorbs the round in flight first (sync_comms), see the test's docstring.
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "batches": self.batches.get_state(),
            "step": self.step,
        }

    def restore(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.batches.set_state(state["batches"])
        self.step = state["step"]

    def finish(self, path: str) -> None:
        self.model.sync_comms()
        _atomic_save(
            {
                "steps": self.log_steps,
                "params": torch.stack(self.log_params) if self.log_params else None,
                "final": self.flat_params(),
            },
            path,
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for logs and checkpoints")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes to run")
    parser.add_argument("--steps", type=int, required=True, help="last step to run")
    parser.add_argument("--save-at", type=int, default=None, help="checkpoint after this step")
    parser.add_argument(
        "--save-modes", default=None, help="modes to checkpoint at --save-at (default: all)"
    )
    parser.add_argument(
        "--wait-for-kill",
        action="store_true",
        help="after the last step, wait to be killed instead of exiting",
    )
    parser.add_argument("--resume-from", default=None, help="checkpoint folder to resume from")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    save_modes = modes if args.save_modes is None else args.save_modes.split(",")
    for mode in modes + save_modes:
        if mode not in MODES:
            parser.error(f"unknown mode {mode!r}; choose from {MODES}")

    torch.set_num_threads(1)  # four ranks on two shared cores
    rank = int(os.environ["RANK"])
    _atomic_write(str(os.getpid()), os.path.join(args.out, f"pid-rank{rank}"))
    dist.init_process_group("gloo")  # torchrun's environment: rank, world size, store
    try:
        ckpt_dir = os.path.join(args.out, "ckpt")
        runs = [Run(mode, rank, args.seed) for mode in modes]
        if args.resume_from is not None:
            for run in runs:
                path = os.path.join(args.resume_from, f"{run.mode}-rank{rank}.pt")
                run.restore(torch.load(path, weights_only=False))
        start = runs[0].step
        for step in range(start + 1, args.steps + 1):
            for run in runs:
                run.train_step()
            if step == args.save_at:
                os.makedirs(ckpt_dir, exist_ok=True)
                for run in runs:
                    if run.mode in save_modes:
                        path = os.path.join(ckpt_dir, f"{run.mode}-rank{rank}.pt")
                        _atomic_save(run.checkpoint(), path)
                _atomic_write("", os.path.join(args.out, f"saved-rank{rank}"))
        if args.wait_for_kill:
            time.sleep(600)
        for run in runs:
            run.finish(os.path.join(args.out, f"{run.mode}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_finalizing()  # see tests/multiprocess.py
