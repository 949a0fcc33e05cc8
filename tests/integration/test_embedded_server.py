"""The embedded server's corrections of mongoeco, each against the server as it ships too (docs/emulator.md).

Every test runs on its own servers (``EmbeddedServer``: the corrected one, and
``as_shipped=True``: mongoeco 4.11 without any correction), never on the session's
MongoDB, and states both outcomes: MongoDB's (the corrected server's) and what
mongoeco does instead. When a later mongoeco behaves like MongoDB by itself, its
``as-shipped`` case fails and names the correction that may go.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pymongo
import pytest
from pymongo import AsyncMongoClient
from pymongo.errors import DuplicateKeyError, OperationFailure, ServerSelectionTimeoutError

from lily_mongo.embedded import EmbeddedServer, available
from tests.support.proxy import CuttingProxy, Streams

pytestmark = pytest.mark.skipif(not available(), reason="the embedded server needs the 'embedded' extra")

VARIANTS = ["corrected", "as-shipped"]
TRANSIENT = "TransientTransactionError"


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    """One corrected server and one as shipped, for the module (each test uses a fresh database)."""
    with EmbeddedServer() as corrected, EmbeddedServer(as_shipped=True) as shipped:
        yield {"corrected": corrected.uri, "as-shipped": shipped.uri}


@contextlib.asynccontextmanager
async def connected(uri: str) -> AsyncIterator[AsyncMongoClient[Any]]:
    client: AsyncMongoClient[Any] = AsyncMongoClient(uri, serverSelectionTimeoutMS=10_000)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture(params=VARIANTS)
async def db(request: pytest.FixtureRequest, servers: dict[str, str]) -> AsyncIterator[Any]:
    """A fresh database on the corrected server or on the one as shipped (``db.variant`` says which)."""
    async with connected(servers[request.param]) as client:
        database = client[f"emb_{request.node.name[-40:].replace('[', '_').replace(']', '').replace('-', '_')}"]
        await client.drop_database(database.name)
        database.variant = request.param  # type: ignore[attr-defined]
        try:
            yield database
        finally:
            await client.drop_database(database.name)


async def begin(db: Any) -> Any:
    session = db.client.start_session()
    await session.start_transaction()
    return session


async def commit_failure(session: Any) -> OperationFailure | None:
    """The commit's failure, or None when it committed."""
    try:
        await session.commit_transaction()
    except OperationFailure as exc:
        return exc
    return None


def mongoeco_commit_conflict(exc: OperationFailure | None) -> None:
    """mongoeco's answer to any write since the snapshot: an unlabelled failure of the commit."""
    assert exc is not None
    assert "Write conflict during transaction commit" in str(exc)
    assert not exc.has_error_label(TRANSIENT)


def write_conflict(exc: BaseException) -> None:
    """MongoDB's answer to the second writer of a document: WriteConflict (112), labelled transient."""
    assert isinstance(exc, OperationFailure)
    assert exc.code == 112
    assert exc.has_error_label(TRANSIENT)


# -- write conflicts per document -----------------------------------------------------------------


async def test_two_transactions_writing_different_documents_both_commit(db: Any) -> None:
    await db.docs.insert_many([{"_id": "a", "n": 0}, {"_id": "b", "n": 0}])
    one, two = await begin(db), await begin(db)
    await db.docs.update_one({"_id": "a"}, {"$inc": {"n": 1}}, session=one)
    await db.docs.update_one({"_id": "b"}, {"$inc": {"n": 1}}, session=two)
    assert await commit_failure(one) is None
    failure = await commit_failure(two)
    if db.variant == "corrected":
        assert failure is None
        assert await db.docs.find().sort("_id").to_list() == [{"_id": "a", "n": 1}, {"_id": "b", "n": 1}]
    else:  # any write anywhere fails every open transaction's commit
        mongoeco_commit_conflict(failure)
        assert await db.docs.find().sort("_id").to_list() == [{"_id": "a", "n": 1}, {"_id": "b", "n": 0}]
    for session in (one, two):
        await session.end_session()


