"""A GossipDataParallel's whole configuration as one value: its three objects (gossip, outer step,
membership) and the settings every part shares, with the one place where their combinations are
checked. Each object checks its own arguments when it is made; what no single object can tell
(a combination, the process group, the parameters' device, the number of gossiping processes) is
checked here, in the user's spelling (``_base.Spelling``)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gossip_ext.algorithms._averages import ByCollective, ByGossip, OuterAverage
from gossip_ext.algorithms._base import Spelling, check_type, plain
from gossip_ext.algorithms._gossip import SGP, Gossip, default_graph
from gossip_ext.algorithms._membership import Elastic
from gossip_ext.algorithms._outer import Outer
from gossip_ext.graphs import GraphBase
from gossip_ext.mixing import MixingBase, UniformMixing
from gossip_ext.outer import outer_steps as _outer_steps
from gossip_ext.outer.interface import OuterRuntime


@dataclasses.dataclass(frozen=True)
class Configuration:
    """What a GossipDataParallel was configured with; its runtime reads nothing else.

    ``spelling``: how errors name what the user set (the objects, or the flat keywords that were
    translated into them); it is not part of the value."""

    gossip: Gossip | None
    outer: Outer | None
    membership: Elastic | None = None
    nprocs_per_node: int = 1
    comm_device: torch.device | str | None = None
    timeout: timedelta = timedelta(minutes=5)
    broadcast_buffers: bool = False
    gossip_buffers: bool = False
    log_every: int = 0
    verbose: bool = False
    spelling: Spelling = dataclasses.field(default_factory=Spelling, compare=False, repr=False)

    def __post_init__(self) -> None:
        spell = self.spelling
        if self.gossip is not None:
            check_type(
                "gossip", self.gossip, Gossip, "SGP(...), PushPull(...), AsyncSGP(...) or None"
            )
        if self.outer is not None:
            check_type(
                "outer",
                self.outer,
                Outer,
                "Average(...), SlowMo(...), DiLoCo(...), AsyncDiLoCo(...) or None",
            )
        if self.membership is not None:
            check_type("membership", self.membership, Elastic, "Elastic(...) or None")
        self._check_common()
        average = self.average
        if average is not None and not average.same_everywhere and self.nprocs_per_node > 1:
            raise ValueError(
                f"{spell.object(average, 'average')} with nprocs_per_node={self.nprocs_per_node}: "
                "the outer step over gossip keeps one theta_global per gossiping process, which "
                "the other processes of its machine would not share; use "
                f"{spell.object(ByCollective(), 'average')} with nprocs_per_node"
            )
        if average is not None and average.own_engine and self.gossip is not None:
            raise ValueError(
                f"{spell.object(average, 'average')} sets up an engine of its own, but gossip is "
                "set (the outer round then runs on the inner mix's engine): give its graph, "
                "mixing and message_dtype to the gossip object"
            )
        if self.start_in_forward and self.needs_inner_lr:
            raise ValueError(
                f"{spell.setting(self.gossip, 'start_in_forward')} cannot be combined with "
                f"{spell.setting(self.outer, 'every')}: SlowMo reads the learning rate of the "
                "optimizer given to register_optimizer(), whose hook would start a second round "
                "after every step"
            )
        if self.membership is not None:
            self._check_elastic(average)
        if self.gossip is not None:
            self.gossip.check_combination(self.outer, self.membership, spell)
        if self.outer is not None:
            self.outer.check_combination(self.gossip, self.membership, self.nprocs_per_node, spell)

    def _check_common(self) -> None:
        """The wrapper's own settings, each on its own, then together."""
        check_type("nprocs_per_node", self.nprocs_per_node, int, "an int")
        if self.comm_device is not None:
            check_type(
                "comm_device", self.comm_device, (str, torch.device), "a torch.device, str or None"
            )
        check_type("timeout", self.timeout, timedelta, "a datetime.timedelta")
        check_type("verbose", self.verbose, bool, "a bool")
        check_type("log_every", self.log_every, int, "an int")
        if self.log_every < 0:
            raise ValueError(f"log_every must be >= 0 (0: off), got {self.log_every}")
        if self.nprocs_per_node < 1:
            raise ValueError(f"nprocs_per_node must be >= 1, got {self.nprocs_per_node}")
        for name in ("broadcast_buffers", "gossip_buffers"):
            check_type(name, getattr(self, name), bool, "a bool")
        if self.broadcast_buffers and self.gossip_buffers:
            raise ValueError(
                "broadcast_buffers=True and gossip_buffers=True: the broadcast before every "
                "forward would overwrite what gossip averaged; choose one"
            )
        if self.timeout <= timedelta(0):
            raise ValueError(f"timeout must be positive, got {self.timeout}")

    def _check_elastic(self, average: OuterAverage | None) -> None:
        member = self.spelling.object(self.membership, "membership")
        if self.nprocs_per_node > 1:
            raise ValueError(
                f"{member} with nprocs_per_node={self.nprocs_per_node}: an elastic job's workers "
                "are one process each (launch one per GPU or machine)"
            )
        if average is not None and not average.survives_epochs:
            raise ValueError(
                f"{member} with {self.spelling.object(average, 'average')}: a worker's public copy "
                "is held by its neighbours on a fixed graph, which every membership epoch "
                "changes; an elastic job averages its outer steps by ByCollective (sparse "
                "messages included) or ByGossip"
            )

    # ------------------------------------------------------------------ checks that need more

    def check_group(self, process_group) -> None:
        """The process group given beside this configuration, and that torch.distributed is set up
        (or that an elastic job's membership service is named instead)."""
        if process_group is not None:
            check_type("process_group", process_group, dist.ProcessGroup, "a ProcessGroup or None")
            if self.membership is not None:
                raise ValueError(
                    f"{self.spelling.object(self.membership, 'membership')} with a process_group: "
                    "an elastic job builds a process group per membership epoch itself; pass one "
                    "or the other"
                )
        if self.membership is None and (not dist.is_available() or not dist.is_initialized()):
            raise RuntimeError(
                "GossipDataParallel needs torch.distributed: call "
                "torch.distributed.init_process_group() first (torchrun sets it up), or name an "
                "elastic job's membership service (membership=Elastic('HOST:PORT'))"
            )

    def check_device(self, device: torch.device) -> None:
        """theta_global lives beside the parameters (on ``device``) or in host memory."""
        where_global = None if self.average is None else self.average.global_device
        if where_global is None:
            return
        if torch.device(where_global).type != "cpu" and torch.device(where_global) != device:
            name = self.spelling.argument(self.average, "device")
            raise ValueError(
                f"{name} must be 'cpu' or the parameters' device {device}, got {where_global!r}"
            )

    def check_gossip_world(self, gossip_world_size: int) -> None:
        """A job with neither gossip nor an outer step trains every worker alone, unless there
        is only one (one machine whose processes average gradients)."""
        if self.gossip is None and self.outer is None and gossip_world_size > 1:
            raise ValueError(self.spelling.nothing_averages(self.gossip, self.outer))

    # ------------------------------------------------------------------ what the runtime reads

    @property
    def average(self) -> OuterAverage | None:
        """How the outer step averages, where it names a way (DiLoCo's ``average``)."""
        return getattr(self.outer, "average", None)

    @property
    def engine_owner(self) -> SGP | ByGossip | None:
        """Which object builds the engine (its ``mix``): the gossip object, else an outer step's
        averaging that runs rounds of an engine, else none (no round ever runs)."""
        if self.gossip is not None:
            return self.gossip
        return self.average if self.average is not None and self.average.needs_engine else None

    @property
    def graph(self) -> GraphBase:
        """The graph the engine's rounds run on (the engine owner's, or the default)."""
        return getattr(self.engine_owner, "graph", None) or default_graph()

    @property
    def message_dtype(self) -> torch.dtype | str | None:
        """The format of the engine's messages (None: the parameters' own dtype)."""
        return getattr(self.engine_owner, "message_dtype", None)

    @property
    def mixing(self) -> MixingBase:
        return getattr(self.engine_owner, "mixing", None) or UniformMixing()

    @property
    def push_sum(self) -> bool:
        return getattr(self.gossip, "push_sum", True)

    @property
    def overlap(self) -> bool:
        return getattr(self.gossip, "overlap", False)

    @property
    def synch_freq(self) -> int:
        return getattr(self.gossip, "synch_freq", 0)

    @property
    def start_in_forward(self) -> bool:
        return getattr(self.gossip, "start_in_forward", False)

    @property
    def needs_inner_lr(self) -> bool:
        """Whether the outer step reads the inner optimizer's learning rates (SlowMo's)."""
        return self.outer is not None and self.outer.needs_inner_lr

    def outer_steps(self, params, buffers, group, *, graph, sizes=None) -> OuterRuntime:
        """The outer step's runtime part over ``params`` and the floating-point ``buffers`` on
        ``group`` (with no outer step, one that only ``average_parameters()`` asks for), a gossip
        averaging on ``graph`` (:attr:`graph`, or an elastic epoch's copy with another number of
        peers). ``sizes``: each whole parameter's bytes, where ``params`` are a sharded module's
        local shards."""
        if self.outer is None:
            return _outer_steps.OuterSteps(params, buffers, group)
        return self.outer.steps(
            params,
            buffers,
            group,
            graph=graph,
            mixing=self.mixing,
            timeout=self.timeout,
            sizes=sizes,
        )

    def describe(self, rule: Any) -> dict[str, Any]:
        """What every rank must agree on (``_validation.check_ranks_agree``): how it gossips and
        takes outer steps (the objects' descriptions, and the outer ``rule``'s: its optimizer's
        hyperparameters), and the settings that shape the rounds."""
        return {
            # A 16-bit message read as 32 bits would be garbage; rounds on other graphs never meet.
            "gossip": plain(self.gossip),
            # Outer steps are collectives: ranks on different schedules would hang.
            "outer": None if self.outer is None else dict(self.outer.describe(), rule=rule),
            "nprocs_per_node": self.nprocs_per_node,
            "broadcast_buffers": self.broadcast_buffers,
            "gossip_buffers": self.gossip_buffers,
        }
