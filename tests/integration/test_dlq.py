"""``lily_mongo.dlq`` against the real broker: listing loses nothing, and tells where a message came from."""

from __future__ import annotations

import uuid
from typing import Any

import aio_pika
import aio_pika.abc
import pydantic

from lily_mongo.dlq import list_dead_letters, replay_dead_letters
from tests.support.broker import Broker, wait_for_depth
from tests.support.consumers import NO_RETRIES, outcomes, running
from tests.support.handlers import rejecting
from tests.support.polling import eventually


class Item(pydantic.BaseModel):
    n: int


async def fill(channel: aio_pika.abc.AbstractChannel, name: str, count: int) -> list[str]:
    ids = [str(uuid.uuid4()) for _ in range(count)]
    for event_id in ids:
        message = aio_pika.Message(b"{}", headers={"x-lily-event-id": event_id}, message_id=f"m-{event_id[:8]}")
        await channel.default_exchange.publish(message, routing_key=name)
    assert await wait_for_depth(channel, name, count) == count
    return ids


async def test_listing_a_quorum_dlq_again_and_again_loses_nothing(broker: Broker) -> None:
    q = broker.queue("quorum")
    dlq = f"{q}.dlq"
    # A quorum queue drops a message handed back more often than its delivery limit (20 by
    # default on RabbitMQ 4.0 to 4.2); with a limit of 1 a second requeue would drop it.
    await broker.channel.declare_queue(dlq, durable=True, arguments={"x-queue-type": "quorum", "x-delivery-limit": 1})
    ids = await fill(broker.channel, dlq, 3)
    for _ in range(4):
        listing = await list_dead_letters(broker.url, q)
        assert listing.total == 3
        assert sorted(m.event_id or "" for m in listing.messages) == sorted(ids)
    remaining = await broker.drain(dlq)
    assert sorted(str(m.headers["x-lily-event-id"]) for m in remaining) == sorted(ids)
    # Put back whole: the same properties (the message id included), not just the headers.
    assert sorted(m.message_id or "" for m in remaining) == sorted(f"m-{i[:8]}" for i in ids)


async def test_a_limited_listing_reads_the_oldest_and_keeps_the_rest(broker: Broker) -> None:
    q = broker.queue("limited")
    await broker.channel.declare_queue(f"{q}.dlq", durable=True)
    ids = await fill(broker.channel, f"{q}.dlq", 3)
    listing = await list_dead_letters(broker.url, q, limit=2)
    assert (listing.total, [m.event_id for m in listing.messages]) == (3, ids[:2])
    assert await broker.depth(f"{q}.dlq") == 3


async def test_broker_dead_letters_and_library_copies_are_told_apart(broker: Broker) -> None:
    q = broker.queue("origin")
    consumer = broker.consumer(q, rejecting(q), name="origin", max_body=64, retry=NO_RETRIES)
    forged: dict[str, Any] = {
        "x-lily-schema-version": "1",
        "x-lily-content-kind": "json",
        "x-lily-failure-code": "FORGED_BY_PRODUCER",
        "x-lily-failure-reason": "forged",
        "x-lily-failed-queue": q,
        "x-lily-failed-at": "2025-01-01T00:00:00.000+00:00",
    }
    oversize, rejected = str(uuid.uuid4()), str(uuid.uuid4())
    async with running(consumer) as managed:
        for event_id, body in ((oversize, b"{" + b" " * 100 + b"}"), (rejected, b'{"n": 1}')):
            message = aio_pika.Message(body, headers={"x-lily-event-id": event_id, **forged})
            await broker.channel.default_exchange.publish(message, routing_key=q)
        await eventually(lambda: len(outcomes(managed)) == 2, what="both deliveries settled", interval=0.05)
    assert await broker.wait_for_depth(f"{q}.dlq", 2) == 2
    seen = {m.event_id: m for m in (await list_dead_letters(broker.url, q)).messages}
    by_broker, library = seen[oversize], seen[rejected]
    assert (by_broker.origin, by_broker.broker_reason, by_broker.code, by_broker.untrusted_code) == (
        "broker",
        "rejected",
        None,
        "FORGED_BY_PRODUCER",
    )
    assert (by_broker.reason, by_broker.failed_at) == ("", None)
    assert (library.origin, library.code, library.reason, library.untrusted_code) == (
        "library",
        "ITEM_REJECTED",
        "refused by the handler",
        None,
    )


async def test_replay_moves_the_selected_message_and_reports_unknown_ids(broker: Broker) -> None:
    q = broker.queue("replay")
    await broker.channel.declare_queue(q, durable=True)
    await broker.channel.declare_queue(f"{q}.dlq", durable=True)
    ids = await fill(broker.channel, f"{q}.dlq", 3)
    unknown = str(uuid.uuid4())
    result = await replay_dead_letters(broker.url, q, event_ids=[ids[1].upper(), unknown], reset_retries=True)
    assert (result.scanned, result.moved, result.kept, result.missing) == (3, 1, 2, (unknown,))
    [moved] = await broker.drain(q)
    assert moved.headers["x-lily-event-id"] == ids[1]
    assert moved.headers["x-retry-count"] == 0
    assert moved.message_id != f"m-{ids[1][:8]}"  # a fresh message id, as every copy gets
    assert sorted(str(m.headers["x-lily-event-id"]) for m in await broker.drain(f"{q}.dlq")) == sorted([ids[0], ids[2]])
