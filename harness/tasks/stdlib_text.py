"""Real text with no download: the source files of the running Python's standard library.

Every ``.py`` file under the standard library's folder (third-party packages and caches left out)
goes, whole, either to the training set or to the held-out set, by a hash of its path relative to
that folder: the split does not depend on the order the files are listed in or on what else is
installed, and no held-out file leaks into training. The bytes are the tokens (a vocabulary of
256), with a zero byte between files.

Batches are drawn from the training bytes by a generator seeded with (seed, step, rank) alone, so
a rank's batch at a step is the same on every machine with the same Python, whatever ran before.
The held-out windows are fixed. Different Python versions ship different standard libraries: the
numbers of two runs compare only on the same Python version.

Example::

    data = StdlibText.load()
    x, y = data.batch(step=0, rank=0, batch_size=16, context=128, seed=0)  # [16, 128] each
    windows = data.heldout_windows(context=128, count=64)                   # [64, 129]
"""

from __future__ import annotations

import dataclasses
import functools
import sysconfig
import zlib
from pathlib import Path

import torch

# One file in this many goes to the held-out set.
HELDOUT_ONE_IN = 20
_SEPARATOR = b"\0"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path | None = None) -> list[str]:
    """The standard library's .py files, as paths relative to ``root``, sorted."""
    root = stdlib_root() if root is None else root
    files = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if {"site-packages", "dist-packages", "__pycache__"} & set(relative.parts):
            continue
        files.append(relative.as_posix())
    return sorted(files)


def is_heldout(relative_path: str) -> bool:
    """Whether a file belongs to the held-out set: a hash of its relative path, nothing else."""
    return zlib.crc32(relative_path.encode()) % HELDOUT_ONE_IN == 0


def split(files: list[str]) -> tuple[list[str], list[str]]:
    """(training files, held-out files), each in the order given."""
    train = [f for f in files if not is_heldout(f)]
    heldout = [f for f in files if is_heldout(f)]
    return train, heldout


def _read(root: Path, files: list[str]) -> torch.Tensor:
    data = _SEPARATOR.join((root / f).read_bytes() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@dataclasses.dataclass(frozen=True)
class StdlibText:
    """The training and held-out bytes of the standard library's sources."""

    train_files: tuple[str, ...]
    heldout_files: tuple[str, ...]
    train: torch.Tensor  # uint8, every training file, separated by a zero byte
    heldout: torch.Tensor  # uint8, every held-out file, likewise

    @staticmethod
    @functools.cache
    def load(root: str | None = None) -> StdlibText:
        """Reads the files once per process (about 30 MB)."""
        base = stdlib_root() if root is None else Path(root)
        train, heldout = split(source_files(base))
        return StdlibText(tuple(train), tuple(heldout), _read(base, train), _read(base, heldout))

    def batch(
        self, step: int, rank: int, batch_size: int, context: int, seed: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets, int64 of shape [batch_size, context], for ``rank`` at
        ``step``: windows at offsets drawn from a generator seeded by (seed, step, rank) only."""
        if batch_size < 1 or context < 1:
            raise ValueError(
                f"batch_size and context must be >= 1, got batch_size={batch_size}, "
                f"context={context}"
            )
        generator = torch.Generator().manual_seed(_mix(seed, step, rank))
        starts = torch.randint(
            0, self.train.numel() - context - 1, (batch_size,), generator=generator
        )
        windows = torch.stack([self.train[s : s + context + 1] for s in starts.tolist()]).long()
        return windows[:, :-1], windows[:, 1:]

    def heldout_windows(self, context: int, count: int) -> torch.Tensor:
        """``count`` windows of ``context`` + 1 held-out bytes, int64 [count, context + 1], evenly
        spaced over the held-out set: the same windows for every run."""
        span = self.heldout.numel() - context - 1
        if count < 1 or span < 1:
            raise ValueError(
                f"count must be >= 1 and the held-out set longer than the context, "
                f"got count={count}, context={context}"
            )
        starts = torch.linspace(0, span, count).long().tolist()
        return torch.stack([self.heldout[s : s + context + 1] for s in starts]).long()


def _mix(seed: int, step: int, rank: int) -> int:
    """One 63-bit generator seed from the three, so that neighbouring values do not collide."""
    value = zlib.crc32(f"{seed}/{step}/{rank}".encode())
    return (value * 0x9E3779B97F4A7C15 + seed) % (1 << 63)
