"""A broker-side cancel on each broker of the tier (tests/brokers/conftest.py): a deleted queue on every
version, and a quorum queue's consumer timeout on 4.3, which cancels the consumer and keeps the channel
(docs/deployment.md, "Consumer timeout")."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import pytest

from lily_mongo import EventId, Json, MongoScope, QueueOptions, RetryPolicy, queue
from lily_mongo._plan.options import QueueType
from tests.brokers.tier import RabbitMQ, declare_work_queue
from tests.integration.test_broker_cancel import (
    CANCEL_METRIC,
    RESUMED_WITHIN,
    cancel_warnings,
    consumed_again,
    deleted_queue_is_declared_again,
    watching_readiness,
)
from tests.integration.test_inbox import EFFECTS, inbox_consumer
from tests.support.broker import Broker
from tests.support.consumers import running
from tests.support.mongo import MongoDB
from tests.support.polling import eventually

pytestmark = pytest.mark.broker

TIMEOUT_MS = 3000  # the queue's x-consumer-timeout
SLOW_SECONDS = 5.0  # the slow handler's first call: longer than the timeout, well inside its deadline


async def test_a_deleted_queue_is_declared_again_and_consumed(
    broker: Broker, queue_type: QueueType, caplog: pytest.LogCaptureFixture
) -> None:
    await deleted_queue_is_declared_again(broker, queue_type, caplog)


async def test_a_consumer_timeout_cancel_is_survived_and_every_event_applied_once(
    broker: Broker, mongodb: MongoDB, rabbitmq: RabbitMQ, queue_type: QueueType, caplog: pytest.LogCaptureFixture
) -> None:
    if queue_type != "quorum" or rabbitmq.version < (4, 3):
        pytest.skip(
            "only a quorum queue on RabbitMQ 4.3 answers a consumer timeout with basic.cancel (classic queues there "
            "have none; before 4.3 it closes the channel, checked once a minute)"
        )
    caplog.set_level(logging.INFO, logger="lily_mongo")
    q = broker.queue("timeout")
    options = QueueOptions(name=q, queue_type="quorum", retry=RetryPolicy(max_retries=1, delays=(0.2,)))
    await declare_work_queue(broker.channel, options, **{"x-consumer-timeout": TIMEOUT_MS})
    slow = uuid.uuid4()
    started: list[uuid.UUID] = []

    @queue(q, version=1, content="json", handler_id=f"{q}/effect")
    async def handle(payload: Json[dict[str, Any]], event_id: EventId, mongo: MongoScope) -> None:
        started.append(event_id)
        if event_id == slow and started.count(slow) == 1:
            await asyncio.sleep(SLOW_SECONDS)
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id)}, session=mongo.session)

    consumer = inbox_consumer(
        broker,
        mongodb,
        q,
        handle,
        passive=True,
        queue_type="quorum",
        retry=options.retry,
        deadline=30.0,
        consumer_timeout=TIMEOUT_MS / 1000,
    )
    async with running(consumer) as managed, watching_readiness(managed) as readiness:
        fast = await broker.publish_all(q, [{"n": n} for n in range(3)])
        await broker.publish(q, {"n": 3}, event_id=slow)
        events = [*fast, slow]
        await eventually(lambda: slow in started, what="the slow handler started")
        await eventually(
            lambda: managed.snapshot().queues[0].broker_cancels >= 1, timeout=10.0, what="the broker's cancel"
        )
        cancelled_at = time.monotonic()
        took = await consumed_again(broker, q, cancelled_at)

        async def applied_once() -> bool:
            counts = [await mongodb.db[EFFECTS].count_documents({"event_id": str(e)}) for e in events]
            return counts == [1] * len(events)

        await eventually(applied_once, timeout=20.0, what="every event applied", interval=0.1)
        later = await broker.publish(q, {"n": 4})
        await eventually(lambda: later in started, timeout=10.0, what="the event published after the cancel")
        await eventually(
            lambda: managed.snapshot().queues[0].in_flight == 0, timeout=20.0, what="every delivery settled"
        )
        assert await broker.wait_for_depth(q, 0) == 0
        cancels = managed.snapshot().queues[0].broker_cancels
        assert readiness.metric(CANCEL_METRIC, q) == cancels
        await eventually(lambda: managed.ready, what="ready again")
    assert took < RESUMED_WITHIN, took
    for event in [*events, later]:
        assert await mongodb.db[EFFECTS].count_documents({"event_id": str(event)}) == 1, event
    assert readiness.statuses[:3] == [200, 503, 200], readiness.changes
    assert all(span < RESUMED_WITHIN for span in readiness.not_ready_spans()), readiness.changes
    warnings = cancel_warnings(caplog)
    assert len(warnings) == cancels, warnings
    assert q in warnings[0], warnings
    assert "consumer timeout" in warnings[0], warnings
    startup = [r.getMessage() for r in caplog.records if "past the broker's consumer timeout of 3 s" in r.getMessage()]
    assert len(startup) == 1, startup
    assert q in startup[0], startup
