"""Test helpers shared by the tiers: broker names and inspection, polling, consumers, a raw AMQP producer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import decimal
import gc
import inspect
import logging
import os
import re
import struct
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Self, TypeVar

import aio_pika
import aio_pika.abc
import aiormq.exceptions
import pytest
from pamqp import commands as spec
from pamqp import frame as pamqp_frame
from pymongo import AsyncMongoClient, monitoring
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.uri_parser import parse_uri
from yarl import URL

from lily_mongo import (
    Consumer,
    Json,
    ManagedConsumer,
    Publisher,
    QueueHandlerError,
    QueueOptions,
    RetryPolicy,
    TerminalObservation,
    queue,
)
from lily_mongo._plan.routes import Guard, Middleware

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
T = TypeVar("T")
_MISSING = object()
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


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


# -- the servers of one test -----------------------------------------------------------------------

NO_RETRIES = RetryPolicy(max_retries=0, delays=())
QUEUE_SETTINGS = frozenset(f.name for f in dataclasses.fields(QueueOptions)) - {"name"}


@dataclass
class MongoDB:
    """The MongoDB one test uses: its URI, a client, and a fresh database (dropped afterwards)."""

    uri: str
    client: AsyncMongoClient[Any]
    name: str

    @property
    def db(self) -> AsyncDatabase[Any]:
        return self.client[self.name]

    @contextlib.asynccontextmanager
    async def second_client(self) -> AsyncIterator[MongoDB]:
        """The same database through a client of its own (as another replica has), closed afterwards."""
        client: AsyncMongoClient[Any] = AsyncMongoClient(self.uri, serverSelectionTimeoutMS=10_000)
        try:
            yield MongoDB(self.uri, client, self.name)
        finally:
            await client.close()


class CommandLog(monitoring.CommandListener):
    """Every command a client sends, in order."""

    def __init__(self) -> None:
        self.events: list[monitoring.CommandStartedEvent] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        self.events.append(event)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass

    def naming(self, collection: str) -> list[monitoring.CommandStartedEvent]:
        """The commands whose target is ``collection``."""
        return [e for e in self.events if e.command.get(e.command_name) == collection]


def w1_client(mongodb: MongoDB, listener: CommandLog) -> AsyncMongoClient[Any]:
    """A client of the test's server whose URI asks for ``w=1`` writes; its commands go to ``listener``."""
    separator = "&" if "?" in mongodb.uri else "?"
    return AsyncMongoClient(f"{mongodb.uri}{separator}w=1", event_listeners=[listener], serverSelectionTimeoutMS=10_000)


Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]  # one side of a connection


class CuttingProxy:
    """A TCP proxy in front of the test's one MongoDB server, which a subclass's :meth:`relay` makes drop
    connections: to the client behind it (``uri``) a real network error.

    :meth:`relay` copies the bytes of one client connection both ways and returns when that
    connection is done or cut; both sides are aborted then. ``cut`` counts a cut in ``cuts``
    and aborts the writers it is given at once.
    """

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.cuts = 0
        self.uri = ""
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @classmethod
    def fronting(cls, mongodb: MongoDB) -> Self:
        """A proxy for the test's server; the test is skipped against more than one server."""
        nodes = parse_uri(mongodb.uri)["nodelist"]
        if len(nodes) != 1:
            pytest.skip("a connection-cutting proxy fronts a single server")
        host, port = nodes[0]
        return cls(host, port)

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.uri = f"mongodb://{host}:{port}/?directConnection=true"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        await self._server.wait_closed()

    def cut(self, *writers: asyncio.StreamWriter) -> None:
        self.cuts += 1
        for writer in writers:
            writer.transport.abort()

    async def relay(self, client: Streams, server: Streams) -> None:
        raise NotImplementedError

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection(*self.upstream)
        self._writers |= {client_writer, server_writer}
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            await self.relay((client_reader, client_writer), (server_reader, server_writer))
        for writer in (client_writer, server_writer):
            writer.transport.abort()
            self._writers.discard(writer)


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
        queue_options = {key: value for key, value in options.items() if key in QUEUE_SETTINGS}
        settings = {key: value for key, value in options.items() if key not in QUEUE_SETTINGS}
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


