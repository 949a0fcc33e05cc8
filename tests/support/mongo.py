"""The MongoDB of one test, a log of the commands a client sends, and the sockets PyMongo abandons."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import re
import warnings
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pymongo import AsyncMongoClient, monitoring
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.uri_parser import parse_uri


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
