"""One worker of an elastic job, launched on its own (``python tests/membership_worker.py ...``) by
tests/test_elastic.py, as a user launches each worker: no init_process_group, no torchrun.

It trains a small regression model on its own batches for ``--steps`` optimizer steps (a worker
that joins a running job goes on from the step count it receives), can SIGKILL or SIGSTOP itself
after a given step, and writes what the test checks to ``<out>/<name>.pkl``: per step the epoch,
the members, the bytes sent and whether the model read between steps is finite; the parameters
at its first training forward and at the end; the error it stopped with, if any.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
from torch import nn

import gossip_ext
from gossip_ext.flat_keywords import from_flat

MODES = {
    "sync": {},
    "overlap": {"overlap": True},
    "bounded": {"synch_freq": 2},
    "compressed": {"message_dtype": "int8"},
    "slowmo": {"slowmo_freq": 4, "slowmo_momentum": 0.5},
    "diloco": {
        "base_algorithm": "localsgd",
        "sync_every": 4,
        "outer_optimizer": lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.5, nesterov=True),
    },
    "diloco_int8": {
        "base_algorithm": "localsgd",
        "sync_every": 4,
        "outer_optimizer": lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.5, nesterov=True),
        "outer_dtype": "int8",
    },
    # Streaming DiLoCo, one fragment in flight after every other step (prepared at steps 1 and 3
    # of a period of 4, applied at 2 and 4): an epoch change often finds one in flight.
    "streaming_int8": {
        "base_algorithm": "localsgd",
        "sync_every": 4,
        "fragments": 2,
        "fragment_delay": 1,
        "outer_optimizer": lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.5, nesterov=True),
        "outer_dtype": "int8",
    },
}
# Not of MODES, which the tests run each: a worker configured unlike the "diloco" job in what its
# fingerprint does not hold (the outer optimizer's learning rate), for tests/test_trust.py.
VARIANTS = {
    "diloco_other_lr": {
        **MODES["diloco"],
        "outer_optimizer": lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.5, nesterov=True),
    },
}


def batch(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_000 * seed + step)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def train_step(model, opt, x, y, progress: dict) -> None:
    """One step as a user's loop takes it; if it raises, ``progress["stage"]`` says where:
    "forward", "backward" or "step" (the optimizer step, with the wrapper's round after it)."""
    progress["stage"] = "forward"
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    progress["stage"] = "backward"
    loss.backward()
    progress["stage"] = "step"
    opt.step()


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()]).cpu()


def momentum(opt: torch.optim.Optimizer) -> list[torch.Tensor | None]:
    return [
        None
        if "momentum_buffer" not in opt.state[p]
        else opt.state[p]["momentum_buffer"].to("cpu", copy=True)
        for p in opt.param_groups[0]["params"]
    ]


def die_during_handoff(flag: str) -> None:
    """The first worker of the job to be a donor (the one that creates ``flag``) dies during its
    handoff, after the first part (the size) is sent."""
    from gossip_ext.membership import handoff

    send = handoff.send_state

    def send_then_die(state, joiners, group):
        try:
            os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return send(state, joiners, group)
        size = torch.tensor([1 << 20], dtype=torch.int64)
        for rank in joiners:
            torch.distributed.send(size, rank, group)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)

    handoff.send_state = send_then_die


