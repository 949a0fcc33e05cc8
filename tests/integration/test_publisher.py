"""The typed publisher against the real broker."""

from __future__ import annotations

import uuid

import aio_pika.abc
import pytest

from lily_mongo import Bytes, Consumer, Publisher, TransportError, queue
from lily_mongo._errors import PublishError
from tests.support.broker import BrokerNames, drain


async def test_json_publish_arrives_with_canonical_headers(
    amqp: str, amqp_channel: aio_pika.abc.AbstractChannel, names: BrokerNames
) -> None:
    queue = names.queue("pub")
    await amqp_channel.declare_queue(queue)
    async with Publisher(amqp) as publisher:
        event_id = await publisher.publish_json(queue, {"order": 7}, version=3)
    [message] = await drain(amqp_channel, queue)
    headers = message.headers
    assert headers["x-lily-event-id"] == str(event_id)
    assert headers["x-lily-schema-version"] == "3"
    assert headers["x-lily-content-kind"] == "json"
    assert message.content_type == "application/json"
    assert message.body == b'{"order":7}'


async def test_given_event_id_is_preserved(
    amqp: str, amqp_channel: aio_pika.abc.AbstractChannel, names: BrokerNames
) -> None:
    queue = names.queue("pub")
    await amqp_channel.declare_queue(queue)
    given = uuid.UUID("3f1c2a44-8b9d-4e6f-a1b2-c3d4e5f60718")
    async with Publisher(amqp) as publisher:
        returned = await publisher.publish_text(queue, "héllo", version=1, event_id=given)
    assert returned == given
    [message] = await drain(amqp_channel, queue)
    assert message.headers["x-lily-event-id"] == "3f1c2a44-8b9d-4e6f-a1b2-c3d4e5f60718"
    assert message.body == "héllo".encode()


async def test_unroutable_publish_raises(amqp: str, names: BrokerNames) -> None:
    async with Publisher(amqp) as publisher:
        with pytest.raises(PublishError) as caught:
            await publisher.publish_binary(names.queue("nowhere"), b"\x00", version=1)
    assert caught.value.kind == "unroutable"


async def test_header_types_on_the_wire(
    amqp: str, amqp_channel: aio_pika.abc.AbstractChannel, names: BrokerNames
) -> None:
    queue = names.queue("types")
    await amqp_channel.declare_queue(queue)
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    async with Publisher(amqp) as publisher:
        await publisher.publish_binary(queue, b"\x00\x01", version=65535, retry_count=3, traceparent=traceparent)
    [message] = await drain(amqp_channel, queue)
    headers = message.headers
    assert type(headers["x-lily-event-id"]) is str
    assert type(headers["x-lily-schema-version"]) is str
    assert headers["x-lily-schema-version"] == "65535"
    assert type(headers["x-lily-content-kind"]) is str
    assert type(headers["x-retry-count"]) is int
    assert headers["x-retry-count"] == 3
    assert headers["traceparent"] == traceparent
    assert message.content_type == "application/octet-stream"
    assert message.body == b"\x00\x01"


async def test_unreachable_broker_raises_transport_error_without_the_password() -> None:
    with pytest.raises(TransportError) as caught:
        async with Publisher("amqp://guest:s3cret@127.0.0.1:1/"):
            pass
    assert "s3cret" not in str(caught.value)
    assert "amqp://guest:***@127.0.0.1:1/" in str(caught.value)


async def test_consumer_start_with_unreachable_broker_raises_transport_error() -> None:
    @queue("lt.unreachable", version=1)
    async def handler(body: Bytes) -> None: ...

    consumer = Consumer(amqp_url="amqp://guest:s3cret@127.0.0.1:1/", name="t")
    consumer.include(handler)
    with pytest.raises(TransportError, match="RabbitMQ is not reachable"):
        await consumer.start()
