"""The transactional outbox against the real broker and the MongoDB-wire server (docs/outbox.md).

A handler stages messages with ``mongo.outbox.publish_*``: the record commits with
the handler's writes or not at all. The consumer's dispatcher publishes a committed
attempt's records right after the commit, mandatory with confirms, and marks them
``published`` (TTL retention); a failed publish releases the record to the backstop
relay, which retries with backoff and parks it as ``failed`` after ``max_attempts``.
Every test asserts the outbox documents and what the downstream queue holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aio_pika.abc
import orjson
import pytest
from bson import Binary

from lily_mongo import (
    ConfigError,
    Consumer,
    DeliveryContext,
    EventId,
    Json,
    MongoScope,
    OutboxOptions,
    QueueHandlerError,
    RetryPolicy,
    queue,
)
from lily_mongo._outbox import OutboxRelay
from lily_mongo._tasks import TaskSet
from lily_mongo.envelope import validate_envelope
from lily_mongo.publisher import JSON, prepare_publication
from lily_mongo.testing import Faults
from tests.support.broker import Broker, headers_of
from tests.support.consumers import outcomes, running
from tests.support.mongo import MongoDB
from tests.support.polling import eventually

OUTBOX = "lily_outbox"
EFFECTS = "effects"
FAST = OutboxOptions(poll_interval=0.1, count_interval=0.1)
SEVEN_DAYS = 7 * 24 * 3600.0


# -- helpers --------------------------------------------------------------------------------------


def outbox_consumer(
    broker: Broker, mongodb: MongoDB, q: str, handler: Callable[..., Awaitable[None]], **options: Any
) -> Consumer:
    """A consumer of ``q`` with an inbox and a fast relay (one permit; retry copies stay parked in their bucket)."""
    options.setdefault("outbox", FAST)
    defaults: dict[str, Any] = {"concurrency": 1, "prefetch": 4, "retry": RetryPolicy(max_retries=1, delays=(30,))}
    return broker.consumer(
        q,
        handler,
        name="outbox-test",
        mongodb=mongodb,
        graceful_timeout=10.0,
        force_timeout=2.0,
        **(defaults | options),
    )


def forwarding_consumer(broker: Broker, mongodb: MongoDB, q: str, destination: str, **options: Any) -> Consumer:
    """An :func:`outbox_consumer` whose handler writes one outbox message to ``destination`` per event."""

    @queue(q, version=1, content="json")
    async def handle(event_id: EventId, mongo: MongoScope) -> None:
        await mongo.outbox.publish_json(destination, {"from": str(event_id)}, version=1)

    return outbox_consumer(broker, mongodb, q, handle, **options)


async def source_and_downstream(broker: Broker, base: str) -> tuple[str, str]:
    """A queue for the test's consumer and a declared downstream queue its outbox messages go to."""
    return broker.queue(base), await broker.declare(broker.queue("down"))


def outbox_record(routing_key: str, payload: Any, **fields: Any) -> dict[str, Any]:
    """A pending, unclaimed record shaped like the ones an outbox writer inserts (for relays run directly)."""
    publication = prepare_publication(JSON, routing_key, payload, version=1)
    now = datetime.datetime.now(datetime.UTC)
    record: dict[str, Any] = {
        "_id": uuid.uuid4().hex,
        "event_id": str(publication.event_id),
        "exchange": publication.exchange,
        "routing_key": publication.routing_key,
        "body": Binary(publication.body),
        "headers": publication.headers,
        "content_type": publication.content_type,
        "handler": "direct/test",
        "status": "pending",
        "attempts": 0,
        "created_at": now,
        "available_at": now,
        "seq": 0,
    }
    record.update(fields)
    return record


@contextlib.asynccontextmanager
async def relays_running(
    connection: aio_pika.abc.AbstractConnection, relays: list[OutboxRelay]
) -> AsyncIterator[list[asyncio.Task[None]]]:
    """Start relays as a consumer does (each on its own confirming channel); stop them afterwards."""
    owner = TaskSet()
    for relay in relays:
        await relay.start(connection, 5.0, owner)
    tasks = owner.pending()
    try:
        yield list(tasks)
    finally:
        for relay in relays:
            assert await relay.stop(10.0), "a relay did not stop"
        assert not owner.pending()


