"""The outbox under real faults (docs/outbox.md, "Failure classes"): a broker that stops reading parks
nothing, a record for a missing exchange fails alone without resetting a connection, an undecodable
record parks alone, and a transaction that failed as a whole is retried in write order.

Every test runs against the real broker (a TCP proxy in front of it where the broker must stall or
vanish) and the test's MongoDB server, and asserts the outbox documents and what the queues hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from collections.abc import AsyncIterator
from typing import Any

import aio_pika.abc
import pytest
from bson.codec_options import CodecOptions

from lily_mongo import MongoScope, OutboxOptions, queue
from lily_mongo._amqp import connect_amqp
from lily_mongo._outbox import Outbox, OutboxRelay, OutboxTransaction
from lily_mongo._outbox import process as process_module
from lily_mongo._outbox import relay as relay_module
from lily_mongo._tasks import TaskSet
from lily_mongo.testing import Faults
from tests.integration.test_outbox import OUTBOX, event_ids, outbox_consumer, outbox_record
from tests.support.broker import Broker
from tests.support.consumers import outcomes, running
from tests.support.mongo import MongoDB
from tests.support.polling import eventually
from tests.support.proxy import HoldingProxy

# How long the broker stops reading: long enough for many confirm timeouts (0.5 s each) and
# re-claims; the behaviour is the same for the 3 minutes of a real alarm, only slower to watch.
HOLD_SECONDS = 8.0
FAST_RETRY = OutboxOptions(
    max_attempts=2, poll_interval=0.05, backoff_base=0.05, backoff_max=0.5, count_interval=0.1, claim_seconds=5.0
)


@contextlib.asynccontextmanager
async def relay_on(
    url: str, relay: OutboxRelay, confirm_timeout: float
) -> AsyncIterator[aio_pika.abc.AbstractConnection]:
    """``relay`` running on a connection of its own to ``url``; stopped and closed afterwards."""
    connection = await connect_amqp(url)
    owner = TaskSet()
    try:
        await relay.start(connection, confirm_timeout, owner)
        yield connection
    finally:
        assert await relay.stop(10.0), "the relay did not stop"
        await connection.close()


async def statuses(mongodb: MongoDB) -> dict[str, int]:
    counts: dict[str, int] = {}
    for doc in await mongodb.db[OUTBOX].find({}, {"status": 1}).to_list():
        counts[doc["status"]] = counts.get(doc["status"], 0) + 1
    return counts


# -- a broker that stops reading ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hold", "options", "confirm_timeout"),
    [
        pytest.param(HOLD_SECONDS, FAST_RETRY, 0.5, id="8s-fast-retries"),
        # The defaults (10 attempts, backoff to 60 s, a 10 s confirm timeout) through a 3-minute stall,
        # what a memory or disk alarm lasts: before failure classes, it parked every record.
        pytest.param(
            180.0,
            OutboxOptions(poll_interval=0.2, count_interval=0.5),
            10.0,
            id="3min-defaults",
            marks=pytest.mark.timeout(420),
        ),
    ],
)
async def test_a_broker_that_stops_reading_parks_nothing_and_every_record_is_delivered_once_it_reads(
    mongodb: MongoDB, broker: Broker, hold: float, options: OutboxOptions, confirm_timeout: float
) -> None:
    """Held bytes time out every confirm (a transport failure): no attempt counted, nothing parked;
    once the bytes flow, all 20 records are delivered and marked published."""
    down = await broker.declare(broker.queue("down"))
    outbox = mongodb.db[OUTBOX]
    records = [outbox_record(down, {"n": i}) for i in range(20)]
    relay = OutboxRelay(outbox, options, "relay-held")
    async with (
        HoldingProxy.fronting_broker(broker.url) as proxy,
        relay_on(proxy.url(broker.url), relay, confirm_timeout),
    ):
        proxy.hold()
        try:
            await outbox.insert_many(records)
            await asyncio.sleep(hold)
            assert await outbox.count_documents({"status": "failed"}) == 0
        finally:
            proxy.flow()

        async def all_published() -> bool:
            return (await statuses(mongodb)).get("published", 0) == len(records)

        # after the stall, the breaker's wait (at most 30 s) and a record's backoff (at most backoff_max)
        wait = 30 + options.backoff_max + 2 * confirm_timeout
        await eventually(all_published, what="every record published once the broker reads", timeout=wait)
    assert await statuses(mongodb) == {"published": len(records)}
    counted = [(doc["_id"], doc.get("last_error")) for doc in await outbox.find({"attempts": {"$ne": 0}}).to_list()]
    assert not counted, f"attempts counted on a transport failure: {counted}"
    # At least once: a publish held by the proxy may arrive besides its retry.
    assert set(event_ids(await broker.drain(down))) == {r["event_id"] for r in records}


# -- a bad destination is isolated -----------------------------------------------------------------


async def test_a_record_for_a_missing_exchange_fails_alone_and_resets_no_connection(
    mongodb: MongoDB, broker: Broker
) -> None:
    """40 records, the 21st for an exchange that does not exist, relayed by a consumer's relay while
    the consumer settles deliveries: the 39 others are delivered with no attempt counted, the bad one
    fails as its own fault, no connection is reset, and every delivery is acked once."""
    q, down = broker.queue("busy"), await broker.declare(broker.queue("down"))
    missing = broker.names.exchange("missing")  # never declared
    outbox = mongodb.db[OUTBOX]
    records = [outbox_record(down, {"n": i}) for i in range(40)]
    records[20]["exchange"] = missing

    @queue(q, version=1, content="json")
    async def handle(mongo: MongoScope) -> None:
        await asyncio.sleep(0.03)  # deliveries stay in flight while the relay publishes

    options = OutboxOptions(max_attempts=3, poll_interval=0.05, backoff_base=0.05, backoff_max=0.2, count_interval=0.1)
    consumer = outbox_consumer(broker, mongodb, q, handle, outbox=options, prefetch=8)
    async with running(consumer, expect_clean=False) as managed:
        relay_channel = managed._outbox.relay._channel  # type: ignore[union-attr]
        assert relay_channel is not None
        first = (await relay_channel.get_underlay_channel()).connection
        await broker.publish_all(q, [{"n": i} for i in range(30)])
        await outbox.insert_many(records)  # relayed while the deliveries are in flight

        async def settled() -> bool:
            good = await outbox.count_documents({"status": "published"})
            return good == 39 and len(outcomes(managed)) == 30

        await eventually(settled, what="39 records published and 30 deliveries settled", timeout=20)
        assert (await relay_channel.get_underlay_channel()).connection is first  # no reconnect
        assert managed.snapshot().transport_generation == 1
        assert outcomes(managed) == ["acked"] * 30
    assert await broker.depth(q) == 0
    bad = await outbox.find_one({"_id": records[20]["_id"]})
    assert bad is not None
    assert bad["attempts"] >= 1
    assert "not found" in bad["last_error"]
    good = await outbox.find({"_id": {"$ne": records[20]["_id"]}}).to_list()
    assert {(doc["status"], doc["attempts"]) for doc in good} == {("published", 0)}
    delivered = event_ids(await broker.drain(down))
    assert sorted(set(delivered)) == sorted(r["event_id"] for i, r in enumerate(records) if i != 20)


# -- one bad document fails alone -----------------------------------------------------------------


async def test_an_undecodable_record_parks_alone_with_its_cause_and_the_others_are_published(
    mongodb: MongoDB, broker: Broker
) -> None:
    """One of 150 records holds a date its relay's client cannot decode: 9999-12-31T23:30Z read by a client
    with tz-aware dates in UTC+05:00 is past year 9999 (PyMongo raises InvalidBSON for the whole reply)."""
    down = await broker.declare(broker.queue("down"))
    outbox = mongodb.db[OUTBOX]
    records = [outbox_record(down, {"n": i}) for i in range(150)]
    records[7]["created_at"] = datetime.datetime(9999, 12, 31, 23, 30, tzinfo=datetime.UTC)
    await outbox.insert_many(records)
    plus5 = datetime.timezone(datetime.timedelta(hours=5))
    local: Any = outbox.with_options(codec_options=CodecOptions(tz_aware=True, tzinfo=plus5))
    relay = OutboxRelay(local, OutboxOptions(poll_interval=0.05, count_interval=0.1), "relay-raw")
    async with relay_on(broker.url, relay, 5.0):

        async def all_published() -> bool:
            return await outbox.count_documents({"status": "published"}) == 149

        await eventually(all_published, what="the 149 decodable records published", timeout=15)
    bad = await outbox.find_one({"_id": records[7]["_id"]})
    assert bad is not None
    assert bad["status"] == "failed"
    assert "undecodable" in bad["last_error"]
    delivered = event_ids(await broker.drain(down))
    assert sorted(delivered) == sorted(r["event_id"] for i, r in enumerate(records) if i != 7)


# -- order kept on retry ----------------------------------------------------------------------------


async def test_a_transaction_that_failed_as_a_whole_is_retried_in_write_order(mongodb: MongoDB, broker: Broker) -> None:
    """The broker's connection is gone when a transaction of 10 records commits: the dispatch fails as a
    whole (a transport failure), and the relay publishes the 10 in write order once it reconnects."""
    down = await broker.declare(broker.queue("down"))
    options = OutboxOptions(poll_interval=0.05, backoff_base=0.05, backoff_max=0.2, count_interval=0.1)
    async with HoldingProxy.fronting_broker(broker.url) as proxy:
        outbox = Outbox(
            mongodb.client, mongodb.name, amqp_url=proxy.url(broker.url), options=options, confirm_timeout=0.5
        )
        async with outbox:
            proxy.refusing = True
            proxy.cut_all()

            async def write(tx: OutboxTransaction) -> list[str]:
                return [str(await tx.publish_json(down, {"n": i}, version=1)) for i in range(10)]

            written = await outbox.transaction(write)
            await outbox.process.dispatched()  # the dispatch failed: the records are released
            released = await mongodb.db[OUTBOX].find({}).sort("seq", 1).to_list()
            assert [doc["attempts"] for doc in released] == [0] * 10
            assert len({doc["available_at"] for doc in released}) == 1  # due together: seq decides
            proxy.refusing = False
            await broker.wait_for_depth(down, 10, timeout=30)
    assert event_ids(await broker.drain(down)) == written


# -- marks keep up ------------------------------------------------------------------------------------


async def test_a_mark_that_fails_once_is_retried_and_nothing_is_published_twice(
    mongodb: MongoDB, broker: Broker, failpoints: Faults
) -> None:
    """The first mark write fails (a stepdown's PrimarySteppedDown on ``update``): it is written again,
    so no relay publishes the records once their claim (3 s here) has expired."""
    down = await broker.declare(broker.queue("down"))
    options = OutboxOptions(claim_seconds=3.0, mark_interval=0.2, poll_interval=0.05, count_interval=0.1)
    outbox = Outbox(mongodb.client, mongodb.name, amqp_url=broker.url, options=options, confirm_timeout=0.5)
    async with outbox:
        await failpoints.fail(["update"], code=189, times=1, namespace=f"{mongodb.name}.{OUTBOX}")

        async def write(tx: OutboxTransaction) -> list[str]:
            return [str(await tx.publish_json(down, {"n": i}, version=1)) for i in range(5)]

        written = await outbox.transaction(write)
        await outbox.process.dispatched()
        assert outbox.process.counters.left == 0  # the dispatcher published them
        await asyncio.sleep(options.claim_seconds + 1.0)  # past the claim: a lost mark would be relayed again
        assert await mongodb.db[OUTBOX].count_documents({"status": "published"}) == 5
    assert event_ids(await broker.drain(down)) == written


# -- server time --------------------------------------------------------------------------------------


async def test_a_backward_clock_step_causes_no_second_publish_by_a_relay(
    mongodb: MongoDB, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writing process's wall clock steps back two minutes after its start (NTP, a VM resumed): its
    records' claims still run ``claim_seconds`` on the server's clock, so a relay beside it (another
    process's, on the true clock) publishes none of them again."""
    down = await broker.declare(broker.queue("down"))
    options = OutboxOptions(run_relay=False, count_interval=0.1)  # marks within mark_interval (1 s)
    relay = OutboxRelay(mongodb.db[OUTBOX], OutboxOptions(poll_interval=0.05, count_interval=0.1), "relay-beside")
    outbox = Outbox(mongodb.client, mongodb.name, amqp_url=broker.url, options=options, confirm_timeout=0.5)
    async with outbox, relay_on(broker.url, relay, 5.0):
        stepped = datetime.timedelta(minutes=2)
        monkeypatch.setattr(process_module, "utcnow", lambda: datetime.datetime.now(datetime.UTC) - stepped)

        async def write(tx: OutboxTransaction) -> list[str]:
            return [str(await tx.publish_json(down, {"n": i}, version=1)) for i in range(5)]

        written = await outbox.transaction(write)
        await asyncio.sleep(2.0)  # the marks wait up to mark_interval; the relay polls 40 times meanwhile
        assert relay.counters.published == 0
    assert event_ids(await broker.drain(down)) == written


async def test_a_relay_whose_claim_is_shorter_than_twice_its_confirm_timeout_warns_at_start(
    mongodb: MongoDB, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    relay = OutboxRelay(mongodb.db[OUTBOX], OutboxOptions(claim_seconds=5.0), "relay-short")
    async with relay_on(broker.url, relay, 3.0):
        pass
    [warning] = [r for r in caplog.records if "claim_seconds" in r.getMessage()]
    assert warning.levelname == "WARNING"
    assert "5 s" in warning.getMessage()
    assert "3 s" in warning.getMessage()


async def test_the_snapshots_counts_stop_at_their_limit(mongodb: MongoDB, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay_module, "COUNT_LIMIT", 3)
    outbox = mongodb.db[OUTBOX]
    await outbox.insert_many([outbox_record("down", {"n": i}) for i in range(5)])
    relay = OutboxRelay(outbox, OutboxOptions(), "relay-counts")
    await relay.refresh_counts()
    assert (relay.counters.pending, relay.counters.failed) == (3, 0)  # five pending, shown as the limit


# -- polls fetch only what is due -----------------------------------------------------------------


async def test_a_record_in_flight_is_outside_the_due_querys_index_range(mongodb: MongoDB, broker: Broker) -> None:
    """A born-claimed record becomes due when its claim expires: until then the due query's index bounds
    (status, available_at) exclude it, so an idle relay's poll fetches nothing that is merely in flight."""
    down = await broker.declare(broker.queue("down"))
    options = OutboxOptions(run_relay=False, count_interval=0.1)  # marks wait up to mark_interval (1 s)
    outbox = Outbox(mongodb.client, mongodb.name, amqp_url=broker.url, options=options, confirm_timeout=0.5)
    async with outbox:

        async def write(tx: OutboxTransaction) -> None:
            for i in range(3):
                await tx.publish_json(down, {"n": i}, version=1)

        await outbox.transaction(write)
        records = await mongodb.db[OUTBOX].find({"status": "pending"}).to_list()
        assert len(records) == 3  # committed, not marked yet
        assert {r["available_at"] for r in records} == {r["claim_expires"] for r in records}
        in_range = {"status": "pending", "available_at": {"$lte": outbox.process.clock()}}
        assert await mongodb.db[OUTBOX].count_documents(in_range) == 0
        await outbox.process.dispatched()


async def test_a_claim_implausibly_far_ahead_counts_as_free(mongodb: MongoDB, broker: Broker) -> None:
    """A record born claimed by a writer whose clock read a day ahead: a relay publishes it now, not tomorrow."""
    down = await broker.declare(broker.queue("down"))
    outbox = mongodb.db[OUTBOX]
    tomorrow = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=1)
    record = outbox_record(
        down, {"n": 0}, claim_owner="w", claim_token="t", claim_expires=tomorrow, available_at=tomorrow
    )
    await outbox.insert_one(record)
    relay = OutboxRelay(outbox, OutboxOptions(poll_interval=0.05, count_interval=0.1), "relay-ahead")
    async with relay_on(broker.url, relay, 5.0):
        await broker.wait_for_depth(down, 1, timeout=10)
    assert event_ids(await broker.drain(down)) == [record["event_id"]]


# -- bounded relay memory -----------------------------------------------------------------------------


async def test_a_relay_batch_holds_at_most_its_byte_cap_and_releases_the_rest(
    mongodb: MongoDB, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a cap of 10 KiB and 20 records of 4 KiB claimed together, a batch reads 3 of them; the others'
    claims are released at once and the next passes publish them: all 20 once, none parked."""
    monkeypatch.setattr(relay_module, "RELAY_BATCH_BYTES", 10 * 1024)
    down = await broker.declare(broker.queue("down"))
    outbox = mongodb.db[OUTBOX]
    records = [outbox_record(down, {"n": i, "pad": "x" * 4096}) for i in range(20)]
    await outbox.insert_many(records)
    relay = OutboxRelay(outbox, OutboxOptions(poll_interval=0.05, count_interval=0.1), "relay-capped")
    sizes: list[int] = []
    publish = relay._relay

    async def noted(batch: list[dict[str, Any]], transport: Any) -> float:
        sizes.append(len(batch))
        return await publish(batch, transport)

    relay._relay = noted  # type: ignore[method-assign]
    async with relay_on(broker.url, relay, 5.0):

        async def all_published() -> bool:
            return await outbox.count_documents({"status": "published"}) == 20

        await eventually(all_published, what="every record published in capped batches", timeout=15)
    assert max(sizes) == 3  # 3 x 4 KiB reach the 10 KiB cap
    assert sum(sizes) == 20
    assert sorted(event_ids(await broker.drain(down))) == sorted(r["event_id"] for r in records)


async def test_dispatch_pauses_while_the_oldest_mark_nears_the_end_of_its_claim(
    mongodb: MongoDB, broker: Broker, failpoints: Faults
) -> None:
    """The first mark write hangs 3 s (then fails and is retried). Once the oldest unwritten mark has less
    than mark_interval plus a quarter of claim_seconds of claim left (1.5 s of 4 s here), a transaction
    committed then waits in memory until the marks are written, and is published after."""
    down = await broker.declare(broker.queue("down"))
    options = OutboxOptions(run_relay=False, claim_seconds=4.0, mark_interval=0.5, count_interval=0.1)
    outbox = Outbox(mongodb.client, mongodb.name, amqp_url=broker.url, options=options, confirm_timeout=0.5)

    async def write(tx: OutboxTransaction) -> list[str]:
        return [str(await tx.publish_json(down, {"n": i}, version=1)) for i in range(5)]

    async with outbox:
        dispatcher = outbox.process.dispatcher
        await failpoints.fail(["update"], code=189, block_ms=3000, times=1, namespace=f"{mongodb.name}.{OUTBOX}")
        first = await outbox.transaction(write)
        await broker.wait_for_depth(down, 5)  # published at once; its mark now hangs
        await asyncio.sleep(2.7)  # past 4 s - 1.5 s of the first records' claim
        second = await outbox.transaction(write)
        await asyncio.sleep(0.2)
        assert len(dispatcher._queue) == 5  # held back while the marks lag
        await outbox.process.dispatched()
        assert await mongodb.db[OUTBOX].count_documents({"status": "published"}) == 10
        assert outbox.process.counters.left == 0
    assert event_ids(await broker.drain(down)) == first + second
