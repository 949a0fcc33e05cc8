"""A consumer process on a cluster, for the node-loss test (tests/brokers/test_node_loss.py).

Usage::

    python cluster_worker.py --mongo-uri URI --amqp URL --database DB --queue Q --down D --name NAME

``--amqp`` names the cluster's nodes (a comma-separated host list), in the order this process
tries them. The work queue, its retry buckets and its DLQ are quorum queues. The handler writes
one ``effects`` document (the event, this worker, the node its connection reads from, the time)
and stages one outbox message to ``--down`` in its transaction. Every line on stdout is one JSON
object: ``{"ready": NAME, "node": "host:port"}`` once consuming, ``{"stopped": ...}`` at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from pymongo import AsyncMongoClient

from lily_mongo import Consumer, EventId, MongoScope, OutboxOptions, RetryPolicy, queue
from lily_mongo._amqp import connected_node


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


async def run(args: argparse.Namespace) -> None:
    client: AsyncMongoClient[Any] = AsyncMongoClient(args.mongo_uri, serverSelectionTimeoutMS=10_000)
    node: list[str | None] = [None]

    @queue(args.queue, version=1, content="json", handler_id=f"{args.queue}/cluster")
    async def handle(event_id: EventId, mongo: MongoScope) -> None:
        await mongo.database["effects"].insert_one(
            {"event_id": str(event_id), "worker": args.name, "node": node[0], "at": time.time()},
            session=mongo.session,
        )
        await mongo.outbox.publish_json(args.down, {"from": str(event_id)}, version=1)

    consumer = Consumer(
        amqp_url=args.amqp,
        mongo_client=client,
        database=args.database,
        name=args.name,
        outbox=OutboxOptions(claim_seconds=5.0, poll_interval=0.2),
        graceful_timeout=5.0,
        owns_mongo_client=True,
    )
    consumer.configure_queue(
        args.queue, queue_type="quorum", concurrency=2, prefetch=4, retry=RetryPolicy(max_retries=5, delays=(0.5,))
    )
    consumer.include(handle)
    managed = await consumer.start()
    connection = managed._connection
    assert connection is not None

    def follow() -> None:  # the node of the connection in use now, written into each effect
        node[0] = connected_node(connection)
        asyncio.get_running_loop().call_later(0.05, follow)

    follow()
    managed.install_signal_handlers()
    emit({"ready": args.name, "node": node[0]})
    report = await managed.wait()
    emit({"stopped": args.name, "succeeded": report.succeeded})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for option in ("--mongo-uri", "--amqp", "--database", "--queue", "--down", "--name"):
        parser.add_argument(option, required=True)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