def event_ids(messages: list[aio_pika.abc.AbstractIncomingMessage]) -> list[str]:
    return [str(m.headers["x-lily-event-id"]) for m in messages]


# -- a committed record is relayed ----------------------------------------------------------------


async def test_committed_record_is_published_with_canonical_headers_and_marked(
    broker: Broker, mongodb: MongoDB
) -> None:
    q, down = await source_and_downstream(broker, "src")
    given = uuid.uuid4()
    staged: list[tuple[uuid.UUID, uuid.UUID]] = []

    @queue(q, version=1, content="json", handler_id=f"{q}/relay")
    async def handle(order: Json[dict[str, Any]], event_id: EventId, mongo: MongoScope) -> None:
        first = await mongo.outbox.publish_json(down, {"order": order["n"], "from": str(event_id)}, version=1)
        second = await mongo.outbox.publish_json(down, {"order": order["n"], "copy": True}, version=2, event_id=given)
        staged.append((first, second))

    consumer = outbox_consumer(broker, mongodb, q, handle)
    async with running(consumer, expect_clean=False) as managed:
        source = await broker.publish(q, {"n": 7})
        await eventually(lambda: managed.snapshot().outbox_published == 2, what="two records relayed", interval=0.05)
        assert await broker.wait_for_depth(down, 2) == 2
        await eventually(lambda: managed.snapshot().outbox_pending == 0, what="the relay's idle count", interval=0.05)
    assert outcomes(managed) == ["acked"]
    generated, returned_given = staged[-1]
    assert returned_given == given
    assert generated != given

    messages = {str(m.headers["x-lily-event-id"]): m for m in await broker.drain(down)}
    assert set(messages) == {str(generated), str(given)}
    for event, version, payload in (
        (generated, "1", {"order": 7, "from": str(source)}),
        (given, "2", {"order": 7, "copy": True}),
    ):
        message = messages[str(event)]
        assert message.headers["x-lily-schema-version"] == version
        assert message.headers["x-lily-content-kind"] == "json"
        assert "x-retry-count" not in message.headers
        assert message.content_type == "application/json"
        assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
        assert orjson.loads(message.body) == payload
        envelope = validate_envelope(message.headers, len(message.body))
        assert (envelope.event_id, envelope.schema_version) == (event, int(version))

    records = await mongodb.db[OUTBOX].find({}).sort("seq", 1).to_list()
    assert [r["event_id"] for r in records] == [str(generated), str(given)]  # seq is the write order
    assert [r["seq"] for r in records] == [0, 1]
    # Born claimed by the consumer's dispatcher, published by it: no relay ever claimed them.
    assert len({(r["claim_owner"], r["claim_token"]) for r in records}) == 1
    assert records[0]["claim_owner"].startswith("outbox-test:")
    for record in records:
        assert record["status"] == "published"
        assert record["handler"] == f"{q}/relay"
        assert record["attempts"] == 0
        assert "claim_expires" not in record
        assert (record["expires_at"] - record["published_at"]).total_seconds() == pytest.approx(SEVEN_DAYS, abs=1)
    assert managed.snapshot().outbox_failed == 0
    # Published records are retained by a TTL index on expires_at.
    indexes = await mongodb.db[OUTBOX].index_information()
    assert [i.get("expireAfterSeconds") for i in indexes.values() if i["key"] == [("expires_at", 1)]] == [0]


async def test_aborted_attempt_publishes_nothing(broker: Broker, mongodb: MongoDB) -> None:
    q, down = await source_and_downstream(broker, "abort")
    calls: list[uuid.UUID] = []

    @queue(q, version=1, content="json")
    async def handle(event_id: EventId, mongo: MongoScope) -> None:
        calls.append(event_id)
        await mongo.outbox.publish_json(down, {"from": str(event_id)}, version=1)
        raise QueueHandlerError.permanent("ORDER_INVALID", "no lines")

    consumer = outbox_consumer(broker, mongodb, q, handle)
    async with running(consumer, expect_clean=False) as managed:
        event = await broker.publish(q, {"n": 1})
        await eventually(lambda: outcomes(managed) == ["dead_lettered"], what="the DLQ handoff", interval=0.05)
        # Several relay polls pass: nothing is there to publish.
        await asyncio.sleep(0.5)
        await eventually(lambda: managed.snapshot().outbox_pending == 0, what="the relay's idle count", interval=0.05)
        assert managed.snapshot().outbox_published == 0
    assert calls == [event]
    assert await mongodb.db[OUTBOX].count_documents({}) == 0
    assert await broker.depth(down) == 0
    [copy] = await broker.drain(f"{q}.dlq")
    assert copy.headers["x-lily-failure-code"] == "ORDER_INVALID"
    assert copy.headers["x-lily-event-id"] == str(event)


