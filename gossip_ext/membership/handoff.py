"""The handoff: how a live member gives a joiner the job's state, over the epoch's proven group
(``groups.prove_pairs``): one serialized message of tensors and plain values, its size announced
first and bounded by what the job's model can take before anything is allocated, and loaded with
``torch.load(weights_only=True)``, so that a payload never runs code."""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist

from gossip_ext._plain_messages import tensor_bytes


def send_state(state: dict[str, Any], joiners: list[int], group: dist.ProcessGroup) -> None:
    """The donor's side of the handoff: ``state`` (tensors and plain values) to each joiner's
    rank, as one serialized message."""
    payload = io.BytesIO()
    torch.save(state, payload)
    data = torch.frombuffer(bytearray(payload.getbuffer()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    for rank in joiners:
        dist.send(size, rank, group)
        dist.send(data, rank, group)


def receive_state(
    donor: int, group: dist.ProcessGroup, device: torch.device, limit: int
) -> dict[str, Any]:
    """A joiner's side of the handoff: the donor's state, its CUDA tensors on ``device`` (the
    donor's GPU index means nothing here) and its host tensors on the host. ``limit``: the most
    bytes a state of this job can take (:func:`handoff_limit`); a larger size is refused before
    anything is allocated for it."""
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, donor, group)
    if not 0 < int(size.item()) <= limit:
        raise ValueError(
            f"gossip_ext: the donor (rank {donor}) announced a state of {int(size.item())} bytes, "
            f"outside (0, {limit}] (what this job's model, its optimizer and outer state can "
            "take): refused before anything was allocated"
        )
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, donor, group)
    return load_handoff(tensor_bytes(data), device)


def handoff_limit(module: torch.nn.Module) -> int:
    """The most bytes a handoff of ``module``'s job may take: eight copies of its parameters and
    buffers (the model, an optimizer's moments, an outer step's copy and momentum, with room) and
    64 MiB of plain values."""
    tensors = [*module.parameters(), *module.buffers()]
    return 8 * sum(t.numel() * t.element_size() for t in tensors) + (64 << 20)


def load_handoff(data: bytes, device: torch.device) -> dict[str, Any]:
    """The state a donor sent as ``data``: tensors and plain values only (``weights_only``), so
    that a payload never runs code here; CUDA tensors on ``device``."""

    def place(storage, location: str):
        if location.startswith("cuda") and device.type == "cuda":
            return storage.cuda(device.index)
        return storage

    return torch.load(io.BytesIO(data), map_location=place, weights_only=True)
