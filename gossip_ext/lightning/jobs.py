"""How the workers of a GossipStrategy make a job: launched together by Lightning (its launcher
or torchrun makes the process group, as for DDP), or each started on its own into an elastic job,
whose membership service makes a group per membership epoch. The strategy asks its job what to
do where the two differ; nothing asks which job it is.

An elastic worker is a Lightning run of one process (``devices=1``): Lightning makes no process
group for it, so its barriers and broadcasts are its own and ``sync_dist`` reduces over this worker
alone. A collective outside the training step over the members would not survive one's death,
and members reach validation, checkpoints and the end of training at their own times: each
validates and checkpoints its own model, which is always a valid model.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from .. import _validation, algorithms
from ..distributed import GossipDataParallel
from . import checkpoints

ValidateOn = Literal["average", "worker"]


class Job(abc.ABC):
    """What differs, to a GossipStrategy, between a launched and an elastic job."""

    membership: algorithms.Elastic | None = None
    default_validate_on: ValidateOn = "average"

    @abc.abstractmethod
    def check_validate_on(self, validate_on: ValidateOn) -> None:
        """Raises ValueError where this job cannot validate on ``validate_on``."""

    @abc.abstractmethod
    def setup_distributed(self, make_group: Callable[[], None], set_ranks: Callable[[], None]):
        """Sets Lightning's ranks, with ``make_group`` (its process group, DDP's way) or not."""

    @abc.abstractmethod
    def check_world_size(self, world_size: int) -> None:
        """Raises ValueError where Lightning launched a world this job cannot train in."""

    @abc.abstractmethod
    def sampler_kwargs(self, launched: dict[str, Any], wrapper: GossipDataParallel | None) -> dict:
        """The keywords of the DistributedSampler Lightning puts in the training loader
        (``launched``: DDP's)."""

    @abc.abstractmethod
    def at_rest(self, wrapper: GossipDataParallel) -> None:
        """Before this worker's model is read as the job's (validation on the average, a
        checkpoint): nothing of it left in flight."""

    @abc.abstractmethod
    def inference_state(
        self, own: Mapping[str, torch.Tensor], wrapper: GossipDataParallel
    ) -> dict[str, torch.Tensor]:
        """The model a checkpoint saves for inference (and ``validate_on="average"`` validates),
        from this worker's ``own`` state, after :meth:`at_rest`."""

    @abc.abstractmethod
    def worker_file(self, filepath: str | Path, rank: int, wrapper: GossipDataParallel | None):
        """Where this worker writes its part of the checkpoint at ``filepath``, or None where it
        writes none."""

    @abc.abstractmethod
    def worker_entry(self, rank: int, world_size: int, wrapper: GossipDataParallel) -> dict | None:
        """This worker's own state, saved beside the model under ``checkpoints.WORKER_KEY``."""

    @abc.abstractmethod
    def check_resume(self, checkpoint_path: str | Path) -> None:
        """Raises ValueError where this job cannot resume from a checkpoint."""

    @abc.abstractmethod
    def finish(self, wrapper: GossipDataParallel) -> None:
        """At the end of a run that did not fail: the last step's round made part of the model."""


class LaunchedJob(Job):
    """Workers launched together (Lightning's launcher, torchrun): DDP's process group, its
    sampler's shards, and checkpoints that resume the run (module ``checkpoints``)."""

    def check_validate_on(self, validate_on: ValidateOn) -> None:
        pass

    def setup_distributed(self, make_group: Callable[[], None], set_ranks: Callable[[], None]):
        make_group()

    def check_world_size(self, world_size: int) -> None:
        pass

    def sampler_kwargs(self, launched: dict[str, Any], wrapper: GossipDataParallel | None) -> dict:
        return launched

    def at_rest(self, wrapper: GossipDataParallel) -> None:
        # Every worker is here together (validation, a checkpoint, the end of fit): under
        # AsyncSGP every message sent is absorbed, so the weighted mean is exactly the mean of
        # what the workers held; in the synchronous modes it is sync_comms().
        wrapper.settle()

    def inference_state(
        self, own: Mapping[str, torch.Tensor], wrapper: GossipDataParallel
    ) -> dict[str, torch.Tensor]:
        return checkpoints.consensus_state_dict(own, wrapper.ps_weight, None)

    def worker_file(self, filepath: str | Path, rank: int, wrapper: GossipDataParallel | None):
        if rank != 0 and wrapper is None:
            return None  # not fitting: rank 0 alone writes the checkpoint
        return checkpoints.worker_path(filepath, rank)

    def worker_entry(self, rank: int, world_size: int, wrapper: GossipDataParallel) -> dict:
        return checkpoints.worker_state(rank, world_size, wrapper.state_dict())

    def check_resume(self, checkpoint_path: str | Path) -> None:
        pass

    def finish(self, wrapper: GossipDataParallel) -> None:
        # As a loop that ends with sync_comms() (settle() under AsyncSGP).
        self.at_rest(wrapper)


class ElasticJob(Job):
    """A worker of an elastic job (``Elastic(...)``), started on its own (``devices=1``); see the
    module docstring."""

    default_validate_on: ValidateOn = "worker"

    def __init__(self, membership: algorithms.Elastic):
        _validation.check_type(
            "GossipStrategy: membership", membership, algorithms.Elastic, "a gossip_ext.Elastic"
        )
        self.membership = membership

    def check_validate_on(self, validate_on: ValidateOn) -> None:
        if validate_on == "average":
            raise ValueError(
                "GossipStrategy: validate_on='average' is refused with an elastic membership: "
                "members reach validation at their own times, and an average over them would be "
                "a collective that no member's death could be survived in; use "
                "validate_on='worker' (the default here)"
            )

    def setup_distributed(self, make_group: Callable[[], None], set_ranks: Callable[[], None]):
        set_ranks()  # the membership service makes the groups, one per membership epoch

    def check_world_size(self, world_size: int) -> None:
        if world_size != 1:
            raise ValueError(
                f"GossipStrategy with an elastic membership: Lightning launched {world_size} "
                "processes; start each worker of an elastic job as its own process "
                "(Trainer(devices=1, num_nodes=1)): the membership service makes the job"
            )

    def sampler_kwargs(self, launched: dict[str, Any], wrapper: GossipDataParallel | None) -> dict:
        # Every worker draws the whole dataset in an order of its own, seeded by its worker id:
        # the members change, so no shard of the data could stay a worker's.
        worker_id = 0 if wrapper is None else wrapper.worker_id
        return {"num_replicas": 1, "rank": 0, "seed": _base_seed() + worker_id}

    def at_rest(self, wrapper: GossipDataParallel) -> None:
        # This worker's own round only: the members are not here together.
        wrapper.sync_comms()

    def inference_state(
        self, own: Mapping[str, torch.Tensor], wrapper: GossipDataParallel
    ) -> dict[str, torch.Tensor]:
        return dict(own)

    def worker_file(self, filepath: str | Path, rank: int, wrapper: GossipDataParallel | None):
        # Every worker is its run's rank 0: its file is named by its id in the job.
        filepath = Path(filepath)
        if wrapper is None:
            return filepath
        return filepath.with_name(f"{filepath.name}.worker{wrapper.worker_id}")

    def worker_entry(self, rank: int, world_size: int, wrapper: GossipDataParallel) -> None:
        return None

    def check_resume(self, checkpoint_path: str | Path) -> None:
        raise ValueError(
            f"GossipStrategy with an elastic membership: ckpt_path={str(checkpoint_path)!r} is "
            "refused: a worker of an elastic job starts from the job's model (the first worker "
            "from its module's weights, a joiner from a member's, with its optimizer state); to "
            "start a job from a checkpoint, load its weights into the LightningModule before fit"
        )

    def finish(self, wrapper: GossipDataParallel) -> None:
        # Delivers the last round and tells the others, who drop this worker at once.
        wrapper.leave()


def _base_seed() -> int:
    """Lightning's global seed (``seed_everything``), as its DistributedSampler takes it."""
    return int(os.getenv("PL_GLOBAL_SEED", "0"))
