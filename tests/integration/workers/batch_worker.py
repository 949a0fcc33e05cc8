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
import os
from typing import Any

from lily_mongo import Batch, BatchOptions, InboxOptions, Json, MongoScope, RetryPolicy, queue
from lily_mongo._amqp import AmqpMessage
from tests.support.workers import emit, emit_observations, serve, worker_consumer, worker_parser


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

    consumer = worker_consumer(args, inbox=InboxOptions(lease_seconds=2.0), graceful_timeout=10.0)
    consumer.configure_queue(
        args.queue,
        concurrency=1,
        prefetch=2 * args.max_size,
        max_deferrals=200,
        retry=RetryPolicy(max_retries=1, delays=(0.2,)),
    )
    consumer.include(ingest)
    managed = await consumer.start()
    report = await serve(managed, args.name)
    emit_observations(managed, report, "outcome", "code")


def main() -> None:
    parser = worker_parser(__doc__)
    parser.add_argument("--max-size", type=int, default=20)
    parser.add_argument("--max-wait", type=float, default=0.05)
    parser.add_argument("--stall-acks", action="store_true")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
