"""The systems a user on a slow network would pick, each driving one training step its own way.

Every system trains the same module with the same inner optimizer (AdamW, warmup and cosine
decay: ``byte_lm.make_optimizer``) on the same batches; what differs is how workers communicate:

==================  ==========================================================================
alone               no communication at all: each worker trains by itself (the compute floor
                    a step cannot go below when all workers share the machine)
ddp                 DistributedDataParallel: gradients all-reduced every step
powersgd_r1, _r4    DDP with torch's PowerSGD hook (rank 1 or 4, warm start, error feedback);
                    one bucket, since with several gloo aborts (their collectives interleave)
decent_dp           decent-dp 0.2.3: D-PSGD on the one-peer exponential graph, its own optimizer
                    step inside backward, communication overlapped with the next step
torchft_localsgd    torchft 0.2.0 LocalSGD: parameters averaged every ``local_steps`` steps
torchft_diloco      torchft 0.2.0 DiLoCo: every ``local_steps`` steps, an outer Nesterov SGD
                    step (``Recipe.outer_lr``, momentum 0.9) on the averaged pseudo-gradient
sgp, overlap_sgp    gossip_ext SGP, synchronous or one step stale; ``_bf16``: bfloat16 messages;
                    ``_int8``, ``_fp8``: int8 or float8 (e4m3) blocks of 128 values with a
                    float32 scale each (GOSSIP_MESSAGES)
async_sgp           gossip_ext AsyncSGP: push-sum with every worker at its own pace, no
                    staleness bound; ``_int8``: int8 blocks, as overlap_sgp_int8's
async_diloco        gossip_ext AsyncDiLoCo: an outer Nesterov step (delayed momentum; outer lr
                    and momentum ASYNC_OUTER_LR and ASYNC_OUTER_MOMENTUM, whose sweep is in
                    tuning.py), each worker's at its own pace on the pseudo-gradients
                    that reached it, waiting for a peer only until its message is due
                    (grace="learned"); ``_int8``: in int8 blocks
dpsgd               gossip_ext D-PSGD (push-pull on the bipartite exponential graph)
localsgd, slowmo    gossip_ext LocalSGD and SlowMo, exact average every ``local_steps`` steps
diloco              gossip_ext DiLoCo: torchft_diloco's outer step (the same outer SGD), no
                    communication between outer steps; ``_gossip``: the outer average by one
                    gossip round, no all-reduce (``_gossip_bf16``: in bfloat16 messages);
                    ``_int8``: the exact outer average in int8 messages (outer_dtype);
                    ``_topk2``, ``_topk4``: SparseLoCo's step, the exact outer average in
                    sparse messages (``gossip_ext.TopK``: SPARSE_DENSITY of every 4096 values,
                    in 2 or 4 bits, error feedback decayed by SPARSE_FEEDBACK_DECAY) and plain
                    outer SGD (``Recipe.sparse_outer_lr``, no momentum: the error feedback takes
                    its place)
streaming_diloco_   gossip_ext Streaming DiLoCo: STREAMING_FRAGMENTS fragments, one synced every
 t<tau>_<dtype>     ``local_steps / fragments`` steps, its averaging started ``tau`` steps
                    earlier, the pseudo-gradients in ``dtype`` (fp32, int8 or int4)
torchft_streaming_  torchft 0.2.0 DiLoCo over the same fragments (one ParameterList each) on the
 diloco_t<tau>      same schedule (one fragment every ``local_steps / fragments`` steps), its
                    fragment_sync_delay ``tau``; uncompressed (its quantization needs CUDA and
                    Triton)
==================  ==========================================================================

torchft and decent-dp are benchmark dependencies, never the library's: :func:`available` says
which systems this Python can run and why not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gossip_ext
from gossip_ext.outer.streaming import fragment_bounds
from harness.compare.tuning import (  # noqa: F401  (PEAK_LR: read as systems.PEAK_LR)
    ASYNC_OUTER_LR,
    ASYNC_OUTER_MOMENTUM,
    PEAK_LR,
    SLOWMO_MOMENTUM,
    SPARSE_DENSITY,
    SPARSE_FEEDBACK_DECAY,
    SPARSE_GOSSIP_STEP,
)
from harness.tasks import byte_lm

GOSSIP = (
    "sgp",
    "overlap_sgp",
    "sgp_bf16",
    "overlap_sgp_bf16",
    "sgp_int8",
    "overlap_sgp_int8",
    "sgp_fp8",
    "overlap_sgp_fp8",
    "async_sgp",
    "async_sgp_int8",
    "async_diloco",
    "async_diloco_int8",
    "dpsgd",
    "localsgd",
    "slowmo",
    "diloco",
    "diloco_gossip",
    "diloco_gossip_bf16",
    "diloco_int8",
    "diloco_topk2",
    "diloco_topk4",
    "diloco_gossip_topk2",
    "streaming_diloco_t1_fp32",
    "streaming_diloco_t1_int8",
    "streaming_diloco_t2_int8",
    "streaming_diloco_t1_int4",
    "streaming_diloco_t2_int4",
)
PEERS = (
    "ddp",
    "powersgd_r1",
    "powersgd_r4",
    "decent_dp",
    "torchft_localsgd",
    "torchft_diloco",
    "torchft_streaming_diloco_t1",
    "torchft_streaming_diloco_t2",
)
STREAMING_FRAGMENTS = 4
ALL = ("alone",) + PEERS + GOSSIP


# The gossip messages of the SGP modes, by the system's suffix (none: the parameters' float32).
GOSSIP_MESSAGES = {"bf16": torch.bfloat16, "int8": "int8", "fp8": torch.float8_e4m3fn}
OUTER_DTYPES = {"fp32": None, "int8": "int8", "int4": "int4"}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What every system shares: the optimizer's schedule and the sync period of the periodic
    ones (LocalSGD, SlowMo, DiLoCo)."""

    steps: int
    lr: float = 2e-3
    warmup: int = 20
    local_steps: int = 8
    # DiLoCo's outer Nesterov SGD. Its paper's lr 0.7 was tuned at H = 500; at H = 4 that step
    # overshoots (see tuning.PEAK_LR), so the lowest of those tried.
    outer_lr: float = 0.1
    outer_momentum: float = 0.9
    # SparseLoCo's outer step: plain SGD on the mean of the sparse messages.
    sparse_outer_lr: float = 1.0
    timeout: timedelta = timedelta(minutes=2)

    def sparse_outer_optimizer(self, params) -> torch.optim.Optimizer:
        """SparseLoCo's outer step: SGD without momentum (error feedback stands in for it)."""
        return torch.optim.SGD(params, lr=self.sparse_outer_lr)

    def outer_optimizer(self, params) -> torch.optim.Optimizer:
        """DiLoCo's outer step: Nesterov SGD, for torchft's DiLoCo and gossip_ext's alike."""
        return torch.optim.SGD(
            params, lr=self.outer_lr, momentum=self.outer_momentum, nesterov=True
        )


