"""Each mode's cost on a cluster: one object per mode, each saying its step time (and what bounds
it), its bytes per step and its own buffers; :class:`Mode` turns those into a prediction. The
formulas, with their sources, are in docs/scaling.md, section by section in this file's order.
"""

from __future__ import annotations

import abc
import dataclasses
import math

from gossip_ext.plan.cost import (
    Cluster,
    Model,
    Prediction,
    StepTime,
    all_reduce_bytes,
    elastic_goodput,
    restart_goodput,
)

# The formats a message travels in: the bytes of one value, or the bits of one block code (the
# block formats add one float32 scale per QUANT_BLOCK values: Note [Quantized messages] in
# csrc/kernels/block_format.h).
FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
BLOCK_BITS = {"int8": 8, "float8_e4m3fn": 8, "int4": 4}
QUANT_BLOCK = 128


def message_bytes(params: float, fmt: str) -> float:
    """The bytes of a model's message in ``fmt``."""
    if fmt in FLOAT_BYTES:
        return params * FLOAT_BYTES[fmt]
    if fmt in BLOCK_BITS:
        return math.ceil(params * BLOCK_BITS[fmt] / 8) + 4 * math.ceil(params / QUANT_BLOCK)
    raise ValueError(
        f"message format: one of {sorted(FLOAT_BYTES) + sorted(BLOCK_BITS)}, got {fmt!r}"
    )


def topk_message_bytes(params: float, density: float = 1 / 64, bits: int = 2) -> float:
    """A sparse message (``averagings.sparse.TopK``): per chunk of 4096 values, one float32
    scale, ``k`` int16 positions and ``k`` values of ``bits`` bits."""
    chunk = 4096
    k = max(1, round(density * chunk))
    chunks = math.ceil(params / chunk)
    return chunks * (4 + 2 * k) + math.ceil(chunks * k * bits / 8)


def _largest(parts: dict[str, float]) -> str:
    return max(parts, key=lambda name: parts[name])


def _check(mode: object, *, at_least: dict[str, float], fmt: str | None = None) -> None:
    """Raises ValueError naming the first of ``mode``'s fields below its least value, or a
    message format it does not know."""
    for field, least in at_least.items():
        value = getattr(mode, field)
        if not value >= least:
            raise ValueError(f"{type(mode).__name__}({field}=...): at least {least}, got {value}")
    if fmt is not None and fmt not in FLOAT_BYTES and fmt not in BLOCK_BITS:
        known = sorted(FLOAT_BYTES) + sorted(BLOCK_BITS)
        raise ValueError(f"{type(mode).__name__}(fmt=...): one of {known}, got {fmt!r}")


