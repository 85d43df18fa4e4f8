"""What sealing gossip_ext's own messages costs (Note [Sealed messages]; Elastic(messages=...)):
the step of synchronous SGP with its messages plain, sealed (an AES-GCM tag on each) and encrypted,
side by side on the same processes of an emulated cluster.

    python benchmarks/sealed_cost.py --workers 4 --bandwidth 100mbit 1gbit     # as root

Each worker runs in its own network namespace behind a NIC capped with tbf (harness/netns.py).
A step is an MLP's forward, backward and SGD step on the engine's flat parameters, then one
gossip round (1 peer, float32), absorbed before the next forward: the engine's rounds over a
plain process-group transport, or over the sealed transport wrapped around it. The three are
interleaved in blocks of --steps steps, --blocks times, so that drift on a shared machine falls
on all three alike; a cell is the median step of the slowest worker, and its ratio to the plain
step. The machine's own cost of sealing (GB/s of one core, no network) is measured beside it.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from results import record
from torch import nn

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the root: harness/
from harness import netns  # noqa: E402

MODES = ("plain", "sealed", "encrypted")


def _key(sender: int, receiver: int) -> bytes:
    return hashlib.sha256(f"benchmark link {sender}->{receiver}".encode()).digest()


def _model(num_params: int) -> nn.Module:
    h = int(math.sqrt(num_params / 2))
    return nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Linear(h, h))


def _engine(model: nn.Module, mode: str, group: dist.ProcessGroup, timeout: timedelta):
    import gossip_ext
    from gossip_ext._torch_check import _C
    from gossip_ext.gossip import transport

    wire = _C.ProcessGroupTransport(group)
    if mode != "plain":
        wire = transport.Sealing(_key, encrypt=mode == "encrypted").wrap(wire, group)
    params = list(model.parameters())
    return _C.GossipEngine(
        params,
        [f"p{i}" for i in range(len(params))],
        wire,
        _C.EngineOptions(
            gossip_ext.NPeerDynamicDirectedExponentialGraph().compiled_options(),
            gossip_ext.UniformMixing().compiled_options(),
            synchronous=True,
            timeout=timeout,
        ),
    )


def sealing_speed(nbytes: int) -> dict[str, float]:
    """GB/s of sealing a message of ``nbytes`` on one core (in-process: no network)."""
    from gossip_ext._torch_check import _C

    hub = _C.InProcHub(2)
    speeds = {}
    for mode in ("sealed", "encrypted"):
        ends = [
            _C.SealedTransport(
                _C.InProcTransport(hub, r),
                {1 - r: (_key(r, 1 - r), _key(1 - r, r))},
                mode == "encrypted",
            )
            for r in (0, 1)
        ]
        message = torch.randn(nbytes // 4)
        received = torch.empty_like(message)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            ends[0].exchange([(1, message)], [], 0).wait(timedelta(seconds=30))
            ends[1].exchange([], [(0, received)], 0).wait(timedelta(seconds=30))
            times.append(time.perf_counter() - start)
        speeds[mode] = 2 * nbytes / sorted(times)[len(times) // 2] / 1e9  # seal and open
    return speeds


def worker(rank: int, world_size: int, init_method: str, cfg: dict) -> dict:
    torch.set_num_threads(1)  # the workers share the machine's cores
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=5),
    )
    group = dist.group.WORLD
    torch.manual_seed(rank)
    models = {mode: _model(cfg["params"]) for mode in MODES}
    engines = {m: _engine(models[m], m, group, timedelta(seconds=60)) for m in MODES}
    optimizers = {m: torch.optim.SGD(models[m].parameters(), lr=0.01) for m in MODES}
    width = models["plain"][0].in_features
    steps: dict[str, list[float]] = {m: [] for m in MODES}
    for block in range(cfg["blocks"] + 1):  # the first block warms up
        for mode in MODES:
            model, engine, opt = models[mode], engines[mode], optimizers[mode]
            for _ in range(cfg["steps"]):
                dist.barrier()
                start = time.perf_counter()
                x = torch.randn(cfg["batch"], width)
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
                engine.start_round()
                engine.finish_round()
                if block:
                    steps[mode].append(time.perf_counter() - start)
    medians = {}
    for mode in MODES:
        median = torch.tensor([sorted(steps[mode])[len(steps[mode]) // 2]], dtype=torch.float64)
        dist.all_reduce(median, op=dist.ReduceOp.MAX)
        medians[mode] = median.item()
    message_mb = sum(p.numel() * 4 for p in models["plain"].parameters()) / 1e6
    dist.destroy_process_group()
    return {"medians": medians, "message_mb": message_mb}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--bandwidth", nargs="+", default=["100mbit", "1gbit"])
    parser.add_argument("--params", type=float, default=2e6, help="the MLP's parameters")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5, help="steps per block and mode")
    parser.add_argument("--blocks", type=int, default=4, help="blocks of each mode, interleaved")
    parser.add_argument("--no-record", action="store_true", help="do not write RESULTS.md")
    args = parser.parse_args(argv)
    reason = netns.unavailable()
    if reason:
        sys.exit(f"benchmarks/sealed_cost.py: {reason}")
    cfg = {"params": int(args.params), "batch": args.batch}
    cfg.update(steps=args.steps, blocks=args.blocks)
    here = os.path.dirname(os.path.abspath(__file__))
    rows = {}
    for bandwidth in args.bandwidth:
        rate = netns.parse_rate(bandwidth)
        with netns.EmulatedCluster(args.workers, rate) as cluster:
            rows[bandwidth] = cluster.run("sealed_cost:worker", cfg, 1800, here)
        print(bandwidth, rows[bandwidth], flush=True)
    first = next(iter(rows.values()))
    speed = sealing_speed(int(first["message_mb"] * 1e6))
    lines = [
        "| NIC | plain step | sealed step | encrypted step |",
        "|---|---|---|---|",
    ]
    for bandwidth, row in rows.items():
        plain = row["medians"]["plain"]
        cells = [f"{plain * 1e3:.0f} ms"] + [
            f"{row['medians'][m] * 1e3:.0f} ms ({row['medians'][m] / plain:.3f}x)"
            for m in ("sealed", "encrypted")
        ]
        nic = netns.format_rate(netns.parse_rate(bandwidth))
        lines.append(f"| {nic} | " + " | ".join(cells) + " |")
    text = (
        f"{args.workers} workers, each in its own network namespace behind a NIC capped with tbf; "
        f"synchronous SGP (1 peer, float32 messages of {first['message_mb']:.1f} MB) on an MLP, "
        f"batch {args.batch}, one thread per worker on this machine's {os.cpu_count()} cores; "
        f"the median step of the slowest worker over {args.blocks} interleaved blocks of "
        f"{args.steps} steps per mode, and its multiple of the plain step.\n\n"
        + "\n".join(lines)
        + f"\n\nSealing on one core, without the network (seal and open of one message): "
        f"{speed['sealed']:.2f} GB/s sealed, {speed['encrypted']:.2f} GB/s encrypted.\n"
    )
    print("\n" + text)
    if not args.no_record:
        record("Sealed messages: their cost", text)
    return rows


if __name__ == "__main__":
    main()
