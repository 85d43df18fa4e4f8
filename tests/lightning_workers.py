"""What the Lightning tests run in each rank: a small LightningModule, a Trainer with
GossipStrategy, and the hand-written loop with the same objects that it must equal."""

from __future__ import annotations

import os
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gossip_ext
from gossip_ext.lightning import GossipStrategy

BATCHES, BATCH = 3, 8  # batches per epoch and their size


class Regression(pl.LightningModule):
    """A linear model of noisy targets; every training loss it computed, in order."""

    def __init__(self, lr: float = 0.1, optimizers: int = 1, manual: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        self.lr, self.n_optimizers = lr, optimizers
        # Lightning takes several optimizers only under manual optimization.
        self.automatic_optimization = not manual and optimizers == 1
        self.losses: list[float] = []
        self.validated: list[float] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss, sync_dist=True)
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.validated.append(loss.item())
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self):
        optimizers = [optimizer_of(self.net, self.lr) for _ in range(self.n_optimizers)]
        return optimizers[0] if self.n_optimizers == 1 else optimizers


def nesterov(parameters: list[torch.Tensor]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer."""
    return torch.optim.SGD(parameters, lr=0.7, momentum=0.9, nesterov=True)


def optimizer_of(module: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)


def shard(rank: int) -> TensorDataset:
    """This rank's own samples: the ranks' data differ, so their models drift apart."""
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(BATCHES * BATCH, 6, generator=generator)
    y = x.sum(1, keepdim=True) * (1 + rank) + 0.1 * torch.randn(len(x), 1, generator=generator)
    return TensorDataset(x, y)


def loader(rank: int) -> DataLoader:
    return DataLoader(shard(rank), batch_size=BATCH, shuffle=False)


def as_torchrun_worker(rank: int, world_size: int) -> None:
    """The environment torchrun gives a worker, which Lightning reads its rank from (the process
    group itself is the suite's, already made)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")  # fmt: skip
    torch.set_num_threads(1)


def trainer(world_size: int, strategy: GossipStrategy | str, **kwargs) -> pl.Trainer:
    defaults = {
        "accelerator": "cpu",
        "devices": world_size,
        "num_nodes": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "use_distributed_sampler": False,
        "num_sanity_val_steps": 0,
    }
    return pl.Trainer(strategy=strategy, **{**defaults, **kwargs})


def parameters(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def hand_written_loop(
    rank: int, algorithm, epochs: int, accumulate: int = 1, clip: float | None = None
) -> tuple[list[float], list[torch.Tensor]]:
    """The same training without Lightning: the wrapper, its optimizer hook, the loop (stepping
    every ``accumulate`` batches on the mean of their gradients, clipped to norm ``clip``)."""
    module = Regression()
    model = gossip_ext.GossipDataParallel(module, *algorithm)
    optimizer = optimizer_of(module.net, module.lr)
    model.register_optimizer(optimizer)
    losses = []
    for _ in range(epochs):
        for i, (x, y) in enumerate(loader(rank)):
            loss = nn.functional.mse_loss(model(x), y)
            losses.append(loss.item())
            if i % accumulate == 0:
                optimizer.zero_grad()
            (loss / accumulate).backward()
            if (i + 1) % accumulate == 0:
                if clip is not None:
                    nn.utils.clip_grad_norm_(module.parameters(), clip)
                optimizer.step()
    model.sync_comms()
    return losses, parameters(module)


def fit(rank: int, world_size: int, algorithm, epochs: int, manual: bool = False, **trainer_kwargs):
    """Lightning's training of the same: its losses and final parameters."""
    as_torchrun_worker(rank, world_size)
    module = Regression(manual=manual)
    run = trainer(world_size, GossipStrategy(*algorithm), max_epochs=epochs, **trainer_kwargs)
    run.fit(module, train_dataloaders=loader(rank))
    return module.losses, parameters(module)


def fit_and_checkpoint(rank: int, world_size: int, out: str, epochs: int, resume: str | None):
    """Trains ``epochs`` epochs (from ``resume`` where given), keeping a checkpoint after each."""
    as_torchrun_worker(rank, world_size)
    module = Regression()
    saver = pl.callbacks.ModelCheckpoint(dirpath=out, every_n_epochs=1, save_top_k=-1)
    run = trainer(world_size, GossipStrategy(gossip_ext.SGP()), max_epochs=epochs,
                  enable_checkpointing=True, callbacks=[saver])  # fmt: skip
    run.fit(module, train_dataloaders=loader(rank), ckpt_path=resume)
    return module.losses, parameters(module), sorted(p.name for p in Path(out).iterdir())
