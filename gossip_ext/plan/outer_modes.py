"""The modes that communicate every few steps (an outer step every ``every`` steps): LocalSGD,
SlowMo and DiLoCo, Streaming DiLoCo, SparseLoCo's step and CHOCO-gossip in sparse messages. As in
``modes``, each says its step time, its bytes per step and its own buffers; the formulas, with
their sources, are in docs/scaling.md.
"""

from __future__ import annotations

import abc
import dataclasses

from gossip_ext.plan.cost import (
    Cluster,
    Mode,
    Model,
    StepTime,
    all_reduce_bytes,
    check_fields,
    largest,
    message_bytes,
    topk_message_bytes,
)
from gossip_ext.plan.waits import EveryFew, Schedule


class OuterEvery(Mode):
    """A mode that communicates only in an outer step every ``every`` steps, every worker
    waiting for the slowest there: its step is the compute plus a share of that outer step."""

    every: int

    @abc.abstractmethod
    def outer_parts(self, model: Model, cluster: Cluster) -> dict[str, float]:
        """One outer step's wire, latency and kernels, seconds."""

    @abc.abstractmethod
    def outer_bytes(self, model: Model, cluster: Cluster) -> float:
        """What one worker sends in one outer step."""

    def step(self, model: Model, cluster: Cluster) -> StepTime:
        per_step = {name: t / self.every for name, t in self.outer_parts(model, cluster).items()}
        seconds = model.step_seconds + sum(per_step.values())
        return StepTime(seconds, largest({"compute": model.step_seconds, **per_step}))

    def schedule(self, model: Model, cluster: Cluster) -> Schedule:
        return EveryFew(self.every, sum(self.outer_parts(model, cluster).values()))

    def bytes_per_step(self, model: Model, cluster: Cluster) -> float:
        return self.outer_bytes(model, cluster) / self.every


@dataclasses.dataclass(frozen=True)
class Periodic(OuterEvery):
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
        check_fields(self, at_least={"every": 1}, fmt=self.fmt)

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{self.kind} H={self.every} {self.fmt}"

    def outer_parts(self, model: Model, cluster: Cluster) -> dict[str, float]:
        message = message_bytes(model.params, self.fmt)
        return {
            "wire": cluster.wire(all_reduce_bytes(cluster.workers, message)),
            "latency": cluster.tree_latency(),
            "kernels": cluster.kernels(2 * model.bytes + 2 * message)
            + cluster.host(self.outer_bytes(model, cluster)),
        }

    def outer_bytes(self, model: Model, cluster: Cluster) -> float:
        return all_reduce_bytes(cluster.workers, message_bytes(model.params, self.fmt))

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
        check_fields(self, at_least={"every": 1, "fragments": 1, "delay": 0}, fmt=self.fmt)

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"Streaming DiLoCo H={self.every} k={self.fragments} tau={self.delay} {self.fmt}"

    def _travel(self, model: Model, cluster: Cluster) -> float:
        """A fragment's all-reduce."""
        fragment = message_bytes(model.params, self.fmt) / self.fragments
        return cluster.wire(all_reduce_bytes(cluster.workers, fragment)) + cluster.tree_latency()

    def _stall(self, model: Model, cluster: Cluster) -> float:
        """What a fragment's all-reduce takes beyond the ``delay`` steps that hide it."""
        return max(0.0, self._travel(model, cluster) - self.delay * model.step_seconds)

    def schedule(self, model: Model, cluster: Cluster) -> Schedule:
        # A fragment applied every ``every / fragments`` steps (rounded), once every worker has
        # reached it, hidden by ``delay`` of the slowest worker's steps.
        apart = max(1, round(self.every / self.fragments))
        share = self.fragments * apart / self.every
        travel = self._travel(model, cluster)
        return EveryFew(apart, travel, self.delay, share, self._host(model, cluster))

    def _host(self, model: Model, cluster: Cluster) -> float:
        """A CPU worker's transport copying a step's share of the fragments' bytes."""
        return cluster.host(self.bytes_per_step(model, cluster))

    def step(self, model: Model, cluster: Cluster) -> StepTime:
        stall = self._stall(model, cluster)
        seconds = model.step_seconds + self._host(model, cluster)
        seconds += self.fragments * stall / self.every
        if stall == 0.0:
            return StepTime(seconds, "compute")
        fragment = message_bytes(model.params, self.fmt) / self.fragments
        wire = cluster.wire(all_reduce_bytes(cluster.workers, fragment))
        return StepTime(seconds, "wire" if wire >= cluster.tree_latency() else "latency")

    def bytes_per_step(self, model: Model, cluster: Cluster) -> float:
        message = message_bytes(model.params, self.fmt)
        return all_reduce_bytes(cluster.workers, message) / self.every

    def buffers(self, model: Model, cluster: Cluster) -> float:
        # theta_global and the outer momentum, and the fragment in flight's pseudo-gradient.
        return 2 * model.bytes + model.bytes / self.fragments


@dataclasses.dataclass(frozen=True)
class SparseLoCo(OuterEvery):
    """DiLoCo's step every ``every`` steps on a sparse mean (``ByCollective(dtype=TopK())``):
    each worker's top-k message gathered by every other, as sparse messages do not add up."""

    every: int = 100
    density: float = 1 / 64
    bits: int = 2
    elastic: bool = True

    def __post_init__(self) -> None:
        check_fields(self, at_least={"every": 1, "density": 1e-9, "bits": 1})

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"SparseLoCo H={self.every} top-{self.density:.3g}"

    def outer_bytes(self, model: Model, cluster: Cluster) -> float:
        message = topk_message_bytes(model.params, self.density, self.bits)
        return (cluster.workers - 1) * message

    def outer_parts(self, model: Model, cluster: Cluster) -> dict[str, float]:
        return {
            "wire": cluster.wire(self.outer_bytes(model, cluster)),
            "latency": cluster.tree_latency(),
            "kernels": cluster.kernels(4 * model.bytes)
            + cluster.host(self.outer_bytes(model, cluster)),
        }

    def buffers(self, model: Model, cluster: Cluster) -> float:
        # theta_global, the outer momentum and the error feedback's residual.
        return 3 * model.bytes


@dataclasses.dataclass(frozen=True)
class ChocoGossip(OuterEvery):
    """DiLoCo's step every ``every`` steps on CHOCO-gossip in sparse messages
    (``ByCompressedGossip(TopK())``): one message to each of ``degree`` neighbours."""

    every: int = 100
    degree: int = 2
    density: float = 1 / 64
    bits: int = 2
    elastic: bool = True

    def __post_init__(self) -> None:
        check_fields(self, at_least={"every": 1, "degree": 1, "density": 1e-9, "bits": 1})

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"CHOCO gossip H={self.every} top-{self.density:.3g}"

    def outer_bytes(self, model: Model, cluster: Cluster) -> float:
        return self.degree * topk_message_bytes(model.params, self.density, self.bits)

    def outer_parts(self, model: Model, cluster: Cluster) -> dict[str, float]:
        return {
            "wire": cluster.wire(self.outer_bytes(model, cluster)),
            "latency": cluster.latency,
            "kernels": cluster.kernels(4 * model.bytes)
            + cluster.host(self.outer_bytes(model, cluster)),
        }

    def buffers(self, model: Model, cluster: Cluster) -> float:
        # Two public copies, theta_global and the outer momentum.
        return 4 * model.bytes
