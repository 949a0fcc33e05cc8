"""Batch handlers against the real broker and the embedded MongoDB (docs/handlers.md, "Batch handlers").

Each test fails when batching is off or broken: it checks the sizes of the handler's calls (many events
per call), the commands per event where it matters, and that every event ends on its own: applied once,
a duplicate, or dead-lettered with its code.
"""

from __future__ import annotations

import asyncio
import collections
import random
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pydantic
import pytest
from opentelemetry.trace import SpanKind
from pymongo import AsyncMongoClient

from lily_mongo import (
    Batch,
    BatchOptions,
    Consumer,
    Json,
    MongoScope,
    Publisher,
    QueueHandlerError,
    RetryPolicy,
    queue,
)
from lily_mongo.telemetry import Telemetry
from lily_mongo.testing import Faults
from tests.integration.test_telemetry import Sdk, in_memory_sdk, metric_points, spans_of
from tests.support.broker import Broker
from tests.support.consumers import running
from tests.support.mongo import CommandLog, MongoDB
from tests.support.polling import eventually
from tests.support.processes import worker_processes

WORKER = Path(__file__).resolve().parent / "workers" / "batch_worker.py"
RECORDS = "lily_inbox"
EFFECTS = "effects"


class Reading(pydantic.BaseModel):
    """Reading ``n``; a ``poison`` one raises in the handler (``"raise"``) or is failed alone (``"fail"``)."""

    n: int
    poison: str | None = None


async def effects_per_event(mongodb: MongoDB) -> collections.Counter[str]:
    return collections.Counter([doc["event_id"] async for doc in mongodb.db[EFFECTS].find({}, {"event_id": 1})])


async def publish_with_ids(broker: Broker, q: str, items: list[tuple[uuid.UUID, dict[str, Any]]]) -> None:
    async with Publisher(broker.url) as publisher:
        for start in range(0, len(items), 100):
            await asyncio.gather(
                *(publisher.publish_json(q, body, version=1, event_id=e) for e, body in items[start : start + 100])
            )


async def redeliver(broker: Broker, q: str, count: int) -> int:
    """Take ``count`` messages from ``q`` and give them back unacknowledged: the broker redelivers them flagged."""
    channel = await broker.connection.channel()
    taken: list[aio_pika.abc.AbstractIncomingMessage] = []
    try:
        declared = await channel.declare_queue(q, passive=True)
        while len(taken) < count:
            message = await declared.get(fail=False, no_ack=False)
            if message is None:
                break
            taken.append(message)
        for message in taken:
            await message.nack(requeue=True)
    finally:
        await channel.close()
    return len(taken)


def batch_consumer(
    broker: Broker,
    mongodb: MongoDB,
    q: str,
    calls: list[int],
    *,
    name: str,
    max_size: int,
    max_wait: float,
    prefetch: int,
    **options: Any,
) -> Consumer:
    """A consumer of ``q``, one permit, whose batch handler (``<q>/ingest``) notes each call's size in ``calls``
    and writes one effect per entry with one insert_many; a poison entry either raises (no entry named: bisected)
    or is failed alone with items.fail."""

    @queue(q, version=1, handler_id=f"{q}/ingest", batch=BatchOptions(max_size=max_size, max_wait=max_wait))
    async def ingest(items: Batch[Json[Reading]], mongo: MongoScope) -> None:
        calls.append(len(items))
        for entry in items:
            if entry.body.poison == "raise":
                raise ValueError(f"reading {entry.body.n} cannot be stored")
            if entry.body.poison == "fail":
                items.fail(entry, QueueHandlerError.permanent("READING_INVALID", f"reading {entry.body.n}"))
        kept = [entry for entry in items if items.failure_of(entry) is None]
        if kept:
            await mongo.database[EFFECTS].insert_many(
                [{"event_id": str(entry.event_id), "n": entry.body.n} for entry in kept], session=mongo.session
            )

    return broker.consumer(q, ingest, name=name, mongodb=mongodb, concurrency=1, prefetch=prefetch, **options)


