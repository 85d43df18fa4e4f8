"""Messages between processes as plain data: JSON text, never a pickle.

Unpickling runs whatever code the bytes name, so nothing another process sends is unpickled
(docs/elastic.md, "Security"): configurations, control messages and small tables travel as JSON
text (UTF-8) in a uint8 tensor, and the receiver checks what arrived against the shape it expects
(:func:`check`) before using it. A malformed message raises :class:`MalformedMessage` (a
ValueError) naming what it was and what was wrong in it, never a confusing error from the code
that would have used it.

Shapes, written as the JSON they accept: ``int``, ``float`` (an int too), ``str``, ``bool``,
``None`` (null), ``dict`` / ``list`` (any object / array), ``ANY``; a ``str`` instance is that
literal string; ``[shape]`` an array of any length of ``shape``; ``(a, b)`` an array of exactly
those; ``{"key": shape}`` an object of exactly those keys; ``OneOf(a, b)`` either.

    steps = all_gather({"steps": 3}, group, "the step counts", {"steps": int})
"""

from __future__ import annotations

import ctypes
import json
import math
import numbers
import re
from collections.abc import Mapping
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

# Far above any message of the package (a configuration lists every parameter in about 100
# bytes); a size beyond it is a broken or hostile sender, refused before anything is allocated.
MAX_BYTES = 64 << 20