def needs(system: str) -> str | None:
    """The module a system needs beyond torch and gossip_ext, if any."""
    if system == "decent_dp":
        return "decent_dp"
    if system.startswith("torchft"):
        return "torchft"
    return None


def streaming_delay(system: str) -> int | None:
    """A streaming system's tau (its fragment_delay, or torchft's fragment_sync_delay); None for
    the others."""
    for prefix in ("streaming_diloco_t", "torchft_streaming_diloco_t"):
        if system.startswith(prefix):
            return int(system.removeprefix(prefix).split("_")[0])
    return None


def schedule_problem(system: str, local_steps: int) -> str | None:
    """Why ``system`` cannot run with a sync period of ``local_steps`` (None: it can). A streaming
    system syncs its STREAMING_FRAGMENTS fragments one after another within the period, each
    averaged over tau + 1 steps before the next starts: the period is at least fragments *
    (tau + 1) (gossip_ext and torchft both refuse less) and a multiple of the fragments (torchft
    refuses others; gossip_ext's runs take the same schedule)."""
    tau = streaming_delay(system)
    fragments = STREAMING_FRAGMENTS
    if tau is None or (local_steps % fragments == 0 and local_steps // fragments > tau):
        return None
    return (
        f"{system} syncs {fragments} fragments of tau + 1 = {tau + 1} steps each in one sync "
        f"period: it needs a period that is a multiple of {fragments} and at least "
        f"{fragments * (tau + 1)}, got {local_steps}"
    )


def available(system: str) -> str | None:
    """None if this Python can run ``system``, else why not."""
    if system not in ALL:
        raise ValueError(f"unknown system {system!r}; the systems are {', '.join(ALL)}")
    module = needs(system)
    if module and importlib.util.find_spec(module) is None:
        package = {"decent_dp": "decent-dp==0.2.3", "torchft": "torchft==0.2.0"}[module]
        return f"{system} needs {module} (pip install {package})"
    return None


class System:
    """One worker's side of a system: ``train_step`` runs a whole step (forward, backward,
    optimizer step and whatever communication the system does), ``module`` is the worker's model
    to evaluate between steps, ``finish`` completes communication in flight, ``close`` tears down
    what the system started."""

    def __init__(self, module: nn.Module, recipe: Recipe) -> None:
        self.module = module
        self.recipe = recipe

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        raise NotImplementedError

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass

    def gossip_statistics(self) -> dict[str, float | None] | None:
        """What the system's asynchronous gossip did (messages held back, their staleness), where
        it counts them; None elsewhere."""
        return None


class _OptimizerStep(System):
    """Systems whose loop is the plain one: forward, backward, optimizer step, schedule step."""

    def __init__(self, module: nn.Module, recipe: Recipe, model: nn.Module) -> None:
        super().__init__(module, recipe)
        self.model = model
        self.opt, self.schedule = byte_lm.make_optimizer(
            module, recipe.lr, recipe.warmup, recipe.steps
        )

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        loss = byte_lm.next_byte_loss(self.model, inputs, targets)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.schedule.step()
        return loss.item()


def powersgd_start(warmup: int) -> int:
    """The steps PowerSGD's hook all-reduces plainly before it compresses (its warm start, as
    torch's PowerSGDState starts at start_powerSGD_iter): the learning rate's warmup."""
    return max(2, warmup)


class _Ddp(_OptimizerStep):
    def __init__(self, module: nn.Module, recipe: Recipe, powersgd_rank: int | None) -> None:
        if powersgd_rank is None:
            model = nn.parallel.DistributedDataParallel(module)
        else:
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            # One bucket: with several, PowerSGD's per-bucket callbacks issue collectives in
            # different orders on different ranks, which gloo cannot match.
            model = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=1 << 16)
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=powersgd_rank,
                start_powerSGD_iter=powersgd_start(recipe.warmup),
                warm_start=True,
                use_error_feedback=True,
            )
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        super().__init__(module, recipe, model)


