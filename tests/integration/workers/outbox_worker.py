"""An outbox process for the multi-process outbox tests: a consumer or a relay, running until SIGTERM.

Usage::

    python outbox_worker.py consumer --mongo-uri URI --amqp URL --database DB --queue Q --down D
                                     --name NAME [--claim-seconds S] [--no-dispatch] [--relay on|off]
    python outbox_worker.py relay --mongo-uri URI --amqp URL --database DB --name NAME
                                  [--claim-seconds S] [--batch-size N] [--mark-delay S]

The consumer's handler writes one ``effects`` document and stages one outbox message
to ``--down`` in its transaction. ``--no-dispatch`` stands for a process that dies
between its commit and its dispatch: the committed records are announced
(``{"committed": [...]}``) but never handed to the dispatcher, so they stay claimed by
this process until their claim expires. The relay's ``--mark-delay`` holds each batch
between its confirmed publishes and its mark (``{"published": [...]}`` is announced
first), so a kill there lands mid-batch. Every line on stdout is one JSON object:
``{"ready": ...}`` once started, then the announcements, ``{"stopped": ...}`` at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

from pymongo import AsyncMongoClient

from lily_mongo import EventId, MongoScope, OutboxOptions, Relay, RetryPolicy, queue
from tests.support.workers import emit, serve, worker_consumer, worker_parser


def options(args: argparse.Namespace, **more: Any) -> OutboxOptions:
    return OutboxOptions(
        claim_seconds=args.claim_seconds,
        mark_interval=min(0.2, args.claim_seconds / 4),
        poll_interval=0.1,
        count_interval=0.2,
        **more,
    )


async def run_consumer(args: argparse.Namespace, client: AsyncMongoClient[Any]) -> None:
    @queue(args.queue, version=1, content="json", handler_id=f"{args.queue}/outbox")
    async def handle(event_id: EventId, mongo: MongoScope) -> None:
        await mongo.database["effects"].insert_one(
            {"event_id": str(event_id), "pid": os.getpid()}, session=mongo.session
        )
        await mongo.outbox.publish_json(args.down, {"from": str(event_id), "pid": os.getpid()}, version=1)

    consumer = worker_consumer(args, client, outbox=options(args, run_relay=args.relay == "on"), graceful_timeout=5.0)
    consumer.configure_queue(args.queue, concurrency=1, prefetch=1, retry=RetryPolicy(max_retries=1, delays=(0.2,)))
    consumer.include(handle)
    managed = await consumer.start()
    outbox = managed._outbox
    assert outbox is not None
    if args.no_dispatch:

        def committed(records: list[dict[str, Any]]) -> None:
            emit({"committed": [r["_id"] for r in records], "pid": os.getpid()})

        outbox.dispatcher.submit = committed  # type: ignore[method-assign]
    report = await serve(managed, args.name)
    emit({"stopped": args.name, "succeeded": report.succeeded, "published": managed.snapshot().outbox_published})


class HeldMarks:
    """The relay's majority collection, with every mark held ``delay`` seconds after its batch was confirmed."""

    def __init__(self, collection: Any, delay: float) -> None:
        self._collection = collection
        self._delay = delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self._collection, name)

    async def update_many(self, filter: dict[str, Any], update: Any, **kwargs: Any) -> Any:
        if "claim_token" in filter:  # a mark (a claim's filter has no token)
            emit({"published": list(filter["_id"]["$in"]), "pid": os.getpid()})
            await asyncio.sleep(self._delay)
        return await self._collection.update_many(filter, update, **kwargs)


async def run_relay(args: argparse.Namespace, client: AsyncMongoClient[Any]) -> None:
    relay = Relay(
        client, args.database, amqp_url=args.amqp, options=options(args, batch_size=args.batch_size), name=args.name
    )
    await relay.start()
    if args.mark_delay:
        part = relay.process.relay
        part._majority = HeldMarks(part._majority, args.mark_delay)  # type: ignore[assignment]
    report = await serve(relay, args.name)
    emit(
        {
            "stopped": args.name,
            "succeeded": report.succeeded,
            "forced": report.forced,
            "published": relay.snapshot().outbox_published,
        }
    )


async def run(args: argparse.Namespace) -> None:
    client: AsyncMongoClient[Any] = AsyncMongoClient(args.mongo_uri, serverSelectionTimeoutMS=10_000)
    try:
        await (run_consumer if args.mode == "consumer" else run_relay)(args, client)
    finally:
        await client.close()


def main() -> None:
    parser = worker_parser(__doc__, consumer=False)
    parser.add_argument("mode", choices=("consumer", "relay"))
    parser.add_argument("--queue", default="")
    parser.add_argument("--down", default="")
    parser.add_argument("--claim-seconds", type=float, default=2.0)
    parser.add_argument("--no-dispatch", action="store_true")
    parser.add_argument("--relay", choices=("on", "off"), default="on")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--mark-delay", type=float, default=0.0)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
