"""The inbox's command budget (SPEC section 5), counted on the consumer's own command stream.

A pymongo ``CommandListener`` on the consumer's client sees every command a
delivery sends. Budget: a first-time successful delivery whose handler makes
``k`` writes sends at most ``3 + k`` (claim, completion, k writes, commit); a
copy of a completed event sends 1 (the claim).
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from pymongo import AsyncMongoClient, monitoring

from lily_mongo import Consumer, EventId, InboxOptions, Json, MongoScope, Publisher, RetryPolicy, queue
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


async def test_first_time_deliveries_cost_3_plus_k_and_a_duplicate_costs_1(
    amqp: str, counted: tuple[AsyncMongoClient[Any], Commands], database_name: str, names: BrokerNames
) -> None:
    client, listener = counted
    q = names.queue("budget")

    @queue(q, version=1, content="json", handler_id=f"{q}/writes")
    async def writes(payload: Json[dict[str, Any]], event_id: EventId, mongo: MongoScope) -> None:
        for n in range(payload["k"]):
            await mongo.database["effects"].insert_one({"event_id": str(event_id), "n": n}, session=mongo.session)

    # No relay (it polls the outbox on its own schedule); the lease outlasts the test, so
    # no heartbeat renewal is due either.
    consumer = Consumer(
        amqp_url=amqp,
        mongo_client=client,
        database=database_name,
        name="budget",
        inbox=InboxOptions(run_relay=False, lease_seconds=300),
    )
    consumer.configure_queue(q, concurrency=1, prefetch=1, retry=RetryPolicy(max_retries=1, delays=(0.2,)))
    consumer.include(writes)
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
    records, effects = "lily_inbox", "effects"
    for k in (0, 1, 2):
        assert seen[f"k={k}"] == [
            ("findAndModify", records),  # the claim
            ("update", records),  # the completion, the transaction's first write
            *[("insert", effects)] * k,  # the handler's writes
            ("commitTransaction", ""),
        ], seen
        assert len(seen[f"k={k}"]) == 3 + k
    assert seen["duplicate"] == [("findAndModify", records)]