async def test_of_two_transactions_writing_one_document_exactly_one_commits(db: Any) -> None:
    await db.docs.insert_one({"_id": "a", "n": 0})
    first, second = await begin(db), await begin(db)
    await db.docs.update_one({"_id": "a"}, {"$inc": {"n": 1}}, session=first)
    if db.variant == "corrected":  # the second writer fails at its write: the first holds the document
        with pytest.raises(OperationFailure) as caught:
            await db.docs.update_one({"_id": "a"}, {"$inc": {"n": 10}}, session=second)
        write_conflict(caught.value)
        await second.abort_transaction()
        assert await commit_failure(first) is None
    else:  # both writes go through; the later commit fails, unlabelled
        await db.docs.update_one({"_id": "a"}, {"$inc": {"n": 10}}, session=second)
        assert await commit_failure(first) is None
        mongoeco_commit_conflict(await commit_failure(second))
    assert await db.docs.find_one({"_id": "a"}) == {"_id": "a", "n": 1}
    for session in (first, second):
        await session.end_session()


async def test_a_write_to_a_document_committed_after_the_snapshot_conflicts(db: Any) -> None:
    await db.docs.insert_one({"_id": "a", "n": 0})
    late = await begin(db)
    assert await db.docs.find_one({"_id": "a"}, session=late) == {"_id": "a", "n": 0}  # its snapshot
    await db.docs.update_one({"_id": "a"}, {"$inc": {"n": 1}})  # committed by another writer
    if db.variant == "corrected":
        with pytest.raises(OperationFailure) as caught:
            await db.docs.update_one({"_id": "a"}, {"$inc": {"n": 10}}, session=late)
        write_conflict(caught.value)
        await late.abort_transaction()
    else:
        await db.docs.update_one({"_id": "a"}, {"$inc": {"n": 10}}, session=late)
        mongoeco_commit_conflict(await commit_failure(late))
    assert await db.docs.find_one({"_id": "a"}) == {"_id": "a", "n": 1}
    await late.end_session()


async def test_two_transactions_inserting_the_same_new_id(db: Any) -> None:
    first, second = await begin(db), await begin(db)
    await db.docs.insert_one({"_id": "new", "by": "first"}, session=first)
    if db.variant == "corrected":
        with pytest.raises(OperationFailure) as caught:
            await db.docs.insert_one({"_id": "new", "by": "second"}, session=second)
        write_conflict(caught.value)
        await second.abort_transaction()
        assert await commit_failure(first) is None
    else:
        await db.docs.insert_one({"_id": "new", "by": "second"}, session=second)
        assert await commit_failure(first) is None
        mongoeco_commit_conflict(await commit_failure(second))
    assert await db.docs.find({}).to_list() == [{"_id": "new", "by": "first"}]
    for session in (first, second):
        await session.end_session()


async def test_a_write_that_changes_nothing_conflicts_with_nothing(db: Any) -> None:
    # $setOnInsert on an existing document (the inbox's first claim of a completed event) writes nothing.
    await db.records.insert_one({"_id": "done", "state": "completed"})
    one, two = await begin(db), await begin(db)
    for session, name in ((one, "one"), (two, "two")):
        await db.records.update_one({"_id": "done"}, {"$setOnInsert": {"state": "x"}}, upsert=True, session=session)
        await db.effects.insert_one({"_id": name}, session=session)
    assert await commit_failure(one) is None
    failure = await commit_failure(two)
    if db.variant == "corrected":
        assert failure is None
        assert await db.effects.count_documents({}) == 2
    else:
        mongoeco_commit_conflict(failure)
        assert await db.effects.count_documents({}) == 1
    for session in (one, two):
        await session.end_session()