async def test_a_thousand_events_with_duplicates_and_poison_each_end_on_their_own(
    broker: Broker, mongodb: MongoDB
) -> None:
    q = broker.queue("ingest")
    rng = random.Random(30)
    events: list[tuple[uuid.UUID, dict[str, Any]]] = [(uuid.uuid4(), {"n": n}) for n in range(1000)]
    poison = {3: "raise", 250: "fail", 499: "raise", 730: "fail", 998: "raise"}
    for n, kind in poison.items():
        events[n] = (events[n][0], {"n": n, "poison": kind})
    valid = {str(e) for n, (e, _) in enumerate(events) if n not in poison}
    copies = [events[n] for n in rng.sample([n for n in range(1000) if n not in poison], 100)]
    stream = events + copies  # 10 % republished copies, some landing in the batch of their original
    calls: list[int] = []
    listener = CommandLog()
    client: AsyncMongoClient[Any] = AsyncMongoClient(mongodb.uri, event_listeners=[listener])

    def consumer() -> Consumer:
        return batch_consumer(
            broker,
            MongoDB(mongodb.uri, client, mongodb.name),
            q,
            calls,
            name="batch-thousand",
            max_size=100,
            max_wait=0.5,
            prefetch=200,
            unknown_errors="permanent",
            retry=RetryPolicy(max_retries=0, delays=()),
        )

    try:
        async with running(consumer()) as first:
            await publish_with_ids(broker, q, stream)
            await eventually(
                lambda: len(first.delivery_terminal_observations()) >= len(stream),
                timeout=300.0,
                interval=0.2,
                what="every delivery to end",
            )
        # Redelivered duplicates: copies of applied events the broker hands out again, flagged
        # redelivered (as after a lost ACK).
        again = [events[n] for n in rng.sample(sorted(set(range(1000)) - set(poison)), 50)]
        await publish_with_ids(broker, q, again)
        assert await broker.wait_for_depth(q, 50) == 50
        assert await redeliver(broker, q, 50) == 50
        async with running(consumer()) as second:
            await eventually(lambda: len(second.delivery_terminal_observations()) >= 50, timeout=60.0)
    finally:
        await client.close()
    observations = [*first.delivery_terminal_observations(), *second.delivery_terminal_observations()]
    total = len(stream) + len(again)
    effects = await effects_per_event(mongodb)
    assert set(effects) == valid  # every valid event applied, no poison event
    assert set(effects.values()) == {1}  # each exactly once
    ends = collections.Counter(o.outcome for o in observations)
    assert ends == {"acked": 995, "duplicate": 150, "dead_lettered": 5}, ends
    assert sum(o.outcome == "duplicate" for o in second.delivery_terminal_observations()) == 50
    dlq = await broker.drain(f"{q}.dlq")
    codes = {m.headers["x-lily-event-id"]: m.headers["x-lily-failure-code"] for m in dlq}
    expected = {
        str(events[n][0]): ("QUEUE_HANDLER_FAILED" if kind == "raise" else "READING_INVALID")
        for n, kind in poison.items()
    }
    assert codes == expected
    # Batched: many events per handler call, and few commands per event on the records.
    assert max(calls) >= 50, calls  # one event per call would be 1,095 calls of 1
    assert len(calls) < 200, calls
    records = len(listener.naming(RECORDS))
    assert records / total < 0.2, records
    assert await mongodb.db[RECORDS].count_documents({"state": "completed"}) == 995


async def test_a_transient_error_on_the_batch_commit_replays_it_once(
    broker: Broker, mongodb: MongoDB, failpoints: Faults
) -> None:
    q = broker.queue("commit")
    calls: list[int] = []
    consumer = batch_consumer(broker, mongodb, q, calls, name="batch-commit", max_size=20, max_wait=5.0, prefetch=40)
    async with running(consumer) as managed:
        await failpoints.transient_commits(1)
        ids = await broker.publish_all(q, [{"n": n} for n in range(20)])
        await eventually(lambda: len(managed.delivery_terminal_observations()) == 20, timeout=30.0)
    observations = managed.delivery_terminal_observations()
    assert calls == [20, 20]  # one batch, replayed once in a fresh transaction
    assert {(o.outcome, o.attempts, o.transient_replays) for o in observations} == {("acked", 2, 1)}
    effects = await effects_per_event(mongodb)
    assert effects == collections.Counter({str(i): 1 for i in ids})


async def test_a_graceful_shutdown_runs_a_half_formed_batch(broker: Broker, mongodb: MongoDB) -> None:
    q = broker.queue("half")
    calls: list[int] = []
    consumer = batch_consumer(broker, mongodb, q, calls, name="batch-half", max_size=100, max_wait=60.0, prefetch=200)
    managed = await consumer.start()
    try:
        ids = await broker.publish_all(q, [{"n": n} for n in range(7)])
        await eventually(lambda: managed.snapshot().queues[0].in_flight == 7, what="7 deliveries in a forming batch")
        assert calls == []  # max_size not reached, max_wait far away: the batch is still forming
    finally:
        report = await managed.shutdown()
    assert calls == [7]
    assert report.succeeded, report.render()
    assert report.settled == {"acked": 7}, report.render()
    assert await effects_per_event(mongodb) == collections.Counter({str(i): 1 for i in ids})
    assert await broker.depth(q) == 0


def worker_args(broker: Broker, mongodb: MongoDB, q: str, handler_id: str) -> list[str]:
    return [
        *("--mongo-uri", mongodb.uri, "--amqp", broker.url, "--database", mongodb.name, "--queue", q),
        *("--handler-id", handler_id),
    ]


