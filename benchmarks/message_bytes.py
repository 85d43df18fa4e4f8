"""What a message costs, read from the network interface beside the size the format computes.

    python benchmarks/message_bytes.py --workers 4 --bandwidth 1gbit --params 4e6      # as root

On the emulated cluster (harness/netns.py: each worker in its own network namespace behind
its own NIC capped at --bandwidth, gloo over those NICs only), every worker holds a model of
--params float32 values, and in one run on the same processes this measures, for every message
format (float32, bfloat16, float16, float8 e4m3fn, int8, int4):

- a synchronous gossip round (GossipDataParallel, one peer): the bytes the engine posts per round
  (``bytes_sent``, the computed size) beside the bytes the worker's NIC sent (its
  ``tx_bytes`` counter, so TCP/IP headers and every other packet count), and the round time;
- DiLoCo's exact outer step (``sync_every=1``, so that every step is one): float32 by all-reduce
  (computed: a ring's 2 (n - 1) / n model copies), the others by outer_dtype's all-to-all and
  all-gather of compressed shards (computed: ``CompressedMean.bytes_per_step``), and its time;
  and in sparse messages (``TopK``, outer steps only: every worker's message gathered by all,
  computed: ``TopK.bytes_per_step``);
- DiLoCo's outer step by gossip in the same sparse messages (``ByCompressedGossip``, "ring
  gossip": each worker's one message to its two neighbours on a ring, computed:
  ``SparseGossip.bytes_per_step``).

Each figure is the mean over workers and over --reps repetitions. The compute is nothing but the
messages' own kernels, so the NIC is what the times measure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from results import record
from torch import nn

import gossip_ext
from gossip_ext.averagings.compressed import bytes_per_step

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the root: harness/
from harness import netns  # noqa: E402

FORMATS = {
    "float32": None,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": "int8",
    "int4": "int4",
}
# Outer steps only: a gossip round sends dense messages.
SPARSE = {
    "topk 1/64 2-bit": gossip_ext.TopK(density=1 / 64, bits=2),
    "topk 1/64 4-bit": gossip_ext.TopK(density=1 / 64, bits=4),
}


def _tx_bytes() -> int:
    with open(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes") as f:
        return int(f.read())


def _mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _measure(step, reps: int) -> tuple[float, float]:
    """(NIC bytes, seconds) per call of ``step``, averaged over ``reps`` calls and the workers;
    barriers before and after keep the workers' counts apart."""
    step()  # warm-up: connections, buffers
    dist.barrier()
    before, start = _tx_bytes(), time.perf_counter()
    for _ in range(reps):
        step()
    dist.barrier()
    seconds = (time.perf_counter() - start) / reps
    return _mean((_tx_bytes() - before) / reps), _mean(seconds)


def _model(num_params: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(num_params, 1, bias=False)


def _outer_step(num_params: int, message_format, average=None) -> gossip_ext.GossipDataParallel:
    """DiLoCo whose every step is an outer step, averaged exactly in ``message_format`` (or as
    ``average`` says)."""
    return gossip_ext.GossipDataParallel(
        _model(num_params),
        gossip=None,
        outer=gossip_ext.DiLoCo(
            lambda p: torch.optim.SGD(p, lr=0.7),
            every=1,
            average=average or gossip_ext.ByCollective(dtype=message_format),
        ),
    )


def measure(rank: int, world_size: int, init_method: str, payload: dict) -> dict:
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world_size,
        timeout=timedelta(minutes=5),
    )  # fmt: skip
    torch.set_num_threads(1)
    num_params, reps = payload["params"], payload["reps"]
    rows = []
    for name, message_dtype in FORMATS.items():
        model = gossip_ext.GossipDataParallel(_model(num_params), message_dtype=message_dtype)

        def gossip_round(model=model):
            model.transfer_params()
            model.sync_comms()

        sent_before, rounds_before = model.bytes_sent, model.gossip_round
        nic, seconds = _measure(gossip_round, reps)
        computed = (model.bytes_sent - sent_before) / max(model.gossip_round - rounds_before, 1)
        rows.append(("gossip round", name, _mean(computed), nic, seconds))

        outer = _outer_step(num_params, message_dtype)
        if message_dtype is None:
            computed = 2 * (world_size - 1) / world_size * 4 * (num_params + 1)
        else:
            computed = bytes_per_step([num_params], world_size, message_dtype)
        nic, seconds = _measure(outer.transfer_params, reps)
        rows.append(("outer step", name, computed, nic, seconds))
        del model, outer
    for name, message_format in SPARSE.items():
        outer = _outer_step(num_params, message_format)
        nic, seconds = _measure(outer.transfer_params, reps)
        computed = message_format.bytes_per_step([num_params], world_size)
        rows.append(("outer step", name, computed, nic, seconds))
        del outer
        gossip = _outer_step(num_params, None, gossip_ext.ByCompressedGossip(message_format))
        nic, seconds = _measure(gossip.transfer_params, reps)
        computed = gossip.runtime.outer.averaging.bytes_per_step()
        rows.append(("outer step", f"{name}, ring gossip", computed, nic, seconds))
        del gossip
    dist.destroy_process_group()
    return {"rows": rows}


def format_table(rows: list[tuple], rate: float) -> str:
    """One row per measurement; "wire ms" is the NIC bytes at the NIC's rate, the time the
    bytes alone take (several workers share no link, each has its own NIC)."""
    lines = [
        "| what | message | computed MB | NIC MB | NIC / computed | NIC / float32's | ms "
        "| wire ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    float32 = {what: nic for what, name, _, nic, _ in rows if name == "float32"}
    for what, name, computed, nic, seconds in rows:
        lines.append(
            f"| {what} | {name} | {computed / 1e6:.2f} | {nic / 1e6:.2f} | {nic / computed:.3f} "
            f"| {nic / float32[what]:.3f} | {1e3 * seconds:.0f} | {8e3 * nic / rate:.0f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4, help="workers (default: 4)")
    parser.add_argument(
        "--bandwidth", default="1gbit", help="each worker's NIC rate (default: 1gbit)"
    )
    parser.add_argument(
        "--params", type=float, default=4e6, help="float32 parameters per worker (default: 4e6)"
    )
    parser.add_argument("--reps", type=int, default=5, help="repetitions (default: 5)")
    parser.add_argument("--no-record", action="store_true", help="do not write RESULTS.md")
    args = parser.parse_args(argv)
    problem = netns.unavailable()
    if problem:
        sys.exit(f"benchmarks/message_bytes.py: {problem}")
    rate = netns.parse_rate(args.bandwidth)
    payload = {"params": int(args.params), "reps": args.reps}
    with netns.EmulatedCluster(args.workers, rate) as cluster:
        result = cluster.run(
            "message_bytes:measure",
            payload,
            timeout=1800,
            sys_path=os.path.dirname(os.path.abspath(__file__)),
        )
    table = format_table(result["rows"], rate)
    header = (
        f"{args.workers} workers, each behind a {netns.format_rate(rate)} NIC (emulated), "
        f"{int(args.params):,} float32 parameters; bytes per round or outer step sent by one "
        "worker, the mean over workers."
    )
    print(header, table, sep="\n\n")
    if not args.no_record:
        record("Message bytes on the wire", f"{header}\n\n{table}")


if __name__ == "__main__":
    main()