async def test_transient_replay_writes_and_publishes_exactly_one_record(
    broker: Broker, mongodb: MongoDB, failpoints: Faults
) -> None:
    q, down = await source_and_downstream(broker, "replay")
    staged: list[uuid.UUID] = []

    @queue(q, version=1, content="json")
    async def handle(event_id: EventId, mongo: MongoScope) -> None:
        # The outbox write comes first, so the failing attempt has already staged a record.
        staged.append(await mongo.outbox.publish_json(down, {"from": str(event_id)}, version=1))
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id)}, session=mongo.session)

    attempts: list[int] = []

    async def middleware(ctx: DeliveryContext, call_next: Callable[[], Awaitable[None]]) -> None:
        attempts.append(ctx.attempt)  # every replay is a fresh middleware invocation
        await call_next()

    consumer = outbox_consumer(broker, mongodb, q, handle)
    consumer.use(middleware)
    async with running(consumer, expect_clean=False) as managed:
        await failpoints.fail(
            ["insert"], code=112, labels=["TransientTransactionError"], namespace=f"{mongodb.name}.{EFFECTS}"
        )
        event = await broker.publish(q, {"n": 1})
        await eventually(lambda: outcomes(managed) == ["acked"], what="the delivery", interval=0.05)
        await eventually(lambda: managed.snapshot().outbox_published == 1, what="the relay", interval=0.05)
        assert await broker.wait_for_depth(down, 1) == 1
        await asyncio.sleep(0.3)  # a few relay polls: no second message appears
        assert await broker.depth(down) == 1
    await failpoints.clear()
    [observation] = managed.delivery_terminal_observations()
    assert observation.transient_replays >= 1
    assert len(staged) == observation.attempts == observation.transient_replays + 1
    assert len(set(staged)) == len(staged)  # every attempt stages its own message
    assert attempts == list(range(1, observation.attempts + 1))
    db = mongodb.db
    [record] = await db[OUTBOX].find({}).to_list()
    assert record["event_id"] == str(staged[-1])
    assert record["status"] == "published"
    assert await db[EFFECTS].count_documents({"event_id": str(event)}) == 1
    assert event_ids(await broker.drain(down)) == [str(staged[-1])]


# -- relay failures -------------------------------------------------------------------------------


async def test_unroutable_record_is_retried_then_parked_as_failed(broker: Broker, mongodb: MongoDB) -> None:
    q = broker.queue("unroutable")
    nowhere = f"{broker.names.prefix}.nowhere"  # no queue is bound to this routing key

    options = OutboxOptions(max_attempts=2, backoff_base=0.05, poll_interval=0.1, count_interval=0.1)
    consumer = forwarding_consumer(broker, mongodb, q, nowhere, outbox=options)
    outbox = mongodb.db[OUTBOX]
    async with running(consumer, expect_clean=False) as managed:
        await broker.publish(q, {"n": 1})
        await eventually(lambda: outcomes(managed) == ["acked"], what="the delivery", interval=0.05)

        async def parked() -> bool:
            return await outbox.count_documents({"status": "failed"}) == 1

        await eventually(parked, what="the record parked as failed", interval=0.05)
        await eventually(lambda: managed.snapshot().outbox_failed == 1, what="snapshot().outbox_failed", interval=0.05)
        snapshot = managed.snapshot()
        assert (snapshot.outbox_pending, snapshot.outbox_published) == (0, 0)
    [record] = await outbox.find({}).to_list()
    assert record["status"] == "failed"
    assert record["attempts"] == 2
    assert "unroutable" in record["last_error"]
    assert "claim_expires" not in record
    assert "published_at" not in record


