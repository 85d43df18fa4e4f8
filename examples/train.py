"""Decentralized data-parallel training of a small MLP with gossip_ext, launched with torchrun.

    torchrun --standalone --nproc_per_node 4 examples/train.py --mode sgp
    torchrun --standalone --nproc_per_node 4 examples/train.py --mode overlap --message-dtype int8
    torchrun --standalone --nproc_per_node 4 examples/train.py --mode async --synch-freq 2
    torchrun --standalone --nproc_per_node 4 examples/train.py --mode diloco --sync-every 8
    torchrun --standalone --nproc_per_node 4 examples/train.py --mode streaming --fragments 3
    torchrun --standalone --nproc_per_node 4 examples/train.py --mode sparseloco
    torchrun --standalone --nproc_per_node 4 examples/train.py --mode sgp --nprocs-per-node 2
    torchrun --standalone --nproc_per_node 4 examples/train.py --mode ddp

On GPUs (--device cuda), one process per GPU over NCCL, or several processes sharing one GPU,
gossiping over gloo through pinned host buffers (GossipDataParallel's comm_device="cpu";
examples/devices.py):

    torchrun --standalone --nproc_per_node 8 examples/train.py --device cuda
    torchrun --standalone --nproc_per_node 4 examples/train.py --device cuda --comm-device cpu

Every rank trains the same MLP on its own shard of a synthetic classification data set,
generated deterministically from --seed (no download): each class is the union of two Gaussian
clusters, so the classes are not linearly separable. By default everything runs on the CPU over
gloo.

Modes:
    sgp         Stochastic Gradient Push: push-sum over a directed graph, synchronous.
    overlap     SGP whose round runs during the next forward, backward and step.
    async       SGP with bounded asynchrony (--synch-freq forwards may skip a late round).
    dpsgd       D-PSGD: push-pull averaging over a graph that pairs ranks symmetrically.
    diloco      DiLoCo: no gossip; every --sync-every steps an outer Nesterov step on the
                averaged pseudo-gradient (its messages in --message-dtype).
    streaming   Streaming DiLoCo: the same in --fragments fragments, each overlapped with one
                step of training.
    sparseloco  SparseLoCo's step: DiLoCo in sparse 2-bit messages with error feedback.
    ddp         torch DistributedDataParallel (all-reduce of gradients), the baseline.

--message-dtype compresses the gossip messages (the SGP modes) or the outer step's (the DiLoCo
modes): bfloat16 and float16 halve them, int8 and float8 (float8_e4m3fn) send about a quarter,
int4 an eighth, each with error feedback.

Rank 0 prints its own mean loss every --log-interval steps and, at the end, the training loss
and accuracy averaged over ranks, the time per step and the consensus distance
max_i ||z_i - mean z|| / ||mean z|| (exactly 0 under DDP).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import devices  # examples/devices.py: this process's device and the process group's backend
import torch
import torch.distributed as dist
from torch import nn

import gossip_ext

MODES = ("sgp", "overlap", "async", "dpsgd", "diloco", "streaming", "sparseloco", "ddp")
OUTER_MODES = ("diloco", "streaming", "sparseloco")
# The graphs that need nothing but peers_per_itr (CustomGraph needs phone books).
GRAPHS = {
    cls.__name__: cls
    for cls in (
        gossip_ext.NPeerDynamicDirectedExponentialGraph,
        gossip_ext.DynamicDirectedExponentialGraph,
        gossip_ext.DynamicBipartiteExponentialGraph,
        gossip_ext.DynamicDirectedLinearGraph,
        gossip_ext.DynamicBipartiteLinearGraph,
        gossip_ext.RingGraph,
        gossip_ext.HypercubeGraph,
    )
}
FEATURES = 16
NUM_CLASSES = 4
SAMPLES = 8192


def make_dataset(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SAMPLES points in FEATURES dimensions; class c is drawn from clusters 2c and 2c + 1."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(2 * NUM_CLASSES, FEATURES, generator=g)
    cluster = torch.randint(0, 2 * NUM_CLASSES, (SAMPLES,), generator=g)
    # Noise wide enough that clusters overlap: accuracy saturates near 90%, not at 100%.
    points = centres[cluster] + 1.5 * torch.randn(SAMPLES, FEATURES, generator=g)
    return points, cluster // 2


MESSAGE_DTYPES = {
    "float32": None,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": "int8",
    "int4": "int4",
    "float8": torch.float8_e4m3fn,
}


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, NUM_CLASSES)
    )


def make_graph(args: argparse.Namespace, gossip_world_size: int) -> gossip_ext.GraphBase:
    if args.graph is not None:
        return GRAPHS[args.graph](peers_per_itr=args.peers_per_itr or 1)
    if args.mode == "dpsgd":
        # Push-pull averaging is doubly stochastic only if every round pairs ranks symmetrically:
        # the bipartite graph does that for an even number of gossipers, the two-sided ring always.
        if gossip_world_size % 2 == 0:
            return gossip_ext.DynamicBipartiteExponentialGraph(
                peers_per_itr=args.peers_per_itr or 1
            )
        return gossip_ext.RingGraph(peers_per_itr=args.peers_per_itr or 2)
    return gossip_ext.NPeerDynamicDirectedExponentialGraph(peers_per_itr=args.peers_per_itr or 1)


def wrap(args: argparse.Namespace, module: nn.Module, world_size: int) -> nn.Module:
    if args.mode == "ddp":
        device = next(module.parameters()).device
        return nn.parallel.DistributedDataParallel(
            module, device_ids=[device.index] if device.type == "cuda" else None
        )
    dtype = MESSAGE_DTYPES[args.message_dtype]
    if args.mode in OUTER_MODES:
        gossip, outer = None, make_diloco(args, dtype)
    else:
        kind = gossip_ext.PushPull if args.mode == "dpsgd" else gossip_ext.SGP
        gossip = kind(
            graph=make_graph(args, world_size // args.nprocs_per_node),
            overlap=args.mode == "overlap",
            synch_freq=args.synch_freq if args.mode == "async" else 0,
            message_dtype=dtype,
        )
        outer = None
        if args.slowmo_freq:
            outer = gossip_ext.SlowMo(
                every=args.slowmo_freq,
                momentum=args.slowmo_momentum,
                lr=args.slowmo_lr,
                average_every=args.global_avg_freq or None,
            )
        elif args.global_avg_freq:
            outer = gossip_ext.Average(every=args.global_avg_freq)
    return gossip_ext.GossipDataParallel(
        module,
        gossip,
        outer,
        nprocs_per_node=args.nprocs_per_node,
        comm_device=args.comm_device,
        log_every=args.log_every,
    )


def make_diloco(args: argparse.Namespace, dtype) -> gossip_ext.DiLoCo:
    """DiLoCo's outer step as the papers run it: SGD with Nesterov momentum 0.9 on the averaged
    pseudo-gradient; Streaming DiLoCo in fragments, each averaged while one step trains;
    SparseLoCo's step in TopK messages (1/32 of the values, 2 bits each, error feedback)."""

    def outer_optimizer(params):
        return torch.optim.SGD(params, lr=args.outer_lr, momentum=0.9, nesterov=True)

    if args.mode == "sparseloco":
        average = gossip_ext.ByCollective(
            dtype=gossip_ext.TopK(density=1 / 32, bits=2, feedback_decay=0.95)
        )
    else:
        average = gossip_ext.ByCollective(dtype=dtype)
    streaming = args.mode == "streaming"
    return gossip_ext.DiLoCo(
        outer_optimizer,
        every=args.sync_every,
        average=average,
        fragments=args.fragments if streaming else 1,
        delay=1 if streaming else 0,
        alpha=0.5 if streaming else 0.0,
    )