class OneEvent(NamedTuple):
    """A fresh queue, the id of the handler a test links to it, a new event id and that event's inbox record key."""

    q: str
    handler_id: str
    event: uuid.UUID
    key: str


def one_event(broker: Broker, base: str) -> OneEvent:
    q = broker.queue(base)
    handler_id, event = f"{q}/{base}", uuid.uuid4()
    return OneEvent(q, handler_id, event, f"{handler_id}|{event}")


def accepting(q: str) -> Callable[..., Awaitable[None]]:
    """A json v1 handler on ``q`` that accepts every delivery and does nothing."""

    @queue(q, version=1, content="json")
    async def accept(body: Json[dict[str, Any]]) -> None:
        return None

    return accept


def rejecting(q: str) -> Callable[..., Awaitable[None]]:
    """A json v1 handler on ``q`` that refuses every delivery it decodes, permanently (``ITEM_REJECTED``)."""

    @queue(q, version=1, content="json")
    async def reject(body: Json[dict[str, Any]]) -> None:
        raise QueueHandlerError.permanent("ITEM_REJECTED", "refused by the handler")

    return reject


# -- polling --------------------------------------------------------------------------------------


async def eventually(
    predicate: Callable[[], bool] | Callable[[], Awaitable[bool]],
    *,
    timeout: float = 10.0,
    what: str = "condition",
    interval: float = 0.02,
) -> None:
    """Poll ``predicate`` (sync, or returning an awaitable) every ``interval`` s until it holds.

    Raises AssertionError("timed out after <timeout> s waiting for <what>") once ``timeout`` s have passed.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)


def new_tasks(before: set[asyncio.Task[Any]]) -> set[asyncio.Task[Any]]:
    """Unfinished tasks started since ``before`` was taken (``asyncio.all_tasks()``), except the current one."""
    current = asyncio.current_task()
    return {t for t in asyncio.all_tasks() - before if t is not current and not t.done()}


# -- consumers ------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def running(
    consumer: Consumer, *, expect_clean: bool = True, release: asyncio.Event | None = None
) -> AsyncIterator[ManagedConsumer]:
    """Start ``consumer`` and shut it down on the way out.

    On the way out ``release`` (if given) is set first, so blocked handlers can end; with ``expect_clean`` the
    shutdown report must leave no delivery unresolved. ``shutdown()`` returns the same report when the test already
    shut the consumer down.
    """
    managed = await consumer.start()
    try:
        yield managed
    finally:
        if release is not None:
            release.set()
        report = await managed.shutdown()
        if expect_clean:
            assert report.unresolved == 0, report.render()


def outcomes(managed: ManagedConsumer) -> list[str]:
    """The outcome of every ended delivery, oldest first."""
    return [o.outcome for o in managed.delivery_terminal_observations()]


async def wait_observations(managed: ManagedConsumer, count: int, timeout: float = 10.0) -> list[TerminalObservation]:
    """Wait until ``count`` deliveries have ended; return their observations, oldest first."""
    try:
        await eventually(
            lambda: len(managed.delivery_terminal_observations()) >= count,
            timeout=timeout,
            what=f"{count} terminal observations",
        )
    except AssertionError as error:
        raise AssertionError(f"{error} (have {outcomes(managed)})") from None
    return list(managed.delivery_terminal_observations())


# -- AsyncAPI documents ---------------------------------------------------------------------------


def resolve(document: dict[str, Any], ref: str) -> Any:
    """Follow a local JSON pointer (RFC 6901) inside ``document``; KeyError when it points nowhere."""
    assert ref.startswith("#/"), f"not a local reference: {ref!r}"
    node: Any = document
    for token in ref[2:].split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list):
            node = node[int(token)]
        elif isinstance(node, dict) and token in node:
            node = node[token]
        else:
            raise KeyError(f"{ref!r} does not resolve (missing {token!r})")
    return node


def version_and_content(message: dict[str, Any]) -> tuple[str, str]:
    """A message's (schema version, content kind), from the constants of its header schema."""
    properties = message["headers"]["properties"]
    return properties["x-lily-schema-version"]["const"], properties["x-lily-content-kind"]["const"]


