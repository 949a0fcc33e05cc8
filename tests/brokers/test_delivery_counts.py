"""How each broker counts returned deliveries, and what that does to the inbox's deferrals (docs/inbox.md,
counting deferrals).

What was observed, on quorum queues (classic queues write no count on any version):

- RabbitMQ 3.10.8: ``x-delivery-count`` is 0 on the first delivery and grows by one on every
  return (``basic.nack(requeue=true)``, ``basic.reject(requeue=true)``, a closed channel); no
  delivery limit unless one is set.
- RabbitMQ 4.0.5: the same count, absent on the first delivery; a default delivery limit of 20.
- RabbitMQ 4.3.6: ``basic.nack(requeue=true)`` no longer raises ``x-delivery-count``; it raises
  ``x-acquired-count``, which every return raises; reject and a closed channel raise both; the
  delivery limit (default 20) is checked against ``x-delivery-count``.
- With a delivery limit of N, the broker dead-letters a message at its N+1-th counted return,
  with ``x-death`` and ``x-first-death-reason`` ``delivery_limit``.

Brokers of other versions are held to the rules of the nearest observed one (before 4.0, 4.0 to
4.2, 4.3 and later).
"""

from __future__ import annotations

import asyncio
import datetime
import uuid
from collections.abc import Mapping
from typing import Any

import aio_pika
import aio_pika.abc
import pytest

from lily_mongo import MongoScope, QueueOptions, RawDelivery, queue
from lily_mongo._plan.options import QueueType
from lily_mongo.dlq import list_dead_letters
from tests.brokers.tier import RabbitMQ, declare_work_queue, type_argument
from tests.integration.test_inbox import EFFECTS, RECORDS, effect_handler, inbox_consumer, publish
from tests.support.broker import Broker, headers_of
from tests.support.consumers import NO_RETRIES, one_event, outcomes, running
from tests.support.mongo import MongoDB
from tests.support.polling import eventually

pytestmark = pytest.mark.broker

Counts = tuple[int | None, int | None]  # (x-delivery-count, x-acquired-count) of one delivery


def observed_counts(rabbitmq: RabbitMQ, queue_type: QueueType, how: str, deliveries: int) -> list[Counts]:
    """The counts each of ``deliveries`` deliveries carries when every one is returned ``how``."""
    if queue_type == "classic":
        return [(None, None)] * deliveries
    if rabbitmq.version < (4, 0):
        return [(n, None) for n in range(deliveries)]
    if rabbitmq.version < (4, 3):
        return [(n or None, None) for n in range(deliveries)]
    if how == "nack":
        return [(None, n or None) for n in range(deliveries)]
    return [(n or None, n or None) for n in range(deliveries)]


async def get_one(queue: aio_pika.abc.AbstractQueue, timeout: float = 5.0) -> aio_pika.abc.AbstractIncomingMessage:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (message := await queue.get(fail=False, no_ack=False)) is None:
        assert loop.time() < deadline, f"nothing came back to {queue.name} within {timeout} s"
        await asyncio.sleep(0.02)
    return message


def counts_of(message: aio_pika.abc.AbstractIncomingMessage) -> Counts:
    headers = message.headers
    delivery, acquired = headers.get("x-delivery-count"), headers.get("x-acquired-count")
    assert delivery is None or isinstance(delivery, int)
    assert acquired is None or isinstance(acquired, int)
    return delivery, acquired


@pytest.mark.parametrize("how", ["nack", "reject", "channel-closed"])
async def test_the_broker_counts_returned_deliveries(
    broker: Broker, rabbitmq: RabbitMQ, queue_type: QueueType, how: str
) -> None:
    q = broker.queue(f"count-{how}")
    channel = await broker.connection.channel()
    declared = await channel.declare_queue(q, durable=True, arguments=type_argument(queue_type))
    await channel.default_exchange.publish(aio_pika.Message(b"{}"), routing_key=q)
    seen: list[Counts] = []
    redelivered: list[bool] = []
    for _ in range(4):
        message = await get_one(declared)
        seen.append(counts_of(message))
        redelivered.append(bool(message.redelivered))
        if how == "nack":
            await message.nack(requeue=True)
        elif how == "reject":
            await message.reject(requeue=True)
        else:
            await channel.close()
            channel = await broker.connection.channel()
            declared = await channel.declare_queue(q, passive=True)
    await channel.close()
    assert seen == observed_counts(rabbitmq, queue_type, "reject" if how == "channel-closed" else how, 4)
    assert redelivered == [False, True, True, True]