async def test_an_unroutable_destination_is_logged_once_by_name_and_counted(
    broker: Broker, mongodb: MongoDB, caplog: pytest.LogCaptureFixture
) -> None:
    q = broker.queue("unroutable-log")
    nowhere = f"{broker.names.prefix}.orders.confirmed"  # nothing declares this queue

    relay = OutboxOptions(max_attempts=4, backoff_base=0.02, backoff_max=0.05, poll_interval=0.05)
    consumer = forwarding_consumer(broker, mongodb, q, nowhere, outbox=relay)
    outbox = mongodb.db[OUTBOX]
    caplog.set_level("WARNING", logger="lily_mongo")
    async with running(consumer, expect_clean=False) as managed:
        await broker.publish(q, {"n": 1})

        async def parked() -> bool:
            return await outbox.count_documents({"status": "failed"}) == 1

        await eventually(parked, what="the record parked as failed", interval=0.05)
        unroutable = managed.snapshot().outbox_unroutable
    # Four attempts, each refused as unroutable: counted four times, warned about once (rate-limited).
    assert unroutable == 4
    warnings = [r.getMessage() for r in caplog.records if r.name == "lily_mongo" and r.levelname == "WARNING"]
    unroutable_lines = [line for line in warnings if "unroutable" in line and "parked" not in line]
    assert len(unroutable_lines) == 1, warnings
    assert f"routing key {nowhere!r}" in unroutable_lines[0]
    parked_lines = [line for line in warnings if "parked as failed after 4 attempts" in line]
    assert len(parked_lines) == 1, warnings
    assert nowhere in parked_lines[0]


async def test_start_warns_about_a_declared_destination_that_does_not_exist(
    broker: Broker, mongodb: MongoDB, caplog: pytest.LogCaptureFixture
) -> None:
    q = broker.queue("dest-check")
    missing = f"{broker.names.prefix}.missing"

    @queue(q, version=1, content="json")
    async def handle(mongo: MongoScope) -> None:
        await mongo.outbox.publish_json(missing, {}, version=1)

    consumer = outbox_consumer(broker, mongodb, q, handle)
    consumer.sends(missing, version=1)
    caplog.set_level("WARNING", logger="lily_mongo")
    async with running(consumer):
        pass
    warnings = [r.getMessage() for r in caplog.records if r.name == "lily_mongo" and r.levelname == "WARNING"]
    assert any(f"outbox destination queue {missing!r} does not exist" in line for line in warnings), warnings


async def test_a_destination_declared_by_the_consumer_makes_its_records_routable(
    broker: Broker, mongodb: MongoDB
) -> None:
    q = broker.queue("dest-src")
    destination = broker.queue("dest-confirmed")
    consumer = forwarding_consumer(broker, mongodb, q, destination)
    consumer.sends(destination, version=1, declare=True)
    async with running(consumer) as managed:
        await broker.publish(q, {"n": 1})
        assert await broker.wait_for_depth(destination, 1) == 1
        assert managed.snapshot().outbox_unroutable == 0

    # Declared as a lily_mongo consumer of it declares it: such a consumer starts on the same queue.
    @queue(destination, version=1, content="json")
    async def downstream(event_id: EventId) -> None: ...

    downstream_consumer = Consumer(amqp_url=broker.url, name="downstream")
    downstream_consumer.include(downstream)
    async with running(downstream_consumer) as managed:
        await eventually(lambda: outcomes(managed) == ["acked"], what="the relayed message consumed", interval=0.05)


async def test_a_record_for_a_missing_exchange_does_not_stall_the_relay(broker: Broker, mongodb: MongoDB) -> None:
    """Publishing to a missing exchange makes the broker close the relay's channel; later records still go."""
    q, down = await source_and_downstream(broker, "exchange")
    missing = broker.names.exchange("missing")  # never declared
    staged: dict[str, uuid.UUID] = {}

    @queue(q, version=1, content="json")
    async def handle(order: Json[dict[str, Any]], mongo: MongoScope) -> None:
        exchange = missing if order["bad"] else ""
        staged[order["name"]] = await mongo.outbox.publish_json(down, order, version=1, exchange=exchange)

    options = OutboxOptions(max_attempts=2, backoff_base=0.05, poll_interval=0.1, count_interval=0.1)
    consumer = outbox_consumer(broker, mongodb, q, handle, outbox=options)
    outbox = mongodb.db[OUTBOX]
    async with running(consumer, expect_clean=False) as managed:
        await broker.publish(q, {"name": "bad", "bad": True})
        await eventually(lambda: outcomes(managed) == ["acked"], what="the first delivery", interval=0.05)

        async def parked() -> bool:
            return await outbox.count_documents({"status": "failed"}) == 1

        # The broker closed the relay's channel on every attempt (404 NOT_FOUND): it is parked after two.
        await eventually(parked, what="the record for the missing exchange parked", interval=0.05)
        await broker.publish(q, {"name": "good", "bad": False})
        await eventually(
            lambda: managed.snapshot().outbox_published == 1, what="the good record published", interval=0.05
        )
        await eventually(lambda: managed.snapshot().outbox_failed == 1, what="the bad record parked", interval=0.05)
    assert event_ids(await broker.drain(down)) == [str(staged["good"])]
    bad = await outbox.find_one({"event_id": str(staged["bad"])})
    assert bad is not None
    assert (bad["status"], bad["attempts"]) == ("failed", 2)
    good = await outbox.find_one({"event_id": str(staged["good"])})
    assert good is not None
    assert (good["status"], good["attempts"]) == ("published", 0)


