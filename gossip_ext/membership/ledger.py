"""The membership store's sealed lists, remembered: what a worker has seen is never forgotten
because the store lost it.

The store is a bulletin board anyone who reaches it may rewrite or wipe (docs/elastic.md,
Security). A list of sealed entries appended under one key (the workers registered, those gone,
the changes announced) is therefore read as a *hint*: each worker keeps every sealed entry it has
seen, in the order it first saw them, and takes the union with what the store shows now. An
entry an outsider deleted (or overwrote with junk) is still known to every worker that saw it, and
is written back by the first that finds it missing, so a joiner learns it too. An entry is
unique by construction (it names its writer and what it says), so writing one back twice, or an
outsider replaying one, changes nothing.

Reads never wait (:func:`read_keys`): ``get`` and ``multi_get`` wait for a key that does not
exist, and a deleted key would hold a worker for the store's whole timeout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from gossip_ext.membership import trust


def read_keys(store: dist.Store, keys: Sequence[str]) -> list[bytes | None]:
    """The values of ``keys`` (None where missing), never waiting: one ``multi_get`` where every
    key exists (the common case: two requests), else one request per key."""
    keys = list(keys)
    if keys and store.check(keys):
        try:
            return list(store.multi_get(keys))
        except dist.DistError:  # deleted between the two requests: read them one by one
            pass
    return [trust.peek(store, key) for key in keys]


class Ledger:
    """The sealed entries appended under ``key`` (each ended by ``end``), as this worker has
    seen them, oldest first."""

    def __init__(self, store: dist.Store, seal: trust.Seal, key: str, end: str):
        self.store, self.seal, self.key, self.end = store, seal, key, end
        self._sealed: dict[str, str] = {}  # entry -> as written (sealed), in the order seen
        self._last: bytes | None = None  # the value last merged: unchanged, nothing to open

    def merge(self, raw: bytes | None) -> list[str]:
        """Every entry known, after taking in what the store shows now (``raw``: ``key``'s
        value, None where the key is gone); writes back those it lost."""
        if raw is not None and raw == self._last:
            return list(self._sealed)
        self._last = raw
        shown: set[str] = set()
        for written in (raw or b"").decode(errors="replace").split(self.end):
            entry = self.seal.open(self.key, written) if written else None
            if entry is not None:
                shown.add(entry)
                self._sealed.setdefault(entry, written)
        lost = [written for entry, written in self._sealed.items() if entry not in shown]
        if lost:
            self.store.append(self.key, "".join(f"{w}{self.end}" for w in lost))
        return list(self._sealed)

    def read(self) -> list[str]:
        """Every entry known, the store read now."""
        return self.merge(trust.peek(self.store, self.key))

    def add(self, entries: Sequence[str]) -> None:
        """Appends ``entries``, sealed."""
        sealed = {entry: self.seal.seal(self.key, entry) for entry in entries}
        self.store.append(self.key, "".join(f"{w}{self.end}" for w in sealed.values()))
        for entry, written in sealed.items():
            self._sealed.setdefault(entry, written)
