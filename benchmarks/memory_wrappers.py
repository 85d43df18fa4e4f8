"""The models benchmarks/memory.py trains, and the wrappers of each configuration around them.

make_model builds the bare stack of Linear layers; wrap puts a configuration's data-parallel
wrapper around it (gossip_ext's, DDP, fairscale's SlowMo through gossip_ext.compat); the two
peers that are not library wrappers are written out here: a plain-PyTorch push-sum as SGP does
it (PlainPushSum) and torchft's DiLoCo on one worker (TorchftDiLoCo).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from memory_configs import WIDTH, nesterov
from torch import nn

import gossip_ext
from gossip_ext.compat.fairscale import SlowMoDistributedDataParallel


def make_model(num_params: int, device: torch.device) -> nn.Module:
    layers = max(1, round(num_params / (WIDTH * WIDTH + WIDTH)))
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers))).to(device)


class PlainPushSum:
    """Synchronous push-sum in plain PyTorch, as SGP's gossiper does it: a round flattens the
    parameters into a new message scaled by the mixing share, posts it to the out-peers and
    receives into new buffers (after the optimizer step); the next forward waits, sums, and
    copies the result back into the parameters. Uniform mixing on a regular graph, so the
    push-sum weight stays 1 and is not sent."""

    def __init__(self, module: nn.Module, rank: int, world_size: int):
        self.module = module
        self.params = list(module.parameters())
        self.graph = gossip_ext.NPeerDynamicDirectedExponentialGraph()
        self.rank, self.world_size, self.round = rank, world_size, 0
        self.pending = None
        with torch.no_grad():
            for p in self.params:
                dist.broadcast(p, 0)

    def __call__(self, x):
        self.finish_round()
        return self.module(x)

    def transfer_params(self) -> None:
        self.finish_round()
        out_peers = self.graph.out_peers(self.rank, self.world_size, self.round)
        in_peers = self.graph.in_peers(self.rank, self.world_size, self.round)
        with torch.no_grad():
            message = torch.cat([p.reshape(-1) for p in self.params]).mul_(
                1.0 / (len(out_peers) + 1)
            )
            received = [torch.empty_like(message) for _ in in_peers]
            works = [dist.irecv(buf, src) for buf, src in zip(received, in_peers)]
            works += [dist.isend(message, dst) for dst in out_peers]
        self.pending = (message, received, works)

    def wait_for_messages(self) -> None:
        if self.pending is not None:
            for work in self.pending[2]:
                work.wait()

    def finish_round(self) -> None:
        if self.pending is None:
            return
        self.wait_for_messages()
        message, received, _ = self.pending
        with torch.no_grad():
            for buf in received:
                message.add_(buf)
            offset = 0
            for p in self.params:
                p.copy_(message[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        self.pending = None
        self.round += 1


class TorchftDiLoCo:
    """torchft's DiLoCo on this worker: one replica group of one process, coordinated by the
    lighthouse the parent started; outer steps run from the inner optimizer's step hook."""

    def __init__(self, module: nn.Module, opt, lighthouse: str, rank: int, world_size: int, **kw):
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo
        from torchft.local_sgd import DiLoCo

        self.module = module
        timeout = timedelta(minutes=5)
        self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=lambda sd: module.load_state_dict(sd["model"]),
            state_dict=lambda: {"model": module.state_dict()},
            min_replica_size=world_size,
            use_async_quorum=False,
            replica_id=f"replica_{rank}",
            store_addr="127.0.0.1",
            store_port=self._store.port,
            rank=0,
            world_size=1,
            lighthouse_addr=lighthouse,
            hostname="127.0.0.1",
            init_sync=False,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
        )
        self.diloco = DiLoCo(self.manager, [module], opt, nesterov(module.parameters()), **kw)
        self.diloco.__enter__()

    def __call__(self, x):
        return self.module(x)

    def close(self) -> None:
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)


def wrap(kind: str, options: dict, module: nn.Module, rank: int, world_size: int):
    if kind == "bare":
        return module
    if kind == "gossip":
        if options.get("push_sum") is False:
            options = {**options, "graph": gossip_ext.DynamicBipartiteExponentialGraph()}
        return gossip_ext.GossipDataParallel(module, **options)
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(module, **options)
    if kind == "fairscale":
        return SlowMoDistributedDataParallel(module, **options)
    if kind == "hook":
        return gossip_ext.GossipDataParallel(module, **options)
    if next(module.parameters()).device.type != "cpu":
        raise ValueError(
            "the plain push-sum sends with gloo point-to-point, which takes CPU tensors"
        )
    return PlainPushSum(module, rank, world_size)