# -- a raw AMQP producer ----------------------------------------------------------------------------


def short_bytes(raw: bytes) -> bytes:
    """An AMQP short string holding ``raw`` as it is (valid UTF-8 or not)."""
    assert len(raw) <= 255
    return bytes((len(raw),)) + raw


def long_string_value(text: str) -> bytes:
    """A header table value of type ``S`` (long string)."""
    raw = text.encode()
    return b"S" + len(raw).to_bytes(4) + raw


def raw_table(entries: Iterable[tuple[bytes, bytes]]) -> bytes:
    """A field table from (name bytes, encoded value) pairs: names are written as they are."""
    payload = b"".join(short_bytes(name) + value for name, value in entries)
    return len(payload).to_bytes(4) + payload


def raw_properties(
    *,
    content_type: bytes | None = None,
    headers: bytes | None = None,
    delivery_mode: int | None = None,
    message_id: bytes | None = None,
    message_type: bytes | None = None,
) -> bytes:
    """The property flags and list of a content header, each field written as given (AMQP 0-9-1 order)."""
    flags = 0
    parts: list[bytes] = []
    for bit, value in ((15, content_type), (13, headers), (12, delivery_mode), (7, message_id), (5, message_type)):
        if value is None:
            continue
        flags |= 1 << bit
        if bit == 13:
            parts.append(value)  # an encoded table
        elif bit == 12:
            parts.append(bytes((value,)))
        else:
            parts.append(short_bytes(value))
    return flags.to_bytes(2) + b"".join(parts)


class RawProducer:
    """A minimal AMQP 0-9-1 producer on a socket, writing frames by hand.

    It sends what a producer in any language may send and RabbitMQ accepts, including
    metadata the Python client libraries would never write: header names or short
    strings that are not UTF-8. Publishes are mandatory and wait for the confirm.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, url: str) -> RawProducer:
        parsed = URL(url)
        reader, writer = await asyncio.open_connection(parsed.host, parsed.port or 5672)
        producer = cls(reader, writer)
        writer.write(b"AMQP\x00\x00\x09\x01")
        await producer.expect(spec.Connection.Start)
        response = f"\0{parsed.user or 'guest'}\0{parsed.password or 'guest'}"
        producer.send(0, spec.Connection.StartOk(client_properties={}, mechanism="PLAIN", response=response))
        tune = await producer.expect(spec.Connection.Tune)
        producer.send(0, spec.Connection.TuneOk(channel_max=tune.channel_max, frame_max=tune.frame_max, heartbeat=0))
        vhost = parsed.path[1:] or "/"
        producer.send(0, spec.Connection.Open(virtual_host=vhost))
        await producer.expect(spec.Connection.OpenOk)
        producer.send(1, spec.Channel.Open())
        await producer.expect(spec.Channel.OpenOk)
        producer.send(1, spec.Confirm.Select())
        await producer.expect(spec.Confirm.SelectOk)
        return producer

    def send(self, channel: int, method: Any) -> None:
        self.writer.write(pamqp_frame.marshal(method, channel))

    async def expect(self, kind: type[T], timeout: float = 10.0) -> T:
        head = await asyncio.wait_for(self.reader.readexactly(7), timeout)
        rest = await asyncio.wait_for(self.reader.readexactly(int.from_bytes(head[3:7]) + 1), timeout)
        received = pamqp_frame.unmarshal(head + rest)[2]
        assert isinstance(received, kind), f"expected {kind.__name__}, got {received!r}"
        return received

    async def publish(self, exchange: str, routing_key: bytes, properties: bytes, body: bytes) -> None:
        """basic.publish (mandatory) with a hand-made content header; wait for the broker's ack."""
        method = b"\x00\x3c\x00\x28\x00\x00" + short_bytes(exchange.encode()) + short_bytes(routing_key) + b"\x01"
        content_header = b"\x00\x3c\x00\x00" + len(body).to_bytes(8) + properties
        for kind, payload in ((1, method), (2, content_header), (3, body)):
            self.writer.write(bytes((kind,)) + (1).to_bytes(2) + len(payload).to_bytes(4) + payload + b"\xce")
        await self.writer.drain()
        await self.expect(spec.Basic.Ack)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        try:
            self.send(0, spec.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0))
            await self.expect(spec.Connection.CloseOk, timeout=2.0)
        finally:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()


