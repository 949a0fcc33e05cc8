"""The inbox's command budget (docs/inbox.md), counted on the consumer's own command stream.

A pymongo ``CommandListener`` on the consumer's client sees every command a
delivery sends. The documented budget: a first-time successful delivery whose handler makes
``k`` writes sends at most ``3 + k`` (claim, completion, k writes, commit); a
copy of a completed event sends 1 (the claim).

With ``claim_in_transaction`` (the default), a copy the broker delivers for the
first time claims inside the transaction: ``2 + k`` (the claim that is the
completion, k writes, commit); a copy of a completed event delivered for the
first time then costs 2 (the claim finds it, the read-only commit); a redelivered copy
takes the lease claim: 1 for a completed event, ``3 + k`` for one not yet done.
"""

from __future__ import annotations

import uuid
from typing import Any

import aio_pika
import pytest
from pymongo import AsyncMongoClient, monitoring

from lily_mongo import Consumer, EventId, InboxOptions, Json, MongoScope, OutboxOptions, Publisher, RetryPolicy, queue
from tests.support import BrokerNames, eventually, outcomes, running

# Driver housekeeping that no delivery sends.
MONITORING = frozenset({"hello", "ismaster", "isMaster", "ping", "endSessions", "buildInfo"})


class Commands(monitoring.CommandListener):
    """Every command the client starts, by name and target collection."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name not in MONITORING:
            target = event.command.get(event.command_name)
            self.seen.append((event.command_name, target if isinstance(target, str) else ""))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass

    def take(self) -> list[tuple[str, str]]:
        taken, self.seen = self.seen, []
        return taken


@pytest.fixture
async def counted(mongo_uri: str) -> Any:
    listener = Commands()
    client: AsyncMongoClient[Any] = AsyncMongoClient(mongo_uri, event_listeners=[listener])
    try:
        yield client, listener
    finally:
        await client.close()


RECORDS, EFFECTS = "lily_inbox", "effects"


def lease_path(k: int) -> list[tuple[str, str]]:
    return [
        ("findAndModify", RECORDS),  # the lease claim
        ("update", RECORDS),  # the completion, the transaction's first write
        *[("insert", EFFECTS)] * k,  # the handler's writes
        ("commitTransaction", ""),
    ]


def in_transaction_path(k: int) -> list[tuple[str, str]]:
    return [
        ("findAndModify", RECORDS),  # the claim inside the transaction, which is the completion
        *[("insert", EFFECTS)] * k,
        ("commitTransaction", ""),
    ]


def budget_consumer(amqp: str, client: AsyncMongoClient[Any], database: str, q: str, **inbox: Any) -> Consumer:
    @queue(q, version=1, content="json", handler_id=f"{q}/writes")
    async def writes(payload: Json[dict[str, Any]], event_id: EventId, mongo: MongoScope) -> None:
        for n in range(payload["k"]):
            await mongo.database[EFFECTS].insert_one({"event_id": str(event_id), "n": n}, session=mongo.session)

    # No relay (it polls the outbox on its own schedule); the lease outlasts the test, so
    # no heartbeat renewal is due either.
    consumer = Consumer(
        amqp_url=amqp,
        mongo_client=client,
        database=database,
        name="budget",
        inbox=InboxOptions(lease_seconds=300, **inbox),
        outbox=OutboxOptions(run_relay=False),
    )
    consumer.configure_queue(q, concurrency=1, prefetch=1, retry=RetryPolicy(max_retries=1, delays=(0.2,)))
    consumer.include(writes)
    return consumer


async def redeliver_all(amqp: str, q: str, count: int) -> None:
    """Take ``count`` messages off ``q`` and give them back: the broker marks them redelivered."""
    connection = await aio_pika.connect(amqp)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(q, passive=True)
        taken = []
        for _ in range(count):
            message = await declared.get(no_ack=False, timeout=5)
            assert message is not None
            taken.append(message)
        for message in taken:
            await message.nack(requeue=True)


@pytest.mark.parametrize("claim_in_transaction", [True, False], ids=["in-transaction", "lease-first"])
async def test_commands_per_delivery(
    claim_in_transaction: bool,
    amqp: str,
    counted: tuple[AsyncMongoClient[Any], Commands],
    database_name: str,
    names: BrokerNames,
) -> None:
    client, listener = counted
    q = names.queue("budget")
    consumer = budget_consumer(amqp, client, database_name, q, claim_in_transaction=claim_in_transaction)
    seen: dict[str, list[tuple[str, str]]] = {}
    async with running(consumer) as managed, Publisher(amqp) as publisher:
        listener.take()  # start-up: index creation
        events: dict[int, uuid.UUID] = {}
        for k in (0, 1, 2):
            events[k] = await publisher.publish_json(q, {"k": k}, version=1)
            await eventually(lambda k=k: len(outcomes(managed)) == k + 1, what=f"the k={k} delivery")
            seen[f"k={k}"] = listener.take()
        await publisher.publish_json(q, {"k": 2}, version=1, event_id=events[2])
        await eventually(lambda: len(outcomes(managed)) == 4, what="the duplicate")
        seen["duplicate"] = listener.take()
    assert outcomes(managed) == ["acked", "acked", "acked", "duplicate"]
    for k in (0, 1, 2):
        if claim_in_transaction:
            assert seen[f"k={k}"] == in_transaction_path(k), seen
            assert len(seen[f"k={k}"]) == 2 + k
        else:
            assert seen[f"k={k}"] == lease_path(k), seen
            assert len(seen[f"k={k}"]) == 3 + k
    if claim_in_transaction:  # found inside the transaction: the claim, then the read-only commit
        assert seen["duplicate"] == [("findAndModify", RECORDS), ("commitTransaction", "")]
    else:
        assert seen["duplicate"] == [("findAndModify", RECORDS)]


async def test_redelivered_copies_take_the_lease_claim(
    amqp: str, counted: tuple[AsyncMongoClient[Any], Commands], database_name: str, names: BrokerNames
) -> None:
    """A redelivered copy of a completed event costs 1; a redelivered first copy costs 3 + k."""
    client, listener = counted
    q = names.queue("budget")
    async with running(budget_consumer(amqp, client, database_name, q)) as managed, Publisher(amqp) as publisher:
        done = await publisher.publish_json(q, {"k": 1}, version=1)
        await eventually(lambda: outcomes(managed) == ["acked"], what="the first delivery")
    async with Publisher(amqp) as publisher:
        await publisher.publish_json(q, {"k": 1}, version=1, event_id=done)
        await publisher.publish_json(q, {"k": 1}, version=1)
    await redeliver_all(amqp, q, 2)
    listener.take()
    consumer = budget_consumer(amqp, client, database_name, q)
    async with running(consumer) as managed:
        await eventually(lambda: len(outcomes(managed)) == 2, what="the redelivered copies")
        taken = listener.take()
        # Start-up: the MongoDB check (hello, and on a server that says it is standalone a
        # transaction's read), then the index set-up; the deliveries follow.
        last_index = max(i for i, c in enumerate(taken) if c[0] in ("createIndexes", "listIndexes"))
        seen = taken[last_index + 1 :]
    # Concurrency 1: the copies run one after the other, the duplicate first (queue order).
    assert outcomes(managed) == ["duplicate", "acked"]
    assert seen == [("findAndModify", RECORDS), *lease_path(1)], seen
