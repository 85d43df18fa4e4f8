"""torchft 0.2.0's DiLoCo between sharded replicas: torchft's own HSDP with DiLoCo.

Each replica is one torchft replica group of S processes (FSDP2 over the replica's shard mesh,
as every system of harness.compare.sharded): process ``s`` of a replica is the group's rank
``s``, and its Manager's process group joins it with process ``s`` of every other replica, so
each averages its own shard's pseudo-gradients (torchft's DiLoCo works on the local shards of
DTensor parameters). The group's store lives with its rank 0, at the replica's own address
(GOSSIP_EXT_HOST on the emulated network), since the quorum hands it to the other replicas.
"""

from __future__ import annotations

import contextlib
import os

import torch.distributed as dist
from torch import nn

from harness.compare import systems


class TorchftHsdpDiloco(systems._OptimizerStep):
    """This process's side: its replica group's Manager and torchft's DiLoCo on its shards."""

    def __init__(self, module: nn.Module, recipe: systems.Recipe, mesh, lighthouse: str) -> None:
        super().__init__(module, recipe, module)
        from torch.distributed import TCPStore
        from torchft.local_sgd import DiLoCo

        if lighthouse is None:
            raise ValueError("torchft_hsdp_diloco needs the address of a torchft lighthouse")
        os.environ.setdefault("RUST_LOG", "warn")
        replicas, shards = mesh.shape
        replica, shard = divmod(dist.get_rank(), shards)
        host = os.environ.get("GOSSIP_EXT_HOST", "127.0.0.1")
        self._store = (
            TCPStore(host, 0, is_master=True, wait_for_workers=False) if shard == 0 else None
        )
        port = [self._store.port if self._store is not None else None]
        group = mesh["shard"].get_group()
        dist.broadcast_object_list(port, src=dist.get_global_rank(group, 0), group=group)
        self.manager = systems.torchft_manager(
            self,
            recipe,
            replicas=replicas,
            replica=replica,
            store_port=port[0],
            rank=shard,
            world_size=shards,
            lighthouse=lighthouse,
            host=host,
        )
        self.outer = recipe.outer_optimizer(module.parameters())
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(
            DiLoCo(self.manager, [module], self.opt, self.outer, sync_every=recipe.local_steps)
        )

    def close(self) -> None:
        self._stack.close()
        self.manager.shutdown(wait=False)
