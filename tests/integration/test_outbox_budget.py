"""What the outbox costs on its collection, and the order it keeps (docs/outbox.md, budget and order).

Commands are counted with a ``pymongo.monitoring.CommandListener`` on the client of
the process under test, whose URI asks for ``w=1``: every write outside a
transaction must still ask for a majority. A command counts against the outbox
when it names the outbox collection.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

from pymongo import monitoring

from lily_mongo import Consumer, EventId, MongoScope, Outbox, OutboxOptions, OutboxTransaction, RetryPolicy, queue
from lily_mongo._outbox import OutboxRelay
from tests.integration.test_outbox import event_ids, outbox_record, relays_running
from tests.support.broker import Broker
from tests.support.consumers import running
from tests.support.mongo import CommandLog, MongoDB, w1_client
from tests.support.polling import eventually

OUTBOX = "lily_outbox"
WRITES = frozenset({"insert", "update", "delete", "findAndModify"})


def assert_majority_outside_transactions(events: list[monitoring.CommandStartedEvent]) -> None:
    outside = [e for e in events if e.command_name in WRITES and "txnNumber" not in e.command]
    assert all(e.command.get("writeConcern") == {"w": "majority"} for e in outside), [e.command for e in outside]


async def test_the_happy_path_costs_the_insert_plus_batched_marks_and_no_claim(
    broker: Broker, mongodb: MongoDB
) -> None:
    q, down = broker.queue("src"), await broker.declare(broker.queue("down"))
    count = 40
    listener = CommandLog()
    client = w1_client(mongodb, listener)

    @queue(q, version=1, content="json", handler_id=f"{q}/budget")
    async def handle(event_id: EventId, mongo: MongoScope) -> None:
        await mongo.database["effects"].insert_one({"_id": str(event_id)}, session=mongo.session)
        await mongo.outbox.publish_json(down, {"from": str(event_id)}, version=1)

    consumer = Consumer(amqp_url=broker.url, name="budget", mongo_client=client, database=mongodb.name)
    consumer.configure_queue(q, concurrency=1, prefetch=8, retry=RetryPolicy(max_retries=0, delays=()))
    consumer.include(handle)
    try:
        async with running(consumer) as managed:
            started = time.monotonic()
            await broker.publish_all(q, [{"n": n} for n in range(count)])
            await eventually(lambda: managed.snapshot().outbox_published == count, what="all marked", timeout=30.0)
            elapsed = time.monotonic() - started
        assert await broker.depth(down) == count
    finally:
        await client.close()
    events = listener.naming(OUTBOX)
    names = collections.Counter(e.command_name for e in events)
    inserts = [e for e in events if e.command_name == "insert"]
    assert len(inserts) == count
    assert all("txnNumber" in e.command for e in inserts)  # in the handler's transaction
    updates = [e for e in events if e.command_name == "update"]
    # No claim of a record its writer dispatched: every update is a mark (fenced by the dispatcher's token).
    assert all("claim_token" in u["q"] for e in updates for u in e.command["updates"]), [e.command for e in updates]
    assert_majority_outside_transactions(events)
    writes = sum(names[name] for name in WRITES)
    assert writes / count <= 1.5, names
    # Reads are the relay's idle polls (one per poll interval) and its counts (one per count interval).
    options = OutboxOptions()
    reads = names["find"] + names["aggregate"]
    assert reads <= (elapsed + 12) / options.poll_interval + (elapsed + 12) / options.count_interval + 4, names


async def test_draining_a_backlog_costs_at_most_a_tenth_of_a_command_per_record(
    broker: Broker, mongodb: MongoDB
) -> None:
    down = await broker.declare(broker.queue("down"))
    count = 300
    records = [outbox_record(down, {"n": n}, seq=0) for n in range(count)]
    await mongodb.db[OUTBOX].insert_many(records)
    listener = CommandLog()
    client = w1_client(mongodb, listener)
    try:
        relay = OutboxRelay(client[mongodb.name][OUTBOX], OutboxOptions(poll_interval=0.2), "drain")
        async with relays_running(broker.connection, [relay]):
            await eventually(lambda: relay.counters.published == count, what="the backlog drained", timeout=60.0)
    finally:
        await client.close()
    assert await broker.wait_for_depth(down, count) == count
    events = listener.naming(OUTBOX)
    names = collections.Counter(e.command_name for e in events)
    # Three batches of 100: find the ids, claim them (one update_many), read them, mark them (one update_many).
    assert names["update"] == 6, names
    assert_majority_outside_transactions(events)
    # The commands until the last mark (the idle polls after it depend on how long the test waits).
    last_mark = max(i for i, e in enumerate(events) if e.command_name == "update")
    assert (last_mark + 1) / count <= 0.1, names
    assert await mongodb.db[OUTBOX].count_documents({"status": "published"}) == count


async def test_records_of_one_transaction_are_published_in_write_order(broker: Broker, mongodb: MongoDB) -> None:
    down = await broker.declare(broker.queue("down"))
    options = OutboxOptions(mark_interval=0.05, poll_interval=0.05, batch_size=7)
    # Five transactions of twelve records, written with nothing dispatching; a relay claims them in
    # batches of seven, so transactions straddle batches.
    outbox = Outbox(mongodb.client, mongodb.name)

    def writing(t: int) -> Any:
        async def write(tx: OutboxTransaction) -> list[str]:
            return [str(await tx.publish_json(down, {"t": t, "n": n}, version=1)) for n in range(12)]

        return write

    written = [await outbox.transaction(writing(t)) for t in range(5)]
    relay = OutboxRelay(mongodb.db[OUTBOX], options, "order")
    async with relays_running(broker.connection, [relay]):
        await eventually(lambda: relay.counters.published == 60, what="every record relayed", timeout=30.0)
    arrived = event_ids(await broker.drain(down))
    assert sorted(arrived) == sorted(e for t in written for e in t)
    for transaction in written:
        assert [e for e in arrived if e in transaction] == transaction

    # The same through the dispatcher, right after the commit.
    async with Outbox(mongodb.client, mongodb.name, amqp_url=broker.url, options=options) as dispatching:
        again = await asyncio.gather(*(dispatching.transaction(writing(t)) for t in range(3)))
        assert await broker.wait_for_depth(down, 36) == 36
    arrived = event_ids(await broker.drain(down))
    for transaction in again:
        assert [e for e in arrived if e in transaction] == transaction
