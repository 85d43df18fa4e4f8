"""What the planner is given (a model, a cluster), what it says of a mode (a prediction), the few
costs every mode is made of (bytes on a link, a collective's latency, a kernel's pass over memory,
a message's size, a failure's lost time) and :class:`Mode`, the interface every mode implements.
Each formula is written out, with its source, in docs/scaling.md.
"""

from __future__ import annotations

import abc
import dataclasses
import math

from gossip_ext.plan.waits import Schedule


@dataclasses.dataclass(frozen=True)
class Model:
    """The model and its step on one worker.

    ``params``: the parameters' count; ``step_seconds``: one optimizer step's compute
    (forward, backward, optimizer) on one worker, alone; ``param_bytes``: the bytes of one
    parameter (and of its gradient and the flat buffers an exact average sends: 4 for float32,
    2 for bfloat16); ``optimizer_bytes``: the optimizer's state per parameter (Adam's two float32
    moments: 8); ``width``: the hidden size, which sets PowerSGD's matrices (None: from
    ``params`` by the GPT family's shape, ``12 (d / 128) d^2`` parameters).
    """

    params: float
    step_seconds: float
    param_bytes: int = 4
    optimizer_bytes: float = 8.0
    width: int | None = None

    def __post_init__(self) -> None:
        if not self.params > 0:
            raise ValueError(f"Model(params=...): must be positive, got {self.params}")
        if not self.step_seconds > 0:
            raise ValueError(f"Model(step_seconds=...): must be positive, got {self.step_seconds}")
        if self.param_bytes not in (2, 4, 8):
            raise ValueError(f"Model(param_bytes=...): must be 2, 4 or 8, got {self.param_bytes}")

    @property
    def hidden(self) -> float:
        """The hidden size: ``width``, or ``d`` with ``12 (d / 128) d^2 = params``."""
        return float(self.width) if self.width else (128 * self.params / 12) ** (1 / 3)

    @property
    def bytes(self) -> float:
        """One copy of the parameters."""
        return self.params * self.param_bytes

    def slower(self, factor: float) -> Model:
        """The same model on a worker ``factor`` times slower."""
        return dataclasses.replace(self, step_seconds=self.step_seconds * factor)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The workers and their network.

    ``link_bits``: each worker's link, bits per second each way (full duplex); ``latency``: one
    way, seconds; ``slow_fraction`` of the workers (rounded, at least one where it is above 0)
    are the odd ones: they compute ``slowdown`` times slower, their links are ``link_slowdown``
    times slower, and each is stopped ``stalled`` of the time; ``mtbf``: the cluster's mean
    time between failures (of any one worker), seconds (None: none); a job that restarts after a
    failure loses ``restart`` seconds and, on average, half its ``checkpoint_every``; an elastic
    job's survivors pause ``epoch_pause`` for each membership change while the failed worker
    rejoins after ``restart``;
    ``kernel_bytes``: what the encode and absorb kernels stream per second (memory bandwidth:
    about 2e12 on an H100's HBM, 2e10 on a CPU socket's DRAM; ``benchmarks/kernels.py``);
    ``host_seconds_per_byte``: CPU workers only, what each byte a worker sends or receives adds
    to its step, on the cores it computes on (the transport's copies and sockets:
    ``measure.host_seconds_per_byte`` over the share of a core each worker has); 0 on GPUs,
    whose copies and NICs leave the compute alone.
    """

    workers: int
    link_bits: float
    latency: float = 0.0
    slow_fraction: float = 0.0
    slowdown: float = 1.0
    link_slowdown: float = 1.0
    stalled: float = 0.0
    mtbf: float | None = None
    restart: float = 300.0
    checkpoint_every: float = 1800.0
    epoch_pause: float = 5.0
    kernel_bytes: float = 1e12
    host_seconds_per_byte: float = 0.0

    def __post_init__(self) -> None:
        if self.workers < 2:
            raise ValueError(f"Cluster(workers=...): must be at least 2, got {self.workers}")
        if not self.link_bits > 0:
            raise ValueError(f"Cluster(link_bits=...): must be positive, got {self.link_bits}")
        if not 0.0 <= self.slow_fraction <= 1.0:
            raise ValueError(
                f"Cluster(slow_fraction=...): must be in [0, 1], got {self.slow_fraction}"
            )
        if not self.slowdown >= 1.0:
            raise ValueError(f"Cluster(slowdown=...): must be at least 1, got {self.slowdown}")
        if not self.link_slowdown >= 1.0:
            raise ValueError(
                f"Cluster(link_slowdown=...): must be at least 1, got {self.link_slowdown}"
            )
        if not 0.0 <= self.stalled < 1.0:
            raise ValueError(f"Cluster(stalled=...): must be in [0, 1), got {self.stalled}")
        if not self.host_seconds_per_byte >= 0.0:
            raise ValueError(
                "Cluster(host_seconds_per_byte=...): must be at least 0, got "
                f"{self.host_seconds_per_byte}"
            )
        if self.mtbf is not None and not self.mtbf > 0:
            raise ValueError(f"Cluster(mtbf=...): must be positive or None, got {self.mtbf}")

    @property
    def slow_workers(self) -> int:
        """How many workers are odd: ``slow_fraction`` of them, at least one where it is > 0
        and they differ at all."""
        odd = self.slowdown > 1.0 or self.link_slowdown > 1.0 or self.stalled > 0.0
        if self.slow_fraction == 0.0 or not odd:
            return 0
        return max(1, round(self.slow_fraction * self.workers))

    def slowest_link(self) -> Cluster:
        """The cluster as a lockstep collective sees it: every link at the slowest one's rate
        (a ring or a gossip round crosses the slow link each time, and every worker waits)."""
        if self.slow_workers == 0:
            return self
        return dataclasses.replace(self, link_bits=self.link_bits / self.link_slowdown)

    def wire(self, sent_bytes: float) -> float:
        """Seconds for ``sent_bytes`` to cross this worker's link (the bytes it receives cross
        the other way at the same time)."""
        return sent_bytes * 8 / self.link_bits

    def tree_latency(self) -> float:
        """A collective's latency over every worker: ``2 ceil(log2 n)`` one-way hops, as a
        double binary tree's all-reduce (NCCL's choice where latency dominates)."""
        return 2 * math.ceil(math.log2(self.workers)) * self.latency

    def kernels(self, touched_bytes: float) -> float:
        """Seconds for the kernels to stream ``touched_bytes`` through memory."""
        return touched_bytes / self.kernel_bytes

    def host(self, sent_bytes: float) -> float:
        """Seconds of a CPU worker's step for sending ``sent_bytes`` and receiving as many."""
        return 2 * sent_bytes * self.host_seconds_per_byte


