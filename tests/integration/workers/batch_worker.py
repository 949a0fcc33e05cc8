"""A consumer replica with a batch handler, for the multi-process batch tests: runs until SIGTERM.

Usage::

    python batch_worker.py --mongo-uri URI --amqp URL --database DB --queue Q --handler-id ID --name NAME
                           [--max-size N] [--max-wait S] [--stall-acks]

The handler writes one ``effects`` document per entry, with one ``insert_many`` in the batch's
transaction. ``--stall-acks`` makes every ACK wait forever (the process's ACK frames never leave it):
the test kills it between a batch's commit and its ACK. Every line on stdout is one JSON object:
``{"ready": ...}`` once consuming, ``{"batch": size}`` when a handler call starts, and
``{"observations": [...]}`` after a graceful shutdown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from pymongo import AsyncMongoClient

from lily_mongo import Batch, BatchOptions, Consumer, InboxOptions, Json, MongoScope, RetryPolicy, queue
from lily_mongo._amqp import AmqpMessage


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


async def run(args: argparse.Namespace) -> None:
    @queue(
        args.queue,
        version=1,
        content="json",
        handler_id=args.handler_id,
        batch=BatchOptions(max_size=args.max_size, max_wait=args.max_wait),
    )
    async def ingest(items: Batch[Json[dict[str, Any]]], mongo: MongoScope) -> None:
        emit({"batch": len(items), "pid": os.getpid()})
        await mongo.database["effects"].insert_many(
            [{"event_id": str(entry.event_id), "pid": os.getpid()} for entry in items], session=mongo.session
        )

    if args.stall_acks:

        async def never(self: AmqpMessage) -> None:
            await asyncio.Event().wait()

        AmqpMessage.ack = never  # type: ignore[method-assign]  # this test process's ACKs never leave it

    client: AsyncMongoClient[Any] = AsyncMongoClient(args.mongo_uri, serverSelectionTimeoutMS=10_000)
    consumer = Consumer(
        amqp_url=args.amqp,
        mongo_client=client,
        database=args.database,
        name=args.name,
        inbox=InboxOptions(lease_seconds=2.0),
        graceful_timeout=10.0,
        owns_mongo_client=True,
    )
    consumer.configure_queue(
        args.queue,
        concurrency=1,
        prefetch=2 * args.max_size,
        max_deferrals=200,
        retry=RetryPolicy(max_retries=1, delays=(0.2,)),
    )
    consumer.include(ingest)
    managed = await consumer.start()
    managed.install_signal_handlers()
    emit({"ready": args.name, "pid": os.getpid()})
    report = await managed.wait()
    emit(
        {
            "observations": [
                {"outcome": o.outcome, "code": o.code, "event_id": str(o.event_id)}
                for o in managed.delivery_terminal_observations()
            ],
            "succeeded": report.succeeded,
            "unresolved": report.unresolved,
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mongo-uri", required=True)
    parser.add_argument("--amqp", required=True)
    parser.add_argument("--database", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--handler-id", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--max-size", type=int, default=20)
    parser.add_argument("--max-wait", type=float, default=0.05)
    parser.add_argument("--stall-acks", action="store_true")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
