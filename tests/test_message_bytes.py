"""What a compressed message costs on the wire, read from the network interface (loopback here;
benchmarks/message_bytes.py reads a capped NIC on the emulated cluster): an int8 gossip round
moves at most 0.30x, and an int4 round at most 0.17x, the interface bytes of a float32 round."""

import os

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks
from torch import nn

import gossip_ext

COUNTER = "/sys/class/net/lo/statistics/tx_bytes"
PARAMS = 2_000_000  # 8 MB of float32 per message: the rest of the loopback traffic is noise
ROUNDS = 5

pytestmark = pytest.mark.skipif(
    not os.path.exists(COUNTER), reason=f"no loopback byte counter at {COUNTER}"
)


def _tx_bytes() -> int:
    with open(COUNTER) as f:
        return int(f.read())


def _interface_bytes_per_round(rank: int, world_size: int) -> dict:
    results = {}
    for name, message_dtype in (("float32", None), ("int8", "int8"), ("int4", "int4")):
        module = nn.Linear(PARAMS // 4, 4, bias=False)  # PARAMS float32 values
        model = gossip_ext.GossipDataParallel(module, message_dtype=message_dtype)
        model(torch.zeros(1, PARAMS // 4))  # the first forward, before the counter is read
        dist.barrier()
        rounds = []
        for _ in range(ROUNDS):
            sent, before = model.bytes_sent, _tx_bytes()
            model.transfer_params()
            model.sync_comms()
            dist.barrier()
            rounds.append((_tx_bytes() - before, model.bytes_sent - sent))
        # Loopback is shared: it counts both workers' sends, and whatever else on the machine
        # talks over it then. That traffic only ever adds bytes, so the quietest round is the
        # round's own cost.
        interface, computed = min(rounds)
        results[name] = {"interface": interface, "computed": computed * world_size}
    return results


def test_quantized_rounds_move_a_fraction_of_float32s_interface_bytes():
    r = run_ranks(2, _interface_bytes_per_round)[0]
    for name in r:
        # The interface carries what the engine posts, plus TCP/IP headers and the barriers.
        assert r[name]["interface"] >= r[name]["computed"], (name, r[name])
        assert r[name]["interface"] <= 1.05 * r[name]["computed"] + 64_000, (name, r[name])
    assert r["int8"]["interface"] <= 0.30 * r["float32"]["interface"], r
    assert r["int4"]["interface"] <= 0.17 * r["float32"]["interface"], r


def _outer_step_interface_bytes(rank: int, world_size: int) -> dict:
    import functools

    import test_first_line

    module = nn.Linear(PARAMS // 4, 4, bias=False)
    outer = gossip_ext.DiLoCo(functools.partial(torch.optim.SGD, lr=0.7), every=1)
    model = gossip_ext.GossipDataParallel(module, gossip=None, outer=outer)
    model(torch.zeros(1, PARAMS // 4))
    dist.barrier()
    rounds = []
    for _ in range(ROUNDS):
        before = _tx_bytes()
        model.transfer_params()  # the outer step: its all-reduce
        dist.barrier()
        rounds.append(_tx_bytes() - before)
    logged = test_first_line._figure(model.wire_summary, "outer steps ")
    return {"interface": min(rounds), "logged": logged.expected}


def test_the_outer_steps_logged_bytes_are_what_the_all_reduce_puts_on_the_wire():
    """The first line's outer-step figure for an all-reduce is a ring's 2 (n - 1) / n of the
    model from each worker: on 3 workers 4/3 of it (another algorithm would send more)."""
    results = run_ranks(3, _outer_step_interface_bytes)
    logged = results[0]["logged"]
    assert logged == pytest.approx(2 * 2 * (PARAMS + 1) * 4 / 3, rel=5e-3)
    # Loopback counts every worker's sends: 3 of them.
    interface = results[0]["interface"]
    assert 0.99 * 3 * logged <= interface <= 1.05 * 3 * logged + 64_000, (interface, logged)
