"""Fixtures for every tier.

``LILY_MONGO_URI`` and ``LILY_AMQP_URL`` point the integration tier at other
servers (for instance compose.yaml's replica set); by default it starts the
embedded MongoDB-wire server and uses the local RabbitMQ.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aio_pika
import aio_pika.abc
import pytest
from pymongo import AsyncMongoClient

from lily_mongo.embedded import EmbeddedServer
from tests.support import BrokerNames, FailPoints, amqp_url


@pytest.fixture(scope="session")
def mongo_uri() -> Iterator[str]:
    configured = os.environ.get("LILY_MONGO_URI")
    if configured:
        yield configured
        return
    with EmbeddedServer() as server:
        yield server.uri


@pytest.fixture
async def mongo_client(mongo_uri: str) -> AsyncIterator[AsyncMongoClient[Any]]:
    client: AsyncMongoClient[Any] = AsyncMongoClient(mongo_uri, serverSelectionTimeoutMS=10_000)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def database_name(mongo_client: AsyncMongoClient[Any]) -> AsyncIterator[str]:
    """A fresh database per test (the emulator slows as collections grow)."""
    name = f"lily_test_{uuid.uuid4().hex[:12]}"
    try:
        yield name
    finally:
        await mongo_client.drop_database(name)


@pytest.fixture
async def failpoints(mongo_client: AsyncMongoClient[Any]) -> AsyncIterator[FailPoints]:
    points = FailPoints(mongo_client)
    try:
        yield points
    finally:
        await points.clear()


@pytest.fixture(scope="session")
def amqp() -> str:
    return amqp_url()


@pytest.fixture
async def amqp_connection(amqp: str) -> AsyncIterator[aio_pika.abc.AbstractConnection]:
    connection = await aio_pika.connect(amqp)
    try:
        yield connection
    finally:
        await connection.close()


@pytest.fixture
async def amqp_channel(amqp_connection: aio_pika.abc.AbstractConnection) -> AsyncIterator[aio_pika.abc.AbstractChannel]:
    channel = await amqp_connection.channel()
    try:
        yield channel
    finally:
        if not channel.is_closed:
            await channel.close()


@pytest.fixture
async def names(amqp_connection: aio_pika.abc.AbstractConnection) -> AsyncIterator[BrokerNames]:
    broker_names = BrokerNames()
    try:
        yield broker_names
    finally:
        await broker_names.cleanup(amqp_connection)
