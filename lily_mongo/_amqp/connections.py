"""Connections: :func:`connect_amqp`, the lenient transport, and what a refused connection says."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections.abc import Callable
from typing import Any, cast

import aio_pika
import aio_pika.abc
import aiormq.connection
import aiormq.exceptions
from aio_pika.connection import make_url
from yarl import URL

from .._errors import TransportError
from .._nodes import split_nodes
from .._redact import redact_url
from .._tasks import uncancellable
from . import patches
from .errors import AmqpFailure, amqp_failure
from .lenient import LenientFrameReader
from .patches import FramePath

__all__ = [
    "NODE_CONNECT_TIMEOUT",
    "LenientTransport",
    "connect_amqp",
    "connected_node",
    "connection_error",
    "frame_path",
]

log = logging.getLogger("lily_mongo")

# How long one attempt waits for one node of several to accept a TCP (or TLS) connection
# before it tries the next (a lost node's host may not answer at all).
NODE_CONNECT_TIMEOUT = 5.0


def connection_error(url: str, exc: BaseException) -> TransportError:
    """One sentence saying what refused the connection, with the URL redacted (aiormq's
    exceptions name a Connection.Close frame object for a refused virtual host)."""
    where = redact_url(url)
    failure = amqp_failure(exc)
    nodes = next((e for e in _chain(exc) if isinstance(e, NoNodeAnswered)), None)
    if nodes is not None:
        return TransportError(
            f"RabbitMQ is not reachable at {where}: no node answered ({nodes.args[0]})", unreachable=True
        )
    if failure is AmqpFailure.LOGIN_REFUSED:
        return TransportError(f"RabbitMQ at {where} refused the login (ACCESS_REFUSED): check the user and password")
    if failure is AmqpFailure.PROTOCOL and "Connection.Close" in str(exc):
        with contextlib.suppress(ValueError, TypeError):
            vhost = URL(split_nodes(url)[0]).path[1:] or "/"
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


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes (and contexts), at most 10."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and len(chain) < 10:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


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


class NoNodeAnswered(aiormq.exceptions.AMQPConnectionError):
    """No node of several accepted the connection: its text names each node and what refused it."""


class LenientTransport(aiormq.connection.TransportFactory):
    """aiormq's own TCP or TLS transport, read through a :class:`LenientFrameReader`, and the
    failover over a cluster's nodes.

    Given to one connection (aio-pika passes it to each aiormq connection it opens,
    reconnects included), so the lenient reading is scoped to the connections this
    package opens; every other AMQP client in the process is left as it is.

    With several ``nodes`` (single-node URLs that differ in their host and port only), each
    connection attempt tries them in turn, each for at most :data:`NODE_CONNECT_TIMEOUT`
    seconds: the first attempt from the first node, every later one (a reconnect) from the
    node after the one last connected to, so a connection whose node was lost moves to the
    next live one. aiormq logs in with the URL aio-pika gives it, the same on every node.
    """

    def __init__(self, *, tls: bool, nodes: tuple[str, ...] = ()) -> None:
        self._transport = aiormq.connection.TLSTransportFactory() if tls else aiormq.connection.TCPTransportFactory()
        self.reader: LenientFrameReader | None = None  # the latest connection's
        self.nodes = tuple(URL(node) for node in nodes)
        self.node: int | None = None  # the index in ``nodes`` of the latest connection's node
        self.on_node: Callable[[URL], None] | None = None  # told each node connected to
        self._next = 0

    async def create(self, url: URL, **kwargs: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if len(self.nodes) > 1:
            reader, writer = await self._create_on_a_node(kwargs)
        else:
            reader, writer = await self._transport.create(url, **kwargs)
        self.reader = LenientFrameReader(reader)
        # aiormq's frame receiver reads the stream with at_eof(), read() and readexactly() only.
        return cast(asyncio.StreamReader, self.reader), writer

    async def _create_on_a_node(self, kwargs: dict[str, Any]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        count = len(self.nodes)
        failures: list[str] = []
        error: BaseException | None = None
        for step in range(count):
            index = (self._next + step) % count
            node = self.nodes[index]
            try:
                opened = await asyncio.wait_for(self._transport.create(node, **kwargs), NODE_CONNECT_TIMEOUT)
            except (OSError, TimeoutError, aiormq.exceptions.AMQPConnectionError) as exc:
                failures.append(f"{node.host}:{node.port} ({_os_detail(exc.__cause__ or exc)})")
                error = exc
                continue
            if failures:
                log.info(
                    "RabbitMQ node %s:%s took the connection; not reachable: %s",
                    node.host,
                    node.port,
                    ", ".join(failures),
                )
            self.node, self._next = index, (index + 1) % count
            if self.on_node is not None:
                self.on_node(node)
            return opened
        assert error is not None
        raise NoNodeAnswered(", ".join(failures)) from error

    @property
    def connected_node(self) -> str | None:
        """``host:port`` of the node the latest connection went to (None before the first, or with one node)."""
        if self.node is None:
            return None
        node = self.nodes[self.node]
        return f"{node.host}:{node.port}"


def connected_node(connection: aio_pika.abc.AbstractConnection) -> str | None:
    """``host:port`` of the cluster node ``connection`` was last connected to, when it was opened by
    :func:`connect_amqp` with several nodes; else None."""
    factory = patches.transport_factory(connection)
    return factory.connected_node if isinstance(factory, LenientTransport) else None


def frame_path(connection: aio_pika.abc.AbstractConnection) -> FramePath | None:
    """Which receiver reads ``connection``'s frames now: "fast" (lily's) or "stock" (aiormq's),
    both through the lenient reader; None when it was not opened by :func:`connect_amqp`."""
    factory = patches.transport_factory(connection)
    if not isinstance(factory, LenientTransport) or factory.reader is None:
        return None
    return factory.reader.receiver


async def connect_amqp(url: str, *, robust: bool = True) -> aio_pika.abc.AbstractConnection:
    """Open an AMQP connection (robust by default: it reconnects and restores topology).

    ``url`` may name several nodes of a cluster in a comma-separated host list (what
    :func:`lily_mongo._checks.check_amqp_url` returns for a list): each attempt tries them
    in turn (:class:`LenientTransport`), a reconnect from the node after the one lost.

    The connection reads frames through :class:`LenientTransport`: a delivery whose
    metadata pamqp cannot decode arrives marked (``AmqpMessage.malformed``)
    instead of closing the connection.
    Raises :class:`TransportError` naming what refused the connection (unreachable,
    login refused, virtual host refused), with the URL's password redacted.
    Cancelling the caller while the connection is being opened closes it: a robust
    connection starts background tasks that would otherwise outlive the caller.
    """
    patches.active()  # decided (and the fast receiver installed) before aiormq builds one
    nodes = split_nodes(url)
    made: aio_pika.Connection = (
        aio_pika.RobustConnection(make_url(nodes[0])) if robust else aio_pika.Connection(make_url(nodes[0]))
    )
    factory = LenientTransport(tls=made.url.scheme == "amqps", nodes=nodes)
    # aio-pika names the node connected to (its logs, str(connection)); the next attempt logs in with it.
    factory.on_node = functools.partial(setattr, made, "url")
    patches.set_transport_factory(made, factory)
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
