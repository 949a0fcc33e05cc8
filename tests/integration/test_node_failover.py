"""A URL naming several nodes: the connection goes to the first that answers, and a reconnect starts
from the node after the one it lost (docs/deployment.md, section 4; real broker, closed ports for
the nodes that are down)."""

from __future__ import annotations

import pytest
from yarl import URL

from lily_mongo import EventId, MongoScope, Publisher, TransportError, queue
from lily_mongo._amqp import connect_amqp, connected_node
from tests.support.broker import Broker
from tests.support.consumers import outcomes, running
from tests.support.mongo import MongoDB
from tests.support.polling import eventually


def with_dead_nodes(amqp: str) -> tuple[str, str]:
    """The suite's broker behind two closed ports; the broker's own host:port."""
    url = URL(amqp)
    live = f"{url.host}:{url.port or 5672}"
    head, _, tail = amqp.partition(live)
    return f"{head}127.0.0.1:1,{live},127.0.0.1:2{tail}", live


async def test_the_first_node_that_answers_takes_the_connection(amqp: str) -> None:
    url, live = with_dead_nodes(amqp)
    connection = await connect_amqp(url)
    try:
        assert connected_node(connection) == live
        channel = await connection.channel()
        await channel.close()
    finally:
        await connection.close()
    async with Publisher(url) as publisher:  # a publisher takes the same list
        assert publisher is not None


async def test_no_node_answering_names_every_node_without_the_password() -> None:
    with pytest.raises(TransportError) as caught:
        async with Publisher("amqp://app:s3cret@127.0.0.1:1,127.0.0.1:2/"):
            pass
    message = str(caught.value)
    assert message == (
        "RabbitMQ is not reachable at amqp://app:***@127.0.0.1:1,127.0.0.1:2/: no node answered "
        "(127.0.0.1:1 (connection refused), 127.0.0.1:2 (connection refused))"
    )
    assert "s3cret" not in message


async def test_a_consumer_and_its_outbox_connect_through_a_host_list(broker: Broker, mongodb: MongoDB) -> None:
    """The consumer's own connection and its outbox's (a connection of its own) both take the list."""
    url, _ = with_dead_nodes(broker.url)
    q, down = broker.queue("listed"), await broker.declare(broker.queue("listed-down"))

    @queue(q, version=1, content="json")
    async def forward(event_id: EventId, mongo: MongoScope) -> None:
        await mongo.outbox.publish_json(down, {"from": str(event_id)}, version=1)

    consumer = broker.consumer(q, forward, name="listed", mongodb=mongodb, amqp_url=url)
    async with running(consumer) as managed:
        event = await broker.publish(q)
        await eventually(lambda: managed.snapshot().outbox_published == 1, what="the outbox message published")
    [message] = await broker.drain(down)
    assert message.body == b'{"from":"' + str(event).encode() + b'"}'
    assert outcomes(managed) == ["acked"]
