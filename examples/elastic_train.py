"""An elastic job: workers started each on its own train one model together, and go on when one of
them dies, stalls or leaves; a worker started later joins from a live member's state.

    python -m gossip_ext.membership --port 29400 &        # the job's service: start it first
    python examples/elastic_train.py --membership 127.0.0.1:29400 &   # then each worker, 3 here
    python examples/elastic_train.py --membership 127.0.0.1:29400 &
    python examples/elastic_train.py --membership 127.0.0.1:29400

Kill one worker (``kill -9 PID``): the others log the epoch change and train on. Start another:
it joins at the next epoch with the model, optimizer state and step count of a live member, and
finishes the job's steps with the others. Each worker is its own process, with no torchrun and no
init_process_group; across machines, the membership address is the service's host.

The MLP and the synthetic data set of examples/train.py (no download). Each worker draws its own
batches (seeded by its worker id: the members change, so there are no fixed shards) and, at the
end, prints its own model's loss and accuracy on a held-out part of the data.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from datetime import timedelta

import torch
from torch import nn

import gossip_ext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import make_dataset, make_model  # noqa: E402 - the same model and data

HELD_OUT = 1024  # the data set's last points: never trained on


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--membership", required=True, help="HOST:PORT of python -m gossip_ext.membership"
    )
    parser.add_argument(
        "--min-workers", type=int, default=2, help="the job stops below this many (default: 2)"
    )
    parser.add_argument("--steps", type=int, default=2000, help="the job's optimizer steps")
    parser.add_argument(
        "--step-seconds",
        type=float,
        default=0.01,
        help="a pause per step, so that a person can kill or start a worker mid-run (default: "
        "0.01; 0 trains at full speed)",
    )
    parser.add_argument(
        "--timeout", type=float, default=30.0, help="seconds a stalled peer is waited for"
    )
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="the data set's")
    parser.add_argument("--log-interval", type=int, default=500)
    args = parser.parse_args(argv)
    for name in ("min_workers", "steps", "batch_size", "log_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.step_seconds < 0:
        parser.error(f"--step-seconds must be >= 0, got {args.step_seconds}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # gossip_ext logs each epoch change (who left or joined, the members, how long it took).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    points, labels = make_dataset(args.seed)
    train_x, train_y = points[:-HELD_OUT], labels[:-HELD_OUT]
    held_x, held_y = points[-HELD_OUT:], labels[-HELD_OUT:]

    # Returns once this worker is a member; a joiner holds its donor's model by then.
    model = gossip_ext.GossipDataParallel(
        make_model(),
        membership=args.membership,
        min_workers=args.min_workers,
        timeout=timedelta(seconds=args.timeout),
    )
    me = model.worker_id
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model.register_optimizer(opt)  # its state is what a joiner receives
    batches = torch.Generator().manual_seed(1000 * args.seed + me + 1)
    print(f"worker {me}: epoch {model.epoch}, from step {model.step_count}", flush=True)

    model.train()
    while model.step_count < args.steps:  # a joiner goes on from its donor's count
        idx = torch.randint(0, train_x.shape[0], (args.batch_size,), generator=batches)
        loss = nn.functional.cross_entropy(model(train_x[idx]), train_y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if model.step_count % args.log_interval == 0:
            print(f"worker {me}: step {model.step_count} loss {loss.item():.4f}", flush=True)
        if args.step_seconds:
            time.sleep(args.step_seconds)

    model.eval()  # absorbs the gossip in flight: the module is this worker's model
    with torch.no_grad():
        logits = model(held_x)
    held_loss = nn.functional.cross_entropy(logits, held_y).item()
    accuracy = (logits.argmax(1) == held_y).double().mean().item()
    print(
        f"worker {me}: finished step {model.step_count} in epoch {model.epoch}; held-out loss "
        f"{held_loss:.4f} accuracy {accuracy:.4f}",
        flush=True,
    )
    # Nothing to call at the end: a worker whose script returns leaves as model.leave() would
    # (its last round delivered; the others drop it at their next step, without a timeout).


if __name__ == "__main__":
    main()
