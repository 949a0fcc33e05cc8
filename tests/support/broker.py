"""The RabbitMQ of one test: unique names, inspection by passive declares, publishing, consumers on it."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aio_pika.abc
import aiormq.exceptions

from lily_mongo import Consumer, Publisher, QueueOptions
from lily_mongo._plan.routes import Guard, Middleware
from tests.support.mongo import MongoDB

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
_QUEUE_SETTINGS = frozenset(f.name for f in dataclasses.fields(QueueOptions)) - {"name"}


def amqp_url() -> str:
    return os.environ.get("LILY_AMQP_URL", DEFAULT_AMQP_URL)


@dataclass
class BrokerNames:
    """Unique queue/exchange names per test, deleted (with derived names) afterwards."""

    prefix: str = field(default_factory=lambda: f"lt.{uuid.uuid4().hex[:10]}")
    queues: list[str] = field(default_factory=list)
    exchanges: list[str] = field(default_factory=list)

    def queue(self, base: str = "q") -> str:
        name = f"{self.prefix}.{base}"
        self.queues.append(name)
        return name

    def exchange(self, base: str = "x") -> str:
        name = f"{self.prefix}.{base}"
        self.exchanges.append(name)
        return name

    async def cleanup(self, connection: aio_pika.abc.AbstractConnection) -> None:
        channel = await connection.channel()
        try:
            for queue in self.queues:
                derived = [queue, f"{queue}.dlq", *(f"{queue}.retry.{n}" for n in range(32))]
                for name in derived:
                    await channel.queue_delete(name)
                for name in (f"{queue}.dlx", f"{queue}.retry"):
                    await channel.exchange_delete(name)
            for name in self.exchanges:
                await channel.exchange_delete(name)
        finally:
            await channel.close()


async def queue_depth(channel: aio_pika.abc.AbstractChannel, name: str) -> int:
    """Ready messages in ``name`` (passive declare: fails if the queue does not exist)."""
    queue = await channel.declare_queue(name, passive=True)
    count = queue.declaration_result.message_count
    assert count is not None
    return int(count)


async def wait_for_depth(channel: aio_pika.abc.AbstractChannel, name: str, expected: int, timeout: float = 15.0) -> int:
    """Poll until ``name`` holds ``expected`` ready messages; return the last depth seen."""
    deadline = asyncio.get_running_loop().time() + timeout
    depth = await queue_depth(channel, name)
    while depth != expected and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
        depth = await queue_depth(channel, name)
    return depth


async def drain(
    channel: aio_pika.abc.AbstractChannel, name: str, limit: int = 1000
) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """Get (and ACK) every ready message of ``name``."""
    queue = await channel.declare_queue(name, passive=True)
    out: list[aio_pika.abc.AbstractIncomingMessage] = []
    while len(out) < limit:
        message = await queue.get(fail=False, no_ack=False)
        if message is None:
            break
        await message.ack()
        out.append(message)
    return out


def headers_of(message: aio_pika.abc.AbstractMessage) -> dict[str, Any]:
    """A message's headers as a test reads them: each value's type is the one the test asserts
    (aio-pika types every value as the union of all AMQP field types)."""
    return dict(message.headers)


async def consumer_count(connection: aio_pika.abc.AbstractConnection, name: str) -> int | None:
    """Consumers attached to ``name`` (passive declare); None if the queue does not exist.

    A 404 closes the channel, so each call uses a fresh one.
    """
    channel = await connection.channel()
    try:
        declared = await channel.declare_queue(name, passive=True)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return None
    finally:
        if not channel.is_closed:
            await channel.close()
    count = declared.declaration_result.consumer_count
    assert count is not None
    return int(count)


async def queue_exists(connection: aio_pika.abc.AbstractConnection, name: str) -> bool:
    """Whether ``name`` exists (passive declare on a fresh channel)."""
    channel = await connection.channel()
    try:
        await channel.declare_queue(name, passive=True)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return False
    finally:
        if not channel.is_closed:
            await channel.close()
    return True


@dataclass
class Broker:
    """The RabbitMQ one test uses: its URL, the test's unique names, a connection and a channel to look with."""

    url: str
    names: BrokerNames
    connection: aio_pika.abc.AbstractConnection
    channel: aio_pika.abc.AbstractChannel

    def queue(self, base: str = "q") -> str:
        """A queue name unique to this test (deleted afterwards, with its retry buckets and DLQ)."""
        return self.names.queue(base)

    def consumer(
        self,
        queues: str | tuple[str, ...],
        *handlers: Callable[..., Awaitable[None]],
        name: str = "t",
        mongodb: MongoDB | None = None,
        middleware: Iterable[Middleware] = (),
        guards: Iterable[Guard] = (),
        **options: Any,
    ) -> Consumer:
        """A consumer of ``queues`` on this broker linking ``handlers`` (with an inbox in ``mongodb``, if given),
        with consumer-wide ``middleware`` (outermost first) and ``guards``.

        ``options`` that name a :class:`QueueOptions` field configure each queue; the others go to
        the :class:`Consumer` (``graceful_timeout``, ``inbox``, ``telemetry``, ``amqp_url``, ...).
        """
        queue_options = {key: value for key, value in options.items() if key in _QUEUE_SETTINGS}
        settings = {key: value for key, value in options.items() if key not in _QUEUE_SETTINGS}
        settings.setdefault("amqp_url", self.url)
        if mongodb is not None:
            settings.update(mongo_client=mongodb.client, database=mongodb.name)
        consumer = Consumer(name=name, **settings)
        for q in (queues,) if isinstance(queues, str) else queues:
            consumer.configure_queue(q, **queue_options)
        consumer.include(*handlers)
        for layer in middleware:
            consumer.use(layer)
        for guard in guards:
            consumer.guard(guard)
        return consumer

    async def publish(self, q: str, payload: Any = None, **options: Any) -> uuid.UUID:
        """Publish one JSON message (``{"n": 1}`` by default; version 1 unless ``version=``) to ``q``; its event id."""
        [event_id] = await self.publish_all(q, [{"n": 1} if payload is None else payload], **options)
        return event_id

    async def publish_all(self, q: str, payloads: Iterable[Any], **options: Any) -> list[uuid.UUID]:
        """Publish each payload as one JSON message to ``q``, in order, over one connection; their event ids."""
        options.setdefault("version", 1)
        async with Publisher(self.url) as publisher:
            return [await publisher.publish_json(q, payload, **options) for payload in payloads]

    async def depth(self, name: str) -> int:
        return await queue_depth(self.channel, name)

    async def depths(self, *names: str) -> list[int]:
        return [await queue_depth(self.channel, name) for name in names]

    async def topology_depths(self, q: str) -> list[int]:
        """Ready messages in ``q``, its first retry bucket and its DLQ."""
        return await self.depths(q, f"{q}.retry.0", f"{q}.dlq")

    async def wait_for_depth(self, name: str, expected: int, timeout: float = 15.0) -> int:
        return await wait_for_depth(self.channel, name, expected, timeout)

    async def drain(self, name: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
        return await drain(self.channel, name)

    async def declare(self, name: str) -> str:
        """Declare a plain durable queue (a downstream destination); return its name."""
        await self.channel.declare_queue(name, durable=True)
        return name
