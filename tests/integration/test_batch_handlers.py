"""Batch handlers through the consumer's own pipeline in-process (TestConsumer), against MongoDB (docs/handlers.md,
"Batch handlers"): each event's own fate inside a batch, the bisection, the records shared with single-event
handlers, the commands a batch costs, and check_idempotent on a batch handler."""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import uuid
from collections.abc import Callable
from typing import Any

import pydantic
import pytest
from pymongo import AsyncMongoClient

from lily_mongo import (
    Batch,
    BatchItemFailed,
    BatchOptions,
    Consumer,
    EventId,
    Json,
    MongoDatabase,
    MongoScope,
    QueueHandlerError,
    RetryPolicy,
    queue,
)
from lily_mongo.testing import TestConsumer, check_idempotent
from tests.support.mongo import CommandLog, MongoDB

NO_BROKER = "amqp://guest:guest@127.0.0.1:1/"
HANDLER = "readings.batch"


class Reading(pydantic.BaseModel):
    n: int
    bad: str | None = None


def consumer_of(
    mongodb: MongoDB, *handlers: Any, client: AsyncMongoClient[Any] | None = None, **queue: Any
) -> Consumer:
    consumer = Consumer(
        amqp_url=NO_BROKER, name="batches", mongo_client=client or mongodb.client, database=mongodb.name
    )
    consumer.configure_queue("readings", **({"concurrency": 1, "prefetch": 64} | queue))
    consumer.include(*handlers)
    return consumer


def batch_handler(calls: list[list[int]], *, max_size: int = 16, handler_id: str = HANDLER) -> Callable[..., Any]:
    """Writes one effect per entry; ``bad`` says how an entry fails: "fail" (Batch.fail, permanent), "raise"
    (an exception naming no entry), "named" (BatchItemFailed), "refuse" (QueueHandlerError for the batch)."""

    @queue("readings", version=1, handler_id=handler_id, batch=BatchOptions(max_size=max_size, max_wait=0.05))
    async def ingest(items: Batch[Json[Reading]], mongo: MongoScope) -> None:
        calls.append([entry.body.n for entry in items])
        for entry in items:
            if entry.body.bad == "fail":
                items.fail(entry, QueueHandlerError.permanent("READING_INVALID", f"reading {entry.body.n}"))
            elif entry.body.bad == "raise":
                raise RuntimeError(f"cannot store reading {entry.body.n}")
            elif entry.body.bad == "named":
                raise BatchItemFailed(entry, QueueHandlerError.retryable("READING_LATER", "not yet"))
            elif entry.body.bad == "refuse":
                raise QueueHandlerError.retryable("STORE_DOWN", "the whole batch waits")
        kept = [entry for entry in items if items.failure_of(entry) is None]
        if kept:
            await mongo.database["effects"].insert_many(
                [{"event_id": str(entry.event_id), "n": entry.body.n} for entry in kept], session=mongo.session
            )

    return ingest


async def effects(mongodb: MongoDB) -> collections.Counter[int]:
    return collections.Counter([doc["n"] async for doc in mongodb.db["effects"].find({})])


def readings(count: int, bad: dict[int, str] | None = None) -> list[dict[str, Any]]:
    return [{"n": n, **({"bad": bad[n]} if bad and n in bad else {})} for n in range(count)]


async def test_an_entry_failed_alone_goes_its_own_way_and_the_others_commit(mongodb: MongoDB) -> None:
    calls: list[list[int]] = []
    async with TestConsumer(consumer_of(mongodb, batch_handler(calls))) as tc:
        results = await tc.publish_many("readings", readings(8, {2: "fail"}), version=1)
    assert calls == [list(range(8))]  # one call, one transaction
    assert [r.outcome for r in results] == ["acked"] * 2 + ["dead_lettered"] + ["acked"] * 5
    assert results[2].code == "READING_INVALID"
    assert await effects(mongodb) == collections.Counter({n: 1 for n in range(8) if n != 2})
    records = mongodb.db["lily_inbox"]
    assert await records.count_documents({"state": "completed"}) == 7
    assert await records.count_documents({"event_id": str(results[2].event_id)}) == 0  # it committed nothing
    [copy] = [m for m in tc.published if m.kind == "dlq"]
    assert copy.headers["x-lily-event-id"] == str(results[2].event_id)


