"""Connections: :func:`connect_amqp`, the lenient transport, and what a refused connection says."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any, cast

import aio_pika
import aio_pika.abc
import aiormq.connection
import aiormq.exceptions
from aio_pika.connection import make_url
from yarl import URL

from .._errors import TransportError
from .._redact import redact_url
from .._tasks import uncancellable
from . import patches
from .errors import AmqpFailure, amqp_failure
from .lenient import LenientFrameReader
from .patches import FramePath

__all__ = ["LenientTransport", "connect_amqp", "connection_error", "frame_path"]


def connection_error(url: str, exc: BaseException) -> TransportError:
    """One sentence saying what refused the connection, with the URL redacted (aiormq's
    exceptions name a Connection.Close frame object for a refused virtual host)."""
    where = redact_url(url)
    failure = amqp_failure(exc)
    if failure is AmqpFailure.LOGIN_REFUSED:
        return TransportError(f"RabbitMQ at {where} refused the login (ACCESS_REFUSED): check the user and password")
    if failure is AmqpFailure.PROTOCOL and "Connection.Close" in str(exc):
        with contextlib.suppress(ValueError, TypeError):
            vhost = URL(url).path[1:] or "/"
            return TransportError(
                f"RabbitMQ at {where} refused to open virtual host {vhost!r}: it does not exist, or the user "
                "may not access it"
            )
    if failure in (AmqpFailure.NETWORK, AmqpFailure.TIMEOUT) and not isinstance(exc, aiormq.exceptions.AMQPError):
        return TransportError(f"RabbitMQ is not reachable at {where} ({_os_detail(exc)})", unreachable=True)
    if failure in (AmqpFailure.NETWORK, AmqpFailure.CLOSED) and isinstance(exc, aiormq.exceptions.AMQPConnectionError):
        cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else None
        detail = _os_detail(cause) if cause is not None else _amqp_detail(exc)
        return TransportError(f"RabbitMQ is not reachable at {where} ({detail})", unreachable=True)
    return TransportError(f"connecting to RabbitMQ at {where} failed ({type(exc).__name__})")


def _os_detail(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, socket.gaierror):
        return "unknown host"
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return type(exc).__name__


def _amqp_detail(exc: aiormq.exceptions.AMQPConnectionError) -> str:
    args = exc.args
    if len(args) == 2 and isinstance(args[1], str):
        return args[1]  # (errno, text): how aiormq wraps the socket's OSError
    return type(exc).__name__


class LenientTransport(aiormq.connection.TransportFactory):
    """aiormq's own TCP or TLS transport, read through a :class:`LenientFrameReader`.

    Given to one connection (aio-pika passes it to each aiormq connection it opens,
    reconnects included), so the lenient reading is scoped to the connections this
    package opens; every other AMQP client in the process is left as it is.
    """

    def __init__(self, *, tls: bool) -> None:
        self._transport = aiormq.connection.TLSTransportFactory() if tls else aiormq.connection.TCPTransportFactory()
        self.reader: LenientFrameReader | None = None  # the latest connection's

    async def create(self, url: URL, **kwargs: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await self._transport.create(url, **kwargs)
        self.reader = LenientFrameReader(reader)
        # aiormq's frame receiver reads the stream with at_eof(), read() and readexactly() only.
        return cast(asyncio.StreamReader, self.reader), writer


def frame_path(connection: aio_pika.abc.AbstractConnection) -> FramePath | None:
    """Which receiver reads ``connection``'s frames now: "fast" (lily's) or "stock" (aiormq's),
    both through the lenient reader; None when it was not opened by :func:`connect_amqp`."""
    factory = patches.transport_factory(connection)
    if not isinstance(factory, LenientTransport) or factory.reader is None:
        return None
    return factory.reader.receiver


async def connect_amqp(url: str, *, robust: bool = True) -> aio_pika.abc.AbstractConnection:
    """Open an AMQP connection (robust by default: it reconnects and restores topology).

    The connection reads frames through :class:`LenientTransport`: a delivery whose
    metadata pamqp cannot decode arrives marked (``AmqpMessage.malformed``)
    instead of closing the connection.
    Raises :class:`TransportError` naming what refused the connection (unreachable,
    login refused, virtual host refused), with the URL's password redacted.
    Cancelling the caller while the connection is being opened closes it: a robust
    connection starts background tasks that would otherwise outlive the caller.
    """
    patches.active()  # decided (and the fast receiver installed) before aiormq builds one
    made: aio_pika.Connection = (
        aio_pika.RobustConnection(make_url(url)) if robust else aio_pika.Connection(make_url(url))
    )
    patches.set_transport_factory(made, LenientTransport(tls=made.url.scheme == "amqps"))
    connection: aio_pika.abc.AbstractConnection = made
    try:
        await connection.connect()
    except BaseException as exc:
        with contextlib.suppress(Exception):
            await uncancellable(connection.close())
        if amqp_failure(exc) is not None:
            raise connection_error(url, exc) from exc
        raise
    return connection
