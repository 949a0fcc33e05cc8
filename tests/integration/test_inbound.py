"""The consumer's view of one delivery (:class:`lily_mongo._amqp.AmqpMessage`) against the real broker.

It replaces aio-pika's ``IncomingMessage`` on the consuming path, so it must expose
the same values for everything the pipeline and the handoff copies read, and settle
a delivery at most once.
"""

from __future__ import annotations

import asyncio
import datetime

import aio_pika
import aio_pika.abc
import aiormq.abc
import pytest

from lily_mongo._amqp import AmqpMessage
from tests.support.broker import BrokerNames, queue_depth, wait_for_depth

STAMP = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)


async def consume_one(channel: aio_pika.abc.AbstractChannel, name: str) -> aiormq.abc.DeliveredMessage:
    """The next delivery of ``name`` as aiormq hands it to a consumer callback (unacknowledged)."""
    underlay = await channel.get_underlay_channel()
    got: asyncio.Future[aiormq.abc.DeliveredMessage] = asyncio.get_running_loop().create_future()

    async def on_delivery(delivered: aiormq.abc.DeliveredMessage) -> None:
        if not got.done():
            got.set_result(delivered)

    consuming = await underlay.basic_consume(name, on_delivery, no_ack=False)
    try:
        return await asyncio.wait_for(got, 10)
    finally:
        assert consuming.consumer_tag is not None
        await underlay.basic_cancel(consuming.consumer_tag)


def every_property() -> aio_pika.Message:
    """A message with a body, headers and every basic property set."""
    return aio_pika.Message(
        b'{"n": 1}',
        headers={"x-lily-event-id": "0f8fad5b-d9cb-469f-a165-70867728950e", "x-retry-count": 2, "t": [1, "a"]},
        content_type="application/json",
        content_encoding="identity",
        correlation_id="corr-7",
        reply_to="replies",
        app_id="orders",
        priority=3,
        timestamp=STAMP,
        type="order.placed",
        message_id="m-1",
    )


async def delivered(
    connection: aio_pika.abc.AbstractConnection, name: str, message: aio_pika.Message
) -> tuple[aio_pika.abc.AbstractChannel, AmqpMessage]:
    """On a channel of its own: ``name`` declared, ``message`` published to it and consumed; the channel
    and the delivery as the consumer reads it (unacknowledged)."""
    channel = await connection.channel()
    await channel.declare_queue(name, durable=True)
    await channel.default_exchange.publish(message, routing_key=name)
    return channel, AmqpMessage(await consume_one(channel, name))


async def test_fields_are_the_published_ones(
    amqp_connection: aio_pika.abc.AbstractConnection, names: BrokerNames
) -> None:
    q = names.queue("inbound")
    channel, message = await delivered(amqp_connection, q, every_property())
    assert message.body == b'{"n": 1}'
    assert message.headers == {
        "x-lily-event-id": "0f8fad5b-d9cb-469f-a165-70867728950e",
        "x-retry-count": 2,
        "t": [1, "a"],
    }
    assert (message.content_type, message.content_encoding) == ("application/json", "identity")
    assert (message.routing_key, message.exchange, message.redelivered) == (q, "", False)
    assert (message.correlation_id, message.reply_to, message.app_id) == ("corr-7", "replies", "orders")
    assert (message.priority, message.type, message.message_id) == (3, "order.placed", "m-1")
    assert message.timestamp == STAMP
    assert message.delivery_tag >= 1
    assert message.channel.is_closed is False
    await message.ack()
    assert await wait_for_depth(channel, q, 0) == 0


@pytest.mark.parametrize("first", ["ack", "nack", "reject"])
async def test_a_delivery_is_settled_at_most_once(
    first: str, amqp_connection: aio_pika.abc.AbstractConnection, names: BrokerNames
) -> None:
    q = names.queue(f"inbound-{first}")
    channel, message = await delivered(amqp_connection, q, every_property())
    if first == "ack":
        await message.ack()
    elif first == "nack":
        await message.nack(requeue=False)
    else:
        await message.reject(requeue=False)
    for second in (message.ack(), message.nack(requeue=True), message.reject(requeue=True)):
        with pytest.raises(RuntimeError, match="already settled"):
            await second
    # The one settlement removed it, and the refused ones never reached the broker
    # (a second ACK of the same tag would close the channel with PRECONDITION_FAILED).
    assert await wait_for_depth(channel, q, 0) == 0
    assert not channel.is_closed
    assert await queue_depth(channel, q) == 0


async def test_no_headers_read_as_an_empty_table(
    amqp_connection: aio_pika.abc.AbstractConnection, names: BrokerNames
) -> None:
    q = names.queue("inbound-bare")
    _, message = await delivered(amqp_connection, q, aio_pika.Message(b"x"))
    assert message.headers == {}
    assert (message.content_type, message.timestamp, message.type) == (None, None, None)
    await message.ack()
