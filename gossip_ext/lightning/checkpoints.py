"""What a Lightning checkpoint of a gossip job holds, and where each worker's part lies.

Every worker trains its own model, so a checkpoint that resumes the run needs each worker's own
state: its parameters, its push-sum state and its optimizer's. Rank 0 writes the checkpoint's own
file, whose ``state_dict`` is the workers' average (push-sum's consensus value, the model to load
for inference with ``LightningModule.load_from_checkpoint``); each worker's own state lies under
:data:`WORKER_KEY`, rank 0's in that file and every other rank's in a file of its own beside it
(:func:`worker_path`), written by that rank. A resume on as many workers reads them back; any
other start (another world size, the rank files gone) starts every worker from the average.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

WORKER_KEY = "gossip_ext_worker"  # {"rank", "world_size", "state_dict": the wrapper's own}


def worker_path(filepath: str | Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its own state of the checkpoint at ``filepath`` (rank 0: the
    checkpoint itself)."""
    filepath = Path(filepath)
    return filepath if rank == 0 else filepath.with_name(f"{filepath.name}.rank{rank}")


def worker_state(rank: int, world_size: int, wrapper_state: Mapping) -> dict:
    return {"rank": rank, "world_size": world_size, "state_dict": dict(wrapper_state)}


def own_state(checkpoint: Mapping, rank: int, world_size: int) -> Mapping | None:
    """This worker's own wrapper state in ``checkpoint``, or None where it holds none for this
    rank of a job of this size (a checkpoint of another job, or of a plain DDP run)."""
    saved = checkpoint.get(WORKER_KEY)
    if saved is None or (saved["rank"], saved["world_size"]) != (rank, world_size):
        return None
    return saved["state_dict"]


def consensus_state_dict(
    state: Mapping[str, torch.Tensor], weight: float, group: dist.ProcessGroup | None
) -> dict[str, torch.Tensor]:
    """The workers' push-sum consensus of ``state`` (``sum_i w_i x_i / sum_i w_i`` of every
    floating-point entry; rank 0's value of the others), as new tensors. Collective over
    ``group``: one all-reduce per entry, in the state dict's order, which every rank shares."""
    total = torch.tensor([weight], dtype=torch.float64)
    dist.all_reduce(total, group=group)
    averaged = {}
    for name, value in state.items():
        if not torch.is_tensor(value):
            averaged[name] = value
            continue
        if value.is_floating_point():
            weighted = value.detach().to(torch.float64) * weight
            dist.all_reduce(weighted, group=group)
            averaged[name] = (weighted / total).to(value.dtype)
        else:
            averaged[name] = value.detach().clone()
            dist.broadcast(averaged[name], src=_group_rank_zero(group), group=group)
    return averaged


def _group_rank_zero(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)