class _AsyncGossip(_OptimizerStep):
    def __init__(self, module: nn.Module, recipe: Recipe, system: str) -> None:
        suffix = system.removeprefix("async_sgp").removeprefix("_")
        gossip = gossip_ext.AsyncSGP(message_dtype=GOSSIP_MESSAGES.get(suffix))
        model = gossip_ext.GossipDataParallel(module, gossip=gossip, timeout=recipe.timeout)
        super().__init__(module, recipe, model)
        model.register_optimizer(self.opt)

    def gossip_statistics(self) -> dict[str, float | None] | None:
        return self.model.runtime.mix.engine.statistics()


class _AsyncOuter(_OptimizerStep):
    def __init__(self, module: nn.Module, recipe: Recipe, system: str) -> None:
        suffix = system.removeprefix("async_diloco").removeprefix("_")
        outer = gossip_ext.AsyncDiLoCo(
            every=recipe.local_steps,
            lr=ASYNC_OUTER_LR,
            momentum=ASYNC_OUTER_MOMENTUM,
            grace="learned",
            message_dtype=GOSSIP_MESSAGES.get(suffix),
        )
        model = gossip_ext.GossipDataParallel(
            module, gossip=None, outer=outer, timeout=recipe.timeout
        )
        super().__init__(module, recipe, model)
        model.register_optimizer(self.opt)


