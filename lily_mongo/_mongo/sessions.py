"""Sessions and what the code of a transaction holds: the scope shared by a handler's ``MongoScope`` and
``Outbox.transaction``'s ``tx``; the server's transaction lifetime."""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any, ClassVar

from pymongo import AsyncMongoClient
from pymongo.errors import (
    PyMongoError,
)

from .._clock import clock_offset, utcnow
from .._errors import ScopeClosedError

if TYPE_CHECKING:
    from pymongo.asynchronous.client_session import AsyncClientSession
    from pymongo.asynchronous.database import AsyncDatabase


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


def discard_server_session(session: AsyncClientSession) -> None:
    """Never reuse a session whose transaction outcome is unclear.

    MongoDB aborts a session's open transaction when the next transaction on
    that session starts; some emulators instead keep it open and commit it with
    the next one. Marking the server session dirty makes PyMongo drop it from
    its pool, which is harmless on MongoDB (the server times it out).
    """
    server_session = getattr(session, "_server_session", None)
    mark_dirty = getattr(server_session, "mark_dirty", None)
    if callable(mark_dirty):
        mark_dirty()


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