async def test_an_outside_write_to_another_document_leaves_a_transaction_alone(db: Any) -> None:
    await db.docs.insert_many([{"_id": "a", "n": 0}, {"_id": "b", "n": 0}])
    held = await begin(db)
    await db.docs.update_one({"_id": "a"}, {"$inc": {"n": 1}}, session=held)
    await db.docs.update_one({"_id": "b"}, {"$inc": {"n": 1}})
    failure = await commit_failure(held)
    if db.variant == "corrected":
        assert failure is None
        assert await db.docs.find_one({"_id": "a"}) == {"_id": "a", "n": 1}
    else:
        mongoeco_commit_conflict(failure)
    await held.end_session()


# -- writers outside transactions wait ------------------------------------------------------------


async def test_an_outside_write_to_a_held_document_waits_out_its_max_time(db: Any) -> None:
    await db.docs.insert_one({"_id": "a", "n": 0})
    held = await begin(db)
    await db.docs.update_one({"_id": "a"}, {"$inc": {"n": 1}}, session=held)
    update = {"update": "docs", "updates": [{"q": {"_id": "a"}, "u": {"$inc": {"n": 10}}}], "maxTimeMS": 300}
    started = time.monotonic()
    if db.variant == "corrected":
        with pytest.raises(OperationFailure) as caught:
            await db.command(update)
        waited = time.monotonic() - started
        assert caught.value.code == 50  # MaxTimeMSExpired
        assert 0.3 <= waited < 3.0
        assert await commit_failure(held) is None
        assert await db.docs.find_one({"_id": "a"}) == {"_id": "a", "n": 1}
    else:  # no writer waits: it applies at once, and the transaction's commit fails
        await db.command(update)
        mongoeco_commit_conflict(await commit_failure(held))
        assert await db.docs.find_one({"_id": "a"}) == {"_id": "a", "n": 10}
    await held.end_session()


async def test_an_outside_write_waits_for_the_holder_and_applies_after_its_commit(db: Any) -> None:
    await db.docs.insert_one({"_id": "a", "n": 0})
    held = await begin(db)
    await db.docs.update_one({"_id": "a"}, {"$inc": {"n": 1}}, session=held)
    outside = asyncio.create_task(db.docs.update_one({"_id": "a"}, {"$inc": {"n": 10}}))
    await asyncio.sleep(0.4)
    waiting = not outside.done()
    failure = await commit_failure(held)
    await asyncio.wait_for(outside, 10)
    if db.variant == "corrected":
        assert waiting
        assert failure is None
        assert await db.docs.find_one({"_id": "a"}) == {"_id": "a", "n": 11}
    else:  # it did not wait for the holder: its write is there, the holder's is not
        mongoeco_commit_conflict(failure)
        assert await db.docs.find_one({"_id": "a"}) == {"_id": "a", "n": 10}
    await held.end_session()


# -- what a transaction's failure ends ------------------------------------------------------------


async def test_a_failed_command_aborts_its_transaction(db: Any) -> None:
    # MongoDB aborts a transaction one of whose commands fails; its next command is refused.
    await db.docs.insert_one({"_id": "a"})
    session = await begin(db)
    with pytest.raises(DuplicateKeyError):
        await db.docs.insert_one({"_id": "a"}, session=session)
    if db.variant == "corrected":
        with pytest.raises(OperationFailure) as caught:
            await db.docs.insert_one({"_id": "b"}, session=session)
        assert caught.value.code == 251  # NoSuchTransaction
        assert caught.value.has_error_label(TRANSIENT)
        await session.abort_transaction()
    else:  # the transaction goes on
        await db.docs.insert_one({"_id": "b"}, session=session)
        assert await commit_failure(session) is None
    await session.end_session()


async def test_a_new_transaction_on_a_session_aborts_its_open_one(servers: dict[str, str]) -> None:
    # A commit failing with an unknown outcome leaves the transaction open; the session's next
    # transaction aborts it (MongoDB) rather than committing its writes too (mongoeco). The failpoint
    # that plays the unknown outcome fires on the corrected server only (a correction of its own).
    async with connected(servers["corrected"]) as client:
        db = client.emb_new_transaction
        await client.drop_database(db.name)
        await client.admin.command(
            {
                "configureFailPoint": "failCommand",
                "mode": {"times": 1},
                "data": {
                    "failCommands": ["commitTransaction"],
                    "errorCode": 50,
                    "errorLabels": ["UnknownTransactionCommitResult"],
                },
            }
        )
        async with client.start_session() as session:
            await session.start_transaction()
            await db.docs.insert_one({"_id": "first"}, session=session)
            with pytest.raises(OperationFailure):
                await session.commit_transaction()
            await session.start_transaction()
            await db.docs.insert_one({"_id": "second"}, session=session)
            await session.commit_transaction()
        assert await db.docs.find({}).to_list() == [{"_id": "second"}]
        await client.drop_database(db.name)