class _Gossip(_OptimizerStep):
    def __init__(self, module: nn.Module, recipe: Recipe, system: str) -> None:
        world_size = dist.get_world_size()
        options: dict[str, Any] = {"timeout": recipe.timeout}
        suffix = system.rsplit("_", 1)[-1]
        if system.startswith(("sgp_", "overlap_sgp_")):
            options["message_dtype"] = GOSSIP_MESSAGES[suffix]
        if system == "diloco_gossip_bf16":
            options["message_dtype"] = torch.bfloat16
        if system.startswith("overlap_sgp"):
            options["overlap"] = True
        if system == "dpsgd":
            options["push_sum"] = False
            options["graph"] = (
                gossip_ext.DynamicBipartiteExponentialGraph()
                if world_size % 2 == 0
                else gossip_ext.RingGraph(peers_per_itr=2)
            )
        if system == "localsgd":
            options.update(base_algorithm="localsgd", global_avg_freq=recipe.local_steps)
        if system.startswith("diloco"):
            options.update(
                base_algorithm="localsgd",
                sync_every=recipe.local_steps,
                outer_optimizer=recipe.outer_optimizer,
                outer_average="gossip" if "_gossip" in system else "allreduce",
            )
            if system == "diloco_gossip_topk2":
                options.update(
                    outer_average="compressed_gossip",
                    outer_dtype=gossip_ext.TopK(density=SPARSE_DENSITY, bits=2),
                    outer_consensus_step=SPARSE_GOSSIP_STEP,
                    outer_optimizer=recipe.sparse_outer_optimizer,
                )
            if system == "diloco_int8":
                options["outer_dtype"] = "int8"
            if system.startswith("diloco_topk"):
                bits = int(system.removeprefix("diloco_topk"))
                options.update(
                    outer_dtype=gossip_ext.TopK(
                        density=SPARSE_DENSITY, bits=bits, feedback_decay=SPARSE_FEEDBACK_DECAY
                    ),
                    outer_optimizer=recipe.sparse_outer_optimizer,
                )
        if system.startswith("streaming_diloco"):
            dtype = system.rsplit("_", 1)[1]
            options.update(
                base_algorithm="localsgd",
                sync_every=recipe.local_steps,
                outer_optimizer=recipe.outer_optimizer,
                outer_dtype=OUTER_DTYPES[dtype],
                fragments=STREAMING_FRAGMENTS,
                fragment_delay=streaming_delay(system),
            )
        if system == "slowmo":
            options.update(slowmo_freq=recipe.local_steps, slowmo_momentum=SLOWMO_MOMENTUM)
        model = gossip_ext.GossipDataParallel(module, **options)
        super().__init__(module, recipe, model)
        model.register_optimizer(self.opt)

    def finish(self) -> None:
        self.model.sync_comms()


