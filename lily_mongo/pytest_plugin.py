"""pytest fixtures for testing lily_mongo handlers, registered as a plugin when lily_mongo is installed.

* ``lily_mongo_uri`` (session): ``LILY_MONGO_URI`` when set (a replica set, say), otherwise
  an embedded MongoDB-wire server started once for the session. Without the ``embedded``
  extra and without ``LILY_MONGO_URI`` the tests that use it are skipped, with the reason.
* ``lily_mongo_client``: an ``AsyncMongoClient`` for that server, closed after the test.
* ``lily_mongo_database``: a fresh database name per test (dropped afterwards), for
  ``Consumer(..., database=lily_mongo_database)``.

The two async fixtures need ``pytest-asyncio``; without it only ``lily_mongo_uri`` exists.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from .embedded import EmbeddedServer, available

__all__ = ["lily_mongo_uri"]


@pytest.fixture(scope="session")
def lily_mongo_uri() -> Iterator[str]:
    """The MongoDB to test against: ``LILY_MONGO_URI``, or an embedded server for the session."""
    configured = os.environ.get("LILY_MONGO_URI")
    if configured:
        yield configured
        return
    if not available():
        pytest.skip(
            "no MongoDB for lily_mongo tests: set LILY_MONGO_URI, or install the embedded server "
            "with 'lily-mongo[embedded]' (Python >= 3.13)"
        )
    with EmbeddedServer() as server:
        yield server.uri


if importlib.util.find_spec("pytest_asyncio") is not None:  # the async fixtures need pytest-asyncio
    import pytest_asyncio
    from pymongo import AsyncMongoClient

    @pytest_asyncio.fixture
    async def lily_mongo_client(lily_mongo_uri: str) -> AsyncIterator[AsyncMongoClient[Any]]:
        """A client of ``lily_mongo_uri``, closed after the test."""
        client: AsyncMongoClient[Any] = AsyncMongoClient(lily_mongo_uri, serverSelectionTimeoutMS=10_000)
        try:
            yield client
        finally:
            await client.close()

    @pytest_asyncio.fixture
    async def lily_mongo_database(lily_mongo_client: AsyncMongoClient[Any]) -> AsyncIterator[str]:
        """A fresh database name for this test; the database is dropped afterwards."""
        name = f"lily_test_{uuid.uuid4().hex[:12]}"
        try:
            yield name
        finally:
            await lily_mongo_client.drop_database(name)