async def test_binary_header_values_are_relayed_as_byte_arrays(broker: Broker, mongodb: MongoDB) -> None:
    """A bytes header value passes validation and BSON; the relay sends it as an AMQP byte array."""
    q, down = await source_and_downstream(broker, "encode")
    staged: dict[str, uuid.UUID] = {}

    @queue(q, version=1, content="json")
    async def handle(order: Json[dict[str, Any]], mongo: MongoScope) -> None:
        headers = {"x-fingerprint": b"\x00\x01", "x-nested": {"raw": [b"\xff"]}}
        staged["one"] = await mongo.outbox.publish_json(down, order, version=1, headers=headers)

    consumer = outbox_consumer(broker, mongodb, q, handle)
    async with running(consumer, expect_clean=False) as managed:
        await broker.publish(q, {"name": "one"})
        await eventually(lambda: managed.snapshot().outbox_published == 1, what="the record published", interval=0.05)
    [message] = await broker.drain(down)
    assert message.headers["x-lily-event-id"] == str(staged["one"])
    headers = headers_of(message)
    assert bytes(headers["x-fingerprint"]) == b"\x00\x01"
    assert [bytes(v) for v in headers["x-nested"]["raw"]] == [b"\xff"]


async def test_a_malformed_record_is_a_failed_attempt_and_the_relay_goes_on(mongodb: MongoDB, broker: Broker) -> None:
    """A record the relay cannot publish (here: its routing key field is missing) is parked after
    its attempts; records after it are still published by the same relay."""
    down = broker.queue("down")
    await broker.declare(down)
    outbox = mongodb.db[OUTBOX]
    broken = outbox_record(down, {"n": 0})
    del broken["routing_key"]
    await outbox.insert_one(broken)
    good = outbox_record(down, {"n": 1}, available_at=broken["available_at"] + datetime.timedelta(milliseconds=1))
    await outbox.insert_one(good)
    relay = OutboxRelay(outbox, OutboxOptions(max_attempts=1, poll_interval=0.05, backoff_base=0.05), "relay-a")
    async with relays_running(broker.connection, [relay]) as tasks:
        await broker.wait_for_depth(down, 1)

        async def parked() -> bool:
            doc = await outbox.find_one({"_id": broken["_id"]})
            return doc is not None and doc["status"] == "failed"

        await eventually(parked, what="the malformed record parked", interval=0.05)
        assert not any(task.done() for task in tasks)  # the relay is still running
    assert event_ids(await broker.drain(down)) == [good["event_id"]]
    doc = await outbox.find_one({"_id": broken["_id"]})
    assert doc is not None
    assert "KeyError" in doc["last_error"]


# -- several relays, crash windows ----------------------------------------------------------------


async def test_two_relays_publish_every_record_exactly_once(mongodb: MongoDB, broker: Broker) -> None:
    down = broker.queue("down")
    await broker.declare(down)
    outbox = mongodb.db[OUTBOX]
    records = [outbox_record(down, {"n": i}) for i in range(12)]
    await outbox.insert_many(records)
    relays = [OutboxRelay(outbox, OutboxOptions(poll_interval=0.05), f"relay-{i}") for i in range(2)]
    async with relays_running(broker.connection, relays):

        async def all_published() -> bool:
            return await outbox.count_documents({"status": "published"}) == len(records)

        await eventually(all_published, what="every record published", interval=0.05)
        await asyncio.sleep(0.3)  # both relays poll again: nothing is republished
    messages = await broker.drain(down)
    published = event_ids(messages)
    assert len(published) == len(records)
    assert sorted(published) == sorted(r["event_id"] for r in records)
    assert sum(relay.counters.published for relay in relays) == len(records)
    for record in await outbox.find({}).to_list():
        assert record["status"] == "published"
        assert record["claim_owner"] in ("relay-0", "relay-1")