class _DecentDp(System):
    """decent-dp's loop is forward and backward only: its hooks step its own optimizers."""

    def __init__(self, module: nn.Module, recipe: Recipe) -> None:
        super().__init__(module, recipe)
        from decent_dp.ddp import DecentralizedDataParallel
        from loguru import logger

        logger.disable("decent_dp")  # it logs its topology at DEBUG on every rank

        os.environ.setdefault("LOCAL_WORLD_SIZE", "1")  # read at construction; any divisor works

        def optim_fn(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
            # The same AdamW as every system, one per bucket of decent-dp's.
            opt, _ = byte_lm.make_optimizer(named, recipe.lr, recipe.warmup, recipe.steps)
            return opt

        def schedule_fn(opt: torch.optim.Optimizer):
            return torch.optim.lr_scheduler.LambdaLR(
                opt, byte_lm.schedule_factor(recipe.warmup, recipe.steps)
            )

        self.model = DecentralizedDataParallel(
            module, optim_fn=optim_fn, lr_scheduler_fn=schedule_fn, topology="one-peer-exp"
        )
        self.model.train()

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        loss = byte_lm.next_byte_loss(self.model, inputs, targets)
        loss.backward()
        return loss.item()


def torchft_manager(
    system, recipe, *, replicas, replica, store_port, rank, world_size, lighthouse, host
):
    """torchft's Manager of replica ``replica`` (``rank`` of its ``world_size`` processes, its
    store at ``host:store_port``), as both comparisons run it: a quorum of all ``replicas``,
    synchronous (DiLoCo needs it), no healing at step 0 (every replica starts from the same
    seed), every wait bounded by the recipe's timeout; ``system.module`` is what it checkpoints."""
    from torchft import Manager, ProcessGroupGloo

    return Manager(
        pg=ProcessGroupGloo(timeout=recipe.timeout),
        load_state_dict=lambda sd: system.module.load_state_dict(sd["model"]),
        state_dict=lambda: {"model": system.module.state_dict()},
        min_replica_size=replicas,
        use_async_quorum=False,
        replica_id=f"replica_{replica}",
        store_addr=host,
        store_port=store_port,
        rank=rank,
        world_size=world_size,
        lighthouse_addr=lighthouse,
        hostname=host,
        init_sync=False,
        timeout=recipe.timeout,
        quorum_timeout=recipe.timeout,
        connect_timeout=recipe.timeout,
    )


class _Torchft(_OptimizerStep):
    """One replica group of one worker per rank, coordinated by the lighthouse at
    ``lighthouse`` (started by the runner), over torchft's own gloo process group."""

    def __init__(self, module: nn.Module, recipe: Recipe, system: str, lighthouse: str) -> None:
        super().__init__(module, recipe, module)
        from torch.distributed import TCPStore
        from torchft.local_sgd import DiLoCo, LocalSGD

        os.environ.setdefault("RUST_LOG", "warn")
        rank, world_size = dist.get_rank(), dist.get_world_size()
        # The replica group's store: the quorum hands its address to the other replicas, so it is
        # the worker's own address on the emulated cluster (GOSSIP_EXT_HOST), else loopback.
        host = os.environ.get("GOSSIP_EXT_HOST", "127.0.0.1")
        self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self.manager = torchft_manager(
            self,
            recipe,
            replicas=world_size,
            replica=rank,
            store_port=self._store.port,
            rank=0,
            world_size=1,
            lighthouse=lighthouse,
            host=host,
        )
        self._stack = contextlib.ExitStack()
        if system == "torchft_diloco":
            self.outer = recipe.outer_optimizer(module.parameters())
            algorithm = DiLoCo(
                self.manager, [module], self.opt, self.outer, sync_every=recipe.local_steps
            )
        elif system.startswith("torchft_streaming_diloco"):
            # gossip_ext's fragments, as modules; torchft syncs one every sync_every / k steps.
            params = list(module.parameters())
            sizes = [p.numel() * p.element_size() for p in params]
            fragments = [
                nn.ParameterList(params[lo:hi])
                for lo, hi in fragment_bounds(sizes, STREAMING_FRAGMENTS)
            ]
            self.outer = [recipe.outer_optimizer(f.parameters()) for f in fragments]
            algorithm = DiLoCo(
                self.manager,
                fragments,
                self.opt,
                self.outer,
                sync_every=recipe.local_steps,
                fragment_sync_delay=streaming_delay(system),
            )
        else:
            algorithm = LocalSGD(self.manager, module, self.opt, sync_every=recipe.local_steps)
        self._stack.enter_context(algorithm)

    def close(self) -> None:
        self._stack.close()
        self.manager.shutdown(wait=False)


def make(system: str, module: nn.Module, recipe: Recipe, lighthouse: str | None = None) -> System:
    """``system``'s worker side for ``module``, on the default process group. Collective: every
    rank calls it together, after seeding ``module`` alike."""
    why_not = available(system)
    if why_not:
        raise RuntimeError(why_not)
    if system == "alone":
        return _OptimizerStep(module, recipe, module)
    if system == "ddp":
        return _Ddp(module, recipe, None)
    if system.startswith("powersgd_r"):
        return _Ddp(module, recipe, int(system.removeprefix("powersgd_r")))
    if system == "decent_dp":
        return _DecentDp(module, recipe)
    if system.startswith("torchft"):
        if lighthouse is None:
            raise ValueError(f"{system} needs the address of a torchft lighthouse")
        return _Torchft(module, recipe, system, lighthouse)
    if system.startswith("async_sgp"):
        return _AsyncGossip(module, recipe, system)
    if system.startswith("async_diloco"):
        return _AsyncOuter(module, recipe, system)
    return _Gossip(module, recipe, system)
