"""Training over a slow network: gossip against all-reduce on an emulated cluster, in wall time.

    python benchmarks/cluster.py --workers 4 8 --bandwidth 1gbit 10gbit      # as root

Each worker runs in its own network namespace behind its own NIC of the chosen rate (veth pairs
on a bridge, capped with tbf both ways: harness/netns.py), and gloo talks only over those
NICs. For every worker count and rate, in one run on the same processes, this measures:

- the NIC: the nominal rate beside a timed gloo send between two workers, and with every worker
  sending at once (on a small machine the CPU, not the cap, can be the limit);
- one gossip round (float32 and bfloat16 messages) against its wire time, bytes / NIC rate;
- the step time of compute alone (no communication, all workers computing at once, so under the
  same CPU contention as every mode), DDP, synchronous SGP, overlap SGP, both with bfloat16
  messages, D-PSGD and local SGD (torch's PeriodicModelAverager), on an MLP of --params;
- time to a target loss: DDP trains --steps steps and its final loss (the mean over workers and
  over the last 5 steps) is the target every other mode then trains to, bounded by 4x the steps
  and 2.5x DDP's wall time.

It prints the tables as ratios to DDP, appends them to benchmarks/RESULTS.md and plots the loss
of every mode against wall-clock time.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import warnings
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist
from results import record
from round_time import gossip_round, timed
from torch import nn
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

import gossip_ext

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the root: harness/
from harness import netns  # noqa: E402

GOSSIP = {
    "sgp": {},
    "overlap": {"overlap": True},
    "sgp-bf16": {"message_dtype": torch.bfloat16},
    "overlap-bf16": {"overlap": True, "message_dtype": torch.bfloat16},
    "dpsgd": {"push_sum": False},
}
MODES = ("ddp", *GOSSIP, "localsgd")
FEATURES, CLASSES = 64, 10
WINDOW = 5  # steps the loss is averaged over before it is compared with the target
WARMUP = 2  # first steps left out of the step time (allocations, connections)


def make_model(num_params: int) -> nn.Module:
    """An MLP with two hidden layers of width h, h chosen so the model has about num_params."""
    b = FEATURES + CLASSES + 2
    h = int((-b + math.sqrt(b * b + 4 * num_params)) / 2)
    return nn.Sequential(
        nn.Linear(FEATURES, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, CLASSES)
    )


def batch(centres: torch.Tensor, seed: int, rank: int, step: int, size: int):
    """Worker `rank`'s mini-batch at `step`: the same samples in every mode."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    y = torch.randint(0, CLASSES, (size,), generator=g)
    return centres[y] + 2.0 * torch.randn(size, FEATURES, generator=g), y


