"""Publishing records: the send a record goes through, its transports, and the pipelined batch (docs/outbox.md)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .._amqp import basic_publish
from .._observer import Observer

if TYPE_CHECKING:
    import aio_pika.abc

# -- publishing records ---------------------------------------------------------------------------


class Send(Protocol):
    """Publish one outbox record's message, mandatory and confirmed; raise unless it was accepted."""

    def __call__(
        self, *, exchange: str, routing_key: str, body: bytes, headers: dict[str, Any], content_type: str | None
    ) -> Awaitable[None]: ...


class Transport(Protocol):
    @property
    def ready(self) -> bool: ...

    @property
    def timeout(self) -> float: ...

    async def sender(self) -> Send: ...


class ChannelTransport:
    """A confirming channel: its current underlying channel, fetched once per batch."""

    def __init__(self, channel: aio_pika.abc.AbstractChannel, timeout: float) -> None:
        self.channel = channel
        self.timeout = timeout  # for the channel while it reconnects, and for each confirm

    @property
    def ready(self) -> bool:
        return not self.channel.is_closed

    async def sender(self) -> Send:
        # A robust channel waits for its connection to come back: bounded, so a batch never
        # waits in memory while its claims run out (the records then go to a relay).
        underlay = await asyncio.wait_for(self.channel.get_underlay_channel(), self.timeout)
        send: Send = functools.partial(basic_publish, underlay, timeout=self.timeout)
        return send


class FixedTransport:
    """An in-process send (:class:`lily_mongo.testing.TestConsumer` records what would be published)."""

    ready = True
    timeout = 0.0

    def __init__(self, send: Send) -> None:
        self._send = send

    async def sender(self) -> Send:
        return self._send


class LeftToRelay(Exception):
    """A record :func:`publish_batch` did not publish: its claim would not outlast the publish and the mark."""


async def publish_batch(
    records: Sequence[dict[str, Any]],
    transport: Transport,
    observer: Observer,
    *,
    via: str,
    keep: Callable[[dict[str, Any]], bool] | None = None,
) -> list[BaseException | None]:
    """Publish ``records`` pipelined on ``transport``: every publish in flight at once, the confirms awaited
    together.

    The tasks start in order and each reaches the channel's publish lock without
    suspending first, so the frames go out in ``records`` order (aiormq's lock is FIFO):
    a destination queue receives them in that order. Returns, per record, None once
    confirmed or the exception that refused it (every record's, when the transport had no sender).
    ``keep``, asked once the sender is there, leaves the records it refuses unpublished
    (:class:`LeftToRelay`).
    """
    try:
        send = await transport.sender()
    except Exception as exc:
        return [exc] * len(records)
    left: dict[int, BaseException] = {}
    if keep is not None:
        left = {i: LeftToRelay() for i, record in enumerate(records) if not keep(record)}
        if left:
            chosen = [record for i, record in enumerate(records) if i not in left]
            published = iter(await _publish_all(chosen, send, observer, via=via) if chosen else [])
            return [left[i] if i in left else next(published) for i in range(len(records))]
    return await _publish_all(records, send, observer, via=via)


async def _publish_all(
    records: Sequence[dict[str, Any]], send: Send, observer: Observer, *, via: str
) -> list[BaseException | None]:

    async def one(record: dict[str, Any]) -> None:
        publish = functools.partial(
            send,
            exchange=record["exchange"],
            routing_key=record["routing_key"],
            body=bytes(record["body"]),
            content_type=record.get("content_type"),
        )
        await observer.relay_publish(lambda headers: publish(headers=headers), record, via=via)

    if len(records) == 1:  # no task needed for one
        try:
            await one(records[0])
        except Exception as exc:
            return [exc]
        return [None]
    results = await asyncio.gather(*(one(record) for record in records), return_exceptions=True)
    return [None if result is None else result for result in results]