async def test_expired_claim_is_taken_over_and_a_live_claim_is_respected(mongodb: MongoDB, broker: Broker) -> None:
    down = broker.queue("down")
    await broker.declare(down)
    outbox = mongodb.db[OUTBOX]
    now = datetime.datetime.now(datetime.UTC)
    # A relay crashed after claiming: its claim expired a minute ago.
    crashed = outbox_record(
        down,
        {"n": "crashed"},
        claim_owner="crashed",
        claim_token="t1",
        claim_expires=now - datetime.timedelta(minutes=1),
    )
    # Another relay holds a live claim (it may be publishing right now). Within claim_seconds (30 s)
    # of now: a claim further ahead than any relay takes counts as free (docs/outbox.md, "Server time").
    held = outbox_record(
        down, {"n": "held"}, claim_owner="alive", claim_token="t2", claim_expires=now + datetime.timedelta(seconds=20)
    )
    await outbox.insert_many([crashed, held])
    relay = OutboxRelay(outbox, OutboxOptions(poll_interval=0.05), "relay-new")
    async with relays_running(broker.connection, [relay]):

        async def taken_over() -> bool:
            return await outbox.count_documents({"_id": crashed["_id"], "status": "published"}) == 1

        await eventually(taken_over, what="the expired claim taken over", interval=0.05)
        await asyncio.sleep(0.5)  # ten polls while the other claim is live
        still = await outbox.find_one({"_id": held["_id"]})
        assert still is not None
        assert (still["status"], still["claim_owner"], still["claim_token"]) == ("pending", "alive", "t2")
        assert event_ids(await broker.drain(down)) == [crashed["event_id"]]
        await eventually(lambda: relay.counters.pending == 1, what="the relay's idle count", interval=0.05)
        # Once that claim expires, the record is published after all.
        await outbox.update_one({"_id": held["_id"]}, {"$set": {"claim_expires": now - datetime.timedelta(seconds=1)}})

        async def released() -> bool:
            return await outbox.count_documents({"_id": held["_id"], "status": "published"}) == 1

        await eventually(released, what="the formerly held record published", interval=0.05)
    assert event_ids(await broker.drain(down)) == [held["event_id"]]
    taken = await outbox.find_one({"_id": crashed["_id"]})
    assert taken is not None
    assert taken["claim_owner"] == "relay-new"
    assert relay.counters.published == 2


# -- lifecycle ------------------------------------------------------------------------------------


async def test_graceful_shutdown_stops_the_relay_and_leaves_pending_records(broker: Broker, mongodb: MongoDB) -> None:
    q, down = await source_and_downstream(broker, "stop")

    @queue(q, version=1, content="json")
    async def handle(event_id: EventId, mongo: MongoScope) -> None:
        raise AssertionError("no delivery is published in this test")

    outbox = mongodb.db[OUTBOX]
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
    records = [outbox_record(down, {"n": i}, available_at=later) for i in range(3)]
    await outbox.insert_many(records)
    consumer = outbox_consumer(broker, mongodb, q, handle)
    managed = await consumer.start()
    try:
        await eventually(
            lambda: managed.snapshot().outbox_pending == 3, what="the relay saw the pending records", interval=0.05
        )
    finally:
        report = await managed.shutdown()
    action = report.action("relay_stop")
    assert (action.ok, action.observed, action.error) == (True, True, None)
    assert action.duration < 2.0
    assert report.succeeded is True, report.render()
    for record in await outbox.find({}).to_list():
        assert record["status"] == "pending"
        assert record["attempts"] == 0
        assert "claim_owner" not in record
    assert await broker.depth(down) == 0


