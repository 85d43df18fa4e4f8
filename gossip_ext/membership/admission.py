"""Admission before membership: a worker proves it belongs to the job before it registers.

The first worker of an elastic job writes the job's fingerprint (sealed with the job's secret,
:mod:`gossip_ext.membership.trust`): the job's name, gossip_ext's version and wire format, torch's
version, how many processes a replica spans, the configuration as ``describe()`` gives it, the
membership's heartbeat and silence, and the parameters' names, shapes and dtypes. Every later
worker compares its own with it and, where they differ, is refused with the differences named,
before it registers: the members never see it. Without this, a worker with another model or
algorithm joins an epoch and fails every member's configuration check, ending the job it tried
to join.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from gossip_ext._plain_messages import flat_settings
from gossip_ext.membership import trust

if TYPE_CHECKING:  # the client calls admit(): only its type is needed here
    from gossip_ext.membership.epochs import MembershipClient

# The layout of the messages workers exchange (the rounds' blocks, csrc/kernels/block_format.h;
# gossip_ext/gossip/messages.py): raised whenever it changes, so that two versions never gossip.
WIRE_FORMAT = 1
KEY = "fingerprint"


class JobMismatchError(ValueError):
    """This worker is not of the job it tried to join: ``differences`` name each setting, the
    job's value and this worker's. It was refused before registering; the job goes on."""

    def __init__(self, message: str, differences: Sequence[str]):
        super().__init__(message)
        self.differences = tuple(differences)


def fingerprint(
    *,
    job: str,
    shards: int,
    configuration: Mapping[str, object],
    parameters: Sequence[tuple[str, Sequence[int], str]],
    membership: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """What every worker of a job must share, as plain JSON values."""
    import gossip_ext  # at call time: this module is imported while the package initialises

    return json.loads(
        json.dumps(
            {
                "job": job,
                "gossip_ext": gossip_ext.__version__,
                "wire_format": WIRE_FORMAT,
                "torch": torch.__version__.split("+")[0],
                "shards": shards,
                "configuration": configuration,
                "membership": dict(membership or {}),
                "parameters": {name: [list(shape), dtype] for name, shape, dtype in parameters},
            },
            sort_keys=True,
            default=str,  # a description is plain already; anything else compares by its text
        )
    )


def admit(client: MembershipClient, mine: Mapping[str, object]) -> None:
    """Writes ``mine`` as the job's fingerprint if this worker is the job's first, else checks it
    against the job's: JobMismatchError naming every difference where they differ."""
    text = json.dumps(mine, sort_keys=True)
    first = not client.store.check([KEY])
    written = client.claim(KEY, text)
    if written == text:
        if first and not client.seal.authenticated:  # the job's first worker says it, once
            warnings.warn(f"gossip_ext: {trust.OPEN_PORT_WARNING}", stacklevel=2)
        return
    try:
        theirs = json.loads(written)
    except ValueError:
        theirs = None
    if not isinstance(theirs, dict):  # sealed by a worker of the job: never, short of a bug
        raise RuntimeError(f"gossip_ext: the job's fingerprint at {client.address} is unreadable")
    differences = _differences(theirs, dict(mine))
    if not differences:  # the same content, written with other spacing by another version
        return
    raise JobMismatchError(
        f"gossip_ext: this worker is not of the job at {client.address}, and was refused before "
        "joining (the job goes on): " + "; ".join(differences),
        differences,
    )


def _differences(job: dict, mine: dict) -> list[str]:
    """Each setting that differs, as ``"name: the job has X, this worker has Y"``."""
    found = []
    job_parameters, my_parameters = job.pop("parameters", {}), mine.pop("parameters", {})
    job_leaves, my_leaves = flat_settings(job), flat_settings(mine)
    for name in sorted(job_leaves.keys() | my_leaves.keys()):
        theirs, own = job_leaves.get(name, "(unset)"), my_leaves.get(name, "(unset)")
        if theirs == own:
            continue
        found.append(f"{name}: the job has {theirs!r}, this worker has {own!r}")
        if name == "shards":
            found[-1] += (
                f" (this replica is sharded over {own} process{'es' if own != 1 else ''}, the "
                f"job's replicas over {theirs}; a replica joins with as many shard processes as "
                "the others: a live job is not resharded, resume it from a checkpoint, which "
                "reshards, gossip_ext.sharded.checkpoint)"
            )
    if job_parameters != my_parameters:
        for name in sorted(job_parameters.keys() | my_parameters.keys()):
            theirs, own = job_parameters.get(name), my_parameters.get(name)
            if theirs != own:
                found.append(
                    f"parameter {name!r}: the job has {_layout(theirs)}, this worker has "
                    f"{_layout(own)}"
                )
    return found


def _layout(entry: list | None) -> str:
    if entry is None:
        return "none"
    shape, dtype = entry
    return f"shape {tuple(shape)} {dtype}"
