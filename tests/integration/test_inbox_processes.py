"""Scale-out: several consumer replicas coordinating through lease documents (SPEC section 5).

The takeover test runs real OS processes (``workers/inbox_worker.py``) and kills
one with SIGKILL while it holds a lease. The heartbeat test runs two consumers
in this process, which lets it sample the lease document while the handler runs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aio_pika.abc
from pymongo import AsyncMongoClient

from lily_mongo import Consumer, EventId, InboxOptions, MongoScope, Publisher, RetryPolicy, queue
from tests.support import BrokerNames, eventually, outcomes, queue_depth, running, wait_for_depth

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "workers" / "inbox_worker.py"
COMPLETIONS = "lily_inbox"
LEASES = "lily_leases"
EFFECTS = "effects"


# -- helpers --------------------------------------------------------------------------------------


def read_records(path: Path) -> list[dict[str, Any]]:
    """Complete JSON lines a worker wrote so far."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def open_log(path: Path) -> Any:
    return path.open("wb")


class Workers:
    """Worker processes started by one test; whatever is still running at the end is killed."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.processes: dict[str, asyncio.subprocess.Process] = {}

    async def start(self, name: str, *args: str) -> asyncio.subprocess.Process:
        log = open_log(self.directory / f"{name}.out")
        errors = open_log(self.directory / f"{name}.err")
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                str(WORKER),
                "--name",
                name,
                *args,
                stdout=log,
                stderr=errors,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
        finally:
            log.close()
            errors.close()
        self.processes[name] = process
        return process

    def records(self, name: str) -> list[dict[str, Any]]:
        return read_records(self.directory / f"{name}.out")

    def stderr(self, name: str) -> str:
        return (self.directory / f"{name}.err").read_text()[-2000:]

    async def wait_for_record(self, name: str, key: str, timeout: float = 10.0) -> dict[str, Any]:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            for record in self.records(name):
                if key in record:
                    return record
            process = self.processes[name]
            if process.returncode is not None:
                raise AssertionError(f"worker {name} exited ({process.returncode}): {self.stderr(name)}")
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"worker {name} wrote no {key!r} record in {timeout} s: {self.stderr(name)}")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        for process in self.processes.values():
            if process.returncode is None:
                process.kill()
            await process.wait()


@contextlib.asynccontextmanager
async def workers_in(directory: Path) -> AsyncIterator[Workers]:
    workers = Workers(directory)
    try:
        yield workers
    finally:
        await workers.close()


async def publish(amqp: str, q: str, event_id: uuid.UUID) -> None:
    async with Publisher(amqp) as publisher:
        await publisher.publish_json(q, {"n": 1}, version=1, event_id=event_id)


# -- takeover after a replica dies ----------------------------------------------------------------


async def test_lease_expiry_lets_another_replica_take_over_after_a_kill(
    amqp: str,
    mongo_uri: str,
    mongo_client: AsyncMongoClient[Any],
    database_name: str,
    names: BrokerNames,
    amqp_channel: aio_pika.abc.AbstractChannel,
    tmp_path: Path,
) -> None:
    q = names.queue("takeover")
    handler_id = f"{q}/takeover"
    event = uuid.uuid4()
    key = f"{handler_id}|{event}"
    leases = mongo_client[database_name][LEASES]
    common = ["--mongo-uri", mongo_uri, "--amqp", amqp, "--database", database_name, "--queue", q]
    common += ["--handler-id", handler_id, "--lease-seconds", "1.0"]
    async with workers_in(tmp_path) as workers:
        a = await workers.start("replica-a", *common, "--slow", "60")
        await workers.wait_for_record("replica-a", "ready")
        await publish(amqp, q, event)
        started = await workers.wait_for_record("replica-a", "handler")
        assert started["handler"] == str(event)

        async def held_by_a() -> bool:
            lease = await leases.find_one({"_id": key})
            return lease is not None and str(lease.get("owner", "")).startswith("replica-a:")

        await eventually(held_by_a, what="replica A to hold the lease", interval=0.05)
        a.send_signal(signal.SIGKILL)
        assert await a.wait() == -signal.SIGKILL
        # A's lease is still there, unexpired or not: nobody released it.
        lease_a = await leases.find_one({"_id": key})
        assert lease_a is not None
        assert (lease_a["owner"].split(":")[0], lease_a["token"], lease_a["acquisitions"]) == ("replica-a", 1, 1)

        b = await workers.start("replica-b", *common)
        await workers.wait_for_record("replica-b", "ready")
        db = mongo_client[database_name]

        async def completed() -> bool:
            return await db[COMPLETIONS].count_documents({"_id": key}) == 1

        await eventually(completed, what="replica B to complete the event", interval=0.05)
        b.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(b.wait(), 10.0) == 0, workers.stderr("replica-b")
        final = await workers.wait_for_record("replica-b", "observations")

    b_outcomes = [o["outcome"] for o in final["observations"]]
    assert b_outcomes.count("acked") == 1, b_outcomes
    assert set(b_outcomes) <= {"acked", "deferred"}, b_outcomes  # deferred while A's lease was unexpired
    assert final["unresolved"] == 0
    assert final["succeeded"] is True
    assert [r["pid"] for r in workers.records("replica-b") if "handler" in r] == [b.pid]
    effects = await db[EFFECTS].find({"event_id": str(event)}).to_list()
    assert [e["pid"] for e in effects] == [b.pid]  # effect once, by the replica that took over
    [completion] = await db[COMPLETIONS].find({"_id": key}).to_list()
    assert completion["owner"].startswith("replica-b:")
    assert completion["token"] == 2  # the same lease document, re-acquired with the next fencing token
    assert await leases.count_documents({"_id": key}) == 0  # released after the commit
    assert await wait_for_depth(amqp_channel, q, 0) == 0  # B is gone: anything unacked would be back
    assert await queue_depth(amqp_channel, f"{q}.dlq") == 0


# -- heartbeat ------------------------------------------------------------------------------------


async def test_heartbeat_keeps_a_long_handler_lease_and_defers_a_competing_copy(
    amqp: str,
    mongo_uri: str,
    mongo_client: AsyncMongoClient[Any],
    database_name: str,
    names: BrokerNames,
    amqp_channel: aio_pika.abc.AbstractChannel,
) -> None:
    # lease_seconds=1 and a handler that takes 3 s: without the heartbeat the lease would
    # expire twice over and the competing consumer would take over.
    q = names.queue("heartbeat")
    handler_id = f"{q}/slow"
    event = uuid.uuid4()
    key = f"{handler_id}|{event}"
    db = mongo_client[database_name]
    options = InboxOptions(lease_seconds=1.0, replay_budget=5)
    calls_a: list[float] = []
    calls_b: list[float] = []
    loop = asyncio.get_running_loop()

    @queue(q, version=1, content="json", handler_id=handler_id)
    async def slow(event_id: EventId, mongo: MongoScope) -> None:
        calls_a.append(loop.time())
        if len(calls_a) == 1:
            # The sleep comes before the transaction's first operation: on the emulator a
            # heartbeat write inside an open transaction would fail its commit.
            await asyncio.sleep(3.0)
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id), "by": "a"}, session=mongo.session)

    @queue(q, version=1, content="json", handler_id=handler_id)
    async def competitor(event_id: EventId, mongo: MongoScope) -> None:
        calls_b.append(loop.time())
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id), "by": "b"}, session=mongo.session)

    def consumer(client: AsyncMongoClient[Any], name: str, handler: Callable[..., Awaitable[None]]) -> Consumer:
        c = Consumer(amqp_url=amqp, mongo_client=client, database=database_name, name=name, inbox=options)
        # prefetch 1: while A works, the broker gives the second copy to B.
        c.configure_queue(
            q, concurrency=1, prefetch=1, max_deferrals=50, retry=RetryPolicy(max_retries=1, delays=(0.2,))
        )
        c.include(handler)
        return c

    samples: list[dict[str, Any]] = []
    other: AsyncMongoClient[Any] = AsyncMongoClient(mongo_uri, serverSelectionTimeoutMS=10_000)
    try:
        async with running(consumer(mongo_client, "hb-a", slow)) as a:
            await publish(amqp, q, event)
            await eventually(lambda: len(calls_a) == 1, what="A's handler to start")
            async with running(consumer(other, "hb-b", competitor)) as b:
                await publish(amqp, q, event)
                while await db[COMPLETIONS].count_documents({"_id": key}) == 0:
                    lease = await db[LEASES].find_one({"_id": key})
                    if lease is not None:
                        samples.append(lease)
                    assert loop.time() - calls_a[0] < 9.0, "the slow handler never completed"
                    await asyncio.sleep(0.05)
                await eventually(lambda: len(outcomes(a)) + len(outcomes(b)) >= 2 and "duplicate" in outcomes(b))
                assert await wait_for_depth(amqp_channel, q, 0) == 0
    finally:
        await other.close()

    assert outcomes(a) == ["acked"]
    b_counts = collections.Counter(outcomes(b))
    assert b_counts["duplicate"] == 1
    assert b_counts["deferred"] >= 1  # B's copy met A's live lease
    assert set(b_counts) == {"deferred", "duplicate"}
    assert {o.code for o in b.delivery_terminal_observations() if o.outcome == "deferred"} == {"LEASE_HELD"}
    assert calls_b == []  # B never ran the handler
    # The same owner, token 1 and one acquisition for the whole 3 s; expiry kept moving.
    assert samples
    assert {(s["owner"], s["token"], s["acquisitions"]) for s in samples} == {(samples[0]["owner"], 1, 1)}
    assert samples[0]["owner"].startswith("hb-a:")
    expiries = sorted({s["expires_at"] for s in samples})
    assert len(expiries) >= 3, expiries  # renewed several times (every lease_seconds / 3)
    assert (expiries[-1] - expiries[0]).total_seconds() >= 1.5
    effects = await db[EFFECTS].find({"event_id": str(event)}).to_list()
    assert [e["by"] for e in effects] == ["a"]
    assert await db[COMPLETIONS].count_documents({}) == 1
    assert await db[LEASES].count_documents({}) == 0
    assert await queue_depth(amqp_channel, f"{q}.dlq") == 0