async def test_a_quorum_queue_s_default_delivery_limit(broker: Broker, rabbitmq: RabbitMQ) -> None:
    # Rejected with requeue (a return every version counts) until the broker dead-letters it, or 22 times.
    q = broker.queue("default-limit")
    dead_letters = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": f"{q}.dlq"}
    await broker.channel.declare_queue(f"{q}.dlq", durable=True, arguments={"x-queue-type": "quorum"})
    declared = await broker.channel.declare_queue(q, durable=True, arguments={**dead_letters, "x-queue-type": "quorum"})
    await broker.channel.default_exchange.publish(aio_pika.Message(b"{}", headers={"k": "v"}), routing_key=q)
    deliveries = 0
    while deliveries < 22:
        try:
            message = await get_one(declared, timeout=1.0)
        except AssertionError:
            break
        deliveries += 1
        await message.reject(requeue=True)
    if rabbitmq.default_delivery_limit is None:
        assert deliveries == 22
        assert await broker.wait_for_depth(q, 1) == 1  # the return is applied shortly after the reject
        assert await broker.depth(f"{q}.dlq") == 0
        return
    assert deliveries == rabbitmq.default_delivery_limit + 1
    [dead] = await broker.drain(f"{q}.dlq")
    headers = headers_of(dead)
    assert headers["x-first-death-reason"] == "delivery_limit"
    [death] = headers["x-death"]
    assert (death["reason"], death["queue"]) == ("delivery_limit", q)
    assert headers["k"] == "v"
    assert await broker.depth(q) == 0


# -- the inbox's deferrals ------------------------------------------------------------------------


async def hold_lease(mongodb: MongoDB, key: str, *, for_seconds: float) -> None:
    """The event's record leased by another live owner for ``for_seconds`` more seconds."""
    now = datetime.datetime.now(datetime.UTC)
    await mongodb.db[RECORDS].insert_one(
        {
            "_id": key,
            "state": "leased",
            "owner": "elsewhere:0:0",
            "token": 7,
            "expires_at": now + datetime.timedelta(seconds=for_seconds),
            "purge_at": now + datetime.timedelta(hours=2),
            "acquisitions": 1,
            "deferrals": 0,
        }
    )


async def test_deferrals_while_a_lease_is_held_are_counted_by_the_broker_before_4_3(
    broker: Broker, mongodb: MongoDB, rabbitmq: RabbitMQ, queue_type: QueueType
) -> None:
    # Another owner holds the event's lease for one more second: every copy is deferred (and
    # requeued with basic.nack) until it expires; then the copy takes the lease and the handler
    # reads the counts the broker wrote on it.
    q, handler_id, event, key = one_event(broker, "held")
    seen: list[Mapping[str, Any]] = []

    @queue(q, version=1, content="json", handler_id=handler_id)
    async def handle(raw: RawDelivery, mongo: MongoScope) -> None:
        seen.append(dict(raw.headers))
        await mongo.database[EFFECTS].insert_one({"event_id": str(raw.envelope.event_id)}, session=mongo.session)

    consumer = inbox_consumer(
        broker, mongodb, q, handle, queue_type=queue_type, max_deferrals=50, cooperation_window=0.2, concurrency=1
    )
    async with running(consumer) as managed:
        await hold_lease(mongodb, key, for_seconds=1.0)
        await publish(broker, q, event)
        await eventually(lambda: "acked" in outcomes(managed), timeout=10.0, what="the copy after the lease expired")
    observations = managed.delivery_terminal_observations()
    deferrals = len(observations) - 1
    assert deferrals >= 1
    assert [o.outcome for o in observations] == ["deferred"] * deferrals + ["acked"]
    assert {o.code for o in observations[:-1]} == {"LEASE_HELD"}
    record = await mongodb.db[RECORDS].find_one({"_id": key})
    assert record is not None
    assert (record["state"], record["deferrals"], record["acquisitions"], record["token"]) == (
        "completed",
        deferrals,
        2,
        8,
    )
    [headers] = seen
    [expected] = observed_counts(rabbitmq, queue_type, "nack", deferrals + 1)[-1:]
    assert (headers.get("x-delivery-count"), headers.get("x-acquired-count")) == expected
    assert await mongodb.db[EFFECTS].count_documents({"event_id": str(event)}) == 1
    assert await broker.topology_depths(q) == [0, 0, 0]


