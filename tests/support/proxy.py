"""A TCP proxy in front of the test's MongoDB server that cuts connections: a real network error."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Self

import pytest
from pymongo.uri_parser import parse_uri

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
