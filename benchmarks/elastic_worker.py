"""One worker of benchmarks/elastic.py, launched on its own as a user launches an elastic job's
workers (``python elastic_worker.py ...``, no torchrun, no init_process_group): it trains the
byte-level language model of harness.compare with gossip_ext (an elastic job:
``membership=``; ``gossip_sealed``: the same, the job's secret in GOSSIP_EXT_JOB_SECRET) or with
torchft (its Manager and lighthouse, LocalSGD), writes every finished
step and its wall-clock time to ``<out>/<name>.steps`` as it goes (the harness watches it), and at
the end its held-out bits per byte and timeline to ``<out>/<name>.json``.

Every worker trains until the job's step count reaches ``--steps``; a replacement (``--joiner``)
starts from the step and model a live member hands it. With ``--shards S`` a worker is a replica
of S such processes (``--shard``), the model sharded over them by FSDP2 (an elastic job of
sharded replicas, docs/sharded.md). A worker's batches are those of its slot
(``--slot``, the machine it runs on), so a replacement reads the data of the worker it replaces.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

START = time.time()  # before torch's import: a replacement's start-up counts it

from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import gossip_ext  # noqa: E402
from gossip_ext.membership import trust  # noqa: E402
from gossip_ext.membership.epochs import parse_address  # noqa: E402

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the root: harness/
from harness.tasks import byte_lm  # noqa: E402
from harness.tasks.byte_lm import ByteLM, ByteLMConfig  # noqa: E402
from harness.tasks.stdlib_text import StdlibText  # noqa: E402

MODEL = ByteLMConfig(layers=2, width=128, heads=4, context=64)
BATCH = 8
WARMUP = 20
EVAL_WINDOWS = 64
LOCAL_STEPS = 4  # torchft LocalSGD's H


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--system", required=True, choices=("gossip", "gossip_sealed", "gossip_static", "torchft")
    )
    p.add_argument("--coordinator", required=True, help="membership HOST:PORT or lighthouse URL")
    p.add_argument("--out", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--slot", type=int, required=True, help="whose batches this worker reads")
    p.add_argument("--world-size", type=int, default=0, help="gossip_static's workers")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--min-workers", type=int, required=True)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds")
    p.add_argument("--seed", type=int, default=0, help="the batches' seed")
    p.add_argument("--joiner", action="store_true", help="a replacement, started later")
    p.add_argument("--go", help="a file to wait for before joining (the job's common start)")
    p.add_argument("--shards", type=int, default=1, help="processes of this worker's replica")
    p.add_argument("--shard", type=int, default=0, help="which of them this process is")
    p.add_argument("--replica-port", type=int, default=0, help="the replica's own rendezvous")
    return p.parse_args(argv)


def shard_replica(args, module: torch.nn.Module) -> None:
    """A replica of ``--shards`` processes: its own world (a rendezvous at this slot's address),
    the model sharded over it by FSDP2, every block its own unit (harness.compare.sharded)."""
    from torch.distributed.device_mesh import init_device_mesh

    from harness.compare import sharded

    host = os.environ.get("GOSSIP_EXT_HOST", "127.0.0.1")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{host}:{args.replica_port}",
        rank=args.shard,
        world_size=args.shards,
        timeout=timedelta(seconds=args.timeout),
    )
    sharded.shard(module, init_device_mesh("cpu", (args.shards,)))


class Steps:
    """This worker's finished steps, appended to a file as they finish."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "w")  # noqa: SIM115 - open for the whole run
        self.times: list[tuple[int, float]] = []

    def done(self, step: int) -> None:
        now = time.time()
        self.times.append((step, now))
        self._file.write(f"{step} {now:.6f}\n")
        self._file.flush()


def set_lr(opt: torch.optim.Optimizer, lr: float, factor, step: int) -> None:
    for group in opt.param_groups:
        group["lr"] = lr * factor(step)


def train_gossip(args, module, opt, data, steps: Steps, timeline: dict) -> torch.nn.Module:
    timeout = timedelta(seconds=args.timeout)
    options = {"timeout": timeout, "overlap": True, "message_dtype": torch.bfloat16}
    static = args.system == "gossip_static"
    if static:
        # The same job as a static one: one process group over every worker, for the step time
        # an elastic job must match when nothing fails.
        host, port = parse_address(args.coordinator)
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("static", store),
            rank=args.slot,
            world_size=args.world_size,
            timeout=timeout,
        )
        model = gossip_ext.GossipDataParallel(module, **options)
    else:
        # The job's secret, if any, is read from the environment, as a user's workers read it.
        sealed = trust.job_secret() is not None
        if sealed != (args.system == "gossip_sealed"):
            without = "" if sealed else "out"
            raise RuntimeError(f"--system {args.system} started with{without} a job secret")
        model = gossip_ext.GossipDataParallel(
            module, membership=args.coordinator, min_workers=args.min_workers, **options
        )
    model.register_optimizer(opt)
    timeline["joined"] = time.time()
    timeline["first_step"] = model.step_count
    factor = byte_lm.schedule_factor(WARMUP, args.steps)
    while model.step_count < args.steps:
        step = model.step_count
        set_lr(opt, args.lr, factor, step)
        # Each process of a replica its own batches; a replacement reads those of its slot.
        worker = args.slot * args.shards + args.shard
        inputs, targets = data.batch(step, worker, BATCH, MODEL.context, args.seed)
        loss = byte_lm.next_byte_loss(model, inputs, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()  # the gossip round of this step starts here (register_optimizer)
        steps.done(model.step_count)
    model.sync_comms()
    if static:
        dist.barrier()  # no worker exits while another may still wait on its last round
    else:
        # Leaving now, not at exit: the others drop this worker at their next step boundary.
        model.leave()
    return module


def train_torchft(args, module, opt, data, steps: Steps, timeline: dict) -> torch.nn.Module:
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.local_sgd import LocalSGD

    host = os.environ.get("GOSSIP_EXT_HOST", "127.0.0.1")

    class Transport(HTTPTransport):
        """torchft's checkpoint server, at the worker's own address: it gives its peers the
        machine's hostname, which on a real cluster resolves to that address, but on the emulated
        one (namespaces sharing one hostname) to none of theirs."""

        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{host}:{port}/checkpoint/"

    # The replica group's store, at its process 0; a sharded replica's others are told its port
    # over the replica's own group.
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False) if args.shard == 0 else None
    port = [None if store is None else store.port]
    if args.shards > 1:
        dist.broadcast_object_list(port, src=0)
    done = [0]  # optimizer steps finished, handed to a replacement with the model
    timeout = timedelta(seconds=args.timeout)

    def state_dict():
        return {"model": module.state_dict(), "opt": opt.state_dict(), "done": done[0]}

    def load_state_dict(state):
        module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        done[0] = int(state["done"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        checkpoint_transport=Transport(timeout=timeout, num_chunks=0),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=args.min_workers,
        use_async_quorum=False,  # a replacement heals before its first step (LocalSGD's docs)
        replica_id=f"replica_{args.slot}",
        store_addr=host,
        store_port=port[0],
        rank=args.shard,  # a sharded replica is one torchft replica group of its processes
        world_size=args.shards,
        lighthouse_addr=args.coordinator,
        hostname=host,
        init_sync=False,  # the first members start from the same seed
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
    )
    # Counted before LocalSGD's hook runs its sync, so that a donor hands on the step it is at.
    opt.register_step_post_hook(lambda *_: done.__setitem__(0, done[0] + 1))
    algorithm = LocalSGD(manager, module, opt, sync_every=LOCAL_STEPS)
    factor = byte_lm.schedule_factor(WARMUP, args.steps)
    try:
        with algorithm:
            if args.joiner:
                # Joins the members' next sync: heals from one of them, then averages with them.
                algorithm.sync()
            timeline["joined"] = time.time()
            timeline["first_step"] = done[0]
            while done[0] < args.steps:
                step = done[0]
                set_lr(opt, args.lr, factor, step)
                worker = args.slot * args.shards + args.shard
                inputs, targets = data.batch(step, worker, BATCH, MODEL.context, args.seed)
                loss = byte_lm.next_byte_loss(module, inputs, targets)
                opt.zero_grad()
                loss.backward()
                opt.step()  # LocalSGD syncs every LOCAL_STEPS of this worker's steps
                steps.done(done[0])
    finally:
        manager.shutdown(wait=False)
    return module


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the workers share the machine's cores
    # gossip_ext's line per epoch change (who left or joined, how long it took), timestamped.
    logging.basicConfig(level=logging.INFO, format="%(created).3f %(message)s")
    os.environ.setdefault("RUST_LOG", "warn")
    timeline: dict = {"process_start": START, "imported": time.time()}
    data = StdlibText.load()
    windows = data.heldout_windows(MODEL.context, EVAL_WINDOWS)
    torch.manual_seed(0)  # every worker's own initialisation alike; a joiner's is replaced
    module = ByteLM(MODEL)
    if args.shards > 1:
        shard_replica(args, module)
    opt, _ = byte_lm.make_optimizer(module, args.lr, WARMUP, args.steps)
    timeline["loaded"] = time.time()
    if args.go:
        open(os.path.join(args.out, f"{args.name}.ready"), "w").close()
        while not os.path.exists(args.go):
            time.sleep(0.02)
    timeline["go"] = time.time()
    steps = Steps(os.path.join(args.out, f"{args.name}.steps"))
    train = train_torchft if args.system == "torchft" else train_gossip
    try:
        module = train(args, module, opt, data, steps, timeline)
    except gossip_ext.ReplicaLostError as error:
        # A process of this replica died: the replica left; the harness expects it.
        print(f"{args.name}: {error}", flush=True)
        os._exit(3)
    timeline["finished"] = time.time()
    result = {
        "name": args.name,
        "slot": args.slot,
        "timeline": timeline,
        "steps": steps.times,
        "heldout_bpb": byte_lm.heldout_bits_per_byte(module, windows),
    }
    path = os.path.join(args.out, f"{args.name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    sys.stdout.flush()
    sys.stderr.flush()
    # gloo's threads can abort a finalizing interpreter: leave at once, the result written.
    os._exit(0)


if __name__ == "__main__":
    main()
