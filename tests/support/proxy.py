"""TCP proxies that cut or hold connections: real network errors and stalls, in front of the test's
MongoDB server (:class:`CommitCutter`) or a broker (:class:`HoldingProxy`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Self

import pytest
from pymongo import AsyncMongoClient
from pymongo.uri_parser import parse_uri
from yarl import URL

from tests.support.mongo import MongoDB

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
        self.address = ("", 0)
        self.refusing = False  # new connections are aborted at once while set
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
        self.address = (host, port)
        self.uri = f"mongodb://{host}:{port}/?directConnection=true"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        await self._server.wait_closed()

    def cut_all(self) -> None:
        """Abort every connection open through the proxy (both sides)."""
        self.cut(*self._writers)

    def cut(self, *writers: asyncio.StreamWriter) -> None:
        self.cuts += 1
        for writer in writers:
            writer.transport.abort()

    async def relay(self, client: Streams, server: Streams) -> None:
        raise NotImplementedError

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            client_writer.transport.abort()
            return
        server_reader, server_writer = await asyncio.open_connection(*self.upstream)
        self._writers |= {client_writer, server_writer}
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            await self.relay((client_reader, client_writer), (server_reader, server_writer))
        for writer in (client_writer, server_writer):
            writer.transport.abort()
            self._writers.discard(writer)


class CommitCutter(CuttingProxy):
    """A proxy in front of the MongoDB server that drops connections around ``commitTransaction``.

    ``cut_requests``: drop the connection instead of forwarding the next N commits (the
    commit never reaches the server). ``cut_replies``: forward the next N commits, then
    drop the connection instead of forwarding the reply (the commit applied, the client
    cannot know). Both are real network errors: the driver labels them
    ``UnknownTransactionCommitResult``.
    """

    MARK = b"commitTransaction\x00"

    def __init__(self, host: str, port: int) -> None:
        super().__init__(host, port)
        self.cut_requests = 0
        self.cut_replies = 0

    async def relay(self, client: Streams, server: Streams) -> None:
        (client_reader, client_writer), (server_reader, server_writer) = client, server
        reply_doomed = False

        async def upstream() -> None:
            nonlocal reply_doomed
            while data := await client_reader.read(65536):
                if self.MARK in data:
                    if self.cut_requests > 0:
                        self.cut_requests -= 1
                        self.cut(client_writer, server_writer)
                        return
                    if self.cut_replies > 0:
                        self.cut_replies -= 1
                        reply_doomed = True
                server_writer.write(data)
                await server_writer.drain()

        async def downstream() -> None:
            while data := await server_reader.read(65536):
                if reply_doomed:
                    self.cut(client_writer, server_writer)
                    return
                client_writer.write(data)
                await client_writer.drain()

        await asyncio.gather(upstream(), downstream())


class HoldingProxy(CuttingProxy):
    """A TCP proxy in front of a broker that, while holding (:meth:`hold`), forwards nothing its clients
    send: the broker reads nothing, as under a memory alarm or on a half-open connection. The bytes
    are kept and forwarded, in order, once :meth:`flow` is called; the broker's side flows throughout."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(host, port)
        self._flowing = asyncio.Event()
        self._flowing.set()

    @classmethod
    def fronting_broker(cls, url: str) -> HoldingProxy:
        parsed = URL(url)
        return cls(parsed.host or "127.0.0.1", parsed.port or 5672)

    def url(self, url: str) -> str:
        """``url`` (the broker's) through the proxy."""
        host, port = self.address
        return str(URL(url).with_host(host).with_port(port))

    def hold(self) -> None:
        self._flowing.clear()

    def flow(self) -> None:
        self._flowing.set()

    async def relay(self, client: Streams, server: Streams) -> None:
        (client_reader, client_writer), (server_reader, server_writer) = client, server

        async def upstream() -> None:
            while data := await client_reader.read(65536):
                await self._flowing.wait()
                server_writer.write(data)
                await server_writer.drain()

        async def downstream() -> None:
            while data := await server_reader.read(65536):
                client_writer.write(data)
                await client_writer.drain()

        await asyncio.gather(upstream(), downstream())


@contextlib.asynccontextmanager
async def behind_a_cutter(mongodb: MongoDB) -> AsyncIterator[tuple[CommitCutter, MongoDB]]:
    """A :class:`CommitCutter` in front of the test's server, and the test's database through it."""
    async with CommitCutter.fronting(mongodb) as cutter:
        client: AsyncMongoClient[Any] = AsyncMongoClient(cutter.uri, serverSelectionTimeoutMS=10_000)
        try:
            yield cutter, MongoDB(cutter.uri, client, mongodb.name)
        finally:
            await client.close()
