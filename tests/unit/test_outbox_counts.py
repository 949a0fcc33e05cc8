"""The outbox's pending count agrees with its marks between two counts (the snapshot, ``/metrics``)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from lily_mongo._outbox import OutboxCounters, OutboxOptions
from lily_mongo._outbox.outcomes import write_outcomes


@dataclass
class Updated:
    matched_count: int


class Collection:
    async def update_many(self, *args: Any, **kwargs: Any) -> Updated:
        return Updated(matched_count=len(args[0]["_id"]["$in"]))  # every marked record matched


async def test_records_marked_published_leave_the_pending_count() -> None:
    counters = OutboxCounters(OutboxOptions())
    counters.pending = 5  # the last count saw five records pending
    now = datetime.datetime.now(datetime.UTC)
    await write_outcomes(Collection(), counters, OutboxOptions(), "t", ["a", "b", "c"], [], now)  # type: ignore[arg-type]
    assert (counters.published, counters.pending) == (3, 2)
    await write_outcomes(Collection(), counters, OutboxOptions(), "t", ["d", "e", "f"], [], now)  # type: ignore[arg-type]
    assert (counters.published, counters.pending) == (6, 0)  # never below zero (records written since the count)


async def test_before_any_count_the_pending_count_stays_unknown() -> None:
    counters = OutboxCounters(OutboxOptions())
    now = datetime.datetime.now(datetime.UTC)
    await write_outcomes(Collection(), counters, OutboxOptions(), "t", ["a"], [], now)  # type: ignore[arg-type]
    assert (counters.published, counters.pending) == (1, None)