class MalformedMessage(ValueError):
    """A message that is not what its receiver expects: not UTF-8 JSON, too large, or of another
    shape. ``rank``: the sender's rank in the group, where a collective told it."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class _Any:
    def __repr__(self) -> str:
        return "any value"


ANY = _Any()


class OneOf:
    """A shape that accepts what any of ``shapes`` accepts."""

    def __init__(self, *shapes: Any):
        self.shapes = shapes

    def __repr__(self) -> str:
        return " or ".join(_describe(s) for s in self.shapes)


# ----------------------------------------------------------------------------- encoding


def plain(value: Any) -> Any:
    """``value`` as JSON keeps it, which is what the receiver decodes: tuples become lists, keys
    strings, and what JSON has no type for (a dtype, an enum, a non-finite float) its ``str``, so
    that every process turns the same value into the same text."""
    if isinstance(value, Mapping):
        return {k if isinstance(k, str) else str(plain(k)): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (set, frozenset)):  # iterated in an order each process hashes anew
        return sorted((plain(v) for v in value), key=json.dumps)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, Enum):
        return str(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else str(number)  # strict JSON has no NaN
    # An object's default repr holds its address, which differs between processes.
    return re.sub(r" at 0x[0-9a-fA-F]+", "", str(value))


def encode(value: Any) -> bytes:
    """``value`` (:func:`plain`) as UTF-8 JSON text."""
    return json.dumps(plain(value), allow_nan=False, separators=(",", ":")).encode("utf-8")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def decode(data: bytes | str, what: str, shape: Any = ANY) -> Any:
    """The value of ``data`` (:func:`encode`'s bytes, or their text), checked against ``shape``;
    MalformedMessage naming ``what`` if it is not."""
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
        value = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as error:
        raise MalformedMessage(
            f"{what} is not UTF-8 JSON ({type(error).__name__}: {error}): {_show(data)}"
        ) from None
    return check(value, shape, what)


def check(value: Any, shape: Any, what: str) -> Any:
    """``value`` itself if it has ``shape`` (see the module); MalformedMessage naming ``what``,
    where in it, what was expected and what was there, if not."""
    wrong = _mismatch(value, shape, "")
    if wrong is not None:
        where, expected, got = wrong
        place = f" at {where}" if where else ""
        raise MalformedMessage(f"{what}{place} should be {expected}, got {_show(got)}")
    return value


# ----------------------------------------------------------------------------- collectives


def tensor_bytes(data: torch.Tensor) -> bytes:
    """The bytes of a uint8 tensor, without numpy (torch does not require it, so neither does
    this package)."""
    host = data.detach().to("cpu").contiguous()
    if host.dtype != torch.uint8:
        raise TypeError(f"tensor_bytes takes a uint8 tensor, got {host.dtype}")
    return ctypes.string_at(host.data_ptr(), host.numel()) if host.numel() else b""


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a collective of ``group`` takes its tensors: the host, but for a group of NCCL
    alone, the current GPU (as torch.distributed's own object collectives choose)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_bytes(
    data: bytes, group: dist.ProcessGroup | None, device: torch.device | None = None
) -> list[bytes]:
    """Every rank's ``data``, by rank in ``group``: the sizes first (one all-gather of an int64),
    then the bytes padded to the largest. Collective; every rank raises MalformedMessage alike
    for a size out of bounds, before the second all-gather."""
    device = collective_device(group) if device is None else device
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    counts = [int(s.item()) for s in sizes]
    for rank, count in enumerate(counts):
        _check_size(count, f"rank {rank}'s message", rank)
    padded = torch.zeros(max(counts), dtype=torch.uint8, device=device)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    every = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(every, padded, group=group)
    return [tensor_bytes(t[:count]) for t, count in zip(every, counts)]


def all_gather(
    value: Any,
    group: dist.ProcessGroup | None,
    what: str,
    shape: Any = ANY,
    device: torch.device | None = None,
) -> list[Any]:
    """Every rank's ``value``, by rank in ``group``, as JSON keeps it (:func:`plain`), each
    checked against ``shape``. Collective; MalformedMessage naming ``what`` and the rank whose
    value is not readable (every rank raises alike: each decodes the same bytes)."""
    values = []
    for rank, data in enumerate(all_gather_bytes(encode(value), group, device)):
        try:
            values.append(decode(data, f"{what} from rank {rank}", shape))
        except MalformedMessage as error:
            error.rank = rank
            raise
    return values


def broadcast(
    value: Any,
    src: int,
    group: dist.ProcessGroup | None,
    what: str,
    shape: Any = ANY,
    device: torch.device | None = None,
) -> Any:
    """``value`` of the process of global rank ``src``, on every rank of ``group``, as JSON keeps
    it and checked against ``shape`` (``value`` is ignored elsewhere). Collective; every rank
    raises MalformedMessage alike for a size out of bounds."""
    device = collective_device(group) if device is None else device
    data = encode(value) if dist.get_rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    count = int(size.item())
    _check_size(count, what)
    buffer = torch.zeros(count, dtype=torch.uint8, device=device)
    if data:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src, group=group)
    return decode(tensor_bytes(buffer), what, shape)


def _check_size(count: int, what: str, rank: int | None = None) -> None:
    if not 0 < count <= MAX_BYTES:
        raise MalformedMessage(
            f"{what} is {count} bytes, outside 1..{MAX_BYTES}: not a message of this package",
            rank,
        )


# ----------------------------------------------------------------------------- shapes

_NAMES = {int: "int", float: "number", str: "string", bool: "bool", dict: "object", list: "array"}


def _describe(shape: Any) -> str:
    if shape is None:
        return "null"
    if isinstance(shape, type):
        return _NAMES[shape]
    if isinstance(shape, str):
        return json.dumps(shape)
    if isinstance(shape, list):
        return f"[{_describe(shape[0])}, ...]"
    if isinstance(shape, tuple):
        return f"[{', '.join(_describe(s) for s in shape)}]"
    if isinstance(shape, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_describe(s)}" for k, s in shape.items()) + "}"
    return repr(shape)


def _mismatch(value: Any, shape: Any, where: str) -> tuple[str, str, Any] | None:
    """None if ``value`` has ``shape``; else (where, what was expected there, what was)."""
    if shape is ANY:
        return None
    if isinstance(shape, OneOf):
        for option in shape.shapes:
            if _mismatch(value, option, where) is None:
                return None
        # A tagged message (["stopped", ...]) is told what its own tag's shape wants.
        for option in shape.shapes:
            tagged = isinstance(option, tuple) and option and isinstance(option[0], str)
            if tagged and isinstance(value, list) and value and value[0] == option[0]:
                return _mismatch(value, option, where)
        return where, repr(shape), value
    if shape is None:
        return None if value is None else (where, "null", value)
    if isinstance(shape, str):
        return None if value == shape else (where, json.dumps(shape), value)
    if isinstance(shape, type):
        fits = isinstance(value, shape) and not (isinstance(value, bool) and shape is not bool)
        if shape is float:
            fits = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if fits else (where, _NAMES[shape], value)
    if isinstance(shape, (list, tuple)):
        if not isinstance(value, list):
            return where, _describe(shape), value
        if isinstance(shape, tuple) and len(value) != len(shape):
            return where, f"{_describe(shape)} ({len(shape)} items)", value
        shapes = shape if isinstance(shape, tuple) else [shape[0]] * len(value)
        for index, (item, item_shape) in enumerate(zip(value, shapes)):
            wrong = _mismatch(item, item_shape, f"{where}[{index}]")
            if wrong is not None:
                return wrong
        return None
    if not isinstance(value, dict):
        return where, _describe(shape), value
    if value.keys() != shape.keys():
        missing, extra = sorted(shape.keys() - value.keys()), sorted(value.keys() - shape.keys())
        return where, f"an object of keys {sorted(shape)} (missing {missing}, extra {extra})", value
    for key, item_shape in shape.items():
        wrong = _mismatch(value[key], item_shape, f"{where}.{key}" if where else key)
        if wrong is not None:
            return wrong
    return None


def _show(value: Any) -> str:
    """``value`` for an error message: its JSON type and a short text (it may be huge)."""
    if value is None:
        kind = "null"
    elif isinstance(value, bool):
        kind = "bool"
    else:
        kind = next((n for t, n in _NAMES.items() if isinstance(value, t)), type(value).__name__)
    text = repr(value)
    return f"{kind} {text[:80]}{'...' if len(text) > 80 else ''}"


def flat_settings(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``config`` with its nested descriptions flattened to dotted names (``outer.every``), so
    that a disagreement names the one setting."""
    leaves = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            leaves.update(flat_settings(value, f"{prefix}{key}."))
        else:
            leaves[f"{prefix}{key}"] = value
    return leaves
