"""Which setup makes a gossip round through NCCL fail: one small training run per setup, each in
a process of its own, so that a crash (a segmentation fault) names its setup and the others
still run.

    python tools/nccl_probe.py            # on a machine with a CUDA GPU and a CUDA build

The setups differ only in what exists beside gossip_ext's own NCCL communicator, in one process
on one GPU (a world of one, whose rounds go to itself):
- alone:     the default group is gloo; nothing of torch's NCCL exists;
- lazy:      the default group is NCCL, created lazily (its communicator at its first collective);
- eager:     the default group is NCCL with ``device_id`` (its communicator created at once), as
             examples/devices.py and torchrun scripts do;
- forked:    as alone, in a process forked from one that imported torch and gossip_ext first
             (the test suite's forkserver).
Prints one line per setup (passed, or how it ended) and exits non-zero if any failed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import tempfile

SETUPS = ("alone", "lazy", "eager", "forked")
STEPS = 8


def train(setup: str) -> None:
    """A few SGP steps of a small CUDA model: every round through gossip_ext's NCCL transport."""
    import torch
    import torch.distributed as dist

    import gossip_ext

    torch.cuda.set_device(0)
    store = os.path.join(tempfile.mkdtemp(), "store")
    device = torch.device("cuda", 0)
    backend = "gloo" if setup in ("alone", "forked") else "nccl"
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",
        rank=0,
        world_size=1,
        device_id=device if setup == "eager" else None,
    )
    net = torch.nn.Linear(64, 64).to(device)
    model = gossip_ext.GossipDataParallel(net, gossip_ext.SGP())  # CUDA parameters: NCCL
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.register_optimizer(opt)
    for _ in range(STEPS):
        loss = model(torch.randn(8, 64, device=device)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.sync_comms()
    assert model.gossip_round == STEPS, model.gossip_round
    dist.destroy_process_group()


def _forked() -> int:
    """``train("forked")`` in a child forked after torch and gossip_ext were imported (CUDA not
    yet initialised, as in the forkserver)."""
    import torch  # noqa: F401

    import gossip_ext  # noqa: F401

    child = mp.get_context("fork").Process(target=train, args=("forked",))
    child.start()
    child.join(120)
    if child.exitcode is None:
        child.kill()
        return 124
    if child.exitcode < 0:
        print(f"nccl_probe: the forked child ended by signal {-child.exitcode}", flush=True)
        return 1
    return child.exitcode


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--setup":
        if sys.argv[2] == "forked":
            return _forked()
        train(sys.argv[2])
        return 0
    import torch

    if not torch.cuda.is_available():
        print("nccl_probe: needs a CUDA GPU; nothing run")
        return 0
    failed = False
    for setup in SETUPS:
        env = dict(os.environ, PYTHONFAULTHANDLER="1")
        try:
            done = subprocess.run(
                [sys.executable, __file__, "--setup", setup], env=env, timeout=120, check=False
            )
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = 124
        how = {0: "passed", 124: "TIMED OUT"}.get(code, f"FAILED (exit {code})")
        if code < 0:
            how = f"FAILED (signal {-code})"
        print(f"nccl_probe: {setup:7s} {how}", flush=True)
        failed |= code != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
