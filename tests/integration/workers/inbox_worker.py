"""A consumer replica for the multi-process inbox tests: runs until SIGTERM.

Usage::

    python inbox_worker.py --mongo-uri URI --amqp URL --database DB --queue Q
                           --handler-id ID --name NAME [--lease-seconds S] [--slow S]
                           [--deadline S] [--max-deferrals N] [--queue-type T] [--passive]
                           [--die-in-handler]

The handler sleeps ``--slow`` seconds, then writes one ``effects`` document in
the attempt's transaction (the sleep comes before the transaction's first
operation); with ``--die-in-handler`` it kills its own process with SIGKILL
instead, on every delivery (a message that crashes its consumer). Every line
on stdout is one JSON object: ``{"ready": ...}`` once consuming,
``{"handler": ...}`` when a handler call starts, and ``{"observations": [...]}``
after shutdown.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal

from lily_mongo import EventId, InboxOptions, MongoScope, RetryPolicy, queue
from tests.support.workers import emit, emit_observations, serve, worker_consumer, worker_parser


async def run(args: argparse.Namespace) -> None:
    @queue(args.queue, version=1, content="json", handler_id=args.handler_id)
    async def handle(event_id: EventId, mongo: MongoScope) -> None:
        emit({"handler": str(event_id), "pid": os.getpid()})
        if args.die_in_handler:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.slow:
            await asyncio.sleep(args.slow)
        await mongo.database["effects"].insert_one(
            {"event_id": str(event_id), "pid": os.getpid()}, session=mongo.session
        )

    consumer = worker_consumer(
        args,
        inbox=InboxOptions(lease_seconds=args.lease_seconds, claim_in_transaction=args.claim_in_transaction == "on"),
        graceful_timeout=5.0,
    )
    consumer.configure_queue(
        args.queue,
        concurrency=1,
        prefetch=1,
        deadline=args.deadline,
        max_deferrals=args.max_deferrals,
        queue_type=args.queue_type,
        passive=args.passive,
        retry=RetryPolicy(max_retries=1, delays=(0.2,)),
    )
    consumer.include(handle)
    managed = await consumer.start()
    report = await serve(managed, args.name)
    emit_observations(managed, report, "outcome", "code", "reason", "attempts")


def main() -> None:
    parser = worker_parser(__doc__)
    parser.add_argument("--claim-in-transaction", choices=("on", "off"), default="on")
    parser.add_argument("--lease-seconds", type=float, default=1.0)
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--deadline", type=float, default=60.0)
    parser.add_argument("--max-deferrals", type=int, default=20)  # QueueOptions' default
    parser.add_argument("--queue-type", choices=("classic", "quorum"), default="classic")
    parser.add_argument("--passive", action="store_true", help="take the queues as they are declared")
    parser.add_argument("--die-in-handler", action="store_true")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
