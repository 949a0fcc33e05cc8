"""A message whose handler kills its consumer process on every attempt (a "poison message").

Nothing in the consumer can count such an attempt: the process dies before any settlement, and
the attempt's transaction never commits. The broker sees a closed channel with the delivery
unacknowledged and returns it. A quorum queue counts that return (on every version observed,
4.3 included) and dead-letters the message past its delivery limit, to the work queue's DLQ,
where ``lily-mongo dlq list`` shows it as the broker's (``delivery_limit``). A classic queue
has no such limit: the message comes back for as long as consumers die on it.

The work queue here is declared by the test with a delivery limit of 2 (``x-delivery-limit``;
the default, 20 on 4.x, would take twenty-one worker processes), and the workers take the
topology as it is (``passive``). Workers are real processes (``tests/integration/workers``).
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from lily_mongo import QueueOptions, RetryPolicy
from lily_mongo._plan.options import QueueType
from tests.brokers.tier import declare_work_queue
from tests.integration.test_inbox_processes import EFFECTS, RECORDS, WORKER, worker_args
from tests.support.broker import Broker
from tests.support.cli import cli_env, run_cli
from tests.support.consumers import one_event
from tests.support.mongo import MongoDB
from tests.support.polling import eventually
from tests.support.processes import Workers, worker_processes

pytestmark = pytest.mark.broker

DELIVERY_LIMIT = 2
LEASE_SECONDS = 1.0
WORKER_RETRY = RetryPolicy(max_retries=1, delays=(0.2,))  # the worker's own (workers/inbox_worker.py)


async def one_death(workers: Workers, name: str, args: list[str], event: str) -> None:
    """Start a worker; it takes the message, writes its handler line, and dies of SIGKILL."""
    child = await workers.start(name, *args)
    started = await workers.wait_for_record(name, "handler", timeout=30.0)
    assert started["handler"] == event
    ended = await child.finish(10.0)
    assert ended.returncode == -signal.SIGKILL, ended.describe()


async def test_a_message_that_kills_its_consumer_every_time(
    broker: Broker, mongodb: MongoDB, queue_type: QueueType, tmp_path: Path
) -> None:
    q, handler_id, event, key = one_event(broker, "poison")
    options = QueueOptions(name=q, queue_type=queue_type, retry=WORKER_RETRY)
    limit = {"x-delivery-limit": DELIVERY_LIMIT} if queue_type == "quorum" else {}
    await declare_work_queue(broker.channel, options, **limit)
    args = [
        *worker_args(broker, mongodb, q, handler_id, lease_seconds=str(LEASE_SECONDS)),
        *("--queue-type", queue_type, "--passive", "--die-in-handler"),
    ]
    deaths = 0
    async with worker_processes(WORKER, tmp_path) as workers:
        await broker.publish(q, event_id=event)
        for deaths in range(1, DELIVERY_LIMIT + 2):
            await one_death(workers, f"replica-{deaths}", args, str(event))

            async def returned() -> bool:
                return await broker.depth(q) + await broker.depth(f"{q}.dlq") == 1

            await eventually(returned, what="the message back in its queue or in the DLQ", interval=0.05)
            if await broker.depth(f"{q}.dlq"):
                break
            # The next replica starts once the dead one's lease (taken by a redelivered copy) expired,
            # as a restarted process would usually find it; a live lease would defer the copy instead.
            await asyncio.sleep(LEASE_SECONDS + 0.2)
    handler_lines = [r for name in workers.children for r in workers.records(name) if "handler" in r]
    assert len(handler_lines) == deaths  # one attempt per process, each ended by its death
    assert await mongodb.db[EFFECTS].count_documents({}) == 0
    record = await mongodb.db[RECORDS].find_one({"_id": key})
    # The first attempt claimed in its transaction (never committed); each later one took the lease.
    assert record is not None
    assert (record["state"], record["acquisitions"]) == ("leased", deaths - 1)
    if queue_type == "classic":
        assert deaths == DELIVERY_LIMIT + 1
        assert await broker.depths(q, f"{q}.dlq") == [1, 0]  # nothing bounds it: it comes back again
        return
    assert deaths == DELIVERY_LIMIT + 1  # dead-lettered at its third return
    assert await broker.depths(q, f"{q}.dlq") == [0, 1]
    listing = await run_cli("dlq", "list", q, env=cli_env(broker.url, mongodb.uri))
    assert listing.returncode == 0, listing.describe()
    [row] = [line for line in listing.stdout.splitlines() if str(event) in line]
    assert "broker-native (delivery_limit)" in row, listing.stdout
    [original] = await broker.drain(f"{q}.dlq")
    assert original.headers["x-first-death-reason"] == "delivery_limit"
    assert original.headers["x-lily-event-id"] == str(event)
    assert "x-lily-failure-code" not in original.headers