class Mode(abc.ABC):
    """One way to train, as the planner sees it: ``lockstep``, every worker keeps the slowest's
    pace (at every step, or at every outer step); ``elastic``, it survives a worker's death
    without restarting the job (gossip_ext's ``Elastic`` membership)."""

    name: str
    lockstep: bool = True
    elastic: bool = False

    @abc.abstractmethod
    def step(self, model: Model, cluster: Cluster) -> StepTime:
        """One worker's optimizer step at a steady pace, every worker computing as ``model``."""

    @abc.abstractmethod
    def bytes_per_step(self, model: Model, cluster: Cluster) -> float:
        """What one worker sends per optimizer step."""

    @abc.abstractmethod
    def buffers(self, model: Model, cluster: Cluster) -> float:
        """The mode's own memory per worker, beyond the parameters, gradients and optimizer."""

    def carried(self, model: Model, cluster: Cluster) -> float:
        """The share of the messages the links carry (1 but for an asynchronous mode)."""
        return 1.0

    def memory(self, model: Model, cluster: Cluster) -> float:
        own = model.params * (2 * model.param_bytes + model.optimizer_bytes)
        return own + self.buffers(model, cluster)

    def goodput(self, model: Model, cluster: Cluster) -> float:
        """Steps taken over those the workers could take computing alone (the odd workers
        slowed and stopped as they are): a lockstep mode steps every worker at the slowest
        one's pace over the slowest link, and stops them all while one is stopped; an
        asynchronous one steps each at its own pace. A failure costs a restart, or an elastic
        job's rejoin and pauses."""
        n, odd = cluster.workers, cluster.slow_workers
        slowed, running = model.slower(cluster.slowdown), 1.0 - cluster.stalled
        alone = (n - odd) / model.step_seconds + odd * running / slowed.step_seconds
        if odd and self.lockstep:
            step = self.step(slowed, cluster.slowest_link()).seconds
            taken = n * max(0.0, 1.0 - odd * cluster.stalled) / step
        else:
            taken = (n - odd) / self.step(model, cluster).seconds
            if odd:
                taken += odd * running / self.step(slowed, cluster.slowest_link()).seconds
        kept = elastic_goodput(cluster) if self.elastic else restart_goodput(cluster)
        return taken / alone * kept

    def predict(self, model: Model, cluster: Cluster) -> Prediction:
        step = self.step(model, cluster)
        return Prediction(
            mode=self.name,
            step_seconds=step.seconds,
            bound=step.bound,
            bytes_per_step=self.bytes_per_step(model, cluster),
            utilization=model.step_seconds / step.seconds,
            goodput=self.goodput(model, cluster),
            memory_bytes=self.memory(model, cluster),
            carried=self.carried(model, cluster),
        )


@dataclasses.dataclass(frozen=True)
class DDP(Mode):
    """DDP's bucketed all-reduce of the gradients, overlapped with the backward (two thirds of
    the compute); ``powersgd_rank``: DDP with PowerSGD's hook at that rank (None: plain)."""

    powersgd_rank: int | None = None
    bucket_bytes: float = 25 * 2**20

    def __post_init__(self) -> None:
        _check(
            self,
            at_least={
                "bucket_bytes": 1,
                **({"powersgd_rank": 1} if self.powersgd_rank is not None else {}),
            },
        )

    @property
    def name(self) -> str:  # type: ignore[override]
        return "DDP" if self.powersgd_rank is None else f"DDP + PowerSGD r{self.powersgd_rank}"

    def _sent(self, model: Model) -> float:
        """The bytes each all-reduce carries: the gradients, or PowerSGD's factors (``r (m +
        k)`` values for an ``m x k`` matrix: ``1.5 r / d`` of a transformer's parameters)."""
        if self.powersgd_rank is None:
            return model.bytes
        return model.bytes * 1.5 * self.powersgd_rank / model.hidden

    def step(self, model: Model, cluster: Cluster) -> StepTime:
        buckets = math.ceil(model.bytes / self.bucket_bytes)
        collectives = buckets * (1 if self.powersgd_rank is None else 2)
        parts = {
            "wire": cluster.wire(all_reduce_bytes(cluster.workers, self._sent(model))),
            "latency": collectives * cluster.tree_latency(),
        }
        # PowerSGD's products read the gradient twice and write it once, on the compute stream.
        kernels = 0.0 if self.powersgd_rank is None else cluster.kernels(3 * model.bytes)
        backward = 2 * model.step_seconds / 3
        communication = sum(parts.values())
        seconds = kernels + model.step_seconds / 3 + max(backward, communication)
        bound = "compute" if communication <= backward else _largest(parts)
        return StepTime(seconds, bound)

    def bytes_per_step(self, model: Model, cluster: Cluster) -> float:
        return all_reduce_bytes(cluster.workers, self._sent(model))

    def buffers(self, model: Model, cluster: Cluster) -> float:
        # The buckets hold a copy of the gradients; PowerSGD keeps its error feedback as another.
        return model.bytes * (1 if self.powersgd_rank is None else 2)


