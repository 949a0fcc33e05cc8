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

The client's URI says ``w=1``: every write on the records outside a transaction must
still go out with ``writeConcern: {w: "majority"}``, and every claim with a ``maxTimeMS``
(docs/inbox.md, "Majority, always" and "Bounded waits"), read here on the wire.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import aio_pika
import pytest
from pymongo import AsyncMongoClient, monitoring
from pymongo.errors import OperationFailure

from lily_mongo import (
    Consumer,
    EventId,
    InboxOptions,
    Json,
    MongoScope,
    OutboxOptions,
    Publisher,
    QueueHandlerError,
    RetryPolicy,
    queue,
)
from lily_mongo.testing import Faults
from tests.support.broker import BrokerNames
from tests.support.consumers import outcomes, running
from tests.support.polling import eventually

# Driver housekeeping that no delivery sends, and the start-up's one read of the server's limit.
MONITORING = frozenset({"hello", "ismaster", "isMaster", "ping", "endSessions", "buildInfo", "getParameter"})
# Commands that write a collection's documents or indexes.
WRITES = frozenset({"insert", "update", "delete", "findAndModify", "createIndexes"})


@dataclass(frozen=True)
class Sent:
    """One command as it went out: its name, target collection and the fields that matter here."""

    name: str
    target: str
    in_transaction: bool
    write_concern: dict[str, Any] | None
    max_time_ms: int | None

    @property
    def pair(self) -> tuple[str, str]:
        return (self.name, self.target)


class Commands(monitoring.CommandListener):
    """Every command the client starts, by name and target collection."""

    def __init__(self) -> None:
        self.sent: list[Sent] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name not in MONITORING:
            command = event.command
            target = command.get(event.command_name)
            self.sent.append(
                Sent(
                    event.command_name,
                    target if isinstance(target, str) else "",
                    # Commands of a transaction carry autocommit: false (its first one also startTransaction).
                    command.get("autocommit") is False,
                    command.get("writeConcern"),
                    command.get("maxTimeMS"),
                )
            )

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass

    def take_sent(self) -> list[Sent]:
        taken, self.sent = self.sent, []
        return taken

    def take(self) -> list[tuple[str, str]]:
        return [s.pair for s in self.take_sent()]


@pytest.fixture
async def counted(mongo_uri: str) -> Any:
    """A client whose URI asks for w=1 writes (as a primary-secondary-arbiter set's default would be)."""
    listener = Commands()
    uri = mongo_uri + ("&" if "?" in mongo_uri else "/?") + "w=1"
    client: AsyncMongoClient[Any] = AsyncMongoClient(uri, event_listeners=[listener])
    assert client.write_concern.document == {"w": 1}
    try:
        yield client, listener
    finally:
        await client.close()


def outside_writes_are_majority(sent: list[Sent], collection: str) -> list[Sent]:
    """The writes on ``collection`` outside a transaction; each must carry w: "majority" (the URI says w=1)."""
    writes = [s for s in sent if s.name in WRITES and s.target == collection and not s.in_transaction]
    for s in writes:
        assert s.write_concern is not None, s
        assert s.write_concern.get("w") == "majority", s
    return writes


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
        start_up = listener.take_sent()  # index creation
        assert [s.pair for s in outside_writes_are_majority(start_up, RECORDS)] == [("createIndexes", RECORDS)]
        events: dict[int, uuid.UUID] = {}
        sent: list[Sent] = []
        for k in (0, 1, 2):
            events[k] = await publisher.publish_json(q, {"k": k}, version=1)
            await eventually(lambda k=k: len(outcomes(managed)) == k + 1, what=f"the k={k} delivery")
            sent += listener.sent
            seen[f"k={k}"] = listener.take()
        await publisher.publish_json(q, {"k": 2}, version=1, event_id=events[2])
        await eventually(lambda: len(outcomes(managed)) == 4, what="the duplicate")
        sent += listener.sent
        seen["duplicate"] = listener.take()
    assert outcomes(managed) == ["acked", "acked", "acked", "duplicate"]
    claims = outside_writes_are_majority(sent, RECORDS)
    # Lease first: every copy's claim goes out of a transaction (4); in the transaction, none does.
    assert len(claims) == (0 if claim_in_transaction else 4)
    assert all(c.name == "findAndModify" and c.max_time_ms is not None and 0 < c.max_time_ms <= 10_000 for c in claims)
    # Inside a transaction, the transaction's own concerns apply: only its commit names one.
    assert all(s.write_concern is None for s in sent if s.in_transaction and s.name != "commitTransaction")
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
        taken = listener.take_sent()
        # Start-up: the MongoDB check (hello, and on a server that says it is standalone a
        # transaction's read), the lifetime read, then the index set-up; the deliveries follow.
        last_index = max(i for i, c in enumerate(taken) if c.name in ("createIndexes", "listIndexes"))
        sent = taken[last_index + 1 :]
    # Concurrency 1: the copies run one after the other, the duplicate first (queue order).
    assert outcomes(managed) == ["duplicate", "acked"]
    assert [c.pair for c in sent] == [("findAndModify", RECORDS), *lease_path(1)], sent
    claims = outside_writes_are_majority(sent, RECORDS)
    assert [c.pair for c in claims] == [("findAndModify", RECORDS)] * 2
    assert all(c.max_time_ms is not None and c.max_time_ms > 0 for c in claims)


