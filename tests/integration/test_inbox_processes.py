"""Scale-out: several consumer replicas coordinating through inbox records (docs/inbox.md, scale-out).

The takeover test runs real OS processes (``workers/inbox_worker.py``) and kills
one with SIGKILL while it holds a lease. The long-handler tests run consumers in
this process, which lets them sample the record while the handler runs.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pymongo.asynchronous.collection import AsyncCollection

from lily_mongo import Consumer, EventId, InboxOptions, MongoScope, RetryPolicy, queue
from tests.support.broker import Broker
from tests.support.consumers import one_event, outcomes, running
from tests.support.mongo import MongoDB
from tests.support.polling import eventually
from tests.support.processes import Child, Workers, worker_processes
from tests.support.proxy import CuttingProxy, Streams

WORKER = Path(__file__).resolve().parent / "workers" / "inbox_worker.py"
RECORDS = "lily_inbox"
EFFECTS = "effects"


# -- takeover after a replica dies ----------------------------------------------------------------


def worker_args(broker: Broker, mongodb: MongoDB, q: str, handler_id: str, *, lease_seconds: str) -> list[str]:
    """The arguments every worker of one test shares."""
    return [
        *("--mongo-uri", mongodb.uri, "--amqp", broker.url, "--database", mongodb.name, "--queue", q),
        *("--handler-id", handler_id, "--lease-seconds", lease_seconds),
    ]


async def replica_b_completes(
    workers: Workers, args: list[str], records: AsyncCollection[Any], key: str
) -> tuple[Child, dict[str, Any]]:
    """Start replica B, wait until the record ``key`` is completed, stop B; return it and its last report."""

    async def completed() -> bool:
        return await records.count_documents({"_id": key, "state": "completed"}) == 1

    # On MongoDB, A's open transaction holds the record until the server reaps it
    # (transactionLifetimeLimitSeconds, 60 s by default); B's claim waits for that.
    what = "replica B to complete the event"
    b = await workers.serve_until("replica-b", *args, done=completed, what=what, timeout=90.0, stop=10.0)
    return b, await workers.wait_for_record("replica-b", "observations")


async def test_lease_expiry_lets_another_replica_take_over_after_a_kill(
    broker: Broker, mongodb: MongoDB, tmp_path: Path
) -> None:
    q, handler_id, event, key = one_event(broker, "takeover")
    db = mongodb.db
    records = db[RECORDS]
    common = worker_args(broker, mongodb, q, handler_id, lease_seconds="1.0")
    async with worker_processes(WORKER, tmp_path) as workers:
        # A's copy takes the lease claim, as a redelivered copy would: the lease is what this is about.
        a = await workers.start("replica-a", *common, "--slow", "60", "--claim-in-transaction", "off")
        await broker.publish(q, event_id=event)
        started = await workers.wait_for_record("replica-a", "handler")
        assert started["handler"] == str(event)

        async def held_by_a() -> bool:
            record = await records.find_one({"_id": key})
            return record is not None and str(record.get("owner", "")).startswith("replica-a:")

        await eventually(held_by_a, what="replica A to hold the lease", interval=0.05)
        await a.kill()
        # A's lease is still there, unexpired or not: nobody released it.
        lease_a = await records.find_one({"_id": key})
        assert lease_a is not None
        assert (lease_a["owner"].split(":")[0], lease_a["token"], lease_a["acquisitions"]) == ("replica-a", 1, 1)
        assert lease_a["state"] == "leased"  # A's completion write died with its transaction
        b, final = await replica_b_completes(workers, common, records, key)

    b_outcomes = [o["outcome"] for o in final["observations"]]
    assert b_outcomes.count("acked") == 1, b_outcomes
    assert set(b_outcomes) <= {"acked", "deferred"}, b_outcomes  # deferred while A's lease was unexpired
    assert final["unresolved"] == 0
    assert final["succeeded"] is True
    assert [r["pid"] for r in workers.records("replica-b") if "handler" in r] == [b.pid]
    effects = await db[EFFECTS].find({"event_id": str(event)}).to_list()
    assert [e["pid"] for e in effects] == [b.pid]  # effect once, by the replica that took over
    [completion] = await db[RECORDS].find({"_id": key}).to_list()
    assert completion["owner"].startswith("replica-b:")
    assert completion["token"] == 2  # the same record, re-acquired with the next fencing token
    assert (completion["state"], completion["acquisitions"]) == ("completed", 2)
    assert await broker.wait_for_depth(q, 0) == 0  # B is gone: anything unacked would be back
    assert await broker.depth(f"{q}.dlq") == 0


async def test_a_replica_killed_while_claiming_in_its_transaction_leaves_nothing_behind(
    broker: Broker, mongodb: MongoDB, tmp_path: Path
) -> None:
    # A first-time copy's record is written by its transaction: killed mid-handler, A leaves
    # no record at all (its transaction never committed). The redelivered copy takes the lease
    # claim on B and completes the event once, with no lease expiry to wait for.
    q, handler_id, event, key = one_event(broker, "killed")
    db = mongodb.db
    common = worker_args(broker, mongodb, q, handler_id, lease_seconds="30")
    async with worker_processes(WORKER, tmp_path) as workers:
        a = await workers.start("replica-a", *common, "--slow", "60")
        await broker.publish(q, event_id=event)
        started = await workers.wait_for_record("replica-a", "handler")
        assert started["handler"] == str(event)
        await a.kill()
        assert await db[RECORDS].count_documents({"_id": key}) == 0  # nothing committed, nothing to expire
        b, final = await replica_b_completes(workers, common, db[RECORDS], key)

    assert [o["outcome"] for o in final["observations"]] == ["acked"]
    assert final["unresolved"] == 0
    effects = await db[EFFECTS].find({"event_id": str(event)}).to_list()
    assert [e["pid"] for e in effects] == [b.pid]
    [completion] = await db[RECORDS].find({"_id": key}).to_list()
    assert completion["owner"].startswith("replica-b:")
    assert (completion["state"], completion["token"], completion["acquisitions"]) == ("completed", 1, 1)
    assert await broker.wait_for_depth(q, 0) == 0


# -- long handlers: the transaction holds the record --------------------------------------------


async def test_no_renewal_touches_the_record_while_a_long_handler_transaction_holds_it(
    broker: Broker, mongodb: MongoDB
) -> None:
    # A 2.5 s handler with a 1 s lease and a heartbeat every 0.1 s. The transaction's first
    # write is the completion, so it holds the record from the start; a renewal now would
    # wait for it on MongoDB, and on the emulator any write between the transaction's first
    # operation and its commit fails the commit. So: the committed record never changes
    # while the handler runs, and the commit succeeds at the first try.
    q, handler_id, event, key = one_event(broker, "long")
    db = mongodb.db
    # The lease path (a first-time copy claiming in its transaction has no lease to renew).
    options = InboxOptions(lease_seconds=1.0, heartbeat_seconds=0.1, claim_in_transaction=False)
    loop = asyncio.get_running_loop()
    started: list[float] = []

    @queue(q, version=1, content="json", handler_id=handler_id)
    async def slow(event_id: EventId, mongo: MongoScope) -> None:
        started.append(loop.time())
        await asyncio.sleep(2.5)
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id)}, session=mongo.session)

    retry = RetryPolicy(max_retries=1, delays=(0.2,))
    consumer = broker.consumer(
        q, slow, name="long", mongodb=mongodb, inbox=options, concurrency=1, prefetch=1, retry=retry
    )
    samples: list[dict[str, Any]] = []
    async with running(consumer) as managed:
        await broker.publish(q, event_id=event)
        await eventually(lambda: bool(started), what="the handler to start")
        while not outcomes(managed):
            record = await db[RECORDS].find_one({"_id": key})
            if record is not None and record.get("state") == "leased":
                samples.append(record)
            assert loop.time() - started[0] < 9.0, "the slow handler never completed"
            await asyncio.sleep(0.05)
    [observation] = managed.delivery_terminal_observations()
    assert (observation.outcome, observation.attempts, observation.transient_replays) == ("acked", 1, 0)
    assert len(samples) >= 20  # sampled through most of the 2.5 s
    assert len({(s["owner"], s["token"], s["expires_at"]) for s in samples}) == 1  # never renewed meanwhile
    [record] = await db[RECORDS].find({}).to_list()
    assert (record["state"], record["token"], record["acquisitions"]) == ("completed", 1, 1)
    assert await db[EFFECTS].count_documents({"event_id": str(event)}) == 1


async def test_a_competing_copy_during_a_long_handler_never_applies_the_event_twice(
    broker: Broker, mongodb: MongoDB
) -> None:
    # Replica A runs a 3 s handler with a 1 s lease; replica B gets a second copy meanwhile.
    # B's claim waits for A's transaction (which holds the record), is deferred when its wait
    # runs out, and finds the event completed once A commits. Either way the event is applied
    # exactly once and every delivery ends acked, duplicate or deferred, within the default
    # deferral bound.
    q, handler_id, event, key = one_event(broker, "compete")
    db = mongodb.db
    options = InboxOptions(lease_seconds=1.0, replay_budget=5)
    calls_a: list[str] = []

    @queue(q, version=1, content="json", handler_id=handler_id)
    async def slow(event_id: EventId, mongo: MongoScope) -> None:
        calls_a.append(str(event_id))
        if len(calls_a) == 1:
            await asyncio.sleep(3.0)
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id), "by": "a"}, session=mongo.session)

    @queue(q, version=1, content="json", handler_id=handler_id)
    async def competitor(event_id: EventId, mongo: MongoScope) -> None:
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id), "by": "b"}, session=mongo.session)

    # prefetch 1: while A works, the broker gives the second copy to B.
    settings: dict[str, Any] = {"inbox": options, "concurrency": 1, "prefetch": 1}

    def consumer(replica: MongoDB, name: str, handler: Callable[..., Awaitable[None]]) -> Consumer:
        retry = RetryPolicy(max_retries=1, delays=(0.2,))
        return broker.consumer(q, handler, name=name, mongodb=replica, retry=retry, **settings)

    async with mongodb.second_client() as other, running(consumer(mongodb, "race-a", slow)) as a:
        await broker.publish(q, event_id=event)
        await eventually(lambda: len(calls_a) == 1, what="A's handler to start")
        async with running(consumer(other, "race-b", competitor)) as b:
            await broker.publish(q, event_id=event)

            async def both_copies_done() -> bool:
                done = [o for o in outcomes(a) + outcomes(b) if o != "deferred"]
                return len(done) == 2 and await broker.wait_for_depth(q, 0, timeout=0.1) == 0

            await eventually(both_copies_done, timeout=20.0, what="both copies to end", interval=0.1)

    ends = collections.Counter(o for o in outcomes(a) + outcomes(b) if o != "deferred")
    assert ends == {"acked": 1, "duplicate": 1}, (outcomes(a), outcomes(b))
    for managed in (a, b):
        assert managed.snapshot().queues[0].unresolved == 0
        assert {o.code for o in managed.delivery_terminal_observations() if o.outcome == "deferred"} <= {
            "LEASE_HELD",
            "LEASE_LOST",
        }
    effects = await db[EFFECTS].find({"event_id": str(event)}).to_list()
    assert len(effects) == 1, effects
    [record] = await db[RECORDS].find({"_id": key}).to_list()
    assert record["state"] == "completed"
    assert record["owner"].startswith(f"race-{effects[0]['by']}:")  # the completion is the effect's author
    assert await broker.depth(f"{q}.dlq") == 0


# -- the deferral count survives the process ------------------------------------------------------


class ClaimCutter(CuttingProxy):
    """A proxy in front of the MongoDB server that drops every connection carrying a lease claim.

    A claim is recognised by its pipeline's field ``_lily_free`` (``records.claim_pipeline``);
    everything else (the deferral counts among it) passes. To the consumer behind it the
    database is unreachable for claims: each delivery is deferred with ``MONGO_UNAVAILABLE``.
    """

    MARK = b"_lily_free"

    async def relay(self, client: Streams, server: Streams) -> None:
        (client_reader, client_writer), (server_reader, server_writer) = client, server

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, cut_claims: bool) -> None:
            while data := await reader.read(65536):
                if cut_claims and self.MARK in data:
                    self.cuts += 1
                    return
                writer.write(data)
                await writer.drain()

        _, pending = await asyncio.wait(
            [
                asyncio.ensure_future(pipe(client_reader, server_writer, cut_claims=True)),
                asyncio.ensure_future(pipe(server_reader, client_writer, cut_claims=False)),
            ],
            return_when=asyncio.FIRST_COMPLETED,
        )
        for task in pending:
            task.cancel()


async def test_the_deferral_count_continues_across_a_killed_consumer(
    broker: Broker, mongodb: MongoDB, tmp_path: Path
) -> None:
    # Every claim fails on the network (MONGO_UNAVAILABLE): no record of a lease counts these
    # deferrals, a counting record does. Replica A defers the event, is killed; replica B
    # starts with an empty process memory and carries on from A's count: the event is
    # dead-lettered at the bound counted across both, not after max_deferrals more.
    q, handler_id, event, key = one_event(broker, "counted")
    records = mongodb.db[RECORDS]
    bound = 4
    async with ClaimCutter.fronting(mongodb) as cutter, worker_processes(WORKER, tmp_path) as workers:
        common = [
            *worker_args(broker, MongoDB(cutter.uri, mongodb.client, mongodb.name), q, handler_id, lease_seconds="30"),
            *("--claim-in-transaction", "off", "--deadline", "8", "--max-deferrals", str(bound)),
        ]

        async def deferrals() -> int:
            record = await records.find_one({"_id": key})
            return int((record or {}).get("deferrals", 0))

        a = await workers.start("replica-a", *common)
        await broker.publish(q, event_id=event)

        async def two_counted() -> bool:
            return await deferrals() >= 2

        await eventually(two_counted, what="replica A's deferrals to be counted", timeout=30.0, interval=0.05)
        await a.kill()
        await asyncio.sleep(0.5)  # whatever A had sent has landed
        counted_by_a = await deferrals()
        assert 2 <= counted_by_a < bound

        async def dead_lettered() -> bool:
            return await broker.depth(f"{q}.dlq") == 1

        what = "the event dead-lettered"
        await workers.serve_until("replica-b", *common, done=dead_lettered, what=what, timeout=40.0, stop=20.0)
        final = await workers.wait_for_record("replica-b", "observations")
        assert cutter.cuts >= bound

    b_ends = [(o["outcome"], o["code"]) for o in final["observations"]]
    # B's own deferrals plus its dead-lettering complete A's count to the bound.
    assert b_ends == [("deferred", "MONGO_UNAVAILABLE")] * (bound - counted_by_a - 1) + [
        ("dead_lettered", "QUEUE_DEFERRALS_EXHAUSTED")
    ], b_ends
    assert f"deferred {bound} times (bound {bound})" in final["observations"][-1]["reason"]
    assert await deferrals() == bound
    assert not [r for name in ("replica-a", "replica-b") for r in workers.records(name) if "handler" in r]
    [copy] = await broker.drain(f"{q}.dlq")
    assert copy.headers["x-lily-failure-code"] == "QUEUE_DEFERRALS_EXHAUSTED"
    assert await broker.depth(q) == 0