@dataclasses.dataclass(frozen=True)
class SGP(Mode):
    """Stochastic gradient push on the exponential graph: one message of the model in ``fmt`` to
    one peer a round, a round a step; ``overlap``: the round runs beside the next step."""

    fmt: str = "float32"
    overlap: bool = False
    elastic: bool = True

    def __post_init__(self) -> None:
        _check(self, at_least={}, fmt=self.fmt)

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{'overlap ' if self.overlap else ''}SGP {self.fmt}"

    def _parts(self, model: Model, cluster: Cluster) -> dict[str, float]:
        message = message_bytes(model.params, self.fmt)
        return {
            "wire": cluster.wire(message),
            "latency": cluster.latency,
            # The send reads the parameters and writes the message; the absorb reads the message
            # and the parameters and writes them.
            "kernels": cluster.kernels(3 * model.bytes + 2 * message),
        }

    def step(self, model: Model, cluster: Cluster) -> StepTime:
        parts = self._parts(model, cluster)
        if self.overlap:
            round_trip = parts["wire"] + parts["latency"]
            seconds = max(model.step_seconds, round_trip) + parts["kernels"]
            if round_trip <= model.step_seconds and parts["kernels"] <= model.step_seconds:
                return StepTime(seconds, "compute")
            return StepTime(seconds, _largest(parts))
        seconds = model.step_seconds + sum(parts.values())
        return StepTime(seconds, _largest({"compute": model.step_seconds, **parts}))

    def bytes_per_step(self, model: Model, cluster: Cluster) -> float:
        return message_bytes(model.params, self.fmt)

    def buffers(self, model: Model, cluster: Cluster) -> float:
        # A message sent and one received; overlap keeps one more in flight.
        return message_bytes(model.params, self.fmt) * (3 if self.overlap else 2)


@dataclasses.dataclass(frozen=True)
class AsyncSGP(Mode):
    """Asynchronous gossip: each worker at its own pace, its messages sent and absorbed by the
    engine's own threads; a share its link cannot carry in time is held back and kept."""

    fmt: str = "int8"
    lockstep: bool = False

    def __post_init__(self) -> None:
        _check(self, at_least={}, fmt=self.fmt)

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"AsyncSGP {self.fmt}"

    def step(self, model: Model, cluster: Cluster) -> StepTime:
        message = message_bytes(model.params, self.fmt)
        kernels = cluster.kernels(3 * model.bytes + 2 * message)
        bound = "compute" if kernels <= model.step_seconds else "kernels"
        return StepTime(model.step_seconds + kernels, bound)

    def carried(self, model: Model, cluster: Cluster) -> float:
        travel = cluster.wire(message_bytes(model.params, self.fmt)) + cluster.latency
        return min(1.0, self.step(model, cluster).seconds / travel)

    def bytes_per_step(self, model: Model, cluster: Cluster) -> float:
        return message_bytes(model.params, self.fmt) * self.carried(model, cluster)

    def buffers(self, model: Model, cluster: Cluster) -> float:
        # The message being sent and one held per in-peer (the exponential graph's log2 n).
        return message_bytes(model.params, self.fmt) * (1 + math.ceil(math.log2(cluster.workers)))


