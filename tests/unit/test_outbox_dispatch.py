"""Dispatch after commit without servers (docs/outbox.md): publishes pipelined in order, marks batched, fenced.

The dispatcher runs against a recording collection and an in-process send, so the
figures the docs state (one mark write per ``batch_size`` records or per
``mark_interval``, all publishes of a batch in flight together) are checked exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from collections.abc import AsyncIterator
from typing import Any

import pytest
from bson.codec_options import CodecOptions
from bson.errors import InvalidBSON
from yarl import URL

from lily_mongo._errors import PublishError
from lily_mongo._nodes import split_nodes
from lily_mongo._outbox import FixedTransport, OutboxCounters, OutboxDispatcher, OutboxOptions, OutboxRelay, protocol
from lily_mongo._outbox import dispatcher as dispatcher_module
from lily_mongo._outbox.outcomes import BREAKER_MAX, Breaker
from lily_mongo._outbox.process import outbox_url
from lily_mongo._tasks import TaskSet
from tests.support.outbox import written_record


class Result:
    def __init__(self, matched: int) -> None:
        self.matched_count = matched


class Collection:
    """Records the writes the dispatcher sends."""

    codec_options: CodecOptions[dict[str, Any]] = CodecOptions()

    def __init__(self) -> None:
        self.marks: list[tuple[dict[str, Any], Any]] = []
        self.failures: list[list[Any]] = []

    def with_options(self, **options: Any) -> Collection:
        return self

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
    return [written_record(f"{txn}{n}", written_at=now, seq=n, claim=claim) for n in range(count)]


def dispatcher(collection: Collection, **options: Any) -> OutboxDispatcher:
    settings = OutboxOptions(**options)
    return OutboxDispatcher(collection, settings, "proc", OutboxCounters(settings))  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def dispatching(
    collection: Collection, broker: Broker, transport: Any = None, **options: Any
) -> AsyncIterator[OutboxDispatcher]:
    """A dispatcher with ``options`` writing to ``collection`` and sending through ``broker`` (or
    ``transport``), started, and stopped at the end."""
    outbox = dispatcher(collection, **options)
    outbox.start(FixedTransport(broker.send) if transport is None else transport, TaskSet())
    try:
        yield outbox
    finally:
        await outbox.stop(1.0)


async def test_a_batch_is_published_pipelined_in_write_order_and_marked_in_one_write_per_batch_size() -> None:
    collection, broker = Collection(), Broker()
    async with dispatching(collection, broker, batch_size=100, mark_interval=60, claim_seconds=600) as outbox:
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


async def test_marks_wait_the_mark_interval_to_share_one_write() -> None:
    collection, broker = Collection(), Broker()
    broker.release.set()
    async with dispatching(collection, broker, mark_interval=0.3) as outbox:
        for n in range(5):  # five transactions, one record each, 20 ms apart
            outbox.submit(records(outbox, 1, f"t{n}-"))
            await asyncio.sleep(0.02)
        assert collection.marks == []  # not yet: the interval runs from the first confirmed record
        await asyncio.sleep(0.4)
        assert [len(f["_id"]["$in"]) for f, _ in collection.marks] == [5]  # one write for the five


async def test_a_refused_publish_is_recorded_as_a_failed_attempt_and_the_others_are_marked() -> None:
    collection, broker = Collection(), Broker(refuse=frozenset({"t1"}))
    broker.release.set()
    async with dispatching(collection, broker) as outbox:
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


async def test_a_record_whose_claim_expired_before_its_dispatch_is_left_to_the_relay() -> None:
    collection, broker = Collection(), Broker()
    broker.release.set()
    async with dispatching(collection, broker) as outbox:
        stale = records(outbox, 2)
        stale[0]["claim_expires"] = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=1)
        outbox.submit(stale)
        await outbox.drain()
        assert broker.sent == ["t1"]
        assert [f["_id"]["$in"] for f, _ in collection.marks] == [["t1"]]


class SlowChannel:
    """A channel transport whose confirms may take ``timeout`` seconds and that becomes ready on ``up``."""

    ready = True

    def __init__(self, send: Any, timeout: float) -> None:
        self.timeout = timeout
        self.up = asyncio.Event()
        self._send = send

    async def sender(self) -> Any:
        await self.up.wait()
        return self._send

    async def missing(self, exchanges: Any) -> set[str]:
        return set()

    async def unblocked(self, limit: float) -> float:
        return 0.0


async def test_a_claim_that_would_run_out_before_the_confirm_and_the_mark_is_left_to_the_relay() -> None:
    # claim_seconds 10, confirm timeout 5, mark interval 1: a record needs 6 s of claim left
    # when its publish starts. The check is made once the channel is back, not before.
    collection, broker = Collection(), Broker()
    broker.release.set()
    channel = SlowChannel(broker.send, timeout=5)
    async with dispatching(collection, broker, channel, claim_seconds=10, mark_interval=1) as outbox:
        batch = records(outbox, 3)
        now = datetime.datetime.now(datetime.UTC)
        batch[1]["claim_expires"] = now + datetime.timedelta(seconds=5.5)  # less than 6 s left
        batch[2]["claim_expires"] = now + datetime.timedelta(seconds=7)  # 7 s now, under 6 s after the wait
        outbox.submit(batch)
        await asyncio.sleep(1.2)  # the channel reconnects meanwhile
        channel.up.set()
        await outbox.drain()
        assert broker.sent == ["t0"]
        assert [f["_id"]["$in"] for f, _ in collection.marks] == [["t0"]]
        assert collection.failures == []  # left to the relay: no attempt counted, the claim simply expires
        assert outbox.counters.left == 2


async def test_while_the_broker_is_away_the_dispatch_queue_stops_growing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatcher_module, "DISPATCH_QUEUE_LIMIT", 5)
    collection, broker = Collection(), Broker()
    async with dispatching(collection, broker, batch_size=2, claim_seconds=600) as outbox:
        in_flight = records(outbox, 2, "a")
        outbox.submit(in_flight)
        await asyncio.sleep(0.05)  # taken as a batch: waiting for its confirms
        queued, refused = records(outbox, 3, "b"), records(outbox, 3, "c")
        outbox.submit(queued)
        outbox.submit(refused)  # 3 + 3 > 5: this transaction's records wait for a relay
        assert outbox.counters.left == 3
        broker.release.set()
        await outbox.drain()
        assert broker.sent == ["a0", "a1", "b0", "b1", "b2"]


async def test_a_stopped_dispatcher_claims_nothing_and_takes_nothing() -> None:
    collection = Collection()
    outbox = dispatcher(collection)
    assert outbox.claim() is None  # not started: records are born free, for a relay
    outbox.start(FixedTransport(Broker().send), TaskSet())
    assert outbox.claim() is not None
    assert await outbox.stop(1.0) is True
    assert outbox.claim() is None
    outbox.submit([{"_id": "late"}])  # a commit after the stop: left claimed, for a relay
    assert collection.marks == []


class FlakyRelay(OutboxRelay):
    """A relay whose first claim meets a record the driver cannot decode; no database behind it."""

    def __init__(self, **options: Any) -> None:
        super().__init__(Collection(), OutboxOptions(**options), "relay")  # type: ignore[arg-type]
        self.claims = 0

    async def refresh_counts(self) -> None:
        pass

    async def _claim_batch(self) -> list[dict[str, Any]]:
        self.claims += 1
        if self.claims == 1:
            raise InvalidBSON("year 0 is out of range")
        return []


async def test_the_relay_outlives_a_claim_that_fails_with_something_else_than_a_database_error() -> None:
    relay = FlakyRelay(poll_interval=0.01)
    task = asyncio.ensure_future(relay.run(FixedTransport(Broker().send)))
    await asyncio.sleep(0.1)
    assert not task.done()
    assert relay.claims > 1  # it went on polling
    relay._task = task
    assert await relay.stop(1.0) is True


async def test_a_relay_stopped_while_claiming_ends_without_waiting_its_poll_interval() -> None:
    relay = FlakyRelay(poll_interval=60)
    claiming = asyncio.Event()
    proceed = asyncio.Event()

    async def slow_claim() -> list[dict[str, Any]]:
        claiming.set()
        await proceed.wait()
        return []

    relay._claim_batch = slow_claim  # type: ignore[method-assign]
    relay._task = asyncio.ensure_future(relay.run(FixedTransport(Broker().send)))
    await claiming.wait()
    stopping = asyncio.ensure_future(relay.stop(30.0))
    await asyncio.sleep(0)
    proceed.set()  # the claim finds nothing after the stop's wake-up
    started = asyncio.get_running_loop().time()
    assert await stopping is True
    assert asyncio.get_running_loop().time() - started < 1.0
    assert not relay._task.cancelled()  # it ended on its own, not by the stop's cancellation


def test_records_that_fail_together_get_one_delay_and_a_transport_only_batch_opens_the_breaker() -> None:
    options = OutboxOptions(backoff_base=0.5, backoff_max=60.0)
    counters, breaker = OutboxCounters(options), Breaker(options)
    batch = [{"_id": f"r{i}", "attempts": 0, "exchange": "", "routing_key": "k", "seq": i} for i in range(10)]
    settled = counters.settle(batch, [TimeoutError()] * 10, breaker)
    assert len({failure.delay for _, failure in settled.failures}) == 1  # due together: seq decides
    assert not any(failure.counted for _, failure in settled.failures)
    assert 0.25 <= settled.pause < 0.5  # the first step of the backoff rule
    assert breaker.streak == 1
    again = counters.settle(batch, [TimeoutError()] * 10, breaker)
    assert 0.5 <= again.pause < 1.0
    assert breaker.streak == 2
    # Same attempts, same class: one delay, whatever the number of records.
    own = counters.settle(batch, [PublishError("unroutable", "x")] * 10, breaker)
    assert len({failure.delay for _, failure in own.failures}) == 1
    assert own.pause == 0.0
    assert breaker.streak == 0


def test_the_breakers_wait_is_bounded() -> None:
    options = OutboxOptions(backoff_base=1.0, backoff_max=3600.0)
    breaker = Breaker(options)
    breaker.streak = 50
    assert breaker.delay(0.999) <= BREAKER_MAX


def test_the_outbox_connection_is_named_after_the_consumers() -> None:
    named = URL(outbox_url("amqp://u:p%40ss@127.0.0.1:5672/vh?name=svc&heartbeat=30"))
    assert (named.query["name"], named.query["heartbeat"], named.password, named.path) == (
        "svc (outbox)",
        "30",
        "p@ss",
        "/vh",
    )
    assert URL(outbox_url("amqp://127.0.0.1/")).query["name"] == "lily-mongo outbox"


def test_the_outbox_connection_of_a_cluster_keeps_its_host_list() -> None:
    url = outbox_url("amqp://u:p@h1:5672,h2:5673,h3/vh?name=svc")
    assert url.startswith("amqp://u:p@h1:5672,h2:5673,h3/vh?")
    assert [URL(node).query["name"] for node in split_nodes(url)] == ["svc (outbox)"] * 3
