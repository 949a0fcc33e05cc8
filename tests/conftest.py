"""Fixtures for every tier.

``LILY_MONGO_URI`` and ``LILY_AMQP_URL`` point the integration tier at other
servers (for instance compose.yaml's replica set); by default it starts the
embedded MongoDB-wire server and uses the local RabbitMQ.

An integration test usually takes ``broker`` (the RabbitMQ: unique queue names,
consumers, publishing, queue depths; see ``tests.support.broker.Broker``) and, with an
inbox, ``mongodb`` (client and a fresh database). ``failpoints`` is the
package's own ``lily_mongo.testing.Faults``, off again after the test;
``raw_producer`` sends frames no Python client library would write.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import aio_pika.abc
import pytest
from pymongo import AsyncMongoClient

from lily_mongo.testing import Faults
from tests.support.broker import Broker, BrokerNames, amqp_url
from tests.support.frames import RawProducer
from tests.support.mongo import MongoDB

# The MongoDB fixtures are the package's own pytest plugin's (lily_mongo.pytest_plugin),
# under the names these tests use.


@pytest.fixture(scope="session")
def mongo_uri(lily_mongo_uri: str) -> str:
    return lily_mongo_uri


@pytest.fixture
def mongo_client(lily_mongo_client: AsyncMongoClient[Any]) -> AsyncMongoClient[Any]:
    return lily_mongo_client


@pytest.fixture
def database_name(lily_mongo_database: str) -> str:
    """A fresh database per test (the emulator slows as collections grow)."""
    return lily_mongo_database


@pytest.fixture
async def failpoints(mongo_client: AsyncMongoClient[Any]) -> AsyncIterator[Faults]:
    """The package's own fault injection; the failpoint is off after the test, whoever set it."""
    async with Faults(mongo_client) as faults:
        yield faults


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


@pytest.fixture
async def raw_producer(amqp: str) -> AsyncIterator[RawProducer]:
    """A producer writing AMQP frames by hand (``tests.support.frames.RawProducer``), closed after the test."""
    async with await RawProducer.open(amqp) as producer:
        yield producer


@pytest.fixture
def broker(
    amqp: str,
    names: BrokerNames,
    amqp_connection: aio_pika.abc.AbstractConnection,
    amqp_channel: aio_pika.abc.AbstractChannel,
) -> Broker:
    """The test's RabbitMQ in one object: URL, unique names, inspection, consumers and publishing."""
    return Broker(amqp, names, amqp_connection, amqp_channel)


@pytest.fixture
def mongodb(mongo_uri: str, mongo_client: AsyncMongoClient[Any], database_name: str) -> MongoDB:
    """The test's MongoDB in one object: URI, client and a fresh database."""
    return MongoDB(mongo_uri, mongo_client, database_name)
