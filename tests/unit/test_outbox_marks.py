"""Marks keep up with dispatch (docs/outbox.md, "Marks keep up"): at 2,000 records/s with every majority
write taking 50 ms, every record is marked before its claim expires; a failed mark is retried.

The dispatcher runs against a collection whose writes take a fixed time and an in-process send that
confirms at once, so what is measured is the mark writer alone.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from typing import Any

from bson.codec_options import CodecOptions
from pymongo.errors import AutoReconnect

from lily_mongo._outbox import FixedTransport, OutboxCounters, OutboxDispatcher, OutboxOptions
from lily_mongo._tasks import TaskSet
from tests.support.outbox import written_record

RATE = 2000  # records per second, in transactions of 10
SECONDS = 4.0
WRITE_DELAY = 0.05  # each majority write's round trip


class Result:
    def __init__(self, matched: int) -> None:
        self.matched_count = matched


class SlowCollection:
    """Every write takes :data:`WRITE_DELAY`; notes when each record's mark landed. ``fail`` refuses that
    many mark writes first (a stepdown's ``AutoReconnect``)."""

    codec_options: CodecOptions[dict[str, Any]] = CodecOptions()

    def __init__(self, fail: int = 0) -> None:
        self.marked: dict[str, datetime.datetime] = {}
        self.writes = 0
        self.fail = fail

    def with_options(self, **options: Any) -> SlowCollection:
        return self

    async def update_many(self, filter: dict[str, Any], update: Any) -> Result:
        self.writes += 1
        await asyncio.sleep(WRITE_DELAY)
        if self.fail:
            self.fail -= 1
            raise AutoReconnect("not primary")
        landed = datetime.datetime.now(datetime.UTC)
        ids = filter["_id"]["$in"]
        fresh = [rid for rid in ids if rid not in self.marked]
        for rid in fresh:
            self.marked[rid] = landed
        return Result(len(fresh))

    async def bulk_write(self, writes: list[Any], ordered: bool) -> None:
        await asyncio.sleep(WRITE_DELAY)


async def send(**message: Any) -> None:
    return None


async def test_at_2000_records_a_second_with_50_ms_writes_no_record_is_marked_after_its_claim_expires() -> None:
    # Batches of 50: one mark write at a time would carry at most 1,000 records/s.
    options = OutboxOptions(claim_seconds=1.0, mark_interval=0.2, batch_size=50)
    collection = SlowCollection()
    outbox = OutboxDispatcher(collection, options, "proc", OutboxCounters(options))  # type: ignore[arg-type]
    outbox.start(FixedTransport(send), TaskSet())
    expires: dict[str, datetime.datetime] = {}
    started = time.monotonic()
    sent = 0
    try:
        while (elapsed := time.monotonic() - started) < SECONDS:
            due = int(elapsed * RATE)
            while sent < due:
                claim = outbox.claim()
                assert claim is not None
                now = datetime.datetime.now(datetime.UTC)
                batch = [written_record(f"r{sent + i}", written_at=now, seq=i, claim=claim) for i in range(10)]
                for record in batch:
                    expires[record["_id"]] = claim.expires
                outbox.submit(batch)
                sent += 10
            await asyncio.sleep(0.005)
        await asyncio.wait_for(outbox.drain(), 30)
    finally:
        await outbox.stop(5.0)
    assert sent >= RATE * SECONDS * 0.9
    late = [rid for rid, landed in collection.marked.items() if landed > expires[rid]]
    left = outbox.counters.left
    assert len(collection.marked) + left == sent  # each marked once, or left to the relay
    assert late == [], f"{len(late)} of {sent} records marked after their claim expired"


async def test_a_mark_write_that_fails_once_is_retried() -> None:
    options = OutboxOptions(claim_seconds=10.0, mark_interval=0.05)
    collection = SlowCollection(fail=1)
    outbox = OutboxDispatcher(collection, options, "proc", OutboxCounters(options))  # type: ignore[arg-type]
    outbox.start(FixedTransport(send), TaskSet())
    try:
        claim = outbox.claim()
        assert claim is not None
        now = datetime.datetime.now(datetime.UTC)
        outbox.submit([written_record(f"r{i}", written_at=now, seq=i, claim=claim) for i in range(5)])
        await asyncio.wait_for(outbox.drain(), 10)
    finally:
        await outbox.stop(5.0)
    assert sorted(collection.marked) == [f"r{i}" for i in range(5)]
    assert collection.writes == 2
    assert outbox.counters.published == 5
