"""A bounded memory: at most ``capacity`` keys, the least recently written forgotten first.

For what the engine remembers per event or destination across deliveries (handoff
failures and deferrals per event, the outbox relay's warnings per destination), so
that no stream of distinct keys can grow it without bound.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable

__all__ = ["Lru", "LruCounter"]


class Lru[K: Hashable, V]:
    """A mapping of at most ``capacity`` entries; writing an entry makes it the most recent."""

    __slots__ = ("_entries", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity!r}")
        self.capacity = capacity
        self._entries: collections.OrderedDict[K, V] = collections.OrderedDict()

    def get(self, key: K, default: V) -> V:
        """The entry of ``key`` (without making it more recent), or ``default``."""
        return self._entries.get(key, default)

    def put(self, key: K, value: V) -> None:
        """Write ``key``'s entry, the most recent now; forget the oldest beyond the capacity."""
        entries = self._entries
        entries[key] = value
        entries.move_to_end(key)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def forget(self, key: K) -> None:
        """Remove ``key``'s entry, if there is one."""
        self._entries.pop(key, None)

    def items(self) -> list[tuple[K, V]]:
        """Every entry, the least recently written first (a copy: safe to write while iterating)."""
        return list(self._entries.items())

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)


class LruCounter[K: Hashable](Lru[K, int]):
    """A bounded count per key (0 for a key never counted, or forgotten)."""

    __slots__ = ()

    def bump(self, key: K) -> int:
        """Count one more for ``key`` and return its count."""
        count = self._entries.get(key, 0) + 1
        self.put(key, count)
        return count