async def test_run_relay_false_dispatches_but_leaves_a_failed_record_for_another_relay(
    broker: Broker, mongodb: MongoDB
) -> None:
    q = broker.queue("norelay")
    down = broker.queue("norelay-down")  # not declared yet: the dispatch is returned as unroutable
    staged: list[uuid.UUID] = []

    @queue(q, version=1, content="json")
    async def handle(event_id: EventId, mongo: MongoScope) -> None:
        staged.append(await mongo.outbox.publish_json(down, {"from": str(event_id)}, version=1))

    options = OutboxOptions(run_relay=False, poll_interval=0.1, backoff_base=0.05, backoff_max=0.05, mark_interval=0)
    consumer = outbox_consumer(broker, mongodb, q, handle, outbox=options)
    outbox = mongodb.db[OUTBOX]

    async def attempted() -> bool:
        return await outbox.count_documents({"attempts": 1}) == 1

    async with running(consumer, expect_clean=False) as managed:
        await broker.publish(q, {"n": 1})
        await eventually(lambda: outcomes(managed) == ["acked"], what="the delivery", interval=0.05)
        await eventually(attempted, what="the failed dispatch recorded", interval=0.05)
        await broker.declare(down)
        await asyncio.sleep(0.5)  # several of a relay's polls, and its backoff, pass: nobody retries here
        assert managed.snapshot().outbox_published == 0
        assert managed.snapshot().outbox_unroutable == 1
        assert await broker.depth(down) == 0
    report = await managed.shutdown()
    assert report.succeeded is True, report.render()
    [record] = await outbox.find({}).to_list()
    assert (record["status"], record["attempts"], record["event_id"]) == ("pending", 1, str(staged[-1]))
    assert record["last_error"] == "publish unroutable"
    assert "claim_expires" not in record  # released by the failed dispatch
    # A relay run elsewhere picks it up.
    relay = OutboxRelay(outbox, OutboxOptions(poll_interval=0.05), "relay-elsewhere")
    async with relays_running(broker.connection, [relay]):
        await eventually(lambda: relay.counters.published == 1, what="the relay elsewhere", interval=0.05)
    assert event_ids(await broker.drain(down)) == [str(staged[-1])]


# -- bounds ---------------------------------------------------------------------------------------


async def test_outbox_body_over_the_bound_raises_config_error_in_the_handler(broker: Broker, mongodb: MongoDB) -> None:
    q, down = await source_and_downstream(broker, "bound")
    caught: list[ConfigError] = []

    @queue(q, version=1, content="json")
    async def handle(order: Json[dict[str, Any]], mongo: MongoScope) -> None:
        await mongo.outbox.publish_text(down, order["fill"] * 64, version=1)  # exactly at the bound
        if order["catch"]:
            try:
                await mongo.outbox.publish_text(down, order["fill"] * 65, version=1)
            except ConfigError as exc:
                caught.append(exc)
        else:
            await mongo.outbox.publish_text(down, order["fill"] * 65, version=1)

    options = OutboxOptions(max_body=64, poll_interval=0.1)
    consumer = outbox_consumer(broker, mongodb, q, handle, outbox=options, unknown_errors="permanent")
    outbox = mongodb.db[OUTBOX]
    async with running(consumer, expect_clean=False) as managed:
        await broker.publish(q, {"fill": "a", "catch": True})
        await eventually(lambda: outcomes(managed) == ["acked"], what="the caught case", interval=0.05)
        bad = await broker.publish(q, {"fill": "b", "catch": False})
        await eventually(
            lambda: outcomes(managed) == ["acked", "dead_lettered"], what="the uncaught case", interval=0.05
        )
        await eventually(lambda: managed.snapshot().outbox_published == 1, what="the relay", interval=0.05)
        assert await broker.wait_for_depth(f"{q}.dlq", 1) == 1
    [error] = caught
    assert "QUEUE_BODY_TOO_LARGE" in str(error)
    [message] = await broker.drain(down)
    assert message.body == b"a" * 64
    assert message.content_type == "text/plain; charset=utf-8"
    assert message.headers["x-lily-content-kind"] == "text"
    [record] = await outbox.find({}).to_list()  # the uncaught attempt aborted with its 64-byte record
    assert record["body"] == b"a" * 64
    [copy] = await broker.drain(f"{q}.dlq")
    assert copy.headers["x-lily-event-id"] == str(bad)
    assert copy.headers["x-lily-failure-code"] == "QUEUE_HANDLER_FAILED"
    assert "ConfigError" in str(copy.headers["x-lily-failure-reason"])
