"""What every algorithm object of gossip_ext.algorithms shares: the checks that name the object
and the argument in the user's spelling, and the description that ranks compare to know they were
configured alike.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from gossip_ext.graphs import GraphBase
from gossip_ext.mixing import MixingBase

# What a message may be besides full precision: 16-bit floats, or block-quantized formats with a
# float32 scale per block of 128 values (Note [Quantized messages] in csrc/kernels/block_format.h).
MESSAGE_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, "int8", "int4")


class Spelling:
    """How an error names what the user set: as the objects were written (this class), or as
    the flat keywords of earlier releases that set them (``flat_keywords.FlatSpelling``). An
    error in the user's own words points at the line to change."""

    def argument(self, owner: Any, name: str) -> str:
        """The subject of "... must be ...": ``SlowMo(momentum=...): momentum``."""
        return f"{type(owner).__name__}({name}=...): {name}"

    def setting(self, owner: Any, name: str) -> str:
        """An argument with its value, in a sentence about a combination: ``SGP(overlap=True)``."""
        return f"{type(owner).__name__}({name}={getattr(owner, name)!r})"

    def value(self, owner: Any, name: str) -> str:
        """An argument's value as a reader finds it in this spelling: ``every=4``."""
        return f"{name}={getattr(owner, name)!r}"

    def object(self, obj: Any, role: str) -> str:
        """An object given as ``role`` (``average``, ``membership``), as it was written:
        ``average=ByGossip(graph=None, ...)``."""
        return f"{role}={obj!r}"

    def nothing_averages(self, gossip: Any, outer: Any) -> str:
        """Why a job with neither gossip nor an outer step is refused (more than one worker)."""
        return (
            "gossip=None and outer=None: no worker ever hears from another, each trains alone; "
            "give an outer step (outer=Average(every=...) for LocalSGD, SlowMo(...), "
            "DiLoCo(...)) or gossip (gossip=SGP())"
        )


_AS_WRITTEN = Spelling()
_SPELLING: contextvars.ContextVar[Spelling | None] = contextvars.ContextVar(
    "spelling", default=None
)


@contextlib.contextmanager
def spelled(spelling: Spelling) -> Iterator[None]:
    """Objects made inside name their arguments in ``spelling`` (the flat keywords' translation
    makes its objects so)."""
    token = _SPELLING.set(spelling)
    try:
        yield
    finally:
        _SPELLING.reset(token)


def where(obj: Any, name: str) -> str:
    """The subject of an error about argument ``name`` of ``obj``, in the current spelling."""
    return (_SPELLING.get() or _AS_WRITTEN).argument(obj, name)


def value_of(obj: Any, name: str) -> str:
    """Argument ``name`` of ``obj`` with its value (``every=4``), in the current spelling."""
    return (_SPELLING.get() or _AS_WRITTEN).value(obj, name)


def check_type(name: str, value, expected, what: str) -> None:
    """TypeError ``"{name} must be {what}, got ..."`` unless ``value`` is an ``expected``."""
    # bool is an int to isinstance: push_sum=1 or synch_freq=True are mistakes worth naming.
    allowed = expected if isinstance(expected, tuple) else (expected,)
    if isinstance(value, bool) and bool not in allowed:
        raise TypeError(f"{name} must be {what}, got {value!r}")
    if not isinstance(value, expected):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")


def check_argument(obj: Any, name: str, value: Any, expected, what: str) -> None:
    check_type(where(obj, name), value, expected, what)


def check_every(obj: Any, value: Any) -> None:
    check_argument(obj, "every", value, int, "an int")
    if value < 1:
        raise ValueError(f"{where(obj, 'every')} must be >= 1 (steps), got {value}")


def check_message_dtype(name: str, value) -> None:
    """ValueError naming ``name`` unless ``value`` is None or one of MESSAGE_DTYPES."""
    if value is None or (
        isinstance(value, (str, torch.dtype)) and any(value == d for d in MESSAGE_DTYPES)
    ):
        return
    raise ValueError(
        f"{name} must be torch.bfloat16, torch.float16, torch.float8_e4m3fn, 'int8', 'int4' or "
        f"None (full precision), got {value!r}"
    )


def check_dtype_argument(obj: Any, name: str, value: Any, check=check_message_dtype) -> None:
    check(where(obj, name), value)


def plain(value: Any) -> Any:
    """``value`` as what ranks compare, plain values all the way down (``json.dumps`` takes it): a
    graph by its repr (its kind and peers), a mixing by its kind alone (push-sum allows every node
    its own column-stochastic weights), a dtype or device by name, an object (an algorithm, a
    message format) by its description."""
    if isinstance(value, GraphBase):
        return repr(value)
    if isinstance(value, MixingBase):
        return type(value).__name__
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    describe = getattr(value, "describe", None)  # an Algorithm, or a message format (TopK)
    if callable(describe) and not isinstance(value, type):
        return describe()
    return value


class Algorithm:
    """What every algorithm object shares: its description for the check that every rank was
    configured alike (``_validation.check_ranks_agree``)."""

    def describe(self) -> dict[str, Any]:
        """Its kind and every argument as a plain value. A callable (DiLoCo's ``optimizer``) is
        left out: the rule it builds describes the optimizer's kind and hyperparameters."""
        described = {"kind": type(self).__name__}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not callable(value) or isinstance(value, (GraphBase, MixingBase, Algorithm)):
                described[field.name] = plain(value)
        return described