def configuration(args: argparse.Namespace) -> dict:
    """The wrapper's keywords for ``args.mode`` as objects: the mode's flat keywords' gossip and
    outer step, and an Elastic membership with the job's timings (which no flat keyword sets)."""
    gossip, outer, _ = from_flat({**MODES, **VARIANTS}[args.mode])
    timings = {"heartbeat_s": args.heartbeat_s, "silent_s": args.silent_s}
    membership = gossip_ext.Elastic(
        args.membership,
        min_workers=args.min_workers,
        **{name: value for name, value in timings.items() if value is not None},
        **({"messages": args.messages} if args.messages else {}),
    )
    return {"gossip": gossip, "outer": outer, "membership": membership}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--membership", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--mode", default="sync", choices=sorted({**MODES, **VARIANTS}))
    parser.add_argument("--min-workers", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--heartbeat-s", type=float, default=None, help="Elastic(heartbeat_s=)")
    parser.add_argument("--silent-s", type=float, default=None, help="Elastic(silent_s=)")
    parser.add_argument("--kill-at", type=int, default=-1, help="SIGKILL itself after this step")
    parser.add_argument("--stop-at", type=int, default=-1, help="SIGSTOP itself after this step")
    parser.add_argument("--leave-at", type=int, default=-1, help="leave() after this step")
    parser.add_argument(
        "--peers-at", default="", help="STEP:N: set_peers_per_itr(N) after this step"
    )
    parser.add_argument("--messages", default="", help="Elastic(messages=): sealed, ...")
    parser.add_argument("--init-seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the model lives: cpu, cuda:N")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step")
    parser.add_argument(
        "--hold-for-joiner",
        type=float,
        default=0.0,
        help="sleep per step instead, from the first epoch smaller than the first one until one "
        "as large again (a replacement joined): the replacement is in before this one finishes",
    )
    parser.add_argument("--rejoin", action="store_true", help="rejoin as new once removed")
    parser.add_argument("--die-as-donor", action="store_true", help="SIGKILL during a handoff")
    args = parser.parse_args()
    if args.die_as_donor:
        die_during_handoff(os.path.join(args.out, "died_as_donor"))
    logging.basicConfig(level=logging.INFO, format=f"{args.name} %(message)s")
    torch.set_num_threads(1)
    torch.manual_seed(args.init_seed)
    result: dict = {"steps": [], "error": None, "removed": None}

    def build():
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(args.device)
        model = gossip_ext.GossipDataParallel(
            net, timeout=timedelta(seconds=args.timeout), **configuration(args)
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model.register_optimizer(opt)
        return model, opt

    def record(path: str) -> None:
        with open(path + ".tmp", "wb") as f:
            pickle.dump(result, f)
        os.replace(path + ".tmp", path)

    out = os.path.join(args.out, f"{args.name}.pkl")
    started = time.monotonic()
    model, opt = build()
    result["joined_after_s"] = time.monotonic() - started
    result["worker_id"] = model.worker_id
    result["first_step"] = model.step_count
    result["first_params"] = [p.detach().to("cpu", copy=True) for p in model.module.parameters()]
    result["first_momentum"] = momentum(opt)
    step = model.step_count
    epoch = model.epoch
    first_world, holding = model.gossip_world_size, False
    try:
        while step < args.steps:
            x, y = (t.to(args.device) for t in batch(step, model.worker_id))
            before, progress = flat(model.module), {}
            try:
                train_step(model, opt, x, y, progress)
            except gossip_ext.RemovedError as error:
                result["removed"] = str(error)
                # What a user reads after catching it: raised by the forward, the model it read
                # (the last step's, with any round absorbed); raised after the optimizer step,
                # that step's model. Either way state_dict() agrees, and later calls change
                # nothing and raise the same.
                reads = flat(model.module)
                state = model.module.state_dict()
                result["removed_reads"] = {
                    "raised_in": progress["stage"],
                    "equals_before_forward": torch.equal(reads, before),
                    "finite": bool(reads.isfinite().all()),
                    "state_dict_agrees": torch.equal(
                        torch.cat([state[k].flatten() for k in state]).cpu(), reads
                    ),
                }
                try:
                    model(x)
                    result["removed_again"] = None
                except gossip_ext.RemovedError as again:
                    result["removed_again"] = str(again)
                result["removed_reads"]["unchanged_after"] = torch.equal(flat(model.module), reads)
                if not args.rejoin:
                    raise
                args.rejoin = False
                model, opt = build()
                result["rejoined_as"] = model.worker_id
                result["rejoined_at_step"] = model.step_count
                step = model.step_count
                continue
            step = model.step_count
            params = [p.detach().to("cpu", copy=True) for p in model.module.parameters()]
            if model.epoch != epoch:
                # What a donor handed on at this boundary: its model and optimizer state.
                epoch = model.epoch
                result.setdefault("changes", []).append(
                    {"step": step, "epoch": epoch, "params": params, "momentum": momentum(opt)}
                )
            result["steps"].append(
                {
                    "step": step,
                    "epoch": model.epoch,
                    "world_size": model.gossip_world_size,
                    "peers_per_itr": model.peers_per_itr,
                    "bytes_sent": model.bytes_sent,
                    "finite": all(bool(p.isfinite().all()) for p in params),
                    "params": torch.cat([p.flatten() for p in params]),
                    "momentum": momentum(opt),
                    "time": time.time(),
                }
            )
            record(out)  # after every step: the test watches the progress
            if step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.stop_at:
                os.kill(os.getpid(), signal.SIGSTOP)
            if args.peers_at and step == int(args.peers_at.split(":")[0]):
                model.set_peers_per_itr(int(args.peers_at.split(":")[1]))
            if step == args.leave_at:
                model.leave()
                break
            if args.hold_for_joiner and model.gossip_world_size < first_world:
                holding = True
            elif holding and model.gossip_world_size >= first_world:
                holding = args.hold_for_joiner = False
            if holding:
                time.sleep(args.hold_for_joiner)
            elif args.step_seconds:
                time.sleep(args.step_seconds)
    except Exception as error:  # noqa: BLE001 - the test judges it
        result["error"] = f"{type(error).__name__}: {error}"
        traceback.print_exc()
    model.sync_comms() if result["error"] is None and step >= args.steps else None
    result["final_params"] = [p.detach().to("cpu", copy=True) for p in model.module.parameters()]
    result["final_step"] = step
    record(out)
    print(json.dumps({"name": args.name, "error": result["error"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