def all_reduce_bytes(workers: int, message_bytes: float) -> float:
    """What each worker sends in a bandwidth-optimal all-reduce (reduce-scatter, then
    all-gather) of ``message_bytes``: ``2 (n - 1) / n`` of it."""
    return 2 * (workers - 1) / workers * message_bytes


@dataclasses.dataclass(frozen=True)
class StepTime:
    """One worker's optimizer step at a steady pace, and the part of it that bounds it:
    ``compute``, ``wire``, ``latency`` or ``kernels``."""

    seconds: float
    bound: str


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What a mode costs on a cluster (per worker, at the uniform pace unless said).

    ``utilization``: the step's compute over its time; ``goodput``: the steps the workers take
    over those they could take computing alone, under the cluster's slowness and failures;
    ``carried``: the share of the gossip messages the links carry (below 1 only where an
    asynchronous worker sends faster than its link: the rest are held back, and the models mix
    less); ``memory_bytes``: the parameters, gradients, optimizer state and the mode's own
    buffers.
    """

    mode: str
    step_seconds: float
    bound: str
    bytes_per_step: float
    utilization: float
    goodput: float
    memory_bytes: float
    carried: float = 1.0


# Note [Failures' cost]
# ~~~~~~~~~~~~~~~~~~~~~
# Failures arrive at random (a Poisson process, the cluster's rate 1 / M). A job that restarts
# saves its work every C seconds of running and, at a failure, loses what it did since its last
# save and pays a restart R, which a failure during it starts over. Work of C then takes
# e^(R/M) (e^(C/M) - 1) M seconds on average (Daly, 2006, without a save's own cost), so the share
# kept is (C/M) e^(-R/M) / (e^(C/M) - 1): 1 - (R + C/2) / M where failures are rare (Young, 1974),
# and never below 0 where they are not. An elastic job's worker fails at 1 / (n M) while it runs
# and is back R later: it runs nM / (nM + R) of the time; each failure stops the other running
# workers for an epoch change's pause E. simulation.drawn_failures_kept draws the same failures
# one by one (tests/test_plan.py holds the two together).
def restart_goodput(cluster: Cluster) -> float:
    """The share of time a job that restarts whenever a worker fails keeps (Note [Failures'
    cost])."""
    if cluster.mtbf is None:
        return 1.0
    c, r = cluster.checkpoint_every / cluster.mtbf, cluster.restart / cluster.mtbf
    return c * math.exp(-r) / math.expm1(c)


def elastic_goodput(cluster: Cluster) -> float:
    """The share an elastic job keeps: each worker runs ``nM / (nM + R)`` of the time, and each
    failure pauses the others that run for an epoch change (Note [Failures' cost])."""
    if cluster.mtbf is None:
        return 1.0
    n, m = cluster.workers, cluster.mtbf
    running = n * m / (n * m + cluster.restart)
    # Failures come at running / M; each stops the others that run, (n - 1) running of them.
    paused = running / m * (n - 1) * running * cluster.epoch_pause / n
    return max(0.0, running - paused)


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


def largest(parts: dict[str, float]) -> str:
    return max(parts, key=lambda name: parts[name])


def check_fields(mode: object, *, at_least: dict[str, float], fmt: str | None = None) -> None:
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
    def schedule(self, model: Model, cluster: Cluster) -> Schedule:
        """Who a worker waits for before its next step, for ``simulation.simulate``: a new
        schedule, whose waits at every step's mean give :meth:`step`."""

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
