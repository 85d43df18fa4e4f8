"""What every algorithm object of gossip_ext.algorithms shares: the checks that name the object
and the argument, and the description that ranks compare to know they were configured alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gossip_ext._argument_checks import check_message_dtype
from gossip_ext.graphs import GraphBase
from gossip_ext.mixing import MixingBase


def where(obj: Any, name: str) -> str:
    return f"{type(obj).__name__}({name}=...)"


def check_argument(obj: Any, name: str, value: Any, expected, what: str) -> None:
    # bool is an int to isinstance, never to these arguments.
    allowed = expected if isinstance(expected, tuple) else (expected,)
    if isinstance(value, bool) and bool not in allowed:
        raise TypeError(f"{where(obj, name)}: {name} must be {what}, got {value!r}")
    if not isinstance(value, expected):
        raise TypeError(
            f"{where(obj, name)}: {name} must be {what}, got {type(value).__name__} {value!r}"
        )


def check_every(obj: Any, value: Any) -> None:
    check_argument(obj, "every", value, int, "an int")
    if value < 1:
        raise ValueError(f"{where(obj, 'every')}: every must be >= 1 (steps), got {value}")


def check_dtype_argument(obj: Any, name: str, value: Any, check=check_message_dtype) -> None:
    try:
        check(name, value)
    except ValueError as error:
        raise ValueError(f"{where(obj, name)}: {error}") from None


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
