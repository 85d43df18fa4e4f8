"""How often a two-process gloo job aborts as it exits, after destroy_process_group(), with
"terminate called without an active exception": with plain torch (all-reduced gradients), and the
same loop through gossip_ext. Each trial launches two fresh Python processes that train a small
model for a few steps, destroy the process group and return normally.

    python benchmarks/gloo_exit_race.py [--trials 100]

The abort is torch's: gloo's worker threads may drop the last reference to a Python-owned tensor
while the interpreter finalizes (see tests/multiprocess.py, exit_without_finalizing). This script
measures it so that the troubleshooting guide (docs/troubleshooting.md) states a measured rate.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

WORKER = r"""
import sys
import torch
import torch.distributed as dist

rank, init_file, through_gossip = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
model = torch.nn.Linear(64, 64)
if through_gossip:
    import gossip_ext

    model = gossip_ext.GossipDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(20):
    loss = model(torch.randn(8, 64)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    if not through_gossip:
        for p in model.parameters():
            dist.all_reduce(p.grad)
    opt.step()
    if through_gossip:
        model.transfer_params()
if through_gossip:
    model.sync_comms()
dist.destroy_process_group()
"""

ABORT = "terminate called without an active exception"


def trial(through_gossip: bool) -> tuple[bool, bool]:
    """One two-process job: (some process aborted at exit, some process failed otherwise)."""
    with tempfile.TemporaryDirectory() as folder:
        init = os.path.join(folder, "store")
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", WORKER, str(rank), init, "1" if through_gossip else "0"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        outcomes = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    aborted = any(code != 0 and ABORT in err for code, err in outcomes)
    other = any(code != 0 and ABORT not in err for code, err in outcomes)
    return aborted, other


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100)
    args = parser.parse_args()
    print("| loop | jobs | aborted at exit | other failures | seconds |")
    print("|---|---|---|---|---|")
    for name, through_gossip in (("plain torch + gloo", False), ("gossip_ext", True)):
        start = time.monotonic()
        results = [trial(through_gossip) for _ in range(args.trials)]
        aborted = sum(a for a, _ in results)
        other = sum(o for _, o in results)
        elapsed = time.monotonic() - start
        print(f"| {name} | {args.trials} | {aborted} | {other} | {elapsed:.0f} |", flush=True)


if __name__ == "__main__":
    main()
