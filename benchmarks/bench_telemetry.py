"""Telemetry's CPU per delivery in the engine alone: no broker, no network, so the figure is steady.

Run: ``python benchmarks/bench_telemetry.py [--messages 2500] [--rounds 7] [--traceparent]``

An ``Engine`` fed through its in-process seam (``Engine.deliver``) runs an
at-least-once no-op ``Json[Item]`` handler over prepared messages whose ACK
does nothing, and the process CPU time per delivery is measured for:

* telemetry off (``telemetry=False``: the engine reports to the no-op observer, one empty
  method call per reporting point);
* the OpenTelemetry API with no SDK (no-op providers: lily's own hook work);
* the SDK's metrics with no tracing (two histogram records per delivery);
* the SDK with 10 % of traces sampled, and with every trace sampled (batch span
  processor and periodic metric reader whose exporters discard everything).

Variants alternate within each round; the medians are printed with their
difference from "off". ``bench_throughput.py --telemetry compare`` measures the
same through the broker, where the engine is a part of the cost per message.

Then the SDK's floor: the calls the conventions require per delivery made
straight on the SDK (same set-up, every trace sampled), with no lily code
around them: a CONSUMER span started with its attributes, current while the
handler would run, given its outcome attributes and ended; the two duration
histograms recorded with their attributes in that span's context. No consumer
can emit the same telemetry through this SDK for less.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pydantic
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.trace import NoOpTracerProvider

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.trace import SpanKind

from benchmarks.bench_throughput import sdk_providers, sdk_telemetry
from lily_mongo import Consumer, Json, RetryPolicy, queue
from lily_mongo._engine.engine import Engine
from lily_mongo._observer import NO_OBSERVER
from lily_mongo._tasks import TaskSet
from lily_mongo.publisher import JSON, prepare_publication
from lily_mongo.telemetry import DURATION_BUCKETS, Telemetry

QUEUE = "bench.telemetry"


class Item(pydantic.BaseModel):
    id: int
    sku: str
    qty: int


class _Channel:
    is_closed = False


class Message:
    """A received delivery whose settlement does nothing (the engine's ``InboundMessage``)."""

    content_type = "application/json"
    redelivered = False
    routing_key = QUEUE
    exchange = ""
    message_id = None
    malformed = None
    channel = _Channel()

    def __init__(self, headers: dict[str, Any], body: bytes) -> None:
        self.headers = headers
        self.body = body

    async def ack(self) -> None:
        pass

    async def nack(self, *, requeue: bool = True) -> None:
        pass

    async def reject(self, *, requeue: bool = False) -> None:
        pass


@queue(QUEUE, version=1, content="json", guarantee="at_least_once")
async def handle(item: Json[Item]) -> None:
    pass


def messages(count: int, *, traced: bool = False) -> list[Message]:
    """``traced``: each carries a sampled ``traceparent`` of its own, as from a traced producer."""
    out = []
    for i in range(count):
        traceparent = f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01" if traced else None
        payload = {"id": i, "sku": f"SKU-{i % 97}", "qty": 1}
        publication = prepare_publication(JSON, QUEUE, payload, version=1, traceparent=traceparent)
        out.append(Message(dict(publication.headers), publication.body))
    return out


async def no_handoff(_message: Any, _routing_key: str, _headers: Mapping[str, Any]) -> None:
    """No delivery of this benchmark is handed off (every handler succeeds)."""


async def cpu_per_delivery(telemetry: Telemetry | None, batch: list[Message]) -> float:
    consumer = Consumer(amqp_url="amqp://unused/", name="bench", telemetry=False)
    consumer.configure_queue(QUEUE, concurrency=1, prefetch=1, retry=RetryPolicy(max_retries=0, delays=()))
    consumer.include(handle)
    runtime = Engine(consumer.plan(), TaskSet(), inbox=None, handoff=no_handoff, observer=telemetry or NO_OBSERVER)
    runtime.open()
    for message in batch[:200]:  # warm-up
        await runtime.deliver(QUEUE, message)
    started = time.process_time()
    for message in batch[200:]:
        await runtime.deliver(QUEUE, message)
    return (time.process_time() - started) / (len(batch) - 200) * 1e6


class Floor:
    """The SDK calls of one delivery's telemetry, made directly (every trace sampled)."""

    def __init__(self) -> None:
        tracer_provider, meter_provider = sdk_providers(1.0)
        self.tracer = tracer_provider.get_tracer("floor")
        meter = meter_provider.get_meter("floor")
        self.process = meter.create_histogram(
            "floor.process.duration", unit="s", explicit_bucket_boundaries_advisory=DURATION_BUCKETS
        )
        self.handler = meter.create_histogram(
            "floor.handler.duration", unit="s", explicit_bucket_boundaries_advisory=DURATION_BUCKETS
        )
        base = {"messaging.system": "rabbitmq", "messaging.destination.name": QUEUE}
        self.start = {**base, "messaging.operation.type": "process", "messaging.operation.name": "process"}
        self.process_attributes = {**base, "messaging.operation.name": "process", "lily.outcome": "acked"}
        self.handler_attributes = base
        self.empty = otel_context.Context()

    def span(self, event_id: str) -> Any:
        span = self.tracer.start_span(f"process {QUEUE}", self.empty, SpanKind.CONSUMER, self.start)
        context = otel_trace.set_span_in_context(span, self.empty)
        token = otel_context.attach(context)
        span.set_attributes({"lily.outcome": "acked", "lily.handler.id": "handle", "messaging.message.id": event_id})
        span.end()
        otel_context.detach(token)
        return context

    def histograms(self, context: Any) -> None:
        self.process.record(0.0004, self.process_attributes, context)
        self.handler.record(0.0002, self.handler_attributes, context)

    def cpu_per_delivery(self, part: str, batch: list[Message]) -> float:
        ids = [str(message.headers["x-lily-event-id"]) for message in batch]
        context = self.span(ids[0])
        started = time.process_time()
        for event_id in ids:
            if part == "span":
                self.span(event_id)
            elif part == "histograms":
                self.histograms(context)
            else:
                self.histograms(self.span(event_id))
        return (time.process_time() - started) / len(ids) * 1e6


async def bench(args: argparse.Namespace) -> int:
    variants: dict[str, Telemetry | None] = {
        "off": None,
        "API, no SDK (no-op providers)": Telemetry(
            tracer_provider=NoOpTracerProvider(), meter_provider=NoOpMeterProvider()
        ),
        "SDK metrics, no tracing": Telemetry(
            tracer_provider=NoOpTracerProvider(), meter_provider=MeterProvider(metric_readers=[InMemoryMetricReader()])
        ),
        "SDK, 10 % of traces sampled": sdk_telemetry(0.1),
        "SDK, every trace sampled": sdk_telemetry(1.0),
    }
    floor = Floor()
    floors = {
        "span: start, current, end": "span",
        "two histogram records": "histograms",
        "both (the floor per delivery)": "both",
    }
    batch = messages(args.messages + 200, traced=args.traceparent)
    results: dict[str, list[float]] = {name: [] for name in [*variants, *floors]}
    for _ in range(args.rounds):
        for name, telemetry in variants.items():
            results[name].append(await cpu_per_delivery(telemetry, batch))
        for name, part in floors.items():
            results[name].append(floor.cpu_per_delivery(part, batch[200:]))
    base = statistics.median(results["off"])
    traced = ", each with a traceparent" if args.traceparent else ""
    print(
        f"engine CPU per delivery, {args.messages} deliveries{traced} x {args.rounds} rounds (medians; min in brackets)"
    )
    for name in variants:
        median = statistics.median(results[name])
        print(f"  {name:<32} {median:6.1f} us (+{median - base:5.1f})  [{min(results[name]):.1f}]")
    print("the SDK's own calls per delivery, no lily code (every trace sampled)")
    for name in floors:
        median = statistics.median(results[name])
        print(f"  {name:<32} {median:6.1f} us           [{min(results[name]):.1f}]")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=2500, help="deliveries per measurement (default 2500)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of every variant (default 7)")
    parser.add_argument(
        "--traceparent",
        action="store_true",
        help="deliveries carry a sampled traceparent (a traced producer; the sampler then follows it)",
    )
    return asyncio.run(bench(parser.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