async def test_an_entry_named_by_the_exception_fails_and_the_rest_run_again_without_it(mongodb: MongoDB) -> None:
    calls: list[list[int]] = []
    async with TestConsumer(consumer_of(mongodb, batch_handler(calls))) as tc:
        results = await tc.publish_many("readings", readings(6, {4: "named"}), version=1)
        retries = await tc.deliver_retries()
    assert calls[:2] == [list(range(6)), [0, 1, 2, 3, 5]]
    assert [r.outcome for r in results] == ["acked"] * 4 + ["retried", "acked"]
    assert results[4].code == "READING_LATER"
    # Its retry copy carries its own count, and fails again on its own (one retry per the default policy).
    assert next(m.headers["x-retry-count"] for m in tc.published if m.kind == "retry") == 1
    assert retries[0].event_id == results[4].event_id
    assert await effects(mongodb) == collections.Counter({n: 1 for n in range(6) if n != 4})


async def test_a_refusal_for_the_whole_batch_is_every_events_verdict(mongodb: MongoDB) -> None:
    calls: list[list[int]] = []
    async with TestConsumer(consumer_of(mongodb, batch_handler(calls))) as tc:
        results = await tc.publish_many("readings", readings(5, {0: "refuse"}), version=1)
    assert len(calls) == 1  # no bisection: the handler said so for the whole batch
    assert {(r.outcome, r.code) for r in results} == {("retried", "STORE_DOWN")}
    assert sorted(m.headers["x-lily-event-id"] for m in tc.published if m.kind == "retry") == sorted(
        str(r.event_id) for r in results
    )
    assert await effects(mongodb) == collections.Counter()


@pytest.mark.parametrize("poison", [0, 9, 15])
async def test_a_poison_event_is_isolated_by_bisection_within_its_bound(mongodb: MongoDB, poison: int) -> None:
    calls: list[list[int]] = []
    consumer = consumer_of(mongodb, batch_handler(calls), unknown_errors="permanent")
    async with TestConsumer(consumer) as tc:
        results = await tc.publish_many("readings", readings(16, {poison: "raise"}), version=1)
    assert len(calls) <= 1 + 2 * math.ceil(math.log2(16))  # the documented bound: 9 calls for 16
    assert [c for c in calls if len(c) == 1 and c[0] == poison]  # it ended alone
    outcomes = [(r.outcome, r.code) for r in results]
    assert outcomes[poison] == ("dead_lettered", "QUEUE_HANDLER_FAILED")
    assert [o for i, o in enumerate(outcomes) if i != poison] == [("acked", None)] * 15
    assert await effects(mongodb) == collections.Counter({n: 1 for n in range(16) if n != poison})
    assert isinstance(results[poison].exception, RuntimeError)


async def test_duplicates_inside_a_batch_and_across_batches_run_once(mongodb: MongoDB) -> None:
    calls: list[list[int]] = []
    async with TestConsumer(consumer_of(mongodb, batch_handler(calls))) as tc:
        ids: list[uuid.UUID | None] = [uuid.uuid4() for _ in range(4)]
        first = await tc.publish_many("readings", readings(4) * 2, version=1, event_ids=ids * 2)
        again = await tc.publish_many("readings", readings(4), version=1, event_ids=ids)
    assert [r.outcome for r in first] == ["acked"] * 4 + ["duplicate"] * 4
    assert [r.outcome for r in again] == ["duplicate"] * 4
    assert calls == [[0, 1, 2, 3]]  # the copies never reached the handler
    assert await effects(mongodb) == collections.Counter({n: 1 for n in range(4)})


async def test_an_event_whose_lease_is_held_elsewhere_is_deferred_alone(mongodb: MongoDB) -> None:
    calls: list[list[int]] = []
    async with TestConsumer(consumer_of(mongodb, batch_handler(calls))) as tc:
        ids: list[uuid.UUID | None] = [uuid.uuid4() for _ in range(5)]
        held = ids[3]
        assert held is not None
        await tc.hold_lease(HANDLER, held)
        results = await tc.publish_many("readings", readings(5), version=1, event_ids=ids)
    assert [(r.outcome, r.code) for r in results] == [("acked", None)] * 3 + [("deferred", "LEASE_HELD")] + [
        ("acked", None)
    ]
    record = await mongodb.db["lily_inbox"].find_one({"event_id": str(held)})
    assert record is not None
    assert (record["state"], record["deferrals"]) == ("leased", 1)  # counted by the lease claim, as for one event
    assert calls == [[0, 1, 2, 4]]


