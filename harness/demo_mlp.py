"""The quick demo on a small MLP: N worker processes on gloo, four ways of keeping them together.
(The main demo, python -m harness.demo, compares systems on a real task.)

    python -m harness.demo_mlp --workers 4
    python -m harness.demo_mlp --bandwidth 100mbit --hidden 2048   # as root: 100 Mbit/s NICs

Every worker trains the same small MLP on its own shard of a synthetic 10-class data set
(generated deterministically: no download) with SGP, overlap SGP, D-PSGD and DDP all-reduce in
turn. The demo prints one table (final loss and accuracy, time per step, wall time to DDP's final
loss and which mode got there first, bytes sent per step, consensus distance: exact, and the
running estimate the gossip modes log for free) and writes a PNG plot of the loss against
wall-clock time and against steps, and of the consensus distance.

By default the workers are processes of this machine talking over loopback, where a message is a
memory copy. With --bandwidth RATE (root) each worker runs in its own network namespace behind a
NIC capped at RATE (harness/netns.py): the regime gossip is for, where bytes cost time.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import threading
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import gossip_ext
from gossip_ext.gossip import consensus
from harness import netns

MODES = ("sgp", "overlap", "dpsgd", "ddp")
NUM_CLASSES = 10
FEATURES = 32


def make_dataset(samples: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian clusters around fixed random centres, with enough noise that they overlap."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(NUM_CLASSES, FEATURES, generator=g) * 1.5
    labels = torch.randint(0, NUM_CLASSES, (samples,), generator=g)
    points = centres[labels] + torch.randn(samples, FEATURES, generator=g) * 3.0
    return points, labels


def make_model(hidden: int = 64) -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, NUM_CLASSES))


def wrap(mode: str, module: nn.Module, world_size: int, log_every: int) -> nn.Module:
    if mode == "ddp":
        return nn.parallel.DistributedDataParallel(module)
    if mode == "dpsgd":
        # Push-pull averaging needs a graph that pairs workers symmetrically.
        graph = (
            gossip_ext.DynamicBipartiteExponentialGraph()
            if world_size % 2 == 0
            else gossip_ext.RingGraph(peers_per_itr=2)
        )
        return gossip_ext.GossipDataParallel(
            module, graph=graph, push_sum=False, log_every=log_every
        )
    return gossip_ext.GossipDataParallel(module, overlap=(mode == "overlap"), log_every=log_every)


def consensus_distance(model: nn.Module, module: nn.Module, world_size: int) -> float:
    """sqrt(mean_i ||z_i - mean z||^2): the wrapper's own metric; DDP's replicas get the same
    definition (and are exactly 0 apart)."""
    if isinstance(model, gossip_ext.GossipDataParallel):
        return model.consensus_distance()
    return consensus.consensus_distance(
        list(module.parameters()), dist.group.WORLD, True, world_size
    )


def estimate_over_workers(model: nn.Module) -> float:
    """The root mean square over workers of their running estimates (what the estimate's scale
    is calibrated for); NaN until every worker has measured one, and for DDP."""
    if not isinstance(model, gossip_ext.GossipDataParallel):
        return math.nan
    estimate = model.consensus_estimate
    missing = estimate is None
    t = torch.tensor([0.0 if missing else estimate**2, float(missing)], dtype=torch.float64)
    dist.all_reduce(t)
    return math.nan if t[1] > 0 else math.sqrt(t[0].item() / dist.get_world_size())


def mean_over_workers(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def run_mode(mode: str, rank: int, world_size: int, args) -> dict:
    # One draw, so the held-out samples come from the same clusters as the training ones.
    points, labels = make_dataset(args.samples + 2000, seed=args.seed)
    x, y = points[: args.samples], labels[: args.samples]
    test_x, test_y = points[args.samples :], labels[args.samples :]
    shard_x, shard_y = x[rank::world_size], y[rank::world_size]
    torch.manual_seed(args.seed)
    module = make_model(args.hidden)
    model = wrap(mode, module, world_size, args.log_every)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    gen = torch.Generator().manual_seed(args.seed + rank)

    grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    # loss: the mean over workers and over the steps since the previous sample; time: wall-clock
    # seconds of training, without the time the samples themselves take (they communicate).
    history = {"step": [], "time": [], "loss": [], "consensus": [], "estimate": []}
    losses, paused = [], 0.0
    progress = None
    if rank == 0 and not args.quiet:
        from tqdm import tqdm

        # One process draws bars, so a thread lock serves. tqdm's default lock adds a
        # multiprocessing one, whose semaphore the resource tracker reports as leaked at exit
        # because the worker leaves by os._exit (see worker).
        tqdm.set_lock(threading.RLock())
        progress = tqdm(total=args.steps, desc=f"{mode:>7}", leave=True)
    dist.barrier()
    start = time.perf_counter()
    for step in range(args.steps):
        idx = torch.randint(0, shard_x.shape[0], (args.batch_size,), generator=gen)
        loss = nn.functional.cross_entropy(model(shard_x[idx]), shard_y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % args.log_every == 0 or step == args.steps - 1:
            sampled = time.perf_counter()
            history["step"].append(step)
            history["time"].append(sampled - start - paused)
            history["loss"].append(mean_over_workers(sum(losses) / len(losses)))
            losses.clear()
            # Before this step's round: the drift the local steps made, which the round shrinks
            # and which the running estimate reads off the rounds it measures.
            history["consensus"].append(consensus_distance(model, module, world_size))
            history["estimate"].append(estimate_over_workers(model))
            paused += time.perf_counter() - sampled
        if mode != "ddp":
            model.transfer_params()
        if progress is not None:
            progress.update(1)
    if mode != "ddp":
        model.sync_comms()
    elapsed = time.perf_counter() - start - paused
    if progress is not None:
        progress.close()

    with torch.no_grad():
        model.eval()
        logits = model(test_x)
        test_loss = nn.functional.cross_entropy(logits, test_y).item()
        accuracy = (logits.argmax(1) == test_y).float().mean().item()
    if mode == "ddp":
        # Ring all-reduce volume per worker and step: 2 (n-1)/n of the gradient bytes.
        bytes_per_step = 2 * (world_size - 1) / world_size * grad_bytes
    else:
        bytes_per_step = model.bytes_sent / args.steps
    return {
        "loss": mean_over_workers(test_loss),
        "accuracy": mean_over_workers(accuracy),
        "step_ms": 1000 * mean_over_workers(elapsed) / args.steps,
        "bytes_per_step": mean_over_workers(bytes_per_step),
        "consensus": consensus_distance(model, module, world_size),
        "history": history,
    }


def train_all(rank: int, world_size: int, init_method: str, args) -> dict:
    """Every mode in turn on this worker; returns {mode: result} (rank 0's is the one shown).
    Also the entry point of a worker on the emulated cluster (harness.netns)."""
    torch.set_num_threads(1)  # the workers share the machine's cores
    warnings.filterwarnings("ignore", message=".*one gossiping process.*")
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=2),
    )
    try:
        return {mode: run_mode(mode, rank, world_size, args) for mode in args.modes}
    finally:
        dist.destroy_process_group()


def worker(rank: int, world_size: int, init_file: str, args, results) -> None:
    for mode, result in train_all(rank, world_size, f"file://{init_file}", args).items():
        if rank == 0:
            results[mode] = result
    # The results are handed over: leave without interpreter finalization. torch's gloo worker
    # threads can drop a Python-owned tensor while a finalizing process takes the GIL, which
    # aborts it ("terminate called without an active exception", an upstream race in
    # ProcessGroupGloo::runLoop, seen in a few percent of processes with plain torch).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


SMOOTH = 3  # samples the loss is averaged over before it is compared with the target


def smoothed(losses: list[float]) -> list[float]:
    """The mean of each sample and the SMOOTH - 1 before it: one lucky mini-batch must not
    decide which mode reached the target first."""
    return [
        sum(losses[max(0, i - SMOOTH + 1) : i + 1]) / min(i + 1, SMOOTH) for i in range(len(losses))
    ]


def target_loss(results: dict) -> float:
    """The loss every mode is timed to: DDP's final one, else the worst mode's final one."""
    if "ddp" in results:
        return smoothed(results["ddp"]["history"]["loss"])[-1]
    return max(smoothed(r["history"]["loss"])[-1] for r in results.values())


def time_to_target(result: dict, target: float) -> tuple[int, float] | None:
    """(step, wall-clock seconds) of the first sample whose smoothed loss is at or below the
    target; None if none is."""
    h = result["history"]
    points = zip(h["step"], h["time"], smoothed(h["loss"]))
    return next(((s, t) for s, t, x in points if x <= target), None)


def _mean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


def print_table(results: dict, workers: int, network: str = "loopback") -> str | None:
    """Prints the comparison; returns the mode that reached the target loss first."""
    target = target_loss(results)
    reached = {m: time_to_target(r, target) for m, r in results.items()}
    fastest = min((m for m in reached if reached[m]), key=lambda m: reached[m][1], default=None)
    header = (
        f"{'mode':<8} {'test loss':>9} {'accuracy':>9} {'ms/step':>8} {'to target':>10} "
        f"{'bytes/step':>11} {'consensus':>10} {'run mean':>9} {'estimate':>9}"
    )
    print(f"\n{workers} workers on gloo, {network}")
    print(header)
    print("-" * len(header))
    for mode, r in results.items():
        h = r["history"]
        estimate = _mean(h["estimate"])
        to = "not hit" if reached[mode] is None else f"{reached[mode][1]:.2f} s"
        print(
            f"{mode:<8} {r['loss']:>9.4f} {r['accuracy']:>9.3f} {r['step_ms']:>8.2f} {to:>10} "
            f"{r['bytes_per_step']:>11.0f} {r['consensus']:>10.2e} {_mean(h['consensus']):>9.2e} "
            + ("        -" if math.isnan(estimate) else f"{estimate:>9.2e}")
            + ("  <- fastest to target" if mode == fastest else "")
        )
    print(
        f"to target: wall-clock time until the training loss (mean over workers, over the steps "
        f"between samples and over {SMOOTH} samples) first reached {target:.4f}, "
        + ("DDP's final loss." if "ddp" in results else "the worst mode's final loss.")
    )
    if fastest is not None:
        others = [
            f"{reached[fastest][1] / reached[m][1]:.2f}x {m}'s time"
            for m in results
            if m != fastest and reached[m] is not None
        ]
        print(
            f"Fastest to the target loss: {fastest}, in {reached[fastest][1]:.2f} s "
            f"(step {reached[fastest][0]})" + (f": {', '.join(others)}." if others else ".")
        )
    print(
        "test loss, accuracy: the final models on held-out data, mean over workers (the plot shows "
        "the training loss).\n"
        "bytes/step: gossip counts the messages it sent; DDP is the ring all-reduce volume "
        "2(n-1)/n of the gradients.\n"
        "consensus: model.consensus_distance(), sqrt(mean_i ||z_i - mean z||^2), absolute "
        "(examples/train.py prints it relative to ||mean z||), exact, after the "
        "last round; run mean: its mean over the sampled steps (before each step's round);\n"
        "estimate: mean over the same steps of the running estimate (log_every), which costs no "
        "communication."
    )
    return fastest


def plot(results: dict, path: str, network: str = "loopback") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_loss, ax_cons) = plt.subplots(1, 3, figsize=(17, 4.5))
    target = target_loss(results)
    for mode, r in results.items():
        h = r["history"]
        (line,) = ax_time.plot(h["time"], h["loss"], label=mode)
        ax_loss.plot(h["step"], h["loss"], color=line.get_color(), label=mode)
        # All-reduce keeps workers identical: a log plot has nothing to draw for it.
        if any(c > 0 for c in h["consensus"]):
            ax_cons.plot(h["step"], h["consensus"], color=line.get_color(), label=f"{mode} exact")
        if any(not math.isnan(e) for e in h["estimate"]):
            ax_cons.plot(
                h["step"],
                h["estimate"],
                color=line.get_color(),
                linestyle="--",
                alpha=0.8,
                label=f"{mode} running estimate",
            )
    ax_time.axhline(target, color="grey", linestyle=":", label="target (DDP's final loss)")
    ax_time.set(
        xlabel="wall-clock time (s)",
        ylabel="training loss (mean over workers)",
        title=f"Loss against time ({network})",
    )
    ax_loss.set(xlabel="step", ylabel="training loss (mean over workers)", title="Loss per step")
    ax_cons.set(
        xlabel="step",
        ylabel="sqrt(mean_i ||z_i - mean z||^2)",
        title="Consensus distance (DDP: exactly 0)",
        yscale="log",
    )
    for ax in (ax_time, ax_loss, ax_cons):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m harness.demo_mlp",
        description="Train a small MLP on N local worker processes (gloo) with SGP, overlap SGP, "
        "D-PSGD and DDP all-reduce, and compare them.",
    )
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default: 4)")
    parser.add_argument(
        "--steps", type=int, default=300, help="training steps per mode (default: 300)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=32, help="samples per worker and step (default: 32)"
    )
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default: 0.05)")
    parser.add_argument(
        "--samples",
        type=int,
        default=8000,
        help="training samples, split across the workers (default: 8000)",
    )
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated subset of {','.join(MODES)} (default: all)",
    )
    parser.add_argument(
        "--log-every",
        type=int,
        default=10,
        help="steps between loss and consensus samples, and the gossip modes' log_every "
        "(default: 10)",
    )
    parser.add_argument(
        "--plot",
        default=os.path.join(tempfile.gettempdir(), "gossip_demo_mlp.png"),
        help="where to write the PNG plot (default: %(default)s)",
    )
    parser.add_argument(
        "--hidden", type=int, default=64, help="width of the MLP's hidden layer (default: 64)"
    )
    parser.add_argument(
        "--bandwidth",
        metavar="RATE",
        help="run on an emulated cluster (needs root): every worker in its own network namespace "
        "behind a NIC of this rate, e.g. 1gbit or 100mbit (default: local processes on loopback)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        parser.error(f"--modes must be a subset of {','.join(MODES)}, got {unknown or '[]'}")
    for name in ("workers", "steps", "batch_size", "samples", "log_every", "hidden"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.samples < args.workers:
        parser.error(f"--samples ({args.samples}) must be >= --workers ({args.workers})")
    args.rate = netns.rate_option(parser, args.bandwidth, args.workers)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.bandwidth is not None:
        reason = netns.unavailable()
        if reason:
            print(f"python -m harness.demo_mlp --bandwidth: {reason}", file=sys.stderr)
            sys.exit(2)
        network = f"each worker behind its own {netns.format_rate(args.rate)} NIC"
        args.quiet = True  # the workers' output goes through ip netns exec: no progress bars
        with netns.EmulatedCluster(args.workers, args.rate) as cluster:
            print(f"emulated cluster: {args.workers} network namespaces, {network}")
            results = cluster.run("harness.demo_mlp:train_all", args, timeout=3600)
    else:
        network = "loopback"
        # Starting the workers and their process group takes a few seconds before the first bar.
        print(f"starting {args.workers} worker processes on gloo ({', '.join(args.modes)})...")
        with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
            results = manager.dict()
            mp.spawn(
                worker,
                args=(args.workers, os.path.join(tmp, "store"), args, results),
                nprocs=args.workers,
            )
            results = {mode: results[mode] for mode in args.modes}
    print_table(results, args.workers, network)
    plot(results, args.plot, network)
    print(f"plot written to {args.plot}")
    return results


if __name__ == "__main__":
    main()
