"""Deliveries whose metadata is not valid AMQP text, sent by a raw producer to the real broker.

RabbitMQ accepts a header name, a short-string property or a routing key that is not
valid UTF-8; the Python AMQP stack cannot decode such a frame and used to drop the
whole connection, get the same delivery first again after reconnecting, and so stall
the queue for good. Each one must be dead-lettered with ``QUEUE_ENVELOPE_INVALID``,
the messages behind it handled, and the connection kept (no new transport generation).
"""

from __future__ import annotations

import uuid
from typing import Any

import aio_pika
import aio_pika.abc
import pydantic

from lily_mongo import Consumer, Json, ManagedConsumer, RetryPolicy, queue
from tests.support.broker import BrokerNames, drain, headers_of, queue_depth
from tests.support.consumers import wait_observations
from tests.support.frames import RawProducer, long_string_value, raw_properties, raw_table

BODY = b'{"id": 0, "sku": "P-0"}'


class Order(pydantic.BaseModel):
    id: int
    sku: str


def envelope_entries(event_id: str) -> list[tuple[bytes, bytes]]:
    return [
        (b"x-lily-event-id", long_string_value(event_id)),
        (b"x-lily-schema-version", long_string_value("1")),
        (b"x-lily-content-kind", long_string_value("json")),
    ]


def valid_properties(event_id: str) -> bytes:
    return raw_properties(content_type=b"application/json", headers=raw_table(envelope_entries(event_id)))


def make_consumer(amqp: str, q: str, seen: list[int]) -> Consumer:
    @queue(q, version=1, content="json")
    async def handle(order: Json[Order]) -> None:
        seen.append(order.id)

    consumer = Consumer(amqp_url=amqp, name="malformed")
    consumer.configure_queue(q, retry=RetryPolicy(max_retries=1, delays=(0.2,)))
    consumer.include(handle)
    return consumer


async def publish_valid(producer: RawProducer, q: str, n: int) -> None:
    body = Order(id=n, sku=f"V-{n}").model_dump_json().encode()
    await producer.publish("", q.encode(), valid_properties(str(uuid.uuid4())), body)


def refused(managed: ManagedConsumer) -> list[str]:
    return [
        o.reason
        for o in managed.delivery_terminal_observations()
        if (o.outcome, o.code) == ("dead_lettered", "QUEUE_ENVELOPE_INVALID")
    ]


async def test_an_undecodable_header_name_is_dead_lettered_and_the_messages_behind_it_are_handled(
    amqp: str, amqp_channel: aio_pika.abc.AbstractChannel, names: BrokerNames, raw_producer: RawProducer
) -> None:
    q = names.queue("badkey")
    seen: list[int] = []
    managed = await make_consumer(amqp, q, seen).start()
    try:
        event_id = str(uuid.uuid4())
        headers = raw_table([*envelope_entries(event_id), (b"x-\xff\xfe", long_string_value("v"))])
        await raw_producer.publish(
            "", q.encode(), raw_properties(content_type=b"application/json", headers=headers), BODY
        )
        for n in (1, 2, 3):
            await publish_valid(raw_producer, q, n)
        observations = await wait_observations(managed, 4)
        generation = managed.snapshot().transport_generation
    finally:
        report = await managed.shutdown()
    assert sorted(seen) == [1, 2, 3]
    assert sorted(o.outcome for o in observations) == ["acked", "acked", "acked", "dead_lettered"]
    assert refused(managed) == ["a header name is not valid UTF-8"]
    assert generation == 1  # one connection all along: no drop, no reconnect
    assert report.succeeded, report.render()
    assert [await queue_depth(amqp_channel, name) for name in (q, f"{q}.retry.0", f"{q}.dlq")] == [0, 0, 1]
    # The DLQ copy is plain AMQP again (this test reads it with an ordinary client) and keeps the event id.
    [copy] = await drain(amqp_channel, f"{q}.dlq")
    headers_seen = dict(copy.headers)
    assert headers_seen["x-lily-failure-code"] == "QUEUE_ENVELOPE_INVALID"
    assert headers_seen["x-lily-failure-reason"] == "a header name is not valid UTF-8"
    assert headers_seen["x-lily-event-id"] == event_id
    assert copy.body == BODY


async def test_undecodable_text_in_any_metadata_field_is_refused_and_consuming_goes_on(
    amqp: str,
    amqp_channel: aio_pika.abc.AbstractChannel,
    names: BrokerNames,
    raw_producer: RawProducer,
) -> None:
    q = names.queue("badmeta")
    exchange = names.exchange("fanout")
    await amqp_channel.declare_exchange(exchange, aio_pika.ExchangeType.FANOUT, auto_delete=True)
    seen: list[int] = []
    managed = await make_consumer(amqp, q, seen).start()
    # The consumer declared q; a fanout exchange routes any routing key to it.
    await (await amqp_channel.get_queue(q)).bind(exchange)
    entries = envelope_entries(str(uuid.uuid4()))
    nested = (b"x-meta", b"F" + raw_table([(b"caf\xc3", long_string_value("v"))]))
    poison: dict[str, tuple[str, bytes, dict[str, Any]]] = {
        "a nested header name in 'x-meta' is not valid UTF-8": ("", q.encode(), {"headers": [*entries, nested]}),
        "property content_type is not valid UTF-8": ("", q.encode(), {"content_type": b"application/\xff"}),
        "property message_id is not valid UTF-8": ("", q.encode(), {"message_id": b"\xfe\xff-1"}),
        "property type is not valid UTF-8": ("", q.encode(), {"message_type": b"ord\xe9r"}),
        "the routing key is not valid UTF-8": (exchange, b"orders.\xff", {}),
    }
    try:
        for n, (target, routing_key, fields) in enumerate(poison.values(), start=1):
            properties = raw_properties(
                content_type=fields.get("content_type", b"application/json"),
                headers=raw_table(fields.get("headers", entries)),
                message_id=fields.get("message_id"),
                message_type=fields.get("message_type"),
            )
            await raw_producer.publish(target, routing_key, properties, BODY)
            await publish_valid(raw_producer, q, n)
        await wait_observations(managed, 2 * len(poison))
        generation = managed.snapshot().transport_generation
    finally:
        await managed.shutdown()
    assert sorted(seen) == list(range(1, len(poison) + 1))
    assert sorted(refused(managed)) == sorted(poison)
    assert generation == 1
    assert await queue_depth(amqp_channel, f"{q}.dlq") == len(poison)
    copies = await drain(amqp_channel, f"{q}.dlq")
    assert sorted(headers_of(c)["x-lily-failure-reason"] for c in copies) == sorted(poison)
