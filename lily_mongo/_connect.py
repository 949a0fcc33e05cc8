"""Connection helpers shared by the publisher, the consumer and the CLI.

URLs are shown through :mod:`lily_mongo._redact` (re-exported here).
"""

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
from pymongo import AsyncMongoClient
from pymongo.errors import ConfigurationError, ConnectionFailure, OperationFailure, PyMongoError
from yarl import URL

from ._amqp import LenientFrameReader, LenientFrameReceiver
from ._redact import redact_url, scrub
from ._tasks import uncancellable
from .errors import ConfigError, TransportError

__all__ = ["LenientTransport", "connect_amqp", "open_mongo", "redact_url", "scrub"]


def _connection_error(url: str, exc: BaseException) -> TransportError:
    """One sentence saying what refused the connection, with the URL redacted (aiormq's
    exceptions name a Connection.Close frame object for a refused virtual host)."""
    where = redact_url(url)
    if isinstance(exc, aiormq.exceptions.ProbableAuthenticationError | aiormq.exceptions.AuthenticationError):
        return TransportError(f"RabbitMQ at {where} refused the login (ACCESS_REFUSED): check the user and password")
    if isinstance(exc, aiormq.exceptions.InvalidFrameError) and "Connection.Close" in str(exc):
        with contextlib.suppress(ValueError, TypeError):
            vhost = URL(url).path[1:] or "/"
            return TransportError(
                f"RabbitMQ at {where} refused to open virtual host {vhost!r}: it does not exist, or the user "
                "may not access it"
            )
    if isinstance(exc, OSError | TimeoutError) and not isinstance(exc, aiormq.exceptions.AMQPError):
        return TransportError(f"RabbitMQ is not reachable at {where} ({_os_detail(exc)})", unreachable=True)
    if isinstance(exc, aiormq.exceptions.AMQPConnectionError):
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

    async def create(self, url: URL, **kwargs: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await self._transport.create(url, **kwargs)
        # aiormq's frame receiver reads the stream with at_eof(), read() and readexactly() only.
        return cast(asyncio.StreamReader, LenientFrameReader(reader)), writer


# aiormq builds each connection's frame receiver from the module global
# ``aiormq.connection.FrameReceiver`` (``Connection.connect``), with no parameter for it.
# The global is replaced, once, by a subclass of aiormq's receiver that gives a connection
# whose reader is a LenientFrameReader (only the connections this package opens, through
# LenientTransport) lily's receiver, and every other connection an aiormq receiver that
# behaves exactly as the original (it is one: the subclass adds nothing else, so type
# checks and subclasses of the global keep working). A subclass of aiormq's Connection
# would have to copy its whole connect() instead.
class FrameReceiverChoice(aiormq.connection.FrameReceiver):
    """What ``aiormq.connection.FrameReceiver(reader)`` builds: lily's receiver for a
    :class:`LenientFrameReader`, else aiormq's own (this class, which adds nothing)."""

    def __new__(cls, reader: asyncio.StreamReader) -> aiormq.connection.FrameReceiver:  # type: ignore[misc]
        if isinstance(reader, LenientFrameReader):
            # Not an instance of cls: Python does not run cls.__init__ on it again.
            return LenientFrameReceiver(reader)
        return super().__new__(cls)


aiormq.connection.FrameReceiver = FrameReceiverChoice  # type: ignore[misc]


async def connect_amqp(url: str, *, robust: bool = True) -> aio_pika.abc.AbstractConnection:
    """Open an AMQP connection (robust by default: it reconnects and restores topology).

    The connection reads frames through :class:`LenientTransport`: a delivery whose
    metadata pamqp cannot decode arrives marked (``InboundMessage.malformed``)
    instead of closing the connection.
    Raises :class:`TransportError` naming what refused the connection (unreachable,
    login refused, virtual host refused), with the URL's password redacted.
    Cancelling the caller while the connection is being opened closes it: a robust
    connection starts background tasks that would otherwise outlive the caller.
    """
    made: aio_pika.Connection = (
        aio_pika.RobustConnection(make_url(url)) if robust else aio_pika.Connection(make_url(url))
    )
    # aio-pika hands its keyword arguments to every aiormq connection it opens (reconnects
    # too); it keeps only the ones it knows from a constructor call, so set this one here.
    made.kwargs["transport_factory"] = LenientTransport(tls=made.url.scheme == "amqps")
    connection: aio_pika.abc.AbstractConnection = made
    try:
        await connection.connect()
    except BaseException as exc:
        with contextlib.suppress(Exception):
            await uncancellable(connection.close())
        if isinstance(exc, aiormq.exceptions.AMQPError | OSError | TimeoutError):
            raise _connection_error(url, exc) from exc
        raise
    return connection


# PyMongo's code for a refused login (AuthenticationFailed).
_AUTHENTICATION_FAILED = 18


async def open_mongo(uri: str, *, timeout: float = 10.0) -> AsyncMongoClient[Any]:
    """A client for ``uri`` that has answered a ping; the caller closes it.

    ``timeout`` bounds server selection unless the URI sets ``serverSelectionTimeoutMS``
    itself. Raises :class:`ConfigError` for a URI PyMongo refuses, :class:`TransportError`
    when no server answers or the login is refused, with the URI redacted.
    """
    where = redact_url(uri)
    options: dict[str, Any] = {}
    if "serverselectiontimeoutms" not in uri.lower():
        options["serverSelectionTimeoutMS"] = int(timeout * 1000)
    try:
        client: AsyncMongoClient[Any] = AsyncMongoClient(uri, **options)
    except ConfigurationError as exc:  # InvalidURI is one
        raise ConfigError(f"the MongoDB URI {where} is not valid: {scrub(str(exc), uri)}"[:300]) from exc
    try:
        await client.admin.command("ping")
    except BaseException as exc:
        await client.close()
        if isinstance(exc, OperationFailure) and exc.code == _AUTHENTICATION_FAILED:
            raise TransportError(f"MongoDB at {where} refused the login: check the user and password") from exc
        if isinstance(exc, ConnectionFailure):
            raise TransportError(
                f"MongoDB is not reachable at {where} (no server answered in time)", unreachable=True
            ) from exc
        if isinstance(exc, PyMongoError):
            raise TransportError(f"MongoDB at {where} failed: {type(exc).__name__}") from exc
        raise
    return client
