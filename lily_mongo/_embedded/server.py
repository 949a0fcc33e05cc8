"""The embedded server with its corrections: mongoeco's wire server, engine and sessions, subclassed.

:func:`running` opens one on a host and port: the memory engine with MongoDB's write
conflicts (:mod:`.engine`), or the SQLite engine it is given (``--data``), behind
the wire layer of :mod:`.commands`, and the reaper that aborts transactions older
than ``transactionLifetimeLimitSeconds``, as MongoDB's does. Nothing outside the
objects it creates is changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Final

from mongoeco.wire import AsyncMongoEcoProxyServer
from mongoeco.wire.surface import WIRE_SUPPORTED_COMMANDS, WireSurface

from . import commands
from .commands import LilyCommandExecutor, LilySessionStore
from .engine import LilyMemoryEngine
from .transactions import TransactionBook

__all__ = ["REAP_EVERY", "CorrectedServer", "reap", "running"]

log = logging.getLogger("lily_mongo")

REAP_EVERY: Final = 0.5  # seconds between two passes of the reaper (MongoDB's runs about every 30 s)


class CorrectedServer(AsyncMongoEcoProxyServer):  # type: ignore[misc]  # mongoeco.wire re-exports it untyped
    """mongoeco's wire server with the wire layer of :mod:`.commands` and ``hello`` as a replica set's."""

    def __init__(
        self,
        *,
        engine: Any,
        host: str,
        port: int,
        book: TransactionBook,
        replica_set: bool,
        majority_latency: float = 0.0,
    ) -> None:
        super().__init__(engine=engine, host=host, port=port)
        self.book = book
        self._local: dict[tuple[str, int], str] = {}  # a client's address -> the address it reached
        self._surface = WireSurface(supported_commands=(*WIRE_SUPPORTED_COMMANDS, *commands.COMMANDS))
        self._session_store = LilySessionStore(book)
        self._executor = LilyCommandExecutor(
            self._client,
            self._cursor_store,
            self._session_store,
            surface=self._surface,
            auth=self._auth,
            book=book,
            member=self._member if replica_set else None,
            majority_latency=majority_latency,
        )

    async def _handle_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = _pair(writer.get_extra_info("peername"))
        local = _pair(writer.get_extra_info("sockname"))
        if peer is not None and local is not None:
            self._local[peer] = _address(*local)
        try:
            await super()._handle_connection(reader, writer)
        finally:
            if peer is not None:
                self._local.pop(peer, None)
                self.book.connection_lost(peer)

    def _member(self, connection: Any) -> str:
        """This member's address as ``connection``'s client reached it (``hello``'s ``me`` and ``hosts``)."""
        reached = self._local.get((connection.peer_host, connection.peer_port))
        return reached or _address(self.address.host, self.address.port)


def _pair(address: object) -> tuple[str, int] | None:
    if isinstance(address, tuple) and len(address) >= 2 and isinstance(address[0], str):
        return address[0], int(address[1])
    return None


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def reap(book: TransactionBook, now: float | None = None) -> int:
    """Abort the transactions older than the lifetime; how many there were.

    The session's transaction is aborted in the engine at once (its documents
    released, its snapshot freed); its next command is refused with
    NoSuchTransaction (:meth:`.transactions.TransactionBook.refusal`).
    """
    expired = book.expired(time.monotonic() if now is None else now)
    for transaction in expired:
        book.abort(transaction, "it exceeded transactionLifetimeLimitSeconds")
    for transaction in book:
        # Aborted here or by a conflict (inside another command, where the engine cannot end it):
        # the engine lets go of its snapshot now; the client's next command is still refused.
        if transaction.aborted is not None and not transaction.running and transaction.session.transaction_active:
            try:
                transaction.session.abort_transaction()
            except Exception as exc:  # the reaper goes on for the others; the next pass tries again
                log.warning("the embedded server could not abort an expired transaction: %s", exc)
    return len(expired)


async def _reaper(book: TransactionBook) -> None:
    while True:
        await asyncio.sleep(REAP_EVERY)
        reap(book)


@contextlib.asynccontextmanager
async def running(
    host: str, port: int, *, sqlite: Any = None, replica_set: bool = False, majority_latency: float = 0.0
) -> AsyncIterator[CorrectedServer]:
    """A corrected server listening on ``host``:``port`` (``sqlite``: that engine instead of the memory
    one; ``replica_set``: ``hello`` as a replica set's primary, :mod:`.handshake`; ``majority_latency``:
    seconds a commit or a majority write waits before its reply, :mod:`.commands`)."""
    book = TransactionBook()
    engine = sqlite if sqlite is not None else LilyMemoryEngine(book)
    server_made = CorrectedServer(
        engine=engine, host=host, port=port, book=book, replica_set=replica_set, majority_latency=majority_latency
    )
    async with server_made as server:
        reaper = asyncio.create_task(_reaper(book), name="lily-embedded-reaper")
        try:
            yield server
        finally:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
