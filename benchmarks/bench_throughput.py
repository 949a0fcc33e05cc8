"""Consume throughput: a lily_mongo at_least_once Consumer against raw aio-pika, same broker, same prefetch.

Run: ``python benchmarks/bench_throughput.py [--messages 5000] [--runs 7] [--prefetch 64] [--concurrency 32]
[--telemetry off|on|compare]`` (``LILY_AMQP_URL`` selects the broker; default the local RabbitMQ as guest).

``--telemetry`` chooses the lily consumer's telemetry: ``off`` (the default,
``telemetry=False``), ``on`` (the OpenTelemetry SDK with a batch span processor
and a periodic metric reader whose exporters discard everything: the cost of
producing the telemetry, not of shipping it), or ``compare``: each round runs
lily with telemetry off and on instead of raw and lily, and the ratio printed is
the on/off throughput ratio.

Before every timed run the queue is filled with ``--messages`` small JSON
messages published with confirms (transient, canonical Lily headers), so only
consumption is timed:

* raw: aio-pika robust connection, ``basic.qos(prefetch)``, a consumer callback
  that ACKs each message;
* lily: ``Consumer(...).start()`` with a no-op handler taking ``Json[Item]``
  (envelope validation, dispatch, orjson + pydantic decode, settlement,
  observation), the queue's effective prefetch equal to the raw one.

Each round runs both consumers back to back, in alternating order (raw first
in odd rounds, lily first in even ones). A run is timed from the start
(connecting; for lily also declaring the plan's consumers) and from the first
delivery, until the last ACK: the raw callback counts its ACKs; lily's
handler signals the last message and the run ends when the consumer's
snapshot counts that many ACKed outcomes (the ACK is written before the
outcome is counted). The process CPU time per message is measured for both.

The script prints every run, the medians, and the throughput ratio lily/raw
from the first delivery as the median of the per-round ratios (target >= 0.8):
pairing runs that ran seconds apart cancels most of the drift of a shared,
noisy machine. The CPU-per-message ratio is printed as a steadier second view.
It deletes its queues at the end.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aio_pika
import aio_pika.abc
import pydantic

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lily_mongo import Consumer, Json, QueueOptions, RetryPolicy, queue
from lily_mongo._topology import declare_topology, topology_names
from lily_mongo.publisher import JSON, prepare_publication
from lily_mongo.telemetry import Telemetry

TARGET_RATIO = 0.8
TELEMETRY_TARGET = 0.85  # telemetry on may cost at most 15 % of the throughput with it off
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


def sdk_telemetry(sample: float = 1.0) -> Telemetry:
    """The OpenTelemetry SDK as a service would set it up, with exporters that discard everything;
    ``sample`` < 1 samples that share of new traces (``ParentBased(TraceIdRatioBased(sample))``)."""
    tracer_provider, meter_provider = sdk_providers(sample)
    return Telemetry(tracer_provider=tracer_provider, meter_provider=meter_provider)


def sdk_providers(sample: float = 1.0) -> tuple[Any, Any]:
    """The SDK's tracer and meter providers of :func:`sdk_telemetry`."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        MetricExporter,
        MetricExportResult,
        MetricsData,
        PeriodicExportingMetricReader,
    )
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    class Spans(SpanExporter):
        def export(self, spans: object) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    class Metrics(MetricExporter):
        def export(
            self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: object
        ) -> MetricExportResult:
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
            pass

    tracer_provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(sample)))
    tracer_provider.add_span_processor(BatchSpanProcessor(Spans()))
    meter_provider = MeterProvider(metric_readers=[PeriodicExportingMetricReader(Metrics(), 10_000)])
    return tracer_provider, meter_provider


@dataclass
class Run:
    """One timed run: seconds from start and from the first delivery to the last ACK, CPU seconds."""

    total: float
    flowing: float
    cpu: float


async def run_raw(url: str, name: str, count: int, prefetch: int) -> Run:
    """A plain aio-pika consumer that ACKs every message."""
    done = asyncio.Event()
    acked = 0
    first = 0.0
    cpu = time.process_time()
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
        cpu = time.process_time() - cpu
    finally:
        await connection.close()
    return Run(ended - started, ended - first, cpu)


async def run_lily(
    url: str, name: str, count: int, concurrency: int, prefetch: int, telemetry: Telemetry | bool = False
) -> Run:
    """A lily_mongo at_least_once consumer with a no-op ``Json[Item]`` handler."""
    handled = 0
    first = 0.0
    last = asyncio.Event()

    @queue(name, version=1, content="json")
    async def handle(item: Json[Item]) -> None:
        nonlocal handled, first
        if not first:
            first = time.perf_counter()
        handled += 1
        if handled == count:
            last.set()

    consumer = Consumer(amqp_url=url, name="bench", telemetry=telemetry)
    consumer.configure_queue(
        name, concurrency=concurrency, prefetch=prefetch, retry=RetryPolicy(max_retries=0, delays=())
    )
    consumer.include(handle)
    cpu = time.process_time()
    started = time.perf_counter()
    managed = await consumer.start()
    try:
        try:
            await asyncio.wait_for(last.wait(), timeout=120)
        except TimeoutError:
            raise SystemExit(f"lily consumer handled {handled} of {count} within 120 s") from None
        # The last handler returned; its ACK follows within a few turns of the event loop.
        deadline = time.perf_counter() + 10
        while managed.snapshot().queues[0].outcomes.get("acked", 0) < count:
            if time.perf_counter() > deadline:
                raise SystemExit(f"lily consumer ACKed {managed.snapshot().queues[0].outcomes} of {count}")
            await asyncio.sleep(0)
        ended = time.perf_counter()
        cpu = time.process_time() - cpu
    finally:
        report = await managed.shutdown()
    if not report.succeeded or handled != count:
        raise SystemExit(f"lily run did not end cleanly (handled {handled}):\n{report.render()}")
    return Run(ended - started, ended - first, cpu)


