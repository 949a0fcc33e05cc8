"""Consume throughput: a lily_mongo at_least_once Consumer against raw aio-pika, same broker, same prefetch.

Run: ``python benchmarks/bench_throughput.py [--messages 5000] [--runs 5] [--prefetch 64] [--concurrency 32]``
(``LILY_AMQP_URL`` selects the broker; default the local RabbitMQ as guest).

Before every timed run the queue is filled with ``--messages`` small JSON
messages published with confirms (transient, canonical Lily headers), so only
consumption is timed. A run is timed from the start of consuming (connecting
included, for both sides) until the last message is ACKed:

* raw: aio-pika robust connection, ``basic.qos(prefetch)``, a consumer callback
  that ACKs each message;
* lily: ``Consumer(...).start()`` with a no-op handler taking ``Json[Item]``
  (envelope validation, dispatch, orjson + pydantic decode, settlement), the
  queue's effective prefetch equal to the raw one.

Runs alternate (raw, lily, raw, lily, ...). Each run is timed twice: from the
start (connecting, and for lily declaring the topology and the inbox-free plan)
and from the first delivery, both until the last ACK. The script prints the
medians of both, the ratio including start-up, and the throughput ratio
lily/raw from the first delivery (target >= 0.8), then deletes its queues.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path

import aio_pika
import aio_pika.abc
import pydantic

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lily_mongo import Consumer, Json, QueueOptions, RetryPolicy, queue
from lily_mongo.publisher import JSON, prepare_publication
from lily_mongo.topology import declare_topology, topology_names

TARGET_RATIO = 0.8
DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"
PUBLISH_BATCH = 500


class Item(pydantic.BaseModel):
    id: int
    sku: str
    qty: int


async def fill(channel: aio_pika.abc.AbstractChannel, name: str, count: int) -> None:
    """Publish ``count`` messages with confirms and wait until the queue holds them all."""
    for start in range(0, count, PUBLISH_BATCH):
        publishes = []
        for i in range(start, min(start + PUBLISH_BATCH, count)):
            publication = prepare_publication(JSON, name, {"id": i, "sku": f"SKU-{i % 97}", "qty": 1}, version=1)
            message = aio_pika.Message(
                publication.body,
                headers=publication.headers,
                content_type=publication.content_type,
                delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT,
            )
            publishes.append(channel.default_exchange.publish(message, routing_key=name))
        await asyncio.gather(*publishes)
    depth = await ready(channel, name)
    if depth != count:
        raise SystemExit(f"queue holds {depth} messages after publishing {count}")


async def ready(channel: aio_pika.abc.AbstractChannel, name: str) -> int:
    declared = await channel.declare_queue(name, passive=True)
    return int(declared.declaration_result.message_count or 0)


async def run_raw(url: str, name: str, count: int, prefetch: int) -> tuple[float, float]:
    """Seconds from connecting, and from the first delivery, to the last ACK (plain aio-pika consumer)."""
    done = asyncio.Event()
    acked = 0
    first = 0.0
    started = time.perf_counter()
    connection = await aio_pika.connect_robust(url)
    try:
        channel = await connection.channel(publisher_confirms=False)
        await channel.set_qos(prefetch_count=prefetch)
        declared = await channel.declare_queue(name, passive=True)

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            nonlocal acked, first
            if not first:
                first = time.perf_counter()
            await message.ack()
            acked += 1
            if acked == count:
                done.set()

        await declared.consume(on_message, no_ack=False)
        await asyncio.wait_for(done.wait(), timeout=120)
        ended = time.perf_counter()
    finally:
        await connection.close()
    return ended - started, ended - first


async def run_lily(url: str, name: str, count: int, concurrency: int, prefetch: int) -> tuple[float, float]:
    """Seconds from ``Consumer.start()``, and from the first delivery, to the last ACK (no-op handler)."""
    handled = 0
    first = 0.0

    @queue(name, version=1, content="json")
    async def handle(item: Json[Item]) -> None:
        nonlocal handled, first
        if not first:
            first = time.perf_counter()
        handled += 1

    consumer = Consumer(amqp_url=url, name="bench")
    consumer.configure_queue(
        name, concurrency=concurrency, prefetch=prefetch, retry=RetryPolicy(max_retries=0, delays=())
    )
    consumer.include(handle)
    started = time.perf_counter()
    managed = await consumer.start()
    try:
        deadline = started + 120
        while True:
            # The ACK is written before the outcome is counted: "acked" == count means the last ACK is out.
            if managed.snapshot().queues[0].outcomes.get("acked", 0) >= count:
                break
            if time.perf_counter() > deadline:
                raise SystemExit(f"lily consumer handled {handled} of {count} within 120 s")
            await asyncio.sleep(0.001)
        ended = time.perf_counter()
    finally:
        report = await managed.shutdown()
    if not report.succeeded or handled != count:
        raise SystemExit(f"lily run did not end cleanly (handled {handled}):\n{report.render()}")
    return ended - started, ended - first


async def bench(args: argparse.Namespace) -> int:
    url = os.environ.get("LILY_AMQP_URL", DEFAULT_URL)
    name = f"bench.throughput.{uuid.uuid4().hex[:8]}"
    options = QueueOptions(
        name=name, concurrency=args.concurrency, prefetch=args.prefetch, retry=RetryPolicy(max_retries=0, delays=())
    )
    prefetch = options.effective_prefetch
    connection = await aio_pika.connect(url)
    try:
        await declare_topology(connection, options)
        channel = await connection.channel(publisher_confirms=True)
        print(
            f"python {platform.python_version()} on {platform.machine()}; {args.messages} messages per run, "
            f"{args.runs} runs each (alternating); prefetch {prefetch}, lily concurrency {args.concurrency}"
        )
        rates: dict[str, list[float]] = {"raw": [], "lily": []}
        steady: dict[str, list[float]] = {"raw": [], "lily": []}
        for run in range(1, args.runs + 1):
            for kind in ("raw", "lily"):
                await fill(channel, name, args.messages)
                if kind == "raw":
                    seconds, flowing = await run_raw(url, name, args.messages, prefetch)
                else:
                    seconds, flowing = await run_lily(url, name, args.messages, args.concurrency, args.prefetch)
                left = await ready(channel, name)
                if left:
                    raise SystemExit(f"{left} messages left in the queue after a {kind} run")
                rates[kind].append(args.messages / seconds)
                steady[kind].append(args.messages / flowing)
                print(
                    f"run {run} {kind:<4}: {seconds:7.3f} s  {args.messages / seconds:9.0f} msgs/s incl. start-up; "
                    f"{flowing:7.3f} s  {args.messages / flowing:9.0f} msgs/s from the first delivery"
                )
        raw, lily = statistics.median(steady["raw"]), statistics.median(steady["lily"])
        raw_all, lily_all = statistics.median(rates["raw"]), statistics.median(rates["lily"])
        print(f"raw aio-pika consume+ack median: {raw:9.0f} msgs/s ({raw_all:.0f} incl. start-up)")
        print(f"lily_mongo at_least_once median: {lily:9.0f} msgs/s ({lily_all:.0f} incl. start-up)")
        print(f"ratio incl. start-up (connect, topology, consume): {lily_all / raw_all:.2f}")
        ratio = lily / raw
        verdict = "meets" if ratio >= TARGET_RATIO else "BELOW"
        print(f"ratio lily/raw from the first delivery: {ratio:.2f} ({verdict} the target of >= {TARGET_RATIO:g})")
    finally:
        cleanup = await connection.channel()
        for queue_name in topology_names(options):
            await cleanup.queue_delete(queue_name)
        await connection.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=5000, help="messages per run (default 5000)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs of each consumer (default 5)")
    parser.add_argument("--prefetch", type=int, default=64, help="prefetch for both consumers (default 64)")
    parser.add_argument("--concurrency", type=int, default=32, help="lily handler concurrency (default 32)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    return asyncio.run(bench(args))


if __name__ == "__main__":
    raise SystemExit(main())