async def test_a_batch_handler_and_a_single_event_handler_share_their_records(mongodb: MongoDB) -> None:
    calls: list[list[int]] = []

    @queue("readings", version=1, handler_id=HANDLER)
    async def one(reading: Json[Reading], event_id: EventId, mongo: MongoScope) -> None:
        await mongo.database["effects"].insert_one({"event_id": str(event_id), "n": reading.n}, session=mongo.session)

    ids: list[uuid.UUID | None] = [uuid.uuid4() for _ in range(4)]
    async with TestConsumer(consumer_of(mongodb, batch_handler(calls))) as batched:
        first = await batched.publish_many("readings", readings(2), version=1, event_ids=ids[:2])
    async with TestConsumer(consumer_of(mongodb, one)) as single:
        copies = [await single.publish_json("readings", {"n": n}, version=1, event_id=ids[n]) for n in range(4)]
    async with TestConsumer(consumer_of(mongodb, batch_handler(calls))) as batched:
        last = await batched.publish_many("readings", readings(4), version=1, event_ids=ids)
    assert [r.outcome for r in first] == ["acked", "acked"]
    assert [r.outcome for r in copies] == ["duplicate", "duplicate", "acked", "acked"]
    assert [r.outcome for r in last] == ["duplicate"] * 4
    assert await effects(mongodb) == collections.Counter({n: 1 for n in range(4)})


async def test_a_happy_batch_costs_four_commands(mongodb: MongoDB) -> None:
    calls: list[list[int]] = []
    listener = CommandLog()
    client: AsyncMongoClient[Any] = AsyncMongoClient(mongodb.uri, event_listeners=[listener])
    try:
        consumer = consumer_of(mongodb, batch_handler(calls, max_size=50), client=client)
        async with TestConsumer(consumer, relay_outbox=False) as tc:  # no outbox: only the deliveries' commands
            listener.events.clear()
            results = await tc.publish_many("readings", readings(50), version=1)
            sent = [e.command_name for e in listener.events]
    finally:
        await client.close()
    assert {r.outcome for r in results} == {"acked"}
    assert calls == [list(range(50))]
    assert sent == ["find", "insert", "insert", "commitTransaction"], sent  # 0.08 per event
    assert len(sent) / 50 <= 0.1


async def test_an_at_least_once_batch_handler_fails_entries_alone(mongodb: MongoDB) -> None:
    @queue("readings", version=1, guarantee="at_least_once", batch=BatchOptions(max_size=10, max_wait=0.05))
    async def count(items: Batch[Json[Reading]], db: MongoDatabase) -> None:
        for entry in items:
            if entry.body.bad:
                items.fail(entry, ValueError("bad reading"))
        await db["effects"].insert_many([{"n": e.body.n} for e in items if items.failure_of(e) is None])

    consumer = consumer_of(mongodb, count, retry=RetryPolicy(max_retries=0, delays=()))
    async with TestConsumer(consumer) as tc:
        results = await tc.publish_many("readings", readings(5, {1: "x"}), version=1)
    assert [(r.outcome, r.code) for r in results][1] == ("dead_lettered", "QUEUE_RETRIES_EXHAUSTED")
    assert await effects(mongodb) == collections.Counter({0: 1, 2: 1, 3: 1, 4: 1})


async def read_effects(database: Any) -> list[tuple[int, int]]:
    return sorted([(doc["n"], doc.get("count", 1)) async for doc in database["effects"].find({})])


