"""The library's flows on each broker of the tier, with classic and quorum queues (tests/brokers/conftest.py).

Connection and consumption, settlement (ACK, retry bucket, DLQ, the broker's own
dead-lettering), the inbox absorbing duplicates, a lost channel, and the outbox's
dispatch after the commit. Each test builds its consumer as the integration tier
does and asserts what the broker and MongoDB hold afterwards.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import orjson
import pytest

from lily_mongo import EventId, Json, MongoScope, QueueHandlerError, queue
from lily_mongo._plan.options import QueueType
from lily_mongo.dlq import list_dead_letters
from tests.brokers.tier import assert_queue_type, declare_destination
from tests.integration.test_inbox import assert_effect_once, effect_handler, inbox_consumer, publish, settled_copies
from tests.integration.test_outbox import OUTBOX, outbox_consumer
from tests.integration.test_settlement import Calls, raising, recording_handler, retries, settle
from tests.support.broker import Broker
from tests.support.consumers import outcomes, running, wait_observations
from tests.support.handlers import accepting
from tests.support.mongo import MongoDB
from tests.support.polling import eventually

pytestmark = pytest.mark.broker


async def test_a_consumer_connects_declares_its_topology_and_acks(broker: Broker, queue_type: QueueType) -> None:
    q = broker.queue("consume")
    consumer = broker.consumer(q, accepting(q), queue_type=queue_type, retry=retries(1, 30.0))
    async with running(consumer) as managed:
        sent = await broker.publish_all(q, [{"n": i} for i in range(5)])
        observations = await wait_observations(managed, 5)
        assert managed.snapshot().transport_generation == 1
    assert sorted(str(o.event_id) for o in observations) == sorted(str(e) for e in sent)
    assert [o.outcome for o in observations] == ["acked"] * 5
    assert await broker.topology_depths(q) == [0, 0, 0]
    expected: dict[str, dict[str, Any]] = {
        q: {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": f"{q}.dlq"},
        f"{q}.retry.0": {"x-message-ttl": 30_000, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": q},
        f"{q}.dlq": {},
    }
    for name, arguments in expected.items():
        await assert_queue_type(broker.connection, name, queue_type, arguments)


async def test_a_retry_comes_back_from_its_bucket_and_succeeds(broker: Broker, queue_type: QueueType) -> None:
    busy = raising(QueueHandlerError.retryable("APP_BUSY", "stock service down"), times=2)
    run = await settle(broker, "retry", busy, ends=3, retry=retries(3, 0.2), queue_type=queue_type)
    assert [o.outcome for o in run.observations] == ["retried", "retried", "acked"]
    assert [o.code for o in run.observations] == ["APP_BUSY", "APP_BUSY", None]
    assert run.calls.retry_counts == [0, 1, 2]
    assert run.calls.event_ids == [run.event_id] * 3
    assert run.calls.redelivered == [False, False, False]  # retry copies are new messages
    assert run.report.succeeded, run.report.render()
    assert await broker.topology_depths(run.q) == [0, 0, 0]


async def test_failures_end_in_the_dlq_with_their_codes(broker: Broker, queue_type: QueueType) -> None:
    q = broker.queue("dlq")
    calls = Calls()

    async def behaviour(call: int) -> None:
        if calls.ids[-1] == 1:
            raise QueueHandlerError.permanent("ORDER_UNKNOWN", "no order 1")
        raise QueueHandlerError.retryable("APP_BUSY", "still down")

    consumer = broker.consumer(
        q, recording_handler(q, calls, behaviour), queue_type=queue_type, retry=retries(1, 0.1), concurrency=1
    )
    async with running(consumer) as managed:
        permanent, exhausted = await broker.publish_all(q, [{"id": 1}, {"id": 2}])
        observations = await wait_observations(managed, 3)
    ends = {(o.event_id, o.outcome, o.code) for o in observations}
    assert ends == {
        (permanent, "dead_lettered", "ORDER_UNKNOWN"),
        (exhausted, "retried", "APP_BUSY"),
        (exhausted, "dead_lettered", "QUEUE_RETRIES_EXHAUSTED"),
    }
    assert await broker.topology_depths(q) == [0, 0, 2]
    listing = await list_dead_letters(broker.url, q)
    seen = {m.event_id: m for m in listing.messages}
    assert listing.total == 2
    assert (seen[str(permanent)].origin, seen[str(permanent)].code) == ("library", "ORDER_UNKNOWN")
    assert (seen[str(exhausted)].origin, seen[str(exhausted)].code) == ("library", "QUEUE_RETRIES_EXHAUSTED")
    assert (seen[str(exhausted)].retry_count, seen[str(permanent)].retry_count) == (1, 0)
    assert await broker.depth(f"{q}.dlq") == 2  # listing put them back


async def test_a_body_over_max_body_is_dead_lettered_by_the_broker(broker: Broker, queue_type: QueueType) -> None:
    q = broker.queue("too-large")
    calls = Calls()
    consumer = broker.consumer(
        q, recording_handler(q, calls, raising()), queue_type=queue_type, retry=retries(1, 0.1), max_body=64
    )
    async with running(consumer) as managed:
        big, small = await broker.publish_all(q, [{"id": 1, "pad": "x" * 100}, {"id": 2}])
        observations = await wait_observations(managed, 2)
    assert {(o.event_id, o.outcome) for o in observations} == {(big, "broker_dead_lettered"), (small, "acked")}
    assert calls.ids == [2]
    assert await broker.wait_for_depth(f"{q}.dlq", 1) == 1
    [dead] = (await list_dead_letters(broker.url, q)).messages
    assert (dead.event_id, dead.origin, dead.broker_reason, dead.code) == (str(big), "broker", "rejected", None)
    assert await broker.depth(q) == 0


async def test_the_inbox_applies_an_event_once_and_absorbs_its_copies(
    broker: Broker, mongodb: MongoDB, queue_type: QueueType
) -> None:
    q = broker.queue("inbox")
    calls: list[uuid.UUID] = []
    event = uuid.uuid4()
    consumer = inbox_consumer(broker, mongodb, q, effect_handler(q, calls), queue_type=queue_type)
    async with running(consumer) as managed:
        await publish(broker, q, event)
        await eventually(lambda: outcomes(managed) == ["acked"], timeout=8.0, what="the first copy")
        await publish(broker, q, event, copies=3)
        await eventually(lambda: len(outcomes(managed)) == 4, timeout=8.0, what="the three later copies")
    assert outcomes(managed) == ["acked", "duplicate", "duplicate", "duplicate"]
    assert calls == [event]
    await assert_effect_once(mongodb, event)
    assert await broker.topology_depths(q) == [0, 0, 0]


async def test_deliveries_on_a_lost_channel_are_redelivered_and_applied_once(
    broker: Broker, mongodb: MongoDB, queue_type: QueueType
) -> None:
    # Two deliveries are in their handlers when the consuming channel closes: they can no longer
    # be settled; the broker redelivers them on the restored channel and the inbox applies each once.
    q = broker.queue("lost")
    release = asyncio.Event()
    started: list[uuid.UUID] = []

    @queue(q, version=1, content="json", handler_id=f"{q}/effect")
    async def handle(payload: Json[dict[str, Any]], event_id: EventId, mongo: MongoScope) -> None:
        started.append(event_id)
        if len(started) <= 2:
            await release.wait()
        await mongo.database["effects"].insert_one({"event_id": str(event_id)}, session=mongo.session)

    consumer = inbox_consumer(broker, mongodb, q, handle, queue_type=queue_type, concurrency=4)
    async with running(consumer, expect_clean=False, release=release) as managed:
        intake = managed._intake
        assert intake is not None
        first, second = uuid.uuid4(), uuid.uuid4()
        await publish(broker, q, first)
        await publish(broker, q, second)
        await eventually(lambda: len(started) == 2, what="both deliveries in their handlers")
        channel = intake.consumers[q].channel
        assert channel is not None
        await (await channel.get_underlay_channel()).close()
        release.set()
        await eventually(lambda: settled_copies(managed) == 2, timeout=15.0, what="both redeliveries settled")
    ends = outcomes(managed)
    # The first two attempts commit but cannot ACK on the closed channel; their redeliveries find the
    # events completed (or wait while the first attempts still hold them).
    assert ends.count("unresolved") == 2, ends
    assert set(ends) <= {"unresolved", "duplicate", "acked", "deferred"}, ends
    for event in (first, second):
        assert await mongodb.db["effects"].count_documents({"event_id": str(event)}) == 1
    assert await broker.wait_for_depth(q, 0) == 0
    assert await broker.depths(f"{q}.retry.0", f"{q}.dlq") == [0, 0]


async def test_the_outbox_dispatches_after_the_commit_to_its_destination(
    broker: Broker, mongodb: MongoDB, queue_type: QueueType
) -> None:
    q = broker.queue("source")
    down = await declare_destination(broker, "down", queue_type)
    staged: list[uuid.UUID] = []

    @queue(q, version=1, content="json", handler_id=f"{q}/forward")
    async def handle(order: Json[dict[str, Any]], event_id: EventId, mongo: MongoScope) -> None:
        await mongo.database["effects"].insert_one({"event_id": str(event_id)}, session=mongo.session)
        staged.append(await mongo.outbox.publish_json(down, {"order": order["n"], "from": str(event_id)}, version=1))

    consumer = outbox_consumer(broker, mongodb, q, handle, queue_type=queue_type)
    async with running(consumer) as managed:
        source = await broker.publish(q, {"n": 7})
        await publish(broker, q, source)  # a second copy of the same event: absorbed, nothing sent again
        await eventually(lambda: len(outcomes(managed)) == 2, what="both copies settled", interval=0.05)
        assert await broker.wait_for_depth(down, 1) == 1
        await eventually(lambda: managed.snapshot().outbox_pending == 0, what="the relay's idle count", interval=0.05)
    assert outcomes(managed) == ["acked", "duplicate"]
    [message] = await broker.drain(down)
    [sent] = staged
    assert message.headers["x-lily-event-id"] == str(sent)
    assert orjson.loads(message.body) == {"order": 7, "from": str(source)}
    [record] = await mongodb.db[OUTBOX].find({}).to_list()
    assert (record["event_id"], record["status"], record["attempts"]) == (str(sent), "published", 0)
    assert await mongodb.db["effects"].count_documents({"event_id": str(source)}) == 1
    assert await broker.topology_depths(q) == [0, 0, 0]
    assert await broker.depth(down) == 0
