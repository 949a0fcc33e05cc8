"""Publishing records: the send a record goes through, its transports, and the pipelined batch (docs/outbox.md).

A batch never carries a publish the broker answers by closing the channel for a
missing exchange: each non-default exchange is checked first with a passive
declare on a throwaway channel (:class:`ExchangeCheck`, answers cached for a
bounded time), and a record for a missing one fails alone (:class:`ExchangeMissing`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import aiormq.abc
import aiormq.exceptions

from .._amqp import basic_publish, connection_unblocked
from .._lru import Lru
from .._observer import Observer

if TYPE_CHECKING:
    import aio_pika.abc

# How long a passive declare's answer holds: an exchange found, and one found missing. A
# deleted exchange is noticed within the first; a declared one within the second.
EXCHANGE_FOUND_SECONDS = 60.0
EXCHANGE_MISSING_SECONDS = 10.0
EXCHANGES_REMEMBERED = 1024

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

    async def missing(self, exchanges: Collection[str]) -> set[str]: ...

    async def unblocked(self, limit: float) -> float: ...


class ExchangeMissing(Exception):
    """The record's exchange does not exist (a passive declare found none): the record's own fault."""

    def __init__(self, exchange: str) -> None:
        super().__init__(f"exchange {exchange[:200]!r} not found (passive declare)")
        self.exchange = exchange


class ExchangeCheck:
    """Which exchanges exist, each asked once with a passive declare on a throwaway channel and
    remembered for :data:`EXCHANGE_FOUND_SECONDS` (:data:`EXCHANGE_MISSING_SECONDS` when missing).

    The broker answers a passive declare of a missing exchange by closing that channel
    (404), which is why it is a channel of its own: the publishing channel and every
    publish pipelined on it never meet that close.
    """

    def __init__(self) -> None:
        self._known: Lru[str, tuple[float, bool]] = Lru(EXCHANGES_REMEMBERED)

    def forget(self) -> None:
        """Ask again: a channel closed for a missing entity says some answer is stale."""
        self._known = Lru(EXCHANGES_REMEMBERED)

    async def missing(
        self, connection: aiormq.abc.AbstractConnection, exchanges: Collection[str], timeout: float
    ) -> set[str]:
        """Those of ``exchanges`` that do not exist; a failure to ask (a timeout, a closed connection) raises."""
        now = time.monotonic()
        missing: set[str] = set()
        for name in exchanges:
            until, exists = self._known.get(name, (0.0, True))
            if until <= now:
                exists = await asyncio.wait_for(self._declare(connection, name), timeout)
                seconds = EXCHANGE_FOUND_SECONDS if exists else EXCHANGE_MISSING_SECONDS
                self._known.put(name, (time.monotonic() + seconds, exists))
            if not exists:
                missing.add(name)
        return missing

    @staticmethod
    async def _declare(connection: aiormq.abc.AbstractConnection, name: str) -> bool:
        channel = await connection.channel()
        try:
            await channel.exchange_declare(exchange=name, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return False  # the broker closed the throwaway channel
        finally:
            if not channel.is_closed:
                with contextlib.suppress(Exception):
                    await channel.close()
        return True


class ChannelTransport:
    """A confirming channel: its current underlying channel, fetched once per batch."""

    def __init__(self, channel: aio_pika.abc.AbstractChannel, timeout: float) -> None:
        self.channel = channel
        self.timeout = timeout  # for the channel while it reconnects, and for each confirm
        self.exchanges = ExchangeCheck()

    @property
    def ready(self) -> bool:
        return not self.channel.is_closed

    async def missing(self, exchanges: Collection[str]) -> set[str]:
        if not exchanges:
            return set()
        underlay = await asyncio.wait_for(self.channel.get_underlay_channel(), self.timeout)
        return await self.exchanges.missing(underlay.connection, exchanges, self.timeout)

    async def unblocked(self, limit: float) -> float:
        """Wait while the broker blocks the connection (``connection.blocked``: a memory or disk alarm),
        at most ``limit`` seconds; the seconds waited."""
        try:
            underlay = await asyncio.wait_for(self.channel.get_underlay_channel(), self.timeout)
        except Exception:  # no channel: the sender says so
            return 0.0
        event = connection_unblocked(underlay)
        if event is None or event.is_set():
            return 0.0
        started = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), limit)
        return time.monotonic() - started

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

    async def missing(self, exchanges: Collection[str]) -> set[str]:
        return set()

    async def unblocked(self, limit: float) -> float:
        return 0.0


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
    confirmed or the exception that refused it (every record's, when the transport had no sender or
    could not check the exchanges). ``keep``, asked once the sender is there, leaves the records it
    refuses unpublished (:class:`LeftToRelay`); a record for an exchange that does not exist is not
    published either (:class:`ExchangeMissing`).
    """
    try:
        send = await transport.sender()
        exchanges = {r["exchange"] for r in records if isinstance(r.get("exchange"), str) and r["exchange"]}
        missing = await transport.missing(exchanges)
    except Exception as exc:
        return [exc] * len(records)
    refused: dict[int, BaseException] = {}
    for i, record in enumerate(records):
        if keep is not None and not keep(record):
            refused[i] = LeftToRelay()
        elif missing and record.get("exchange") in missing:
            refused[i] = ExchangeMissing(str(record["exchange"]))
    if not refused:
        return await _publish_all(records, send, observer, via=via)
    chosen = [record for i, record in enumerate(records) if i not in refused]
    published = iter(await _publish_all(chosen, send, observer, via=via) if chosen else [])
    return [refused[i] if i in refused else next(published) for i in range(len(records))]


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