async def test_a_first_time_copys_replay_claims_in_its_transaction_again(
    amqp: str, counted: tuple[AsyncMongoClient[Any], Commands], database_name: str, names: BrokerNames
) -> None:
    """A transient error after the claim in the transaction replays 2 + k again, no lease claim.

    The failed attempt wrote nothing (its transaction is aborted), so the replay claims the
    record inside its own transaction like the first attempt: no write on the records goes
    out of a transaction at all.
    """
    client, listener = counted
    q = names.queue("replay")
    runs: list[int] = []

    @queue(q, version=1, content="json", handler_id=f"{q}/flaky")
    async def flaky(payload: Json[dict[str, Any]], event_id: EventId, mongo: MongoScope) -> None:
        runs.append(1)
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id)}, session=mongo.session)
        if len(runs) == 1:
            raise OperationFailure("write conflict", code=112, details={"errorLabels": ["TransientTransactionError"]})

    consumer = Consumer(
        amqp_url=amqp,
        mongo_client=client,
        database=database_name,
        name="replay",
        inbox=InboxOptions(lease_seconds=300, backoff_base=0.01, backoff_max=0.02),
        outbox=OutboxOptions(run_relay=False),
    )
    consumer.configure_queue(q, concurrency=1, prefetch=1, retry=RetryPolicy(max_retries=0, delays=()))
    consumer.include(flaky)
    async with running(consumer) as managed, Publisher(amqp) as publisher:
        listener.take()  # start-up
        await publisher.publish_json(q, {}, version=1)
        await eventually(lambda: len(outcomes(managed)) == 1, what="the delivery")
        sent = listener.take_sent()
    assert outcomes(managed) == ["acked"]
    assert len(runs) == 2
    assert [s.pair for s in sent] == [
        ("findAndModify", RECORDS),
        ("insert", EFFECTS),
        ("abortTransaction", ""),
        *in_transaction_path(1),
    ], sent
    assert outside_writes_are_majority(sent, RECORDS) == []
    assert managed.snapshot().queues[0].transient_replays == 1
    assert await client[database_name][EFFECTS].count_documents({}) == 1


async def test_every_record_write_outside_a_transaction_is_majority_and_bounded(
    amqp: str,
    counted: tuple[AsyncMongoClient[Any], Commands],
    database_name: str,
    names: BrokerNames,
    mongo_client: AsyncMongoClient[Any],
) -> None:
    """Renewals, releases and deferral counts go out as the claims do: w: "majority", a maxTimeMS.

    Four events on the lease path: one replays after a transient error (the heartbeat renews
    its lease during the backoff), one fails permanently (its record is deleted), one keeps
    failing transiently (its deferrals release the lease and count), and one's claim times out
    (a failpoint answers MaxTimeMSExpired: the deferral is counted in a counting record).
    """
    client, listener = counted
    q = names.queue("majority")
    calls: dict[str, int] = {}

    @queue(q, version=1, content="json", handler_id=f"{q}/mixed")
    async def mixed(payload: Json[dict[str, Any]], mongo: MongoScope) -> None:
        kind = payload["kind"]
        calls[kind] = calls.get(kind, 0) + 1
        if kind == "permanent":
            raise QueueHandlerError.permanent("BAD", "no")
        if kind == "always-transient" or (kind == "transient-once" and calls[kind] == 1):
            raise OperationFailure("write conflict", code=112, details={"errorLabels": ["TransientTransactionError"]})
        await mongo.database[EFFECTS].insert_one({"kind": kind}, session=mongo.session)

    options = InboxOptions(
        claim_in_transaction=False,
        lease_seconds=2.0,
        heartbeat_seconds=0.1,
        replay_budget=1,
        backoff_base=0.6,
        backoff_max=1.2,
    )
    consumer = Consumer(
        amqp_url=amqp,
        mongo_client=client,
        database=database_name,
        name="majority",
        inbox=options,
        outbox=OutboxOptions(run_relay=False),
    )
    consumer.configure_queue(q, concurrency=1, prefetch=1, max_deferrals=2, retry=RetryPolicy(max_retries=0, delays=()))
    consumer.include(mixed)
    async with running(consumer) as managed, Publisher(amqp) as publisher, Faults(mongo_client) as faults:
        for kind in ("transient-once", "permanent", "always-transient"):
            await publisher.publish_json(q, {"kind": kind}, version=1)
        await eventually(lambda: len(outcomes(managed)) == 4, timeout=15.0, what="the first three events")
        await faults.fail(["findAndModify"], code=50, namespace=f"{database_name}.{RECORDS}")
        await publisher.publish_json(q, {"kind": "busy"}, version=1)
        await eventually(lambda: len(outcomes(managed)) == 6, timeout=15.0, what="the busy event")
    observations = managed.delivery_terminal_observations()
    assert [(o.outcome, o.code) for o in observations] == [
        ("acked", None),
        ("dead_lettered", "BAD"),
        ("deferred", "REPLAY_BUDGET_SPENT"),
        ("dead_lettered", "QUEUE_DEFERRALS_EXHAUSTED"),
        ("deferred", "LEASE_BUSY"),
        ("acked", None),
    ]
    writes = outside_writes_are_majority(listener.take_sent(), RECORDS)
    kinds = {w.name for w in writes}
    assert kinds == {"createIndexes", "findAndModify", "update", "delete"}, kinds  # renewal: update; release: delete
    assert all(w.max_time_ms is not None and w.max_time_ms > 0 for w in writes if w.name != "createIndexes"), writes
    # The claims (6), the deferral releases (2), the count of the busy claim's deferral (1).
    assert sum(w.name == "findAndModify" for w in writes) == 9, writes