async def test_past_max_deferrals_an_event_goes_to_the_dlq_with_the_library_s_code(
    broker: Broker, mongodb: MongoDB, rabbitmq: RabbitMQ, queue_type: QueueType
) -> None:
    # The default bound (max_deferrals=20) against the broker's default delivery limit (20 on 4.x
    # quorum queues, which dead-letter at the 21st counted return): the library's bound decides.
    q, handler_id, event, key = one_event(broker, "bound")
    calls: list[uuid.UUID] = []
    assert QueueOptions(name=q).max_deferrals == 20
    handler = effect_handler(q, calls, handler_id=handler_id)
    consumer = inbox_consumer(broker, mongodb, q, handler, queue_type=queue_type, cooperation_window=0.05)
    async with running(consumer) as managed:
        await hold_lease(mongodb, key, for_seconds=3600.0)
        await publish(broker, q, event)
        await eventually(lambda: "dead_lettered" in outcomes(managed), timeout=20.0, what="the DLQ handoff")
        assert await broker.wait_for_depth(f"{q}.dlq", 1) == 1
    observations = managed.delivery_terminal_observations()
    assert [o.outcome for o in observations] == ["deferred"] * 19 + ["dead_lettered"]
    assert [o.code for o in observations] == ["LEASE_HELD"] * 19 + ["QUEUE_DEFERRALS_EXHAUSTED"]
    assert calls == []
    [dead] = (await list_dead_letters(broker.url, q)).messages
    assert (dead.event_id, dead.origin, dead.code) == (str(event), "library", "QUEUE_DEFERRALS_EXHAUSTED")
    [copy] = await broker.drain(f"{q}.dlq")
    assert "x-death" not in copy.headers  # published by the library, not dropped by the broker
    record = await mongodb.db[RECORDS].find_one({"_id": key})
    assert record is not None
    assert (record["owner"], record["deferrals"]) == ("elsewhere:0:0", 20)
    assert await broker.depth(q) == 0


@pytest.mark.parametrize("queue_type", ["quorum"])
async def test_a_delivery_limit_below_max_deferrals_decides_only_where_the_broker_counts_nacks(
    broker: Broker, mongodb: MongoDB, rabbitmq: RabbitMQ, queue_type: QueueType
) -> None:
    # The work queue is declared with a delivery limit of 2 (the consumer takes it as it is) and
    # max_deferrals is 5. Where basic.nack counts, the broker dead-letters the original at its
    # third deferral; on 4.3 the deferrals are invisible to the limit and the library's bound
    # sends the event to the DLQ with its code.
    q, handler_id, event, key = one_event(broker, "limit")
    options: dict[str, Any] = {"queue_type": queue_type, "retry": NO_RETRIES, "max_deferrals": 5}
    await declare_work_queue(broker.channel, QueueOptions(name=q, **options), **{"x-delivery-limit": 2})
    calls: list[uuid.UUID] = []
    handler = effect_handler(q, calls, handler_id=handler_id)
    consumer = inbox_consumer(broker, mongodb, q, handler, passive=True, cooperation_window=0.05, **options)
    async with running(consumer) as managed:
        await hold_lease(mongodb, key, for_seconds=3600.0)
        await publish(broker, q, event)
        assert await broker.wait_for_depth(f"{q}.dlq", 1) == 1
        await asyncio.sleep(0.5)  # nothing more comes back
        ends = outcomes(managed)
    [dead] = (await list_dead_letters(broker.url, q)).messages
    record = await mongodb.db[RECORDS].find_one({"_id": key})
    assert record is not None
    assert calls == []
    assert await broker.depth(q) == 0
    if rabbitmq.counts_every_return:
        assert ends == ["deferred"] * 3
        assert (dead.event_id, dead.origin, dead.code) == (str(event), "broker", None)
        assert dead.broker_reason == "delivery_limit"
        [original] = await broker.drain(f"{q}.dlq")
        assert original.headers["x-first-death-reason"] == "delivery_limit"
        assert "x-lily-failure-code" not in original.headers
        assert record["deferrals"] == 3
    else:
        assert ends == ["deferred"] * 4 + ["dead_lettered"]
        assert (dead.event_id, dead.origin, dead.code) == (str(event), "library", "QUEUE_DEFERRALS_EXHAUSTED")
        assert record["deferrals"] == 5
