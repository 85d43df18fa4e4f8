"""Gossip under PyTorch Lightning: a LightningModule trained by ``Trainer(strategy="gossip")``.

    pip install gossip_ext[lightning]
    torchrun --standalone --nproc_per_node 4 examples/lightning_train.py

Each worker trains on its own quarter of a synthetic four-class problem and gossips after every
optimizer step (SGP's defaults); validation runs on the workers' average, and the checkpoint in
--out holds that average for inference and each worker's own state for resuming
(``--resume PATH``). ``--strategy`` picks another configuration, e.g. ``overlap-int8``.
"""

from __future__ import annotations

import argparse
import os

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gossip_ext
from gossip_ext.lightning import GossipStrategy  # registers Trainer(strategy="gossip")

STRATEGIES = {
    "gossip": lambda: "gossip",
    "overlap-int8": lambda: GossipStrategy(gossip_ext.SGP(overlap=True, message_dtype="int8")),
    "diloco": lambda: GossipStrategy(gossip=None, outer=gossip_ext.DiLoCo(_nesterov, every=8)),
}


def _nesterov(parameters: list[torch.Tensor]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer."""
    return torch.optim.SGD(parameters, lr=0.7, momentum=0.9, nesterov=True)


class Classifier(pl.LightningModule):
    def __init__(self, lr: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        self.lr = lr

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)  # the mean over the workers
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_accuracy", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def data(rank: int, world_size: int, samples: int = 4096) -> tuple[TensorDataset, TensorDataset]:
    """A fixed four-class problem (the same on every worker), this worker's share of it to train
    on, and a held-out set."""
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(4, 16, generator=generator) * 0.4
    labels = torch.randint(0, 4, (samples,), generator=generator)
    x = centres[labels] + torch.randn(samples, 16, generator=generator)
    train, held_out = slice(0, samples * 3 // 4), slice(samples * 3 // 4, samples)
    mine = torch.arange(train.stop)[rank::world_size]
    return TensorDataset(x[mine], labels[mine]), TensorDataset(x[held_out], labels[held_out])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="gossip")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", default="lightning_checkpoints")
    parser.add_argument("--resume", default=None, help="a checkpoint of --out to resume from")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    # Under torchrun, Lightning's devices and nodes are torchrun's processes and machines.
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    trainer = pl.Trainer(
        strategy=STRATEGIES[args.strategy](),
        accelerator="cpu",
        devices=per_node,
        num_nodes=int(os.environ.get("WORLD_SIZE", per_node)) // per_node,
        max_epochs=args.epochs,
        use_distributed_sampler=False,  # each worker's dataset is already its own share
        logger=False,
        enable_progress_bar=False,
        default_root_dir=args.out,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=args.out, save_top_k=-1)],
    )
    train, held_out = data(trainer.global_rank, trainer.world_size)
    trainer.fit(
        Classifier(args.lr),
        DataLoader(train, batch_size=32, shuffle=True),
        DataLoader(held_out, batch_size=256),
        ckpt_path=args.resume,
    )
    if trainer.is_global_zero:
        metrics = trainer.callback_metrics
        print(f"validation on the workers' average: loss {float(metrics['val_loss']):.4f}  "
              f"accuracy {float(metrics['val_accuracy']):.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