@dataclasses.dataclass(frozen=True)
class Periodic(Mode):
    """An exact average every ``every`` steps and none between (gossip off): ``LocalSGD``,
    ``SlowMo`` (its heavy ball: two model copies) or ``DiLoCo`` (``theta_global`` and the outer
    momentum: two copies), the average's messages in ``fmt``."""

    kind: str = "DiLoCo"
    every: int = 100
    fmt: str = "float32"
    elastic: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("LocalSGD", "SlowMo", "DiLoCo"):
            raise ValueError(f"Periodic(kind=...): LocalSGD, SlowMo or DiLoCo, got {self.kind!r}")
        _check(self, at_least={"every": 1}, fmt=self.fmt)

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{self.kind} H={self.every} {self.fmt}"

    def _parts(self, model: Model, cluster: Cluster) -> dict[str, float]:
        message = message_bytes(model.params, self.fmt)
        return {
            "wire": cluster.wire(all_reduce_bytes(cluster.workers, message)),
            "latency": cluster.tree_latency(),
            "kernels": cluster.kernels(2 * model.bytes + 2 * message),
        }

    def step(self, model: Model, cluster: Cluster) -> StepTime:
        parts = self._parts(model, cluster)
        seconds = model.step_seconds + sum(parts.values()) / self.every
        per_step = {name: t / self.every for name, t in parts.items()}
        return StepTime(seconds, _largest({"compute": model.step_seconds, **per_step}))

    def bytes_per_step(self, model: Model, cluster: Cluster) -> float:
        message = message_bytes(model.params, self.fmt)
        return all_reduce_bytes(cluster.workers, message) / self.every

    def buffers(self, model: Model, cluster: Cluster) -> float:
        return 0.0 if self.kind == "LocalSGD" else 2 * model.bytes


@dataclasses.dataclass(frozen=True)
class StreamingDiLoCo(Mode):
    """DiLoCo's outer step in ``fragments``, each averaged while ``delay`` steps train on: a
    fragment's all-reduce stalls training only for what ``delay`` steps of compute do not hide."""

    every: int = 100
    fragments: int = 4
    delay: int = 1
    fmt: str = "float32"
    elastic: bool = True

    def __post_init__(self) -> None:
        _check(self, at_least={"every": 1, "fragments": 1, "delay": 0}, fmt=self.fmt)

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"Streaming DiLoCo H={self.every} k={self.fragments} tau={self.delay} {self.fmt}"

    def step(self, model: Model, cluster: Cluster) -> StepTime:
        fragment = message_bytes(model.params, self.fmt) / self.fragments
        travel = cluster.wire(all_reduce_bytes(cluster.workers, fragment)) + cluster.tree_latency()
        stall = max(0.0, travel - self.delay * model.step_seconds)
        seconds = model.step_seconds + self.fragments * stall / self.every
        if stall == 0.0:
            return StepTime(seconds, "compute")
        wire = cluster.wire(all_reduce_bytes(cluster.workers, fragment))
        return StepTime(seconds, "wire" if wire >= cluster.tree_latency() else "latency")

    def bytes_per_step(self, model: Model, cluster: Cluster) -> float:
        message = message_bytes(model.params, self.fmt)
        return all_reduce_bytes(cluster.workers, message) / self.every

    def buffers(self, model: Model, cluster: Cluster) -> float:
        # theta_global and the outer momentum, and the fragment in flight's pseudo-gradient.
        return 2 * model.bytes + model.bytes / self.fragments


@dataclasses.dataclass(frozen=True)
class SparseLoCo(Mode):
    """DiLoCo's step every ``every`` steps on a sparse mean (``ByCollective(dtype=TopK())``):
    each worker's top-k message gathered by every other, as sparse messages do not add up."""

    every: int = 100
    density: float = 1 / 64
    bits: int = 2
    elastic: bool = True

    def __post_init__(self) -> None:
        _check(self, at_least={"every": 1, "density": 1e-9, "bits": 1})

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"SparseLoCo H={self.every} top-{self.density:.3g}"

    def _sent(self, model: Model, cluster: Cluster) -> float:
        message = topk_message_bytes(model.params, self.density, self.bits)
        return (cluster.workers - 1) * message

    def step(self, model: Model, cluster: Cluster) -> StepTime:
        parts = {
            "wire": cluster.wire(self._sent(model, cluster)) / self.every,
            "latency": cluster.tree_latency() / self.every,
            "kernels": cluster.kernels(4 * model.bytes) / self.every,
        }
        seconds = model.step_seconds + sum(parts.values())
        return StepTime(seconds, _largest({"compute": model.step_seconds, **parts}))

    def bytes_per_step(self, model: Model, cluster: Cluster) -> float:
        return self._sent(model, cluster) / self.every

    def buffers(self, model: Model, cluster: Cluster) -> float:
        # theta_global, the outer momentum and the error feedback's residual.
        return 3 * model.bytes


