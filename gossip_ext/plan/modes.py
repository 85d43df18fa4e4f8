"""The modes that communicate every step, each one object saying its step time (and what bounds
it), its bytes per step and its own buffers (``cost.Mode`` turns those into a prediction): DDP and
PowerSGD as the reference, SGP, overlap SGP and asynchronous gossip, and sharded replicas over any
mode; the table of every mode (:func:`every_mode`). The formulas, with their sources, are in
docs/scaling.md.
"""

from __future__ import annotations

import dataclasses
import math

from gossip_ext.plan.cost import (
    Cluster,
    Mode,
    Model,
    StepTime,
    all_reduce_bytes,
    check_fields,
    largest,
    message_bytes,
)
from gossip_ext.plan.outer_modes import ChocoGossip, Periodic, SparseLoCo, StreamingDiLoCo
from gossip_ext.plan.waits import Lockstep, Neighbours, OwnPace, Schedule


@dataclasses.dataclass(frozen=True)
class DDP(Mode):
    """DDP's bucketed all-reduce of the gradients, overlapped with the backward (two thirds of
    the compute); ``powersgd_rank``: DDP with PowerSGD's hook at that rank (None: plain)."""

    powersgd_rank: int | None = None
    bucket_bytes: float = 25 * 2**20
    # The backward's share of a step, which the buckets' all-reduces overlap (4N of a
    # transformer's 6N flops a token).
    BACKWARD = 2 / 3
    # DDP's first bucket, the last layers' gradients (ready first), is this small, so that the
    # first all-reduce starts early.
    FIRST_BUCKET_BYTES = 2**20

    def __post_init__(self) -> None:
        check_fields(
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

    def _buckets(self, model: Model) -> tuple[int, float]:
        """How many buckets, and the bytes of the one whose gradients are ready last (the first
        layers'): after the small first bucket, ``bucket_bytes`` ones, the last holding the
        rest."""
        rest = max(0.0, model.bytes - self.FIRST_BUCKET_BYTES)
        if rest == 0.0:
            return 1, model.bytes
        full = max(0, math.ceil(rest / self.bucket_bytes) - 1)
        return 2 + full, rest - full * self.bucket_bytes if full else rest

    def _collectives(self) -> int:
        """A bucket's collectives: one all-reduce, or PowerSGD's two (P, then Q)."""
        return 1 if self.powersgd_rank is None else 2

    def _parts(self, model: Model, cluster: Cluster) -> dict[str, float]:
        buckets, _ = self._buckets(model)
        return {
            "wire": cluster.wire(all_reduce_bytes(cluster.workers, self._sent(model))),
            "latency": buckets * self._collectives() * cluster.tree_latency(),
        }

    def _tail(self, model: Model, cluster: Cluster) -> float:
        """The last bucket's all-reduce, which starts only when the backward ends."""
        _, last = self._buckets(model)
        sent = all_reduce_bytes(cluster.workers, last * self._sent(model) / model.bytes)
        return cluster.wire(sent) + self._collectives() * cluster.tree_latency()

    def _kernels(self, model: Model, cluster: Cluster) -> float:
        # PowerSGD's products read the gradient twice and write it once, on the compute stream;
        # a CPU worker's transport copies what it sends and receives on its own cores.
        host = cluster.host(self.bytes_per_step(model, cluster))
        return host + (0.0 if self.powersgd_rank is None else cluster.kernels(3 * model.bytes))

    def step(self, model: Model, cluster: Cluster) -> StepTime:
        parts = self._parts(model, cluster)
        backward = self.BACKWARD * model.step_seconds
        communication = sum(parts.values())
        tail = self._tail(model, cluster)
        seconds = self._kernels(model, cluster) + model.step_seconds - backward
        seconds += max(backward + tail, communication)
        # Bound by the compute while the buckets' all-reduces keep up with the backward (the
        # last one's tail grows with the model, not with the step).
        bound = "compute" if communication <= backward else largest(parts)
        return StepTime(seconds, bound)

    def schedule(self, model: Model, cluster: Cluster) -> Schedule:
        communication = sum(self._parts(model, cluster).values())
        return Lockstep(
            communication, self.BACKWARD, self._kernels(model, cluster), self._tail(model, cluster)
        )

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
        check_fields(self, at_least={}, fmt=self.fmt)

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{'overlap ' if self.overlap else ''}SGP {self.fmt}"

    def _parts(self, model: Model, cluster: Cluster) -> dict[str, float]:
        message = message_bytes(model.params, self.fmt)
        return {
            "wire": cluster.wire(message),
            "latency": cluster.latency,
            # The send reads the parameters and writes the message; the absorb reads the message
            # and the parameters and writes them (a CPU worker's transport copies it too).
            "kernels": cluster.kernels(3 * model.bytes + 2 * message) + cluster.host(message),
        }

    # Note [A round beside the step]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Overlapped, the round a worker sends after step k is absorbed at the end of step k + 1, so
    # its message has two steps less one compute to arrive: with P the step, 2P - T - kernels >=
    # wire + latency. A link sends one message after another, so P >= wire as well. The step is
    # the least P that meets both: max(T + kernels, wire, (T + wire + latency + kernels) / 2).
    def step(self, model: Model, cluster: Cluster) -> StepTime:
        parts = self._parts(model, cluster)
        compute = model.step_seconds + parts["kernels"]
        if self.overlap:
            in_flight = (compute + parts["wire"] + parts["latency"]) / 2
            seconds = max(compute, parts["wire"], in_flight)
            if seconds == compute:
                return StepTime(
                    seconds, "compute" if model.step_seconds >= parts["kernels"] else "kernels"
                )
            return StepTime(seconds, largest({"wire": parts["wire"], "latency": parts["latency"]}))
        seconds = model.step_seconds + sum(parts.values())
        return StepTime(seconds, largest({"compute": model.step_seconds, **parts}))

    def schedule(self, model: Model, cluster: Cluster) -> Schedule:
        parts = self._parts(model, cluster)
        return Neighbours(parts["wire"], parts["latency"], parts["kernels"], self.overlap)

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
        check_fields(self, at_least={}, fmt=self.fmt)

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"AsyncSGP {self.fmt}"

    def step(self, model: Model, cluster: Cluster) -> StepTime:
        message = message_bytes(model.params, self.fmt)
        # A CPU worker's transport copies what it sends and receives: charged here for every
        # message, an upper bound where the link carries fewer (``carried`` below 1), which
        # keeps the step free of the share it sets.
        kernels = cluster.kernels(3 * model.bytes + 2 * message) + cluster.host(message)
        bound = "compute" if kernels <= model.step_seconds else "kernels"
        return StepTime(model.step_seconds + kernels, bound)

    def schedule(self, model: Model, cluster: Cluster) -> Schedule:
        return OwnPace(self.step(model, cluster).seconds - model.step_seconds)

    def carried(self, model: Model, cluster: Cluster) -> float:
        travel = cluster.wire(message_bytes(model.params, self.fmt)) + cluster.latency
        return min(1.0, self.step(model, cluster).seconds / travel)

    def bytes_per_step(self, model: Model, cluster: Cluster) -> float:
        return message_bytes(model.params, self.fmt) * self.carried(model, cluster)

    def buffers(self, model: Model, cluster: Cluster) -> float:
        # The message being sent and one held per in-peer (the exponential graph's log2 n).
        return message_bytes(model.params, self.fmt) * (1 + math.ceil(math.log2(cluster.workers)))


@dataclasses.dataclass(frozen=True)
class Sharded(Mode):
    """Sharded replicas: each replica's ``shards`` processes hold a shard each (FSDP2 inside the
    replica, over the node's own links, taken as hidden behind the compute), and each gossips its
    shard with its peers in the other replicas by ``inner``: every process sends
    ``1 / shards`` of ``inner``'s bytes over its own link."""

    inner: Mode = dataclasses.field(default_factory=lambda: SGP("int8", overlap=True))
    shards: int = 8

    def __post_init__(self) -> None:
        check_fields(self, at_least={"shards": 1})

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

    def schedule(self, model: Model, cluster: Cluster) -> Schedule:
        return self.inner.schedule(self._shard(model), cluster)

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