async def test_a_batch_killed_between_its_commit_and_its_acks_is_absorbed_as_duplicates(
    broker: Broker, mongodb: MongoDB, tmp_path: Path
) -> None:
    q = broker.queue("killed")
    handler_id = f"{q}/ingest"
    common = [*worker_args(broker, mongodb, q, handler_id), "--max-size", "20", "--max-wait", "5"]
    async with worker_processes(WORKER, tmp_path) as workers:
        a = await workers.start("batch-a", *common, "--stall-acks")
        ids = await broker.publish_all(q, [{"n": n} for n in range(20)])

        async def committed() -> bool:
            return await mongodb.db[RECORDS].count_documents({"state": "completed"}) == 20

        await eventually(committed, timeout=30.0, interval=0.05, what="A's batch to commit")
        await a.kill()
        assert a.returncode == -signal.SIGKILL
        assert [r["batch"] for r in workers.records("batch-a") if "batch" in r] == [20]
        assert await broker.wait_for_depth(q, 20) == 20  # none was ACKed: the broker has them all back
        b = await workers.start("batch-b", *common)
        assert await broker.wait_for_depth(q, 0, timeout=30.0) == 0

        async def b_settled() -> bool:
            return await broker.wait_for_depth(q, 0, timeout=0.1) == 0

        await eventually(b_settled, timeout=20.0)
        ended = await b.stop(timeout=20.0)
        assert ended.returncode == 0, ended.describe()
        final = await workers.wait_for_record("batch-b", "observations")
    assert [o["outcome"] for o in final["observations"]] == ["duplicate"] * 20
    assert not [r for r in workers.records("batch-b") if "batch" in r]  # the handler never ran again
    assert await effects_per_event(mongodb) == collections.Counter({str(i): 1 for i in ids})


async def test_several_batch_consumers_killed_at_random_lose_nothing_and_double_nothing(
    broker: Broker, mongodb: MongoDB, tmp_path: Path
) -> None:
    q = broker.queue("chaos")
    handler_id = f"{q}/ingest"
    common = [*worker_args(broker, mongodb, q, handler_id), "--max-size", "25"]
    rng = random.Random(7)
    events = [(uuid.uuid4(), {"n": n}) for n in range(400)]
    stream = events + rng.sample(events, 40)
    rng.shuffle(stream)
    kills = 0
    async with worker_processes(WORKER, tmp_path) as workers:
        for name in ("w1", "w2", "w3"):
            await workers.start(name, *common)
        await publish_with_ids(broker, q, stream)
        for generation in range(1, 5):  # kill one worker at random, start a fresh one
            await asyncio.sleep(rng.uniform(0.5, 1.5))
            victim = rng.choice([n for n, c in workers.children.items() if c.returncode is None])
            await workers.children[victim].kill()
            kills += 1
            await workers.start(f"w{3 + generation}", *common)

        async def all_applied() -> bool:
            effects = await effects_per_event(mongodb)
            return len(effects) == len(events) and await broker.wait_for_depth(q, 0, timeout=0.1) == 0

        await eventually(all_applied, timeout=180.0, interval=0.5, what="every event applied")
        running_now = [c for c in workers.children.values() if c.returncode is None]
        for child in running_now:
            child.send_signal(signal.SIGTERM)
        for child in running_now:
            ended = await child.finish(30.0)
            assert ended.returncode == 0, ended.describe()
    assert kills == 4
    effects = await effects_per_event(mongodb)
    assert set(effects) == {str(e) for e, _ in events}  # 0 lost
    assert set(effects.values()) == {1}  # 0 doubled
    assert await broker.depth(f"{q}.dlq") == 0
    sizes = [r["batch"] for name in workers.children for r in workers.records(name) if "batch" in r]
    assert max(sizes) > 1  # batched


@pytest.fixture
def sdk() -> Iterator[Sdk]:
    with in_memory_sdk() as made:
        yield made


async def test_a_batch_has_one_span_linked_to_each_delivery_and_a_size_histogram(
    broker: Broker, mongodb: MongoDB, sdk: Sdk
) -> None:
    telemetry = Telemetry(tracer_provider=sdk.tracer_provider, meter_provider=sdk.meter_provider)
    q = broker.queue("traced")
    calls: list[int] = []
    consumer = batch_consumer(
        broker, mongodb, q, calls, name="batch-traced", max_size=5, max_wait=5.0, prefetch=10, telemetry=telemetry
    )
    async with running(consumer) as managed:
        async with Publisher(broker.url, telemetry=False) as publisher:
            ids = [await publisher.publish_json(q, {"n": n}, version=1) for n in range(5)]
        await eventually(lambda: len(managed.delivery_terminal_observations()) == 5, timeout=20.0)
    assert calls == [5]
    [batch] = spans_of(sdk, SpanKind.CONSUMER, f"process batch {q}")
    deliveries = spans_of(sdk, SpanKind.CONSUMER, f"process {q}")
    assert len(deliveries) == 5
    assert batch.attributes is not None
    assert batch.attributes["messaging.batch.message_count"] == 5
    linked = {link.context.span_id for link in batch.links}
    assert linked == {span.context.span_id for span in deliveries}  # one link per delivery's own span
    assert {span.attributes["messaging.message.id"] for span in deliveries if span.attributes} == {str(i) for i in ids}
    assert {span.attributes["lily.outcome"] for span in deliveries if span.attributes} == {"acked"}
    [(_, point)] = metric_points(sdk, "lily.batch.size", q)
    assert (point.count, point.sum) == (1, 5)
