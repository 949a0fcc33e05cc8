"""Consumer.start fails fast, in one line, when its MongoDB cannot serve it (docs/lifecycle.md, section 2).

A closed port, a replica set name no server answers to, a refused login and a
server without transactions each give their own sentence, naming the client's
servers without credentials, within the check's timeout. The embedded
emulator describes itself as a standalone server yet runs transactions, so the
standalone MongoDB's refusal (IllegalOperation, code 20, on the first command
of a transaction) and a refused login (AuthenticationFailed, code 18) are
played by ``failCommand`` failpoints.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from lily_mongo import Consumer, Json, MongoScope, queue
from lily_mongo._errors import TransportError
from lily_mongo._mongo import check_mongo
from lily_mongo.testing import Faults
from tests.support.broker import Broker, consumer_count
from tests.support.mongo import close_client


async def checked(uri: str, *, transactions: bool = True, timeout: float = 1.0) -> TransportError:
    client: AsyncMongoClient[Any] = AsyncMongoClient(uri)
    try:
        with pytest.raises(TransportError) as caught:
            await check_mongo(
                client, database="lily_check", collection="lily_inbox", timeout=timeout, transactions=transactions
            )
    finally:
        await close_client(client)
    return caught.value


async def skip_on_a_cluster(client: AsyncMongoClient[Any], reason: str) -> None:
    """Skip the test against a replica set or mongos (the failpoints here play a single server's refusals)."""
    hello = await client.admin.command("hello")
    if hello.get("setName") or hello.get("msg") == "isdbgrid":
        pytest.skip(f"a replica set or mongos: {reason}")


async def test_a_closed_port_is_unreachable_with_the_reason_within_the_timeout() -> None:
    started = time.monotonic()
    error = await checked("mongodb://app:S3cret@127.0.0.1:1/?serverSelectionTimeoutMS=60000", timeout=1.0)
    assert time.monotonic() - started < 5  # the check's timeout, not the URI's 60 s
    assert error.unreachable is True
    assert error.service == "MongoDB"
    assert str(error) == (
        "MongoDB is not reachable at mongodb://127.0.0.1:1/ (connection refused); is it running? "
        "(`lily-mongo embedded` runs one for development)"
    )
    assert "S3cret" not in str(error)


async def test_a_replica_set_name_no_server_answers_to_is_named(mongo_uri: str) -> None:
    uri = mongo_uri.split("?")[0] + "?replicaSet=lily-no-such-set"
    if "replicaSet=" in mongo_uri:
        pytest.skip("against a replica set the name exists")
    error = await checked(uri)
    assert error.unreachable is True
    assert "(no member of replica set 'lily-no-such-set' answered within 1 s)" in str(error)
    assert "drop replicaSet= from the URI" in str(error)


async def test_a_server_that_refuses_transactions_is_told_apart(
    mongo_uri: str, failpoints: Faults, mongo_client: AsyncMongoClient[Any]
) -> None:
    await skip_on_a_cluster(mongo_client, "transactions are not probed")
    await failpoints.fail(
        ["find"], code=20, times=None, message="Transaction numbers are only allowed on a replica set member or mongos"
    )
    error = await checked(mongo_uri)
    assert error.unreachable is False
    assert "is a standalone server and refused a transaction" in str(error)
    assert "needs a replica set or a sharded cluster" in str(error)
    # At-least-once handlers need no transaction: then the server only has to answer.
    client: AsyncMongoClient[Any] = AsyncMongoClient(mongo_uri)
    try:
        await check_mongo(client, database="lily_check", collection="lily_inbox", timeout=5.0, transactions=False)
    finally:
        await client.close()


async def test_a_refused_login_is_not_unreachable(
    mongo_uri: str, failpoints: Faults, mongo_client: AsyncMongoClient[Any]
) -> None:
    await skip_on_a_cluster(mongo_client, "no command of the check can be made to fail")
    # MongoDB refuses a login at the connection's handshake, which no failpoint reaches (and the
    # emulator's refusal carries no code); the check's transaction read answering code 18 plays it.
    await failpoints.fail(["find"], code=18, times=None, message="Authentication failed.")
    error = await checked(mongo_uri, timeout=5.0)
    assert error.unreachable is False
    assert "refused the login: check the user and password" in str(error)


async def test_consumer_start_fails_in_one_line_and_opens_nothing(broker: Broker) -> None:
    q = broker.queue("startcheck")

    @queue(q, version=1, content="json")
    async def handler(body: Json[dict[str, Any]], mongo: MongoScope) -> None: ...

    client: AsyncMongoClient[Any] = AsyncMongoClient("mongodb://127.0.0.1:1/")
    consumer = Consumer(
        amqp_url=broker.url, name="startcheck", mongo_client=client, database="shop", mongo_check_timeout=0.5
    )
    consumer.include(handler)
    started = time.monotonic()
    try:
        with pytest.raises(TransportError, match=r"^MongoDB is not reachable at mongodb://127.0.0.1:1/ "):
            await consumer.start()
    finally:
        await close_client(client)
    assert time.monotonic() - started < 5
    assert consumer.state == "stopped"
    assert await consumer_count(broker.connection, q) is None  # nothing was declared


def test_the_check_timeout_is_bounded() -> None:
    from lily_mongo._errors import ConfigError

    with pytest.raises(ConfigError, match="mongo_check_timeout"):
        Consumer(
            amqp_url="amqp://guest:guest@127.0.0.1/",
            name="x",
            mongo_client=AsyncMongoClient(connect=False),
            database="shop",
            mongo_check_timeout=0,
        )
