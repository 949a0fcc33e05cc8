"""What the broker tier's tests share: the broker a test runs on (:class:`RabbitMQ`), and queue
declarations: a destination of either type, the type a queue has, and a work queue topology declared
by the test itself (with queue arguments the library does not write)."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import aio_pika.abc
from pamqp import commands as spec
from pamqp import frame as pamqp_frame
from yarl import URL

from lily_mongo import QueueOptions
from lily_mongo._topology import topology_names
from lily_mongo._versions import release
from tests.integration.test_runtime_features import declare_or_refusal
from tests.support.broker import Broker


@dataclass(frozen=True)
class RabbitMQ:
    """The broker a test runs on, as it describes itself in connection.start."""

    url: str
    version: tuple[int, ...]
    text: str

    @classmethod
    def of(cls, url: str, properties: dict[str, object]) -> RabbitMQ:
        text = str(properties.get("version", ""))
        assert properties.get("product") == "RabbitMQ", properties
        assert release(text), properties
        return cls(url, release(text), text)

    @property
    def counts_every_return(self) -> bool:
        """Whether a quorum queue raises x-delivery-count on every return, basic.nack(requeue=true) included
        (observed on 3.10.8 and 4.0.5; on 4.3.6 only basic.reject(requeue=true) and a lost channel do)."""
        return self.version < (4, 3)

    @property
    def default_delivery_limit(self) -> int | None:
        """A quorum queue's delivery limit when none is set (observed: none on 3.10.8, 20 on 4.0.5 and 4.3.6)."""
        return None if self.version < (4, 0) else 20


def server_properties(url: URL) -> dict[str, object]:
    """The server properties of the broker's connection.start (no session is opened)."""
    with socket.create_connection((url.host or "127.0.0.1", url.port or 5672), timeout=5) as sock:
        sock.sendall(b"AMQP\x00\x00\x09\x01")
        data = b""
        while len(data) < 7 or len(data) < 8 + int.from_bytes(data[3:7]):
            chunk = sock.recv(65536)
            assert chunk, "the broker closed the connection before connection.start"
            data += chunk
    start = pamqp_frame.unmarshal(data)[2]
    assert isinstance(start, spec.Connection.Start), start
    return dict(start.server_properties)


def type_argument(queue_type: str) -> dict[str, Any]:
    return {"x-queue-type": queue_type} if queue_type == "quorum" else {}


async def declare_destination(broker: Broker, base: str, queue_type: str) -> str:
    """A durable downstream queue of ``queue_type`` (deleted after the test); its name."""
    name = broker.queue(base)
    await broker.channel.declare_queue(name, durable=True, arguments=type_argument(queue_type))
    return name


async def assert_queue_type(
    connection: aio_pika.abc.AbstractConnection, name: str, queue_type: str, arguments: dict[str, Any]
) -> None:
    """``name`` is a queue of ``queue_type`` declared with ``arguments`` (besides its type): declaring it
    so again is accepted, declaring it so as the other type is refused."""
    other = "classic" if queue_type == "quorum" else "quorum"
    assert await declare_or_refusal(connection, name, {**arguments, **type_argument(queue_type)}) is None, name
    refusal = await declare_or_refusal(connection, name, {**arguments, "x-queue-type": other})
    assert refusal == "ChannelPreconditionFailed", name


async def declare_work_queue(
    channel: aio_pika.abc.AbstractChannel, options: QueueOptions, **work_queue_arguments: Any
) -> list[str]:
    """Declare the topology a consumer with ``options`` declares (docs/settlement.md, section 8), with
    ``work_queue_arguments`` added to the work queue's own arguments; the consumer then takes it as it
    is (``passive=True``). Returns the names declared."""
    extra = type_argument(options.queue_type)
    await channel.declare_queue(options.dlq_name, durable=True, arguments=extra)
    dead_letters = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": options.dlq_name}
    await channel.declare_queue(options.name, durable=True, arguments={**dead_letters, **extra, **work_queue_arguments})
    for index, delay_ms in enumerate(options.retry.bucket_delays_ms):
        bucket: dict[str, Any] = {
            "x-message-ttl": delay_ms,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": options.name,
        }
        await channel.declare_queue(options.bucket_name(index), durable=True, arguments={**bucket, **extra})
    return topology_names(options)
