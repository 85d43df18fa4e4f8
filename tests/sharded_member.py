"""One process of a sharded replica in an elastic job, as a user launches one: the replica's
processes form their own world (init_process_group over the replica's own rendezvous), shard the
model over it with FSDP2, and join the job through the membership service with
GossipDataParallel(membership=...). Writes its record (each step's local shards, epoch, world
size) to OUT/NAME.pkl after every step. Launched by tests/test_sharded_elastic.py."""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from membership_worker import MODES, batch, die_during_handoff, train_step
from torch import nn

import gossip_ext


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def local_shards(module: nn.Module) -> list[torch.Tensor]:
    return [p.to_local().detach().to("cpu", copy=True) for p in module.parameters()]


def momentum(opt: torch.optim.Optimizer) -> list[torch.Tensor | None]:
    """This process's shard of each parameter's momentum (None before the first step)."""
    return [
        opt.state[p]["momentum_buffer"].to_local().detach().to("cpu", copy=True)
        if "momentum_buffer" in opt.state[p]
        else None
        for p in opt.param_groups[0]["params"]
    ]


def reads_after_losing(model, x, forward_read, raised_in: str) -> dict:
    """What a user reads after catching ReplicaLostError: raised by the forward or the backward,
    this process's shards of the model the forward read (``forward_read``: the last step's, its
    round absorbed); raised by the optimizer step, that step's. Its module's state_dict() holds
    the same local shards, and a later call raises again, changing nothing."""
    reads = local_shards(model.module)
    state = model.module.state_dict()
    read = {"raised_in": raised_in}
    read["equals_forward_read"] = all(map(torch.equal, reads, forward_read))
    read["finite"] = all(bool(r.isfinite().all()) for r in reads)
    read["state_dict_agrees"] = all(
        torch.equal(state[name].to_local().cpu(), r)
        for (name, _), r in zip(model.module.named_parameters(), reads)
    )
    try:
        model(x)
        read["raises_again"] = False
    except gossip_ext.ReplicaLostError:
        read["raises_again"] = True
    read["unchanged_after"] = all(map(torch.equal, local_shards(model.module), reads))
    return read


def die_while_receiving() -> None:
    """This process SIGKILLs itself in its handoff, once its donor sent the size of the state."""
    from gossip_ext.membership import handoff

    def receive_then_die(donor, group, device, limit):
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, donor, group)
        os.kill(os.getpid(), signal.SIGKILL)

    handoff.receive_state = receive_then_die


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--membership", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--replica-port", type=int, required=True, help="the replica's own world")
    parser.add_argument("--shard", type=int, required=True)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--replica", type=int, required=True, help="which batches it trains on")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--mode", default="sync", choices=sorted(MODES))
    parser.add_argument("--min-workers", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--kill-at", type=int, default=-1, help="SIGKILL itself after this step")
    parser.add_argument(
        "--kill-in-world", type=int, default=0, help="...and once its epoch has this many replicas"
    )
    parser.add_argument(
        "--kill-in-backward", action="store_true", help="...in the next step's backward"
    )
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step")
    parser.add_argument("--init-seed", type=int, default=0)
    parser.add_argument("--die-receiving", action="store_true", help="SIGKILL in its handoff")
    parser.add_argument("--die-donating", action="store_true", help="SIGKILL as a donor")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (FSDP2 over NCCL)")
    args = parser.parse_args()
    if args.die_receiving:
        die_while_receiving()
    if args.die_donating:
        die_during_handoff(os.path.join(args.out, "died_donating"))
    logging.basicConfig(level=logging.INFO, format=f"{args.name} %(asctime)s %(message)s")
    torch.set_num_threads(1)
    torch.manual_seed(args.init_seed)
    result: dict = {"steps": [], "error": None, "error_type": None}
    out = os.path.join(args.out, f"{args.name}.pkl")

    def record() -> None:
        with open(out + ".tmp", "wb") as f:
            pickle.dump(result, f)
        os.replace(out + ".tmp", out)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    on_gpu = args.device == "cuda"
    if on_gpu:
        torch.cuda.set_device(args.shard)
    dist.init_process_group(
        "nccl" if on_gpu else "gloo",
        init_method=f"tcp://127.0.0.1:{args.replica_port}",
        rank=args.shard,
        world_size=args.shards,
        timeout=timedelta(seconds=args.timeout),
    )
    mesh = init_device_mesh(args.device, (args.shards,))
    module = net().to(args.device)
    for layer in (module[0], module[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    started = time.monotonic()
    try:
        model = gossip_ext.GossipDataParallel(
            module,
            membership=args.membership,
            min_workers=args.min_workers,
            timeout=timedelta(seconds=args.timeout),
            # CUDA shards gossip through host buffers over the epoch's gloo group.
            comm_device="cpu" if on_gpu else None,
            **MODES[args.mode],
        )
    except Exception as error:  # noqa: BLE001 - the test judges it (a refused replica)
        result["error"] = f"{type(error).__name__}: {error}"
        result["error_type"] = type(error).__name__
        record()
        return 0
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.register_optimizer(opt)
    result["joined_after_s"] = time.monotonic() - started
    result["worker_id"] = model.worker_id
    result["first_step"] = model.step_count
    result["first_shards"] = local_shards(model.module)
    result["first_momentum"] = momentum(opt)
    # This process's shards as each forward reads them (before FSDP2's all-gather).
    forward_read: dict = {}
    model.module.register_forward_pre_hook(
        lambda module, _: forward_read.update(shards=local_shards(module)), prepend=True
    )
    # --kill-in-backward: once armed, the next forward's output SIGKILLs the process when the
    # backward reaches it, before any of FSDP2's backward collectives.
    armed = {"kill_in_backward": False}

    def kill_in_backward(module, inputs, output):
        if armed["kill_in_backward"]:
            output.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))

    model.module.register_forward_hook(kill_in_backward)
    step = model.step_count
    try:
        while step < args.steps:
            x, y = (t.to(args.device) for t in batch(step, 10 * args.replica + args.shard))
            forward_read["shards"], progress = local_shards(model.module), {}
            try:
                train_step(model, opt, x, y, progress)
            except gossip_ext.ReplicaLostError:
                result["lost_reads"] = reads_after_losing(
                    model, x, forward_read["shards"], progress["stage"]
                )
                raise
            step = model.step_count
            shards = local_shards(model.module)
            result["steps"].append(
                {
                    "step": step,
                    "epoch": model.epoch,
                    "world_size": model.gossip_world_size,
                    "finite": all(bool(s.isfinite().all()) for s in shards),
                    "shards": shards,
                    "momentum": momentum(opt),
                    "time": time.time(),
                }
            )
            record()
            # The first step from --kill-at on in an epoch of --kill-in-world replicas: a replica
            # that started late (a slow machine) is in the job before the kill.
            if 0 <= args.kill_at <= step and model.gossip_world_size >= args.kill_in_world:
                if not args.kill_in_backward:
                    os.kill(os.getpid(), signal.SIGKILL)
                armed["kill_in_backward"] = True
            if args.step_seconds:
                time.sleep(args.step_seconds)
    except Exception as error:  # noqa: BLE001 - the test judges it
        result["error"] = f"{type(error).__name__}: {error}"
        result["error_type"] = type(error).__name__
        traceback.print_exc()
    if result["error"] is None:
        model.sync_comms()
    result["final_shards"] = local_shards(model.module)
    result["final_step"] = step
    record()
    return 0


if __name__ == "__main__":
    sys.exit(main())
