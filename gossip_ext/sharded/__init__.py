"""Sharded replicas: a module sharded by FSDP2 inside each replica (``replicas``: the layout
checks, the local shards, the engine over FSDP2's storage) and their checkpoints cut anew under
another mesh (``checkpoint``)."""