@dataclasses.dataclass(frozen=True)
class ChocoGossip(Mode):
    """DiLoCo's step every ``every`` steps on CHOCO-gossip in sparse messages
    (``ByCompressedGossip(TopK())``): one message to each of ``degree`` neighbours."""

    every: int = 100
    degree: int = 2
    density: float = 1 / 64
    bits: int = 2
    elastic: bool = True

    def __post_init__(self) -> None:
        _check(self, at_least={"every": 1, "degree": 1, "density": 1e-9, "bits": 1})

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"CHOCO gossip H={self.every} top-{self.density:.3g}"

    def step(self, model: Model, cluster: Cluster) -> StepTime:
        sent = self.degree * topk_message_bytes(model.params, self.density, self.bits)
        parts = {
            "wire": cluster.wire(sent) / self.every,
            "latency": cluster.latency / self.every,
            "kernels": cluster.kernels(4 * model.bytes) / self.every,
        }
        seconds = model.step_seconds + sum(parts.values())
        return StepTime(seconds, _largest({"compute": model.step_seconds, **parts}))

    def bytes_per_step(self, model: Model, cluster: Cluster) -> float:
        return self.degree * topk_message_bytes(model.params, self.density, self.bits) / self.every

    def buffers(self, model: Model, cluster: Cluster) -> float:
        # Two public copies, theta_global and the outer momentum.
        return 4 * model.bytes


@dataclasses.dataclass(frozen=True)
class Sharded(Mode):
    """Sharded replicas: each replica's ``shards`` processes hold a shard each (FSDP2 inside the
    replica, over the node's own links, taken as hidden behind the compute), and each gossips its
    shard with its peers in the other replicas by ``inner``: every process sends
    ``1 / shards`` of ``inner``'s bytes over its own link."""

    inner: Mode = dataclasses.field(default_factory=lambda: SGP("int8", overlap=True))
    shards: int = 8

    def __post_init__(self) -> None:
        _check(self, at_least={"shards": 1})

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"sharded x{self.shards}, {self.inner.name}"

    @property
    def lockstep(self) -> bool:  # type: ignore[override]
        return self.inner.lockstep

    @property
    def elastic(self) -> bool:  # type: ignore[override]
        return self.inner.elastic

    def _shard(self, model: Model) -> Model:
        return dataclasses.replace(model, params=model.params / self.shards)

    def step(self, model: Model, cluster: Cluster) -> StepTime:
        return self.inner.step(self._shard(model), cluster)

    def bytes_per_step(self, model: Model, cluster: Cluster) -> float:
        return self.inner.bytes_per_step(self._shard(model), cluster)

    def buffers(self, model: Model, cluster: Cluster) -> float:
        return self.inner.buffers(self._shard(model), cluster)

    def memory(self, model: Model, cluster: Cluster) -> float:
        return self.inner.memory(self._shard(model), cluster)


def every_mode(every: int = 100, fragments: int = 4, delay: int = 1, shards: int = 8) -> list[Mode]:
    """The table of modes: DDP and PowerSGD as the reference, then gossip_ext's."""
    formats = ("float32", "bfloat16", "int8", "int4")
    return [
        DDP(),
        DDP(powersgd_rank=4),
        *(SGP(fmt) for fmt in formats),
        *(SGP(fmt, overlap=True) for fmt in formats),
        AsyncSGP("int8"),
        AsyncSGP("int4"),
        Periodic("LocalSGD", every),
        Periodic("SlowMo", every),
        Periodic("DiLoCo", every),
        Periodic("DiLoCo", every, "int8"),
        StreamingDiLoCo(every, fragments, delay),
        StreamingDiLoCo(every, fragments, delay, "int4"),
        SparseLoCo(every),
        ChocoGossip(every),
        Sharded(SGP("int8", overlap=True), shards),
    ]