# -- the transaction lifetime ---------------------------------------------------------------------


async def test_get_parameter_answers_the_transaction_lifetime(servers: dict[str, str]) -> None:
    for variant, uri in servers.items():
        async with connected(uri) as client:
            query = {"getParameter": 1, "transactionLifetimeLimitSeconds": 1}
            if variant == "corrected":
                assert (await client.admin.command(query))["transactionLifetimeLimitSeconds"] == 60
                with pytest.raises(OperationFailure, match="no option found"):
                    await client.admin.command({"getParameter": 1, "noSuchParameter": 1})
                with pytest.raises(OperationFailure, match="must be an integer of at least 1"):
                    await client.admin.command({"setParameter": 1, "transactionLifetimeLimitSeconds": 0})
            else:
                with pytest.raises(OperationFailure, match="unsupported wire command"):
                    await client.admin.command(query)


async def test_a_transaction_older_than_the_lifetime_is_aborted_and_lets_go_of_its_documents() -> None:
    with EmbeddedServer() as server:
        async with connected(server.uri) as client:
            db = client.emb_lifetime
            was = await client.admin.command({"setParameter": 1, "transactionLifetimeLimitSeconds": 1})
            assert was["was"] == 60
            await db.docs.insert_one({"_id": "a", "n": 0})
            session = await begin(db)
            await db.docs.update_one({"_id": "a"}, {"$inc": {"n": 1}}, session=session)
            await asyncio.sleep(2.0)  # the lifetime and one pass of the reaper
            # Released: the write does not wait out its maxTimeMS (it would fail with 50).
            update = {"q": {"_id": "a"}, "u": {"$inc": {"n": 10}}}
            await db.command({"update": "docs", "updates": [update], "maxTimeMS": 1000})
            with pytest.raises(OperationFailure) as caught:
                await db.docs.insert_one({"_id": "b"}, session=session)
            assert caught.value.code == 251
            assert caught.value.has_error_label(TRANSIENT)
            await session.abort_transaction()
            await session.end_session()
            assert await db.docs.find({}).to_list() == [{"_id": "a", "n": 10}]


# -- hello ----------------------------------------------------------------------------------------


async def test_hello_describes_a_standalone_server_by_default(servers: dict[str, str]) -> None:
    for uri in servers.values():
        plain = uri.split("?", 1)[0]  # the README's URI: no directConnection, no replicaSet
        for each in (uri, plain):
            async with connected(each) as client:
                hello = await client.admin.command("hello")
                assert "setName" not in hello
                assert hello["isWritablePrimary"] is True
                async with client.start_session() as session:
                    await session.start_transaction()
                    await client.emb_standalone.docs.insert_one({"uri": each}, session=session)
                    await session.commit_transaction()
                assert client.topology_description.topology_type_name == "Single"


async def test_as_a_replica_set_plain_direct_and_named_uris_work() -> None:
    with EmbeddedServer(replica_set=True) as server:
        address = server.uri.split("://", 1)[1].split("/", 1)[0]
        for uri, topology in (
            (f"mongodb://{address}/", "ReplicaSetWithPrimary"),
            (f"mongodb://{address}/?directConnection=true", "Single"),
            (f"mongodb://{address}/?replicaSet=lily-embedded", "ReplicaSetWithPrimary"),
        ):
            async with connected(uri) as client:
                hello = await client.admin.command("hello")
                assert (hello["setName"], hello["me"], hello["primary"], hello["hosts"]) == (
                    "lily-embedded",
                    address,
                    address,
                    [address],
                )
                async with client.start_session() as session:
                    await session.start_transaction()
                    await client.emb_rs.docs.insert_one({"uri": uri}, session=session)
                    await session.commit_transaction()
                assert client.topology_description.topology_type_name == topology
        other: AsyncMongoClient[Any] = AsyncMongoClient(
            f"mongodb://{address}/?replicaSet=another", serverSelectionTimeoutMS=1000
        )
        try:
            with pytest.raises(ServerSelectionTimeoutError):
                await other.admin.command("ping")
        finally:
            await other.close()