def measure_link(rank: int, world_size: int, rate: float) -> dict:
    """Gbit/s of a timed gloo send from rank 0 to 1, and of every rank sending to the next at
    once; the slowest receiver's median of 3."""
    buf = torch.empty(int(min(max(rate / 8 * 0.3, 4e6), 128e6)) // 4)
    nbytes = buf.numel() * 4

    def pair():
        if rank == 0:
            dist.send(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)

    received = torch.empty_like(buf)

    def ring():
        works = [dist.irecv(received, (rank - 1) % world_size)]
        works.append(dist.isend(buf, (rank + 1) % world_size))
        for w in works:
            w.wait()

    return {name: 8 * nbytes / timed(fn, 3) / 1e9 for name, fn in (("pair", pair), ("ring", ring))}


def measure_rounds(cfg: dict, rate: float) -> dict:
    out = {}
    for name, dtype in (("float32", None), ("bfloat16", torch.bfloat16)):
        torch.manual_seed(cfg["seed"])
        model = gossip_ext.GossipDataParallel(make_model(cfg["params"]), message_dtype=dtype)
        seconds = timed(gossip_round(model), 3)
        nbytes = model.bytes_sent / model.gossip_round
        out[name] = {"seconds": seconds, "bytes": nbytes, "wire": 8 * nbytes / rate}
        del model
    return out


def train(mode: str, rank: int, world_size: int, cfg: dict, target, max_steps, time_limit):
    """Trains until the loss averaged over workers and WINDOW steps reaches `target` (never when
    it is None), or for max_steps, or past time_limit seconds. Step times and the loss curve use
    the mean over workers of their clocks, so every worker takes the same decision to stop."""
    torch.manual_seed(cfg["seed"])
    module = make_model(cfg["params"])
    centres = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(1))
    model, averager = module, None
    if mode == "ddp":
        model = nn.parallel.DistributedDataParallel(module)
    elif mode in GOSSIP:
        kwargs = dict(GOSSIP[mode])
        if mode == "dpsgd":
            kwargs["graph"] = gossip_ext.DynamicBipartiteExponentialGraph()
        model = gossip_ext.GossipDataParallel(module, **kwargs)
    elif mode == "localsgd":
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="When period is 1")
            averager = PeriodicModelAverager(period=cfg["period"], warmup_steps=0)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    if mode in GOSSIP:
        model.register_optimizer(opt)  # the round starts in opt.step()
    params = list(module.parameters())
    recent, curve, stamps, reached = deque(maxlen=WINDOW), [], [], False
    dist.barrier()
    start = time.perf_counter()
    for step in range(max_steps):
        x, y = batch(centres, cfg["seed"], rank, step, cfg["batch_size"])
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if averager is not None:
            averager.average_parameters(params)
        if mode == "compute":
            stamps.append(time.perf_counter() - start)
            continue
        t = torch.tensor([loss.item(), time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(t)
        loss_mean, elapsed = (t / world_size).tolist()
        recent.append(loss_mean)
        stamps.append(elapsed)
        if len(recent) == WINDOW:
            curve.append((step + 1, elapsed, sum(recent) / WINDOW))
            if target is not None and curve[-1][2] <= target:
                reached = True
                break
        if elapsed > time_limit:
            break
    if mode in GOSSIP:
        model.sync_comms()
    steps = len(stamps)
    step_s = (stamps[-1] - stamps[WARMUP - 1]) / (steps - WARMUP)
    if mode == "compute":  # no clocks were shared: the slowest worker's
        t = torch.tensor([step_s], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return {"step": t.item()}
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    allreduce = 2 * (world_size - 1) / world_size * param_bytes  # a ring all-reduce, per worker
    if mode in GOSSIP:
        t = torch.tensor([model.bytes_sent / steps], dtype=torch.float64)
        dist.all_reduce(t)
        bytes_per_step = t.item() / world_size
    else:
        bytes_per_step = allreduce / (cfg["period"] if mode == "localsgd" else 1)
    return {
        "step": step_s,
        "steps": steps,
        "wall": stamps[-1],
        "reached": reached,
        "curve": curve,
        "wire": 8 * bytes_per_step / cfg["rate"],
    }


def time_to(curve: list, target: float) -> tuple[int, float] | None:
    return next(((s, t) for s, t, loss in curve if loss <= target), None)


def cluster_worker(rank: int, world_size: int, init_method: str, cfg: dict) -> dict:
    """Runs on every worker of the emulated cluster (harness.netns); rank 0's dict returns."""
    torch.set_num_threads(1)  # the workers share the machine's cores
    warnings.filterwarnings("ignore", message=".*one gossiping process.*")
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world_size,
        timeout=timedelta(minutes=5),
    )  # fmt: skip
    label = f"{world_size} workers, {netns.format_rate(cfg['rate'])}"
    say = print if rank == 0 else (lambda *a, **k: None)
    out = {"link": measure_link(rank, world_size, cfg["rate"]), "modes": {}}
    say(f"[{label}] link: {out['link']['pair']:.2f} Gbit/s one pair", flush=True)
    out["round"] = measure_rounds(cfg, cfg["rate"])
    out["modes"]["compute"] = train("compute", rank, world_size, cfg, None, 2 + WINDOW, math.inf)
    ddp = train("ddp", rank, world_size, cfg, None, cfg["steps"], math.inf)
    out["target"] = ddp["curve"][-1][2]
    ddp["to_target"] = time_to(ddp["curve"], out["target"])
    for mode in cfg["modes"]:
        if mode == "ddp":
            r = ddp
        else:
            limit = 2.5 * ddp["to_target"][1]
            r = train(mode, rank, world_size, cfg, out["target"], 4 * cfg["steps"], limit)
            r["to_target"] = time_to(r["curve"], out["target"]) if r["reached"] else None
        out["modes"][mode] = r
        say(f"[{label}] {mode}: {r['steps']} steps, {r['wall']:.1f} s", flush=True)
    dist.destroy_process_group()
    return out


def _verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def report(results: dict) -> str:
    """The link and round table, a row per setting; the step table, a row per mode and a column
    per setting; and the goals, as markdown."""
    link, steps, headline, fits = [], {}, [], []
    for (n, rate), r in sorted(results.items()):
        nic = netns.format_rate(rate)
        setting = f"{n} workers, {nic}"
        rounds = [
            f"{1000 * x['seconds']:.0f} ms for {x['bytes'] / 1e6:.1f} MB "
            f"({x['seconds'] / x['wire']:.2f}x wire)"
            for x in r["round"].values()
        ]
        link.append(
            [n, nic, f"{r['link']['pair']:.2f} Gbit/s", f"{r['link']['ring']:.2f} Gbit/s", *rounds]
        )
        compute, ddp = r["modes"]["compute"]["step"], r["modes"]["ddp"]
        steps.setdefault("compute alone", {})[setting] = (
            f"{1000 * compute:.0f} ms ({compute / ddp['step']:.2f}x)"
        )
        for mode, m in r["modes"].items():
            if mode == "compute":
                continue
            bound = max(compute, m["wire"])
            cell = f"{1000 * m['step']:.0f} ms ({m['step'] / ddp['step']:.2f}x); "
            cell += f"{m['step'] / bound:.2f}x; "
            if m["to_target"] is None:
                cell += f"not in {m['steps']} steps, {m['wall']:.0f} s"
            else:
                to_steps, t = m["to_target"]
                cell += f"{to_steps} steps, {t:.1f} s ({t / ddp['to_target'][1]:.2f}x)"
            steps.setdefault(mode, {})[setting] = cell
            where = f"{setting}, {mode}"
            if mode in GOSSIP:
                fits.append((where, m["step"] / bound))
            if (n, rate) == (8, 1e9) and mode == "overlap-bf16":
                x = m["step"] / ddp["step"]
                verdict = _verdict(x <= 0.3)
                headline.append(f"{where}: step {x:.2f}x DDP's (goal <= 0.30x: {verdict})")
            if (n, rate) == (8, 1e9) and mode in ("sgp", "overlap", "sgp-bf16", "overlap-bf16"):
                if m["to_target"] is None:
                    x = "did not reach DDP's final loss within its bounds"
                    headline.append(f"{where}: {x} (goal <= 0.5x DDP's time: missed)")
                else:
                    x = m["to_target"][1] / ddp["to_target"][1]
                    headline.append(f"{where}: DDP's final loss in {x:.2f}x DDP's time "
                                    f"(goal <= 0.5x: {_verdict(x <= 0.5)})")  # fmt: skip
    settings = list(dict.fromkeys(setting for cells in steps.values() for setting in cells))
    met = [f"{where} ({x:.2f}x)" for where, x in fits if x <= 1.1]
    fit = f"met in {len(met)} of {len(fits)} rows" + (", " + "; ".join(met) if met else "")
    headline.append(f"every gossip mode's step within 1.1x max(compute, wire) (goal): {fit}")
    step_rows = [
        [mode, *(cells.get(s, "not run") for s in settings)] for mode, cells in steps.items()
    ]
    messages = next(iter(results.values()))["round"] if results else {}
    return "\n".join([
        "NIC rate, nominal and measured (timed gloo sends), and one gossip round (1 peer) against "
        "its wire time (bytes / nominal rate):", "",
        *_table(["workers", "NIC", "one pair", "all sending at once",
                 *(f"{name} round" for name in messages)], link), "",
        "Each cell: the step time (its multiple of DDP's); the step over max(compute alone, wire "
        "time); the steps and seconds to DDP's final loss (its multiple of DDP's time). Compute "
        "alone: all workers computing at once with no communication, under the same CPU "
        "contention as the modes.", "",
        *_table(["mode", *settings], step_rows),
        "", "Goals:", "", *(f"- {g}" for g in headline),
    ])  # fmt: skip


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(results)
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4.5), squeeze=False)
    for ax, (n, rate) in zip(axes[0], keys):
        r = results[(n, rate)]
        for mode, m in r["modes"].items():
            if mode != "compute":
                ax.plot([t for _, t, _ in m["curve"]], [x for _, _, x in m["curve"]], label=mode)
        ax.axhline(r["target"], color="grey", linestyle=":", label="DDP's final loss")
        ax.set(xlabel="wall-clock time (s)", ylabel=f"training loss (mean of {WINDOW} steps)",
               title=f"{n} workers, {netns.format_rate(rate)} NICs")  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--bandwidth", nargs="+", default=["1gbit", "10gbit"], help="NIC rates")
    parser.add_argument("--params", type=float, default=2.5e7, help="model parameters")
    parser.add_argument("--steps", type=int, default=30, help="DDP's steps (default: 30)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated; DDP always runs")
    parser.add_argument("--batch-size", type=int, default=16, help="per worker (default: 16)")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--period", type=int, default=4, help="local SGD's averaging period")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=os.path.join(tempfile.gettempdir(), "gossip_cluster.png"))
    parser.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if any(m not in MODES for m in modes):
        parser.error(f"--modes must be a subset of {','.join(MODES)}, got {args.modes}")
    if "dpsgd" in modes and any(n % 2 for n in args.workers):
        parser.error(f"dpsgd needs an even number of workers, got --workers {args.workers}")
    if any(n < 2 for n in args.workers) or args.steps < WINDOW + WARMUP:
        parser.error(f"need --workers >= 2 and --steps >= {WINDOW + WARMUP}")
    try:
        rates = [netns.parse_rate(b) for b in args.bandwidth]
    except ValueError as e:
        parser.error(f"--bandwidth: {e}")
    reason = netns.unavailable()
    if reason:
        print(f"benchmarks/cluster.py: {reason}", file=sys.stderr)
        sys.exit(2)
    modes = ["ddp"] + [m for m in modes if m != "ddp"]
    here = os.path.dirname(os.path.abspath(__file__))
    load = os.getloadavg()[0]  # other work on the machine skews every number: say how much
    results = {}
    for n in args.workers:
        for rate in rates:
            cfg = dict(vars(args), params=int(args.params), rate=rate, modes=modes)
            with netns.EmulatedCluster(n, rate) as cluster:
                results[(n, rate)] = cluster.run("cluster:cluster_worker", cfg, 1800, here)
    text = report(results)
    print("\n" + text)
    plot(results, args.plot)
    print(f"plot written to {args.plot}")
    if not args.no_record:
        record(
            "Emulated cluster",
            f"Each worker in its own network namespace behind a veth NIC capped with tbf both "
            f"ways; {int(args.params) / 1e6:g}M-parameter MLP, batch {args.batch_size} per "
            f"worker, one thread per worker, all workers on this machine's {os.cpu_count()} "
            f"cores (1-minute load average {load:.1f} before the run).\n\n{text}",
        )
    return results


if __name__ == "__main__":
    main()
