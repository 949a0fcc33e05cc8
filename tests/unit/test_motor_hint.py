"""A Motor client is refused with the way out: PyMongo's async API, docs/migrating.md."""

from __future__ import annotations

import pytest

from lily_mongo import Consumer
from lily_mongo._errors import ConfigError

# What Motor's client looks like to the check (Motor itself is not installed, and never imported).
AsyncIOMotorClient = type("AsyncIOMotorClient", (), {"__module__": "motor.motor_asyncio"})


def test_a_motor_client_is_refused_with_the_migration_guide() -> None:
    with pytest.raises(ConfigError) as refused:
        Consumer(amqp_url="amqp://guest:guest@127.0.0.1/", name="x", mongo_client=AsyncIOMotorClient(), database="d")
    message = str(refused.value)
    assert message.startswith("mongo_client must be a pymongo.AsyncMongoClient, got AsyncIOMotorClient")
    assert message.endswith("see docs/migrating.md, 'From Motor'")


def test_another_object_gets_no_motor_hint() -> None:
    with pytest.raises(ConfigError) as refused:
        Consumer(amqp_url="amqp://guest:guest@127.0.0.1/", name="x", mongo_client=object(), database="d")  # type: ignore[arg-type]  # what is refused
    assert "migrating" not in str(refused.value)
