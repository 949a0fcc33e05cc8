"""A handler's MongoDB parameters (docs/handlers.md): ``MongoScope``, its view of one attempt, and
``MongoDatabase``, the consumer's database."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from pymongo.asynchronous.database import AsyncDatabase

from .._mongo import TransactionScope
from .._plan.extractors import MongoDatabaseMark

if TYPE_CHECKING:
    from pymongo.asynchronous.client_session import AsyncClientSession

    from .._outbox import OutboxWriter

__all__ = ["MongoDatabase", "MongoScope"]


class MongoScope(TransactionScope):
    """The handler's view of one attempt: its session, the database and the outbox.

    Valid for one attempt only; any use after the attempt ended raises
    :class:`ScopeClosedError`. Pass ``session=mongo.session`` to every operation
    that belongs to the transaction.
    """

    __slots__ = ("_outbox",)

    _closed_message = "this MongoScope belongs to a finished attempt; it cannot be used any more"

    def __init__(self, session: AsyncClientSession, database: AsyncDatabase[Any], outbox: OutboxWriter | None) -> None:
        super().__init__(session, database)
        self._outbox = outbox

    def __repr__(self) -> str:
        return f"<MongoScope open={self._open}>"

    @property
    def outbox(self) -> OutboxWriter:
        """Messages staged here commit with the transaction and are published right after the commit."""
        self._check()
        assert self._outbox is not None
        return self._outbox


MongoDatabase = Annotated[AsyncDatabase[Any], MongoDatabaseMark()]
"""The consumer's database (PyMongo's ``AsyncDatabase``), for handlers of any guarantee.

An inbox handler's writes belong to its transaction only with ``session=mongo.session``
(``MongoScope``); an at-least-once handler writes straight through it."""
