"""The test consumer's command log: which writes a handler made outside its attempt's transaction.

A handler under the inbox writes through ``mongo.session``; a write without it commits on its own,
survives the attempt's abort and is made again by a replay (docs/testing.md, "The idempotence check").
The log is a PyMongo ``CommandListener`` on a copy of the consumer's client (the same settings, one
more listener): every write command that carries no ``autocommit`` field ran outside any transaction.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pymongo import monitoring

if TYPE_CHECKING:
    from pymongo.asynchronous.mongo_client import AsyncMongoClient


_WRITES = ("insert", "update", "delete", "findAndModify")


@dataclass(frozen=True, slots=True)
class SessionlessWrite:
    """One write command that ran outside any transaction: what kind of write, its database and collection."""

    shape: str  # "insert", "update", "$inc", "upsert", "delete", "findAndModify"
    database: str
    collection: str


def _shape(name: str, command: Any) -> str:
    """The write's shape as docs/testing.md names them: an upsert, an ``$inc``, or the command's name."""
    if name == "update":
        updates = command.get("updates") or []
        if any(isinstance(u, dict) and u.get("upsert") for u in updates):
            return "upsert"
        if any(isinstance(u, dict) and isinstance(u.get("u"), dict) and "$inc" in u["u"] for u in updates):
            return "$inc"
    if name == "findAndModify" and command.get("upsert"):
        return "upsert"
    return name


class WriteLog(monitoring.CommandListener):
    """Every write command on a collection other than the framework's own that ran outside a transaction."""

    def __init__(self, own: Collection[str]) -> None:
        self.own = frozenset(own)
        self.writes: list[SessionlessWrite] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        name = event.command_name
        if name not in _WRITES or "autocommit" in event.command:
            return
        collection = event.command.get(name)
        if not isinstance(collection, str) or collection in self.own or collection.startswith("system."):
            return
        self.writes.append(SessionlessWrite(_shape(name, event.command), event.database_name, collection))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        return None

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        return None

    def since(self, mark: int) -> list[SessionlessWrite]:
        return self.writes[mark:]


def watched(client: AsyncMongoClient[Any], log: WriteLog) -> AsyncMongoClient[Any] | None:
    """A client with the settings of ``client`` and ``log`` among its listeners; None when PyMongo does
    not say how ``client`` was made (then the writes are not watched)."""
    arguments = getattr(client, "_init_kwargs", None)
    if not isinstance(arguments, dict) or "host" not in arguments:
        return None
    listeners = [*(arguments.get("event_listeners") or ()), log]
    copied: AsyncMongoClient[Any] = type(client)(**{**arguments, "event_listeners": listeners})
    return copied


def outside_session_hint(writes: list[SessionlessWrite]) -> str:
    """What a delivery's result says about writes outside ``mongo.session``: '' when there were none."""
    if not writes:
        return ""
    names = sorted({f"{w.collection!r} ({w.shape})" for w in writes})
    return (
        f"a write outside mongo.session? {', '.join(names)} written without session=mongo.session, "
        "so the write committed on its own, outside the attempt's transaction: pass session=mongo.session "
        "to every operation on mongo.database"
    )
