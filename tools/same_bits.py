"""Whether two checkouts of gossip_ext train bit for bit alike: for refactors that must not change
a single floating-point operation (the SlowMo and LocalSGD presets of the outer step, say).

    python tools/same_bits.py /path/to/old/checkout /path/to/new/checkout

Each checkout needs its compiled extension (gossip_ext/_C*.so; copy the current one where csrc/ is
unchanged). Every mode of MODES, and fairscale's SlowMo through the compat layer, trains a small
model on 3 gloo ranks under each checkout (PYTHONPATH), one intra-op thread; the final parameters
of every rank are compared with torch.equal. Exit status 0: all equal.
"""

import os
import pickle
import subprocess
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD_SIZE = 3
MODES = {
    "slowmo_sgp": {"slowmo_freq": 3, "slowmo_momentum": 0.5},
    "slowmo_localsgd": {
        "base_algorithm": "localsgd",
        "slowmo_freq": 3,
        "slowmo_momentum": 0.7,
        "slowmo_lr": 0.8,
    },
    "slowmo_sharded": {"slowmo_freq": 2, "slowmo_memory_efficient": True, "slowmo_num_shards": 2},
    "localsgd": {"base_algorithm": "localsgd", "global_avg_freq": 3},
    "sgp_avg": {"global_avg_freq": 4},
    "sgp_overlap_avg": {"overlap": True, "global_avg_freq": 4},
    "slowmo_avg": {"global_avg_freq": 2, "slowmo_freq": 3, "slowmo_momentum": 0.6},
}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def _batches(rank: int):
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)) for _ in range(10)]


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=60),
    )
    import gossip_ext
    from gossip_ext.compat.fairscale import SlowMoDistributedDataParallel

    results = {}
    for name, options in MODES.items():
        net = _net()
        model = gossip_ext.GossipDataParallel(net, **options)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model.register_optimizer(opt)
        for x, y in _batches(rank):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        model.sync_comms()
        results[name] = [p.detach().clone() for p in net.parameters()]
    net = _net()
    model = SlowMoDistributedDataParallel(
        net, nprocs_per_node=1, slowmo_frequency=3, localsgd_frequency=2
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in _batches(rank):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        model.perform_slowmo(opt)
    results["fairscale_slowmo"] = [p.detach().clone() for p in net.parameters()]
    with open(f"{out}.rank{rank}", "wb") as f:
        pickle.dump({"package": gossip_ext.__file__, "results": results}, f)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip finalization: gloo's threads may abort it (tests/multiprocess.py)


def _train(out: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), out), nprocs=WORLD_SIZE)


def main(old: str, new: str) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for label, checkout in (("old", old), ("new", new)):
            out = os.path.join(tmp, label)
            env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout))
            subprocess.run([sys.executable, __file__, "--train", out], env=env, check=True)
            runs.append([pickle.load(open(f"{out}.rank{r}", "rb")) for r in range(WORLD_SIZE)])
        same = True
        for rank, (a, b) in enumerate(zip(*runs)):
            print(f"rank {rank}: {a['package']} against {b['package']}")
            for name, params in a["results"].items():
                equal = all(torch.equal(p, q) for p, q in zip(params, b["results"][name]))
                same &= equal
                print(f"  {name}: {'bit for bit' if equal else 'DIFFERENT'}")
    print("all bit for bit" if same else "some differ")
    return 0 if same else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--train":
        _train(sys.argv[2])
    elif len(sys.argv) == 3:
        sys.exit(main(sys.argv[1], sys.argv[2]))
    else:
        sys.exit(__doc__)
