"""Nothing another process sends is unpickled (docs/elastic.md, "Security").

Unpickling runs whatever code the bytes name, so one crafted message from a joiner would run in
every member. The package's source is read for the calls that unpickle (``pickle.load(s)``, the
``*_object`` collectives of torch.distributed, ``torch.load`` without ``weights_only=True``), and
a rank that sends a pickle where its configuration belongs is refused without running it.
"""

from __future__ import annotations

import ast
import enum
import math
import os
import pickle
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks
from torch import nn

import gossip_ext
from gossip_ext import _plain_messages, _validation
from gossip_ext.errors import ConfigurationMismatch

PACKAGE = Path(__file__).resolve().parent.parent / "gossip_ext"

# torch.distributed's collectives that pickle what they send and unpickle what they receive.
_OBJECT_COLLECTIVES = {
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
}
_UNPICKLERS = {"load", "loads", "Unpickler"}


def _aliases(tree: ast.Module) -> tuple[set[str], set[str], set[str]]:
    """The names under which a module reaches pickle, pickle's loaders, and torch.load."""
    pickles, loaders, torch_loads = {"pickle"}, set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in ("pickle", "_pickle", "cPickle"):
                    pickles.add(alias.asname or alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module in ("pickle", "_pickle", "torch"):
            for alias in node.names:
                if node.module == "torch" and alias.name == "load":
                    torch_loads.add(alias.asname or alias.name)
                elif node.module != "torch" and alias.name in _UNPICKLERS:
                    loaders.add(alias.asname or alias.name)
    return pickles, loaders, torch_loads


def _weights_only(call: ast.Call) -> bool:
    return any(
        k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
        for k in call.keywords
    )


def unpickling(source: str) -> list[str]:
    """Every place in ``source`` that unpickles bytes, as ``line: code``: a use of pickle's
    loaders or of an ``*_object`` collective (called, or handed to a function that calls it), and
    a call of ``torch.load`` whose ``weights_only`` is not literally True."""
    tree = ast.parse(source)
    pickles, loaders, torch_loads = _aliases(tree)
    lines = source.splitlines()
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            bad = node.attr in _OBJECT_COLLECTIVES or (
                owner in pickles and node.attr in _UNPICKLERS
            )
        elif isinstance(node, ast.Name):
            bad = node.id in _OBJECT_COLLECTIVES or node.id in loaders
        elif isinstance(node, ast.Call):
            function = node.func
            torch_load = (
                isinstance(function, ast.Attribute)
                and function.attr == "load"
                and isinstance(function.value, ast.Name)
                and function.value.id == "torch"
            ) or (isinstance(function, ast.Name) and function.id in torch_loads)
            bad = torch_load and not _weights_only(node)
        else:
            continue
        if bad:
            found.add((node.lineno, lines[node.lineno - 1].strip()))
    return [f"{line}: {code}" for line, code in sorted(found)]


def test_the_scan_finds_each_way_to_unpickle():
    source = """
import pickle, pickle as p
from pickle import loads as read
import torch
from torch import load
import torch.distributed as dist
pickle.loads(b"")
p.load(f)
read(b"")
pickle.Unpickler(f).load()
dist.all_gather_object(out, mine)
torch.distributed.broadcast_object_list(objects)
run(dist.recv_object_list, objects, src=0)
torch.load(f)
torch.load(f, weights_only=False)
torch.load(f, **kwargs)
load(f)
torch.load(f, weights_only=True)
load(f, map_location="cpu", weights_only=True)
pickle.dumps(x)
"""
    found = [int(line.split(":")[0]) for line in unpickling(source)]
    assert found == list(range(7, 18)), found


def test_no_module_of_the_package_unpickles():
    found = {
        str(path.relative_to(PACKAGE.parent)): calls
        for path in sorted(PACKAGE.rglob("*.py"))
        if (calls := unpickling(path.read_text()))
    }
    assert not found, found


# ----------------------------------------------------------------------------- the wire


class _WritesMarker:
    """Unpickled, it creates the file at ``path``: what a crafted message would do instead."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _crafted_configurations(rank: int, world_size: int, marker: str) -> list:
    """Rank 1 speaks the configuration check's wire format (an int64 size, then the bytes) with
    three payloads: a pickle that writes ``marker``, JSON that is not a configuration, and a size
    no configuration has; rank 0 builds a GossipDataParallel against each."""
    payloads = [pickle.dumps(_WritesMarker(marker)), b"[1, 2]"]
    seen = []
    for payload in payloads:
        if rank == 0:
            seen.append(_refused(lambda: gossip_ext.GossipDataParallel(nn.Linear(3, 1))))
        else:
            _plain_messages.all_gather_bytes(payload, None)
    if rank == 0:
        seen.append(_refused(lambda: gossip_ext.GossipDataParallel(nn.Linear(3, 1))))
    else:  # a size alone: the bytes never follow
        sizes = [torch.empty(1, dtype=torch.int64) for _ in range(world_size)]
        dist.all_gather(sizes, torch.tensor([1 << 40], dtype=torch.int64))
    return seen


def _refused(build) -> tuple[str, str, tuple[int, ...]] | None:
    try:
        build()
    except ConfigurationMismatch as error:
        return type(error).__name__, str(error), error.ranks
    return None


def test_a_rank_that_sends_a_pickle_as_its_configuration_is_refused_without_running_it():
    with tempfile.TemporaryDirectory() as folder:
        marker = os.path.join(folder, "unpickled")
        pickled, not_a_configuration, too_large = run_ranks(2, _crafted_configurations, marker)[0]
        assert not os.path.exists(marker), "a rank's message was unpickled"
        # The payload is live: unpickled here, it writes its file.
        control = os.path.join(folder, "control")
        pickle.loads(pickle.dumps(_WritesMarker(control))).close()
        assert os.path.exists(control)
    for refused in (pickled, not_a_configuration, too_large):
        assert refused is not None, "rank 0 accepted rank 1's message"
        kind, message, ranks = refused
        assert kind == "ConfigurationMismatch" and ranks == (1,), refused
        assert "rank 1 was configured differently from rank 0 (seen on rank 0)" in message
        assert "Ranks configured differently from rank 0: 1" in message
    assert "rank 1's configuration is not UTF-8 JSON" in pickled[1], pickled
    assert "rank 1's configuration should be object, got array [1, 2]" in not_a_configuration[1]
    assert "rank 1's message is 1099511627776 bytes" in too_large[1], too_large


def test_every_rank_that_differs_from_rank_0_is_named(monkeypatch):
    mine = {"gossip": {"graph": "RingGraph()"}, "parameters": [("w", (3, 1), torch.float32)]}
    sent = [
        _plain_messages.encode(mine),
        _plain_messages.encode({**mine, "gossip": {"graph": "HypercubeGraph()"}}),
        pickle.dumps(mine),
        # Tuples arrive as lists, a dtype as its name: the same configuration.
        b'{"gossip": {"graph": "RingGraph()"}, "parameters": [["w", [3, 1], "torch.float32"]]}',
        _plain_messages.encode({**mine, "parameters": [("w", (1, 3), torch.float32)]}),
    ]
    monkeypatch.setattr(_plain_messages, "all_gather_bytes", lambda data, group: sent)
    with pytest.raises(ConfigurationMismatch) as caught:
        _validation.check_ranks_agree(mine, None, 3)
    assert caught.value.ranks == (1, 2, 4)
    message = str(caught.value)
    assert message.startswith(
        "GossipDataParallel: rank 1 was configured differently from rank 0 (seen on rank 3): "
        "gossip.graph: rank 0 has 'RingGraph()', rank 1 has 'HypercubeGraph()'. "
    ), message
    assert message.endswith("Ranks configured differently from rank 0: 1, 2, 4"), message


# ----------------------------------------------------------------------------- the format


def test_values_json_has_no_type_for_become_the_same_text_on_every_process():
    class Kind(enum.Enum):
        SLOW = "slow"

    described = {"shape": (2, 3), "dtype": torch.bfloat16, "kind": Kind.SLOW, "lr": math.inf}
    plain = _plain_messages.plain(described)
    assert plain == {"shape": [2, 3], "dtype": "torch.bfloat16", "kind": "Kind.SLOW", "lr": "inf"}
    assert _plain_messages.decode(_plain_messages.encode(described), "it") == plain


@pytest.mark.parametrize(
    ("data", "shape", "said"),
    [
        (pickle.dumps({"a": 1}), dict, "the message is not UTF-8 JSON"),
        (b"NaN", float, "the message is not UTF-8 JSON (ValueError: NaN is not JSON)"),
        (b"[" * 100_000, list, "the message is not UTF-8 JSON (RecursionError"),
        (b'["stopped", 1, "x"]', ("stopped", str, str), "the message at [1] should be string"),
        (b'{"text": "t"}', {"text": str, "peers": [int]}, "missing ['peers']"),
        (b"[1, true]", [int], "the message at [1] should be int, got bool True"),
    ],
)
def test_a_malformed_message_is_refused_naming_what_was_wrong(data, shape, said):
    with pytest.raises(ValueError) as caught:
        _plain_messages.decode(data, "the message", shape)
    assert said in str(caught.value), str(caught.value)
