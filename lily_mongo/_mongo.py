"""PyMongo details shared by the inbox and the outbox: labels, sessions, indexes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pymongo.errors import OperationFailure, PyMongoError

from .errors import ConfigError
from .records import TRANSACTION_LABELS

if TYPE_CHECKING:
    from pymongo.asynchronous.client_session import AsyncClientSession
    from pymongo.asynchronous.collection import AsyncCollection

__all__ = ["discard_server_session", "ensure_index", "error_labels"]


def error_labels(exc: PyMongoError) -> frozenset[str]:
    """The transaction labels an error carries: errors are classified by label, never by code or message."""
    return frozenset(label for label in TRANSACTION_LABELS if exc.has_error_label(label))


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


async def ensure_index(
    collection: AsyncCollection[Any], name: str, keys: list[tuple[str, int]], *, passive: bool, **options: Any
) -> None:
    """Create the index (idempotent), or in passive mode only verify that it exists."""
    if passive:
        if name not in await collection.index_information():
            raise ConfigError(f"index {name!r} is missing on collection {collection.name!r} (passive mode)")
        return
    try:
        await collection.create_index(keys, name=name, **options)
    except OperationFailure as exc:
        raise ConfigError(f"index {name!r} on {collection.name!r} exists with other options: {exc.details}") from exc
