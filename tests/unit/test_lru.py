"""The bounded memory behind the per-event counters and the relay's per-destination warnings."""

from __future__ import annotations

import pytest

from lily_mongo._lru import Lru, LruCounter


def test_the_least_recently_written_entry_is_forgotten_first() -> None:
    memory: Lru[str, int] = Lru(3)
    for key, value in (("a", 1), ("b", 2), ("c", 3)):
        memory.put(key, value)
    memory.put("a", 10)  # written again: now the most recent
    memory.put("d", 4)  # over the capacity: "b" goes
    assert len(memory) == 3
    assert "b" not in memory
    assert [memory.get(key, -1) for key in "abcd"] == [10, -1, 3, 4]


def test_reading_does_not_make_an_entry_more_recent() -> None:
    memory: Lru[str, int] = Lru(2)
    memory.put("a", 1)
    memory.put("b", 2)
    assert memory.get("a", 0) == 1
    memory.put("c", 3)
    assert "a" not in memory
    assert memory.get("b", 0) == 2


def test_a_counter_counts_per_key_and_forgets() -> None:
    counts: LruCounter[bytes] = LruCounter(2)
    assert [counts.bump(b"x"), counts.bump(b"x"), counts.bump(b"y")] == [1, 2, 1]
    counts.forget(b"x")
    counts.forget(b"never")
    assert counts.get(b"x", 0) == 0
    assert counts.bump(b"z") == 1
    assert counts.bump(b"w") == 1  # capacity 2: "y" (the oldest) is forgotten
    assert counts.get(b"y", 0) == 0


def test_a_memory_holds_at_least_one_entry() -> None:
    with pytest.raises(ValueError, match="capacity must be at least 1, got 0"):
        Lru(0)