async def bench(args: argparse.Namespace) -> int:
    url = os.environ.get("LILY_AMQP_URL", DEFAULT_URL)
    name = f"bench.throughput.{uuid.uuid4().hex[:8]}"
    options = QueueOptions(
        name=name, concurrency=args.concurrency, prefetch=args.prefetch, retry=RetryPolicy(max_retries=0, delays=())
    )
    prefetch = options.effective_prefetch
    telemetry = sdk_telemetry(args.sample) if args.telemetry in ("on", "compare") else None
    # The two contenders of a round: raw against lily, or (compare) lily off against lily on.
    kinds = ("off", "on") if args.telemetry == "compare" else ("raw", "lily")
    connection = await aio_pika.connect(url)
    try:
        await declare_topology(connection, options)
        channel = await connection.channel(publisher_confirms=True)
        print(
            f"python {platform.python_version()} on {platform.machine()}; {args.messages} messages per run, "
            f"{args.runs} rounds (order alternating); prefetch {prefetch}, lily concurrency {args.concurrency}; "
            f"telemetry {args.telemetry}{f' (sampling {args.sample:g})' if args.telemetry != 'off' else ''}"
        )
        first, second = kinds
        runs: dict[str, list[Run]] = {first: [], second: []}
        ratios: list[float] = []
        for round_ in range(1, args.runs + 1):
            for kind in (first, second) if round_ % 2 else (second, first):
                await fill(channel, name, args.messages)
                if kind == "raw":
                    run = await run_raw(url, name, args.messages, prefetch)
                else:
                    on = kind == "on" or (kind == "lily" and args.telemetry == "on")
                    chosen: Telemetry | bool = telemetry if on and telemetry is not None else False
                    run = await run_lily(url, name, args.messages, args.concurrency, args.prefetch, chosen)
                left = await ready(channel, name)
                if left:
                    raise SystemExit(f"{left} messages left in the queue after a {kind} run")
                runs[kind].append(run)
                print(
                    f"round {round_} {kind:<4}: {args.messages / run.total:7.0f} msgs/s incl. start-up; "
                    f"{args.messages / run.flowing:7.0f} msgs/s from the first delivery; "
                    f"CPU {run.cpu / args.messages * 1e6:6.1f} us/msg"
                )
            ratios.append(runs[first][-1].flowing / runs[second][-1].flowing)
        labels = {
            "raw": "raw aio-pika consume+ack",
            "lily": f"lily_mongo at_least_once (telemetry {args.telemetry})",
            "off": "lily_mongo at_least_once, telemetry off",
            "on": "lily_mongo at_least_once, telemetry on (SDK)",
        }
        for kind in kinds:
            label = labels[kind]
            flowing = statistics.median(args.messages / r.flowing for r in runs[kind])
            total = statistics.median(args.messages / r.total for r in runs[kind])
            cpu = statistics.median(r.cpu / args.messages * 1e6 for r in runs[kind])
            print(f"{label}: median {flowing:7.0f} msgs/s ({total:.0f} incl. start-up), CPU {cpu:.1f} us/msg")
        cpu_ratio = statistics.median(r.cpu for r in runs[first]) / statistics.median(r.cpu for r in runs[second])
        print(f"CPU per message, {first}/{second}: {cpu_ratio:.2f}")
        print(f"per-round ratios {second}/{first}: {' '.join(f'{r:.2f}' for r in ratios)}")
        ratio = statistics.median(ratios)
        target = TELEMETRY_TARGET if args.telemetry == "compare" else TARGET_RATIO
        verdict = "meets" if ratio >= target else "BELOW"
        print(
            f"throughput ratio {second}/{first} from the first delivery, median of rounds: {ratio:.2f} "
            f"({verdict} the target of >= {target:g})"
        )
    finally:
        cleanup = await connection.channel()
        for queue_name in topology_names(options):
            await cleanup.queue_delete(queue_name)
        await connection.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=5000, help="messages per run (default 5000)")
    parser.add_argument("--runs", type=int, default=7, help="rounds of one run of each consumer (default 7)")
    parser.add_argument("--prefetch", type=int, default=64, help="prefetch for both consumers (default 64)")
    parser.add_argument("--concurrency", type=int, default=32, help="lily handler concurrency (default 32)")
    parser.add_argument(
        "--telemetry",
        choices=("off", "on", "compare"),
        default="off",
        help="lily's telemetry: off, on (SDK, discarding exporters), or compare off against on (default off)",
    )
    parser.add_argument(
        "--sample", type=float, default=1.0, help="with telemetry on: the share of traces sampled (default 1: all)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    return asyncio.run(bench(args))


if __name__ == "__main__":
    raise SystemExit(main())
