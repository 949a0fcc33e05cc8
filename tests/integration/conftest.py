"""Integration-tier fixtures: what every test here shares beyond tests/conftest.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.mongo import collect_abandoned_sockets


@pytest.fixture(autouse=True)
def _abandoned_mongo_sockets(mongo_uri: str) -> Iterator[None]:
    """After each test (and after its clients closed), collect the sockets PyMongo abandoned to
    the test's MongoDB server (tests.support.mongo.collect_abandoned_sockets)."""
    yield
    collect_abandoned_sockets(mongo_uri)
