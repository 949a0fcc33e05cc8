"""Sessions and what the code of a transaction holds: the scope shared by a handler's ``MongoScope`` and
``Outbox.transaction``'s ``tx``; the server's transaction lifetime."""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Final

import pymongo
from pymongo import AsyncMongoClient
from pymongo.errors import InvalidOperation, PyMongoError

from .._clock import clock_offset, utcnow
from .._errors import ScopeClosedError

if TYPE_CHECKING:
    from pymongo.asynchronous.client_session import AsyncClientSession
    from pymongo.asynchronous.database import AsyncDatabase

log = logging.getLogger("lily_mongo")


async def server_clock_offset(client: AsyncMongoClient[Any]) -> datetime.timedelta:
    """The server's clock minus this process's, read from ``hello``'s ``localTime`` (zero when it has none)."""
    sent = utcnow()
    hello = await client.admin.command("hello")
    return clock_offset(hello.get("localTime"), sent, utcnow())


# MongoDB's default transactionLifetimeLimitSeconds, assumed where the server does not say.
DEFAULT_TRANSACTION_LIFETIME = 60.0


async def transaction_lifetime(client: AsyncMongoClient[Any]) -> float | None:
    """The server's ``transactionLifetimeLimitSeconds``, or None where ``getParameter`` is refused.

    Unprivileged users (MongoDB Atlas among them) get ``Unauthorized``; some servers and
    emulators do not know the command at all.
    """
    try:
        reply = await client.admin.command({"getParameter": 1, "transactionLifetimeLimitSeconds": 1})
    except PyMongoError:
        return None
    value = reply.get("transactionLifetimeLimitSeconds")
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        return None
    return float(value)


def discard_server_session(session: AsyncClientSession, *, end_on_server: bool = True) -> None:
    """Never reuse a session whose transaction outcome is unclear, and end that transaction on the server.

    MongoDB aborts a session's open transaction when the next transaction on
    that session starts; some emulators instead keep it open and commit it with
    the next one. Marking the server session dirty makes PyMongo drop it from
    its pool. Dropped, it is never used again, so MongoDB would keep its open
    transaction, and the locks of every document it wrote (an inbox record among
    them), until ``transactionLifetimeLimitSeconds`` ran out: the next copy of the
    event would wait for its record that long. With ``end_on_server`` a
    ``killSessions`` for it is sent in the background (bounded by
    :data:`KILL_BOUND`, its failure only logged): it aborts a transaction that did
    not commit and leaves one that did as it is (docs/inbox.md, "Bounded waits").
    ``end_on_server=False`` where the server has aborted the transaction already
    (a commit refused with TransientTransactionError).
    """
    server_session = getattr(session, "_server_session", None)
    mark_dirty = getattr(server_session, "mark_dirty", None)
    if callable(mark_dirty):
        mark_dirty()
    if not end_on_server:
        return
    try:
        loop = asyncio.get_running_loop()
        lsid = session.session_id
    except (RuntimeError, InvalidOperation):  # no loop to send it from, or the session has ended already
        return
    task = loop.create_task(_kill_session(session.client, lsid), name="lily-kill-session")
    _KILLS.add(task)
    task.add_done_callback(_KILLS.discard)


KILL_BOUND: Final = 5.0  # seconds a killSessions for a discarded session may take
_KILLS: set[asyncio.Task[None]] = set()  # the killSessions in flight (a task needs a reference to run)


async def _kill_session(client: AsyncMongoClient[Any], lsid: Mapping[str, Any]) -> None:
    try:
        with pymongo.timeout(KILL_BOUND):
            await client.admin.command({"killSessions": [lsid]})
    except PyMongoError as exc:  # the server times the transaction out in the end
        log.debug("killSessions for a discarded session failed: %s: %s", type(exc).__name__, exc)


class TransactionScope:
    """What the code of one transaction holds: its session and the database, until the transaction ends.

    The base of a handler's :class:`~lily_mongo.MongoScope` and of
    :class:`~lily_mongo.OutboxTransaction`; once :meth:`close` ran, every use raises
    :class:`ScopeClosedError` with the subclass's ``_closed_message``.
    """

    __slots__ = ("_database", "_open", "_session")

    _closed_message: ClassVar[str] = "this transaction has ended; it cannot be used any more"

    def __init__(self, session: AsyncClientSession, database: AsyncDatabase[Any]) -> None:
        self._session = session
        self._database = database
        self._open = True

    def _check(self) -> None:
        if not self._open:
            raise ScopeClosedError(self._closed_message)

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def session(self) -> AsyncClientSession:
        """The transaction's session, for every operation that belongs to the transaction (``session=``)."""
        self._check()
        return self._session

    @property
    def database(self) -> AsyncDatabase[Any]:
        """The database (the consumer's, or the outbox's)."""
        self._check()
        return self._database

    def close(self) -> None:
        self._open = False
