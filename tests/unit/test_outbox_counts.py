"""The outbox's pending count agrees with its marks between two counts, and the snapshots carry every count
(``/metrics``)."""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import Any

from lily_mongo import QueueOptions, Snapshot
from lily_mongo._engine.queues import QueueState
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


def test_the_snapshot_carries_each_outbox_count_under_its_own_field() -> None:
    counters = OutboxCounters(OutboxOptions())
    counters.pending, counters.failed, counters.published = 7, 2, 40
    counters.unroutable, counters.released, counters.blocked_seconds = 3, 5, 1.5
    snapshot = Snapshot("running", 1, (), **counters.figures())
    assert (snapshot.outbox_pending, snapshot.outbox_failed, snapshot.outbox_published) == (7, 2, 40)
    assert (snapshot.outbox_unroutable, snapshot.outbox_released, snapshot.outbox_blocked_seconds) == (3, 5, 1.5)


def test_a_queue_snapshot_carries_every_queue_counter_and_a_copy_of_the_outcomes() -> None:
    queue = QueueState(0, QueueOptions(name="orders"))
    names = [field.name for field in dataclasses.fields(queue.counters) if field.name != "outcomes"]
    for number, name in enumerate(names, start=1):
        setattr(queue.counters, name, number)
    queue.counters.outcomes["acked"] = 9
    snapshot = queue.snapshot()
    assert {name: getattr(snapshot, name) for name in names} == {name: n for n, name in enumerate(names, start=1)}
    queue.counters.outcomes["acked"] += 1
    assert snapshot.outcomes == {"acked": 9}