class ReplyCutter(CuttingProxy):
    """Drops the connection instead of forwarding the reply to the next ``insert``: the insert applied,
    the driver sees a network error and retries it."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(host, port)
        self.cut_replies = 1

    async def relay(self, client: Streams, server: Streams) -> None:
        (client_reader, client_writer), (server_reader, server_writer) = client, server
        doomed = False

        async def upstream() -> None:
            nonlocal doomed
            while data := await client_reader.read(65536):
                if b"insert\x00" in data and self.cut_replies > 0:
                    self.cut_replies -= 1
                    doomed = True
                server_writer.write(data)
                await server_writer.drain()

        async def downstream() -> None:
            while data := await server_reader.read(65536):
                if doomed:
                    self.cut(client_writer, server_writer)
                    return
                client_writer.write(data)
                await client_writer.drain()

        await asyncio.gather(upstream(), downstream())


@pytest.mark.parametrize("variant", ["replica-set", "as-shipped"])
async def test_a_retried_write_is_answered_once(variant: str) -> None:
    with EmbeddedServer(replica_set=variant == "replica-set", as_shipped=variant == "as-shipped") as server:
        host, port = server.uri.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)
        async with ReplyCutter(host, int(port)) as cutter, connected(cutter.uri) as client:
            docs = client.emb_retried.docs
            if variant == "replica-set":  # the driver retries the insert; the server answers the first reply
                await docs.insert_one({"_id": "once"})
            else:  # a standalone server: the driver does not retry
                with pytest.raises(pymongo.errors.AutoReconnect):
                    await docs.insert_one({"_id": "once"})
            assert cutter.cuts == 1
            assert await docs.find({}).to_list() == [{"_id": "once"}]


# -- lookups: the same answers as mongoeco's walks ------------------------------------------------


async def test_a_majority_latency_delays_commits_and_majority_writes_only() -> None:
    """``--majority-latency-ms`` models a replica set's wait for the majority: a commit and a write
    outside a transaction (default write concern) answer after it; w=1 writes and reads do not."""
    latency = 0.2
    with EmbeddedServer(majority_latency_ms=latency * 1000) as server:
        client: AsyncMongoClient[Any] = AsyncMongoClient(server.uri)
        try:
            collection = client.lily_latency.docs

            async def timed(operation: Any) -> float:
                started = time.perf_counter()
                await operation
                return time.perf_counter() - started

            assert await timed(collection.insert_one({"_id": "majority"})) >= latency
            unacknowledged_by_majority = collection.with_options(write_concern=pymongo.WriteConcern(w=1))
            assert await timed(unacknowledged_by_majority.insert_one({"_id": "primary"})) < latency
            assert await timed(collection.find_one({"_id": "majority"})) < latency
            async with client.start_session() as session:
                await session.start_transaction()
                assert await timed(collection.insert_one({"_id": "in-transaction"}, session=session)) < latency
                assert await timed(session.commit_transaction()) >= latency
            assert await collection.count_documents({}) == 3
        finally:
            await client.close()


def test_a_majority_latency_out_of_bounds_is_refused_naming_the_flag() -> None:
    import subprocess

    run = subprocess.run(
        [sys.executable, "-m", "lily_mongo.embedded", "--majority-latency-ms", "-1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 2
    assert "--majority-latency-ms is -1; it must be between 0 and 10000" in run.stderr


async def test_lookups_by_id_and_through_a_partial_index_find_what_a_walk_finds(db: Any) -> None:
    await db.docs.create_index([("status", 1), ("at", 1)], name="due", partialFilterExpression={"status": "pending"})
    await db.docs.insert_many(
        [
            {"_id": "s1", "status": "pending", "at": 3},
            {"_id": 1, "status": "published", "at": 1},
            {"_id": {"k": "v"}, "status": "pending", "at": 2},
            {"_id": "s2", "status": "published", "at": 4},
            {"_id": 2.5, "status": "pending", "at": 5},
        ]
    )
    ids = ["s2", "missing", {"k": "v"}, "s1"]
    assert [d["_id"] for d in await db.docs.find({"_id": {"$in": ids}}).to_list()] == ["s1", {"k": "v"}, "s2"]
    assert [d["_id"] for d in await db.docs.find({"_id": {"$in": [1.0, 2.5, "s1"]}}).to_list()] == ["s1", 1, 2.5]
    assert await db.docs.find_one({"_id": "missing"}) is None
    assert (await db.docs.find_one({"_id": 1.0}))["_id"] == 1  # BSON equality: 1 and 1.0 are one _id
    with pytest.raises(DuplicateKeyError):
        await db.docs.insert_one({"_id": 1.0})
    pending = await db.docs.find({"status": "pending", "at": {"$lte": 4}}).sort("at", 1).to_list()
    assert [d["_id"] for d in pending] == [{"k": "v"}, "s1"]
    result = await db.docs.update_many({"_id": {"$in": ["s1", "s2", "missing"]}}, {"$set": {"status": "done"}})
    assert (result.matched_count, result.modified_count) == (2, 2)
    assert await db.docs.count_documents({"status": "pending"}) == 2


# -- the SQLite engine (--data) -------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
async def test_on_the_sqlite_engine_a_second_transaction_is_refused_transient(variant: str, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "lily_mongo.embedded", "--port", "0", "--data", str(tmp_path)]
    if variant == "as-shipped":
        command.append("--as-shipped")
    process = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
    try:
        assert process.stdout is not None
        uri = (await asyncio.wait_for(process.stdout.readline(), 30)).decode().split(None, 1)[1].strip()
        async with connected(uri) as client:
            db = client.emb_sqlite
            await db.docs.insert_one({"_id": "a"})
            first, second = await begin(db), await begin(db)
            await db.docs.insert_one({"_id": "one"}, session=first)
            with pytest.raises(OperationFailure) as caught:
                await db.docs.insert_one({"_id": "two"}, session=second)
            if variant == "corrected":  # transient: the inbox replays it after a backoff
                write_conflict(caught.value)
            else:
                assert "already has an active transaction" in str(caught.value)
                assert not caught.value.has_error_label(TRANSIENT)
            await commit_failure(first)
            for session in (first, second):
                await session.end_session()
    finally:
        process.terminate()
        await asyncio.wait_for(process.wait(), 10)


async def test_kill_sessions_aborts_the_session_s_transaction_and_frees_its_document(db: Any) -> None:
    docs = db.kill_sessions
    await docs.insert_one({"_id": "k", "n": 0})
    async with db.client.start_session() as session:
        await session.start_transaction()
        await docs.update_one({"_id": "k"}, {"$inc": {"n": 1}}, session=session)
        if db.variant == "as-shipped":  # mongoeco does not know the command
            with pytest.raises(OperationFailure, match="unsupported wire command: killSessions"):
                await db.client.admin.command({"killSessions": [session.session_id]})
            await session.abort_transaction()
            return
        reply = await db.client.admin.command({"killSessions": [session.session_id]})
        assert reply["ok"] == 1.0
        with pymongo.timeout(2):  # not held any more: applies at once
            await docs.update_one({"_id": "k"}, {"$inc": {"n": 10}})
        with pytest.raises(OperationFailure) as refused:
            await session.commit_transaction()
        assert refused.value.code == 251  # NoSuchTransaction, as on MongoDB
    assert await docs.find_one({"_id": "k"}) == {"_id": "k", "n": 10}
