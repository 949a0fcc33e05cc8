"""A session lily gives up on is ended on the server: its open transaction must not hold documents until
the transaction lifetime runs out (docs/inbox.md, "Bounded waits")."""

from __future__ import annotations

import asyncio
from typing import Any

import pymongo
import pytest
from pymongo import AsyncMongoClient

from lily_mongo._mongo import transactions
from lily_mongo._mongo.transactions import Replay
from lily_mongo.testing import Faults
from tests.support.mongo import CommandLog, MongoDB, close_client
from tests.support.proxy import CommitCutter

pytestmark = pytest.mark.asyncio


async def _kills_sent(log: CommandLog, session_id: object) -> int:
    for _ in range(50):  # the kill is sent in the background: give it a moment
        await asyncio.sleep(0.02)
        if any(e.command_name == "killSessions" for e in log.events):
            break
    return sum(1 for e in log.events if e.command_name == "killSessions" and e.command["killSessions"] == [session_id])


class AbortCutter(CommitCutter):
    """Drops the connection instead of forwarding the next ``cut_requests`` aborts."""

    MARK = b"abortTransaction\x00"


async def test_a_session_whose_abort_was_lost_is_killed_and_its_document_written_again(mongodb: MongoDB) -> None:
    log = CommandLog()
    async with AbortCutter.fronting(mongodb) as cutter:
        client: AsyncMongoClient[Any] = AsyncMongoClient(cutter.uri, event_listeners=[log])
        try:
            docs = client[mongodb.name].docs
            await docs.insert_one({"_id": "d", "n": 0})
            session = client.start_session()
            await session.start_transaction()
            await docs.update_one({"_id": "d"}, {"$inc": {"n": 1}}, session=session)
            cutter.cut_requests = 2  # the abort, and a retry of it, never reach the server
            await transactions.abort_quietly(session, 5.0)
            assert cutter.cuts >= 1  # (PyMongo retries it only against a replica set)
            assert await _kills_sent(log, session.session_id) == 1
            await _written_again(mongodb)
            await session.end_session()
        finally:
            await close_client(client)


async def _written_again(mongodb: MongoDB) -> None:
    """The transaction is gone: an outside write to its document applies at once (on MongoDB it would
    wait until the transaction's lifetime, 60 s, ran out)."""
    docs = mongodb.db.docs
    with pymongo.timeout(5):
        await docs.update_one({"_id": "d"}, {"$inc": {"n": 10}})
    assert await docs.find_one({"_id": "d"}) == {"_id": "d", "n": 10}


async def test_a_commit_the_server_refused_as_transient_sends_no_kill(mongodb: MongoDB, failpoints: Faults) -> None:
    log = CommandLog()
    client: AsyncMongoClient[Any] = AsyncMongoClient(mongodb.uri, event_listeners=[log])
    try:
        docs = client[mongodb.name].docs
        session = client.start_session()
        await session.start_transaction()
        await docs.insert_one({"_id": "e"}, session=session)
        await failpoints.transient_commits()
        with pytest.raises(Replay):
            await transactions.commit(session, 5.0)
        await asyncio.sleep(0.2)
        assert [e for e in log.events if e.command_name == "killSessions"] == []
        await session.end_session()
    finally:
        await client.close()