def mean_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = devices.collective_tensor(values, device)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def max_over_ranks(value: float, device: torch.device) -> float:
    t = devices.collective_tensor([value], device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    points, labels = make_dataset(args.seed)
    # Strided shards: disjoint, equal-sized, and every class on every rank.
    shard_x, shard_y = points[rank::world_size].to(device), labels[rank::world_size].to(device)

    torch.manual_seed(args.seed)  # the wrappers broadcast rank 0's initial parameters anyway
    module = make_model().to(device)
    model = wrap(args, module, world_size)
    gossip = isinstance(model, gossip_ext.GossipDataParallel)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    if gossip:
        model.register_optimizer(opt)  # gossip after every opt.step() (SlowMo reads its lr)
    # Each rank draws its own batches; a per-rank generator keeps runs reproducible.
    batches = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)

    if rank == 0:
        graph = repr(model.graph) if gossip else "all-reduce"
        if args.mode in OUTER_MODES:
            graph = f"none, an outer step every {args.sync_every} steps"
        where = f"{device} over {dist.get_backend()}"
        if args.comm_device is not None:
            where += f", comm_device={args.comm_device}"
        print(
            f"mode={args.mode} world_size={world_size} nprocs_per_node={args.nprocs_per_node} "
            f"device={where} graph={graph} params={sum(p.numel() for p in module.parameters())} "
            f"shard={shard_x.shape[0]} samples/rank"
        )

    model.train()
    interval_loss, interval_steps = 0.0, 0
    dist.barrier()  # start the clock together, not after the slowest rank's set-up
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, shard_x.shape[0], (args.batch_size,), generator=batches)
        idx = idx.to(device)
        loss = nn.functional.cross_entropy(model(shard_x[idx]), shard_y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        # Rank 0's own loss only: a collective here would make every rank wait for the slowest
        # one each interval, which would hide what overlap and bounded asynchrony buy.
        interval_loss += loss.item()
        interval_steps += 1
        if rank == 0 and (step % args.log_interval == 0 or step == args.steps):
            print(f"step {step:5d}  loss {interval_loss / interval_steps:.4f}  (rank 0)")
            interval_loss, interval_steps = 0.0, 0
    if gossip:
        model.sync_comms()  # absorb the last round: every message sent is part of the model
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    step_time = max_over_ranks(time.perf_counter() - start, device) / args.steps

    model.eval()
    with torch.no_grad():
        # Through the wrapper: under --nprocs-per-node > 1 its forward gives the node's other
        # processes their leader's parameters.
        logits = model(shard_x)
    loss, accuracy = mean_over_ranks(
        [
            nn.functional.cross_entropy(logits, shard_y).item(),
            (logits.argmax(1) == shard_y).double().mean().item(),
        ],
        device,
    )
    # Exact, collective; DDP's replicas are identical by construction.
    consensus = model.consensus_distance(relative=True) if gossip else 0.0
    # A collective (every rank takes part); DDP has no gossip counter, DiLoCo no gossip.
    counted = gossip and args.mode not in OUTER_MODES
    sent = max_over_ranks(model.bytes_sent / args.steps, device) if counted else None
    if rank == 0:
        print(f"final training loss {loss:.4f}  accuracy {accuracy:.4f}  (mean over ranks)")
        print(f"time per step {1000 * step_time:.2f} ms (slowest rank)")
        print(
            f"relative consensus distance {consensus:.3e}  "
            "(sqrt(mean_i ||z_i - mean z||^2) / ||mean z||)"
        )
        if sent is not None:
            print(f"gossip bytes sent per step {sent:.0f}  (max over ranks)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train an MLP on a synthetic data set with gossip (SGP, overlap SGP, bounded "
        "asynchrony, D-PSGD), DiLoCo (whole, streamed, SparseLoCo's sparse step) or DDP "
        "all-reduce. Launch with torchrun.",
    )
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="sgp",
        help="sgp: push-sum SGP; overlap: SGP one step stale; async: SGP with "
        "bounded asynchrony; dpsgd: push-pull D-PSGD; ddp: all-reduce baseline "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--graph",
        choices=sorted(GRAPHS),
        default=None,
        help="gossip graph (default: NPeerDynamicDirectedExponentialGraph; for "
        "dpsgd DynamicBipartiteExponentialGraph when the number of gossiping "
        "processes is even, else RingGraph with 2 peers)",
    )
    parser.add_argument(
        "--peers-per-itr",
        type=int,
        default=None,
        help="out-peers per gossip round (default: 1, 2 for dpsgd's ring)",
    )
    parser.add_argument(
        "--synch-freq",
        type=int,
        default=2,
        help="--mode async: consecutive forwards that may skip an unfinished "
        "round before one waits for it (default: %(default)s)",
    )
    parser.add_argument(
        "--nprocs-per-node",
        type=int,
        default=1,
        help="processes per gossip node: they average gradients by all-reduce and "
        "one of them gossips; gossip modes only (default: %(default)s)",
    )
    devices.add_arguments(parser)
    parser.add_argument(
        "--steps", type=int, default=200, help="training steps (default: %(default)s)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="samples per rank and step (default: %(default)s)",
    )
    parser.add_argument(
        "--lr", type=float, default=0.05, help="SGD learning rate (default: %(default)s)"
    )
    parser.add_argument(
        "--momentum", type=float, default=0.9, help="SGD momentum (default: %(default)s)"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the data set, the initial model and the batches (default: %(default)s)",
    )
    parser.add_argument(
        "--message-dtype",
        choices=list(MESSAGE_DTYPES),
        default="float32",
        help="what messages travel in: the gossip's (SGP modes) or the outer step's (DiLoCo "
        "modes); 16 bits halve the bytes, int8 and float8 about a quarter, int4 an eighth "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--sync-every",
        type=int,
        default=8,
        help="DiLoCo modes: inner steps between outer steps (default: %(default)s)",
    )
    parser.add_argument(
        "--outer-lr",
        type=float,
        default=0.7,
        help="DiLoCo modes: the outer Nesterov step's learning rate (default: %(default)s)",
    )
    parser.add_argument(
        "--fragments",
        type=int,
        default=3,
        help="--mode streaming: fragments of the model, each synchronised on its own step "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--global-avg-freq",
        type=int,
        default=0,
        help="all-reduce the parameters to their exact average every N steps; 0: never "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--slowmo-freq",
        type=int,
        default=0,
        help="SlowMo every N steps; 0: off (default: %(default)s)",
    )
    parser.add_argument(
        "--slowmo-momentum", type=float, default=0.5, help="SlowMo's beta (default: %(default)s)"
    )
    parser.add_argument(
        "--slowmo-lr", type=float, default=1.0, help="SlowMo's alpha (default: %(default)s)"
    )
    parser.add_argument(
        "--log-every",
        type=int,
        default=0,
        help="log a running consensus estimate every N steps (logger gossip_ext.gossip.consensus); "
        "0: never (default: %(default)s)",
    )
    parser.add_argument(
        "--log-interval",
        type=int,
        default=50,
        help="steps between loss prints (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "log_interval", "nprocs_per_node"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.peers_per_itr is not None and args.peers_per_itr < 1:
        parser.error(f"--peers-per-itr must be >= 1, got {args.peers_per_itr}")
    for name in ("sync_every", "fragments"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.mode == "sparseloco" and args.message_dtype != "float32":
        parser.error("--mode sparseloco sends its own sparse messages; leave --message-dtype out")
    if args.mode in OUTER_MODES and (args.global_avg_freq or args.slowmo_freq):
        parser.error(f"--mode {args.mode} is DiLoCo's outer step; --global-avg-freq and "
                     "--slowmo-freq are for the SGP modes")  # fmt: skip
    if args.mode in OUTER_MODES and args.nprocs_per_node != 1:
        parser.error(f"--mode {args.mode}: --nprocs-per-node is for the SGP modes")
    if args.mode == "async" and args.synch_freq < 1:
        parser.error(f"--synch-freq must be >= 1 with --mode async, got {args.synch_freq}")
    if args.mode == "ddp" and (args.graph, args.peers_per_itr) != (None, None):
        parser.error("--graph and --peers-per-itr are for the gossip modes, not --mode ddp")
    gossip_only = ("message_dtype", "float32"), ("global_avg_freq", 0), ("slowmo_freq", 0)
    gossip_only += (("log_every", 0), ("comm_device", None))
    for name, default in gossip_only:
        if args.mode == "ddp" and getattr(args, name) != default:
            parser.error(f"--{name.replace('_', '-')} is for the gossip modes, not --mode ddp")
    if args.mode == "ddp" and args.nprocs_per_node != 1:
        parser.error("--nprocs-per-node is for the gossip modes; ddp all-reduces over every rank")
    devices.check_arguments(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if int(os.environ.get("RANK", "0")) != 0 and ("-h" in argv or "--help" in argv):
        return  # torchrun starts every rank with the same arguments: one help text is enough
    args = parse_args(argv)
    if args.log_every:
        # The running consensus estimate is logged at INFO (logger gossip_ext.gossip.consensus).
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    # Several ranks share few cores: one intra-op thread each avoids oversubscription, which
    # costs far more than it gains on a model this small.
    torch.set_num_threads(1)
    device = devices.init_process_group(args)  # the rank, size and store: torchrun's environment
    try:
        train(args, device)
        # gloo's worker threads drop their references to the last collectives' tensors just after
        # those return; a thread that drops a Python tensor's last one while the interpreter
        # finalizes aborts the process (a torch race, tests/multiprocess.py). A barrier holds no
        # Python tensor, and by its end every earlier collective has long returned.
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
