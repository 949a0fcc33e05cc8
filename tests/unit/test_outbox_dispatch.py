"""Dispatch after commit without servers (docs/outbox.md): publishes pipelined in order, marks batched, fenced.

The dispatcher runs against a recording collection and an in-process send, so the
figures the docs state (one mark write per ``batch_size`` records or per
``mark_interval``, all publishes of a batch in flight together) are checked exactly.
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

from lily_mongo import _outbox_protocol as protocol
from lily_mongo._tasks import TaskSet
from lily_mongo.errors import PublishError
from lily_mongo.outbox import OutboxCounters, OutboxDispatcher, OutboxOptions, _FixedTransport


class Result:
    def __init__(self, matched: int) -> None:
        self.matched_count = matched


class Collection:
    """Records the writes the dispatcher sends."""

    def __init__(self) -> None:
        self.marks: list[tuple[dict[str, Any], Any]] = []
        self.failures: list[list[Any]] = []

    async def update_many(self, filter: dict[str, Any], update: Any) -> Result:
        self.marks.append((filter, update))
        return Result(len(filter["_id"]["$in"]))

    async def bulk_write(self, writes: list[Any], ordered: bool) -> None:
        self.failures.append(writes)


class Broker:
    """An in-process send: every publish is in flight until ``release`` (confirms awaited together)."""

    def __init__(self, refuse: frozenset[str] = frozenset()) -> None:
        self.sent: list[str] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.release = asyncio.Event()
        self.refuse = refuse

    async def send(
        self, *, exchange: str, routing_key: str, body: bytes, headers: dict[str, Any], content_type: str | None
    ) -> None:
        self.sent.append(headers["x-lily-event-id"])
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await self.release.wait()
        finally:
            self.in_flight -= 1
        if headers["x-lily-event-id"] in self.refuse:
            raise PublishError("unroutable", "nowhere")


def records(dispatcher: OutboxDispatcher, count: int, txn: str = "t") -> list[dict[str, Any]]:
    claim = dispatcher.claim()
    assert claim is not None
    now = datetime.datetime.now(datetime.UTC)
    return [
        protocol.new_record(
            record_id=f"{txn}{n}",
            event_id=f"{txn}{n}",
            exchange="",
            routing_key="down",
            body=b"{}",
            headers={"x-lily-event-id": f"{txn}{n}"},
            content_type="application/json",
            writer="w",
            written_at=now,
            seq=n,
            claim=claim,
        )
        for n in range(count)
    ]


def dispatcher(collection: Collection, **options: Any) -> OutboxDispatcher:
    settings = OutboxOptions(**options)
    return OutboxDispatcher(collection, settings, "proc", OutboxCounters(settings))  # type: ignore[arg-type]


def test_a_batch_is_published_pipelined_in_write_order_and_marked_in_one_write_per_batch_size() -> None:
    async def main() -> None:
        collection, broker, tasks = Collection(), Broker(), TaskSet()
        outbox = dispatcher(collection, batch_size=100, mark_interval=60, claim_seconds=600)
        outbox.start(_FixedTransport(broker.send), tasks)
        first, second = records(outbox, 150, "a"), records(outbox, 100, "b")
        outbox.submit(first)
        outbox.submit(second)
        await asyncio.sleep(0.05)
        assert broker.most_in_flight == 100  # the first batch: every publish in flight at once
        broker.release.set()
        await outbox.drain()  # a drain writes the marks at once (not after mark_interval)
        assert broker.sent == [r["_id"] for r in first + second]  # in submission (write) order
        assert broker.most_in_flight == 100
        ids = [filter["_id"]["$in"] for filter, _ in collection.marks]
        assert [len(batch) for batch in ids] == [100, 100, 50]
        assert [i for batch in ids for i in batch] == broker.sent
        for filter, update in collection.marks:
            assert filter["claim_token"] == outbox.token  # fenced by the dispatcher's own claim token
            assert filter["status"] == "pending"
            assert update == protocol.mark_update(retention_seconds=7 * 24 * 3600.0)
        assert collection.failures == []
        await outbox.stop(1.0)

    asyncio.run(main())


def test_marks_wait_the_mark_interval_to_share_one_write() -> None:
    async def main() -> None:
        collection, broker, tasks = Collection(), Broker(), TaskSet()
        broker.release.set()
        outbox = dispatcher(collection, mark_interval=0.3)
        outbox.start(_FixedTransport(broker.send), tasks)
        for n in range(5):  # five transactions, one record each, 20 ms apart
            outbox.submit(records(outbox, 1, f"t{n}-"))
            await asyncio.sleep(0.02)
        assert collection.marks == []  # not yet: the interval runs from the first confirmed record
        await asyncio.sleep(0.4)
        assert [len(f["_id"]["$in"]) for f, _ in collection.marks] == [5]  # one write for the five
        await outbox.stop(1.0)

    asyncio.run(main())


def test_a_refused_publish_is_recorded_as_a_failed_attempt_and_the_others_are_marked() -> None:
    async def main() -> None:
        collection, broker, tasks = Collection(), Broker(refuse=frozenset({"t1"})), TaskSet()
        broker.release.set()
        outbox = dispatcher(collection)
        outbox.start(_FixedTransport(broker.send), tasks)
        outbox.submit(records(outbox, 3))
        await outbox.drain()
        [(filter, _)] = collection.marks
        assert filter["_id"]["$in"] == ["t0", "t2"]
        [[failure]] = collection.failures
        # PyMongo's UpdateOne keeps its filter and update in these attributes (no public reader).
        assert failure._filter == protocol.failure_filter("t1", outbox.token)
        update = failure._doc
        assert update["$set"]["attempts"] == 1
        assert update["$set"]["last_error"] == "publish unroutable"
        assert update["$unset"] == {"claim_expires": ""}  # released to the relay
        await outbox.stop(1.0)

    asyncio.run(main())


def test_a_record_whose_claim_expired_before_its_dispatch_is_left_to_the_relay() -> None:
    async def main() -> None:
        collection, broker, tasks = Collection(), Broker(), TaskSet()
        broker.release.set()
        outbox = dispatcher(collection)
        outbox.start(_FixedTransport(broker.send), tasks)
        stale = records(outbox, 2)
        stale[0]["claim_expires"] = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=1)
        outbox.submit(stale)
        await outbox.drain()
        assert broker.sent == ["t1"]
        assert [f["_id"]["$in"] for f, _ in collection.marks] == [["t1"]]
        await outbox.stop(1.0)

    asyncio.run(main())


def test_a_stopped_dispatcher_claims_nothing_and_takes_nothing() -> None:
    async def main() -> None:
        collection, tasks = Collection(), TaskSet()
        outbox = dispatcher(collection)
        assert outbox.claim() is None  # not started: records are born free, for a relay
        outbox.start(_FixedTransport(Broker().send), tasks)
        assert outbox.claim() is not None
        assert await outbox.stop(1.0) is True
        assert outbox.claim() is None
        outbox.submit([{"_id": "late"}])  # a commit after the stop: left claimed, for a relay
        assert collection.marks == []

    asyncio.run(main())