def same(a: Any, b: Any) -> bool:
    """Equal, of the same types all the way down (dict order, slots and ``__dict__`` included)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, BaseException):
        return _ADDRESS.sub("", str(a)) == _ADDRESS.sub("", str(b))  # pamqp's texts name object addresses
    if isinstance(a, float):
        return struct.pack(">d", a) == struct.pack(">d", b)
    if isinstance(a, decimal.Decimal):
        return str(a) == str(b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, str | bytes | bytearray | int | bool | datetime.datetime) or a is None:
        return bool(a == b)
    slots = [name for cls in type(a).__mro__ for name in getattr(cls, "__slots__", ())]
    if any(not same(getattr(a, name, _MISSING), getattr(b, name, _MISSING)) for name in slots):
        return False
    return same(getattr(a, "__dict__", {}), getattr(b, "__dict__", {}))


async def close_client(client: AsyncMongoClient[Any]) -> None:
    """Close a client that may have been connecting to a server that is not there.

    PyMongo 4.20's async connection set-up leaves the socket of a connect it was
    cancelled in (the client's close cancels its monitors) open until garbage
    collection (PYTHON-5867, fixed upstream); under this suite's warnings-as-errors
    that ResourceWarning would fail whichever test happens to collect it. So the
    abandoned sockets are collected here, with that warning silenced for this only.
    """
    await client.close()
    await asyncio.sleep(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


def collect_abandoned_sockets(mongo_uri: str) -> None:
    """Collect sockets PyMongo abandoned to the test's MongoDB server, and only those, without a warning.

    The same PyMongo 4.20 defect as :func:`close_client` (PYTHON-5867): a connection set-up
    cut short by an operation timeout (``pymongo.timeout``, which the inbox puts on every
    wait) or by a client's close leaves its socket open until garbage collection, whose
    ResourceWarning would fail whichever later test happens to collect it. Any other unclosed
    socket (to the broker, or anything of ours) is warned about as usual.
    """
    ports = {port for _, port in parse_uri(mongo_uri)["nodelist"]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    for found in caught:
        if not _abandoned_by_pymongo(found, ports):
            warnings.warn_explicit(found.message, found.category, found.filename, found.lineno)


def _abandoned_by_pymongo(found: warnings.WarningMessage, ports: set[int]) -> bool:
    """A socket to the MongoDB server, or one that never connected (a connect to a closed port cut
    short: what :func:`close_client` collects, when it is still referenced then)."""
    text = str(found.message)
    if not issubclass(found.category, ResourceWarning) or not text.startswith("unclosed <socket"):
        return False
    if "raddr=" not in text:
        return True
    return any(re.search(rf"raddr=\('[^']*', {port}\)", text) for port in ports)


@contextlib.contextmanager
def logging_restored() -> Iterator[None]:
    """Run an in-process command (typer's CliRunner) and put the logging set-up back afterwards.

    The command configures logging for its process (one stderr handler on the root logger,
    levels, warnings captured); in a test process that would replace pytest's log capture and
    leave a handler writing to the runner's closed stream for every later test.
    """
    root = logging.getLogger()
    loggers = [root, *(logging.getLogger(name) for name in ("lily_mongo", "lily_mongo._cli.app", "aiormq", "aio_pika"))]
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in loggers]
    try:
        yield
    finally:
        for lg, handlers, level, propagate in saved:
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate = propagate
        logging.captureWarnings(False)