async def test_check_idempotent_passes_a_batch_handler_and_catches_one_that_is_not(mongodb: MongoDB) -> None:
    calls: list[list[int]] = []
    await check_idempotent(consumer_of(mongodb, batch_handler(calls)), "readings", readings(6), read_effects)
    assert max(len(c) for c in calls) > 1  # delivered in batches
    assert any(len(c) > len(set(c)) for c in calls) is False  # a copy inside a batch never reached the handler

    @queue("readings", version=1, guarantee="at_least_once", batch=BatchOptions(max_size=16, max_wait=0.05))
    async def counts(items: Batch[Json[Reading]], db: MongoDatabase) -> None:
        for entry in items:
            await db["effects"].update_one({"n": entry.body.n}, {"$inc": {"count": 1}}, upsert=True)

    with pytest.raises(AssertionError, match="not idempotent"):
        await check_idempotent(consumer_of(mongodb, counts), "readings", readings(3), read_effects)


async def test_the_deadline_applies_to_the_whole_batch_and_says_its_size(
    mongodb: MongoDB, caplog: pytest.LogCaptureFixture
) -> None:
    @queue("readings", version=1, handler_id=HANDLER, batch=BatchOptions(max_size=3, max_wait=0.05))
    async def slow(items: Batch[Json[Reading]], mongo: MongoScope) -> None:
        await asyncio.sleep(30)

    consumer = consumer_of(mongodb, slow, deadline=0.3, cooperation_window=0.5)
    with caplog.at_level(logging.WARNING, logger="lily_mongo"):
        async with TestConsumer(consumer) as tc:
            results = await tc.publish_many("readings", readings(3), version=1)
    assert {(r.outcome, r.code) for r in results} == {("retried", "QUEUE_HANDLER_TIMEOUT")}
    assert "batch of 3 deliveries exceeded the delivery deadline of 0.3 s" in caplog.text
    assert await mongodb.db["lily_inbox"].count_documents({}) == 0  # its transaction never committed


async def test_a_duplicate_in_a_failed_batch_is_confirmed_by_a_commit_of_its_own(mongodb: MongoDB) -> None:
    calls: list[list[int]] = []
    listener = CommandLog()
    client: AsyncMongoClient[Any] = AsyncMongoClient(mongodb.uri, event_listeners=[listener])
    try:
        consumer = consumer_of(mongodb, batch_handler(calls), client=client)
        async with TestConsumer(consumer, relay_outbox=False) as tc:
            [done] = await tc.publish_many("readings", readings(1), version=1)
            listener.events.clear()
            body = readings(2, {1: "refuse"})
            results = await tc.publish_many("readings", body, version=1, event_ids=[done.event_id, None])
            sent = [e.command_name for e in listener.events]
    finally:
        await client.close()
    assert [(r.outcome, r.code) for r in results] == [("duplicate", None), ("retried", "STORE_DOWN")]
    assert calls == [[0], [1]]  # the duplicate never reached the handler
    # The refused batch's transaction was aborted, so its snapshot's duplicate is confirmed by a
    # read-only transaction that commits (majority), not ACKed on the aborted read alone.
    assert sent == ["find", "insert", "abortTransaction", "find", "commitTransaction"], sent


async def test_a_batch_handlers_outbox_messages_are_dispatched_after_its_commit(mongodb: MongoDB) -> None:
    @queue("readings", version=1, handler_id=HANDLER, batch=BatchOptions(max_size=8, max_wait=0.05))
    async def forward(items: Batch[Json[Reading]], mongo: MongoScope) -> None:
        for entry in items:
            await mongo.outbox.publish_json("readings.stored", {"n": entry.body.n}, version=1)
        if any(entry.body.bad for entry in items):
            raise QueueHandlerError.retryable("STORE_DOWN", "nothing of this batch commits")

    async with TestConsumer(consumer_of(mongodb, forward)) as tc:
        stored = await tc.publish_many("readings", readings(4), version=1)
        refused = await tc.publish_many("readings", readings(3, {0: "refuse"}), version=1)
        outbox = mongodb.db["lily_outbox"]
        records = await outbox.find({}).to_list()
    assert {r.outcome for r in stored} == {"acked"}
    assert {r.outcome for r in refused} == {"retried"}
    sent = [m for m in tc.published if m.kind == "outbox"]
    assert sorted(m.body for m in sent) == sorted(f'{{"n":{n}}}'.encode() for n in range(4))  # only the commit's
    assert len(records) == 4
    assert {r["status"] for r in records} == {"published"}  # born claimed, dispatched by its writer, marked
