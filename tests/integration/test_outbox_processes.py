"""Crashes of outbox processes, with real process kills (docs/outbox.md, crash windows).

Workers are OS processes (``workers/outbox_worker.py``) killed with SIGKILL:

* a consumer between its commit and its dispatch: its records stay claimed by it
  until the claim expires, then another process's backstop relay publishes them;
* a relay between a batch's confirmed publishes and its mark: every record is
  still published at least once (that batch's twice).
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import signal
from pathlib import Path

from tests.integration.test_outbox import event_ids, outbox_record
from tests.support.broker import Broker
from tests.support.mongo import MongoDB
from tests.support.processes import worker_processes

WORKER = Path(__file__).resolve().parent / "workers" / "outbox_worker.py"
OUTBOX = "lily_outbox"


def common(broker: Broker, mongodb: MongoDB) -> list[str]:
    return ["--mongo-uri", mongodb.uri, "--amqp", broker.url, "--database", mongodb.name]


def aware(moment: datetime.datetime) -> datetime.datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=datetime.UTC)


async def test_a_consumer_killed_between_commit_and_dispatch_loses_nothing(
    broker: Broker, mongodb: MongoDB, tmp_path: Path
) -> None:
    q, down = broker.queue("src"), await broker.declare(broker.queue("down"))
    outbox = mongodb.db[OUTBOX]
    async with worker_processes(WORKER, tmp_path) as workers:
        consumer = ["consumer", *common(broker, mongodb), "--queue", q, "--down", down, "--claim-seconds", "2"]
        a = await workers.start("consumer-a", *consumer, "--no-dispatch", "--relay", "off")
        event = await broker.publish(q)
        committed = await workers.wait_for_record("consumer-a", "committed")
        await a.kill()
        # Committed with the business write, claimed by A, never published.
        [record_id] = committed["committed"]
        record = await outbox.find_one({"_id": record_id})
        assert record is not None
        assert (record["status"], record["attempts"]) == ("pending", 0)
        assert record["claim_owner"].startswith("consumer-a:")
        claim_expires = aware(record["claim_expires"])
        assert await mongodb.db["effects"].count_documents({"event_id": str(event)}) == 1
        assert await broker.depth(down) == 0

        async def published() -> bool:
            return await outbox.count_documents({"_id": record_id, "status": "published"}) == 1

        what = "B's relay to publish A's record"
        await workers.serve_until("consumer-b", *consumer, done=published, what=what, timeout=30.0)
    [message] = await broker.drain(down)
    done = await outbox.find_one({"_id": record_id})
    assert done is not None
    assert message.headers["x-lily-event-id"] == done["event_id"]
    assert done["claim_owner"].startswith("consumer-b:")  # taken over by B's relay, with its own claim
    assert aware(done["published_at"]) >= claim_expires  # not before A's claim had expired
    assert await mongodb.db["effects"].count_documents({"event_id": str(event)}) == 1  # the handler ran once


async def test_a_relay_killed_mid_batch_still_publishes_every_record_at_least_once(
    broker: Broker, mongodb: MongoDB, tmp_path: Path
) -> None:
    down = await broker.declare(broker.queue("down"))
    outbox = mongodb.db[OUTBOX]
    records = [outbox_record(down, {"n": n}, seq=n) for n in range(60)]
    await outbox.insert_many(records)
    relay = ["relay", *common(broker, mongodb), "--claim-seconds", "2", "--batch-size", "20"]
    async with worker_processes(WORKER, tmp_path) as workers:
        r1 = await workers.start("relay-1", *relay, "--mark-delay", "60")
        first = await workers.wait_for_record("relay-1", "published", timeout=20.0)
        await r1.kill()
        batch = set(first["published"])
        assert len(batch) == 20
        # Published and confirmed, but never marked: still pending, claimed by the dead relay.
        held = await outbox.find({"_id": {"$in": list(batch)}}).to_list()
        assert {(r["status"], r["claim_owner"].split(":")[0]) for r in held} == {("pending", "relay-1")}
        assert await broker.wait_for_depth(down, 20) == 20

        async def all_published() -> bool:
            return await outbox.count_documents({"status": "published"}) == len(records)

        await workers.serve_until("relay-2", *relay, done=all_published, what="every record published", timeout=30.0)
    arrived = collections.Counter(event_ids(await broker.drain(down)))
    by_id = {r["_id"]: r["event_id"] for r in records}
    assert set(arrived) == set(by_id.values())  # every record at least once
    # The dead relay's batch was published again once its claim expired; nothing else twice.
    assert {event for event, count in arrived.items() if count > 1} == {by_id[i] for i in batch}
    assert max(arrived.values()) == 2


async def test_a_relay_stops_gracefully_on_sigterm_and_a_second_signal_forces_it(
    broker: Broker, mongodb: MongoDB, tmp_path: Path
) -> None:
    down = await broker.declare(broker.queue("down"))
    outbox = mongodb.db[OUTBOX]
    await outbox.insert_many([outbox_record(down, {"n": n}, seq=n) for n in range(5)])
    relay = ["relay", *common(broker, mongodb), "--claim-seconds", "30"]
    async with worker_processes(WORKER, tmp_path) as workers:
        # Idle: SIGTERM stops it at once, gracefully.
        idle = await workers.start("relay-idle", *relay)
        assert await broker.wait_for_depth(down, 5) == 5
        ended = await idle.stop(timeout=15.0)
        assert ended.returncode == 0, ended.describe()
        stopped = await workers.wait_for_record("relay-idle", "stopped")
        assert (stopped["succeeded"], stopped["forced"], stopped["published"]) == (True, False, 5)

        # Held in a batch (published, its mark held): the first signal waits for it, the second forces.
        await outbox.insert_many([outbox_record(down, {"n": n}) for n in range(3)])
        held = await workers.start("relay-held", *relay, "--mark-delay", "60")
        await workers.wait_for_record("relay-held", "published")
        held.send_signal(signal.SIGTERM)
        await asyncio.sleep(1.0)
        assert held.returncode is None  # still waiting for its batch (graceful window 30 s)
        ended = await held.stop(timeout=15.0)
        assert ended.returncode == 0, ended.describe()
        forced = await workers.wait_for_record("relay-held", "stopped")
        assert (forced["succeeded"], forced["forced"]) == (True, True)
    # The forced batch was published, not marked: its claim expires and another relay republishes it.
    assert await outbox.count_documents({"status": "pending", "claim_owner": {"$regex": "^relay-held:"}}) == 3
