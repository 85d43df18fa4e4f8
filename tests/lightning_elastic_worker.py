"""One worker of an elastic job trained by Lightning's Trainer with GossipStrategy(membership=
Elastic(...)), started on its own as a user starts one (``devices=1``, no launcher), or the same
training in a hand-written loop (``--loop``) that it must equal. Launched by
tests/test_lightning_elastic.py through tests/elastic_job.py; writes what the test checks to
``<out>/<name>.pkl`` after every step."""

from __future__ import annotations

import argparse
import os
import pickle
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytorch_lightning as pl
import torch
from lightning_workers import Regression, optimizer_of
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gossip_ext
from gossip_ext.lightning import GossipStrategy

SAMPLES, BATCH = 64, 8  # 8 batches an epoch


LR = 0.05


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 6, generator=generator)
    noise = 0.1 * torch.randn(SAMPLES, 1, generator=generator)
    return TensorDataset(x, x.sum(1, keepdim=True) + noise)


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


class Recorder(pl.Callback):
    """After every step: what the test reads; sleeps ``pace`` s, or ``hold`` s while its epoch is
    smaller than the largest it was in (a replacement is then in before it finishes); SIGKILLs
    itself at ``kill_at``."""

    def __init__(self, result: dict, out: str, pace: float, hold: float, kill_at: int):
        self.result, self.out, self.kill_at = result, out, kill_at
        self.pace, self.hold, self.largest = pace, hold, 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        wrapper = trainer.strategy.model
        if "worker_id" not in self.result:
            self.result["worker_id"] = wrapper.worker_id
        self.result["steps"].append(
            {
                "step": wrapper.step_count,
                "world_size": wrapper.gossip_world_size,
                "logged": float(trainer.callback_metrics["train_loss"]),
                "params": flat(module),
            }
        )
        record(self.result, self.out)
        if trainer.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        self.largest = max(self.largest, wrapper.gossip_world_size)
        held = self.hold and wrapper.gossip_world_size < self.largest
        time.sleep(self.hold if held else self.pace)


def record(result: dict, path: str) -> None:
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)


def lightning(args, membership, result, out) -> Regression:
    module = Regression(lr=LR)
    saver = pl.callbacks.ModelCheckpoint(
        dirpath=Path(args.out) / "checkpoints", every_n_train_steps=args.steps, save_top_k=-1
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=GossipStrategy(membership=membership, timeout=timedelta(seconds=args.timeout)),
        max_steps=args.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Recorder(result, out, args.pace, args.hold_for_joiner, args.kill_at), saver],
    )
    trainer.fit(module, train_dataloaders=DataLoader(dataset(), batch_size=BATCH, shuffle=True))
    result["global_step"] = trainer.global_step
    result["checkpoints"] = sorted(p.name for p in (Path(args.out) / "checkpoints").iterdir())
    return module


def loop(args, membership, result, out) -> Regression:
    """What the Trainer does, by hand: the sampler it puts in the loader (the whole dataset in
    an order seeded by the worker id, a new order every epoch), the steps, the leave at the end."""
    module = Regression(lr=LR)
    model = gossip_ext.GossipDataParallel(
        module, membership=membership, timeout=timedelta(seconds=args.timeout)
    )
    optimizer = optimizer_of(module.net, LR)
    model.register_optimizer(optimizer)
    result["worker_id"] = model.worker_id
    sampler = DistributedSampler(
        dataset(), num_replicas=1, rank=0, shuffle=True, seed=model.worker_id
    )
    epoch = 0
    while len(module.losses) < args.steps:
        sampler.set_epoch(epoch)
        for x, y in DataLoader(dataset(), batch_size=BATCH, sampler=sampler):
            loss = nn.functional.mse_loss(model(x), y)
            module.losses.append(loss.item())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            result["steps"].append({"step": model.step_count, "params": flat(module)})
            record(result, out)
            if len(module.losses) == args.steps:
                break
        epoch += 1
    model.leave()
    return module


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--membership", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--heartbeat-s", type=float, default=0.1)
    parser.add_argument("--silent-s", type=float, default=1.5)
    parser.add_argument("--min-workers", type=int, default=1)
    parser.add_argument("--loop", action="store_true", help="the hand-written loop instead")
    parser.add_argument("--pace", type=float, default=0.0, help="seconds slept after each step")
    parser.add_argument(
        "--hold-for-joiner", type=float, default=0.0, help="seconds a step while a member is gone"
    )
    parser.add_argument("--kill-at", type=int, default=-1, help="SIGKILL itself after this step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    membership = gossip_ext.Elastic(
        args.membership,
        min_workers=args.min_workers,
        heartbeat_s=args.heartbeat_s,
        silent_s=args.silent_s,
    )
    out = os.path.join(args.out, f"{args.name}.pkl")
    result: dict = {"steps": []}
    module = (loop if args.loop else lightning)(args, membership, result, out)
    result["losses"] = module.losses
    result["final"] = flat(module)
    result["finished"] = True
    record(result, out)
    return 0
