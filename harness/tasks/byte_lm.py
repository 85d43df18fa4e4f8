"""A small decoder-only transformer over bytes, its optimizer and its held-out quality.

Pre-norm blocks (causal self-attention through ``scaled_dot_product_attention``, a GELU MLP four
times wider), learned positions, and an output layer tied to the byte embedding. The default size
(4 layers of width 256, 128 bytes of context) has about 3.2M parameters: small enough for a CPU
core per worker, large enough that its loss keeps falling for thousands of steps.

Quality is the held-out loss in bits per byte: the mean cross-entropy over fixed held-out windows,
divided by ln 2. Predicting every byte uniformly scores 8.

Example::

    model = ByteLM(ByteLMConfig())
    opt, schedule = make_optimizer(model, lr=1e-3, warmup=100, total_steps=2000)
    loss = next_byte_loss(model, x, y); loss.backward(); opt.step(); schedule.step()
    bpb = heldout_bits_per_byte(model, data.heldout_windows(context=128, count=64))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

VOCABULARY = 256


@dataclasses.dataclass(frozen=True)
class ByteLMConfig:
    layers: int = 4
    width: int = 256
    heads: int = 4
    context: int = 128

    def __post_init__(self) -> None:
        for name in ("layers", "width", "heads", "context"):
            if getattr(self, name) < 1:
                raise ValueError(f"ByteLMConfig: {name} must be >= 1, got {getattr(self, name)}")
        if self.width % self.heads:
            raise ValueError(
                f"ByteLMConfig: width must be a multiple of heads, got width={self.width}, "
                f"heads={self.heads}"
            )


class _Block(nn.Module):
    def __init__(self, config: ByteLMConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.attention_norm = nn.LayerNorm(config.width)
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.attention_out = nn.Linear(config.width, config.width)
        self.mlp_norm = nn.LayerNorm(config.width)
        self.mlp = nn.Sequential(
            nn.Linear(config.width, 4 * config.width),
            nn.GELU(),
            nn.Linear(4 * config.width, config.width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attention_out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.mlp_norm(x))


class ByteLM(nn.Module):
    """Next-byte logits, [batch, length, 256], for int64 bytes of shape [batch, length]."""

    def __init__(self, config: ByteLMConfig | None = None) -> None:
        super().__init__()
        self.config = config or ByteLMConfig()
        c = self.config
        self.embedding = nn.Embedding(VOCABULARY, c.width)
        self.positions = nn.Parameter(torch.zeros(c.context, c.width))
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.width)
        nn.init.normal_(self.embedding.weight, std=0.02)
        nn.init.normal_(self.positions, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.config.context:
            raise ValueError(
                f"ByteLM: input of {length} bytes is longer than the context of "
                f"{self.config.context}"
            )
        x = self.embedding(tokens) + self.positions[:length]
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embedding.weight.t()  # the output layer is the embedding


def next_byte_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next byte, in nats."""
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, VOCABULARY), targets.reshape(-1))


@torch.no_grad()
def heldout_bits_per_byte(model: nn.Module, windows: torch.Tensor, chunk: int = 32) -> float:
    """Mean next-byte cross-entropy over held-out ``windows`` ([count, context + 1]), in bits."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for part in windows.split(chunk):
        loss = next_byte_loss(model, part[:, :-1], part[:, 1:])
        total += loss.item() * part[:, 1:].numel()
        count += part[:, 1:].numel()
    model.train(was_training)
    return total / count / math.log(2)


def make_optimizer(
    params: nn.Module | Iterable[tuple[str, nn.Parameter]],
    lr: float,
    warmup: int,
    total_steps: int,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over a module's parameters (or (name, parameter) pairs), weight decay on matrices
    but not on biases, norms and the positions, and :func:`schedule_factor`'s schedule."""
    named = list(params.named_parameters() if isinstance(params, nn.Module) else params)
    decayed = [p for name, p in named if p.dim() >= 2 and not name.endswith("positions")]
    ids = {id(p) for p in decayed}
    rest = [p for _, p in named if id(p) not in ids]
    opt = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=lr,
        betas=betas,
    )
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule_factor(warmup, total_steps))


def schedule_factor(warmup: int, total_steps: int) -> Callable[[int], float]:
    """The learning rate's factor at a step: linear warmup over ``warmup`` steps, then a cosine
    decay to a tenth at ``total_steps``."""
    if not 0 <= warmup < total_steps:
        raise ValueError(
            f"make_optimizer: need 0 <= warmup < total_steps, got warmup={warmup}, "
            f"total_steps={total_steps}"
        )

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
