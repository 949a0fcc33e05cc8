"""Traces and metrics against the real broker and the MongoDB-wire server (docs/observability.md).

Every consumer here reports to the OpenTelemetry SDK's in-memory span exporter
and metric reader through ``Telemetry(tracer_provider=..., meter_provider=...)``:
the SDK's global providers can be set once per process, so the providers are
made once for the module and passed explicitly. Queue names are unique per
test, so metric points are read by queue.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aio_pika
import aio_pika.abc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from pymongo.errors import OperationFailure

from lily_mongo import (
    Consumer,
    EventId,
    InboxOptions,
    Json,
    MongoScope,
    Outbox,
    OutboxOptions,
    OutboxTransaction,
    Publisher,
    QueueHandlerError,
    Relay,
    RetryPolicy,
    queue,
)
from lily_mongo.publisher import JSON, prepare_publication
from lily_mongo.telemetry import Telemetry
from lily_mongo.testing import Faults
from tests.support.broker import Broker, headers_of
from tests.support.consumers import running, wait_observations
from tests.support.handlers import accepting
from tests.support.mongo import MongoDB
from tests.support.polling import eventually

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
ONE_AT_A_TIME = {"concurrency": 1, "prefetch": 2}
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@dataclass
class Sdk:
    spans: InMemorySpanExporter
    metrics: InMemoryMetricReader
    tracer_provider: TracerProvider
    meter_provider: MeterProvider


@contextlib.contextmanager
def in_memory_sdk() -> Iterator[Sdk]:
    """Providers of their own reporting to the SDK's in-memory exporter and reader, shut down at the end."""
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    metrics = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[metrics])
    try:
        yield Sdk(spans, metrics, tracer_provider, meter_provider)
    finally:
        tracer_provider.shutdown()
        meter_provider.shutdown()


@pytest.fixture(scope="module")
def sdk() -> Iterator[Sdk]:
    with in_memory_sdk() as made:
        yield made


@pytest.fixture
def telemetry(sdk: Sdk) -> Telemetry:
    sdk.spans.clear()
    return Telemetry(tracer_provider=sdk.tracer_provider, meter_provider=sdk.meter_provider)


def consumer_for(broker: Broker, q: str, handler: Any, *, telemetry: Telemetry | bool, **options: Any) -> Consumer:
    """A consumer of ``q`` reporting to ``telemetry`` (two permits, no retries unless ``options`` say)."""
    defaults: dict[str, Any] = {
        "name": "telemetry-test",
        "concurrency": 2,
        "prefetch": 4,
        "retry": RetryPolicy(max_retries=0, delays=()),
    }
    return broker.consumer(q, handler, telemetry=telemetry, graceful_timeout=10.0, **(defaults | options))


async def publish(broker: Broker, q: str, payload: Any, **options: Any) -> uuid.UUID:
    """Publish from a publisher without telemetry: the only spans are the consumer's."""
    async with Publisher(broker.url, telemetry=False) as publisher:
        return await publisher.publish_json(q, payload, version=1, **options)


def spans_of(sdk: Sdk, kind: SpanKind | None = None, name: str | None = None) -> list[ReadableSpan]:
    return [
        s
        for s in sdk.spans.get_finished_spans()
        if (kind is None or s.kind is kind) and (name is None or s.name == name)
    ]


def one(found: list[ReadableSpan]) -> ReadableSpan:
    assert len(found) == 1, [s.name for s in found]
    return found[0]


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def hex_traceparent(span: ReadableSpan) -> str:
    context = span.get_span_context()
    assert context is not None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-01"


def metric_points(sdk: Sdk, name: str, q: str) -> list[tuple[dict[str, Any], Any]]:
    """The data points of metric ``name`` whose ``messaging.destination.name`` is ``q``."""
    data = sdk.metrics.get_metrics_data()
    assert data is not None
    found = []
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name != name:
                    continue
                for point in metric.data.data_points:
                    attributes = dict(point.attributes or {})
                    if attributes.get("messaging.destination.name") == q:
                        found.append((attributes, point))
    return found


# -- the delivery span ------------------------------------------------------------------------------


async def test_a_delivery_span_continues_the_published_trace(broker: Broker, sdk: Sdk, telemetry: Telemetry) -> None:
    q = broker.queue("traced")
    seen: list[trace.SpanContext] = []

    @queue(q, version=1, content="json", guarantee="at_least_once", handler_id=f"{q}/h")
    async def handle(payload: Json[dict[str, Any]]) -> None:
        seen.append(trace.get_current_span().get_span_context())

    async with running(consumer_for(broker, q, handle, telemetry=telemetry)) as managed:
        event = await publish(broker, q, {"n": 1}, traceparent=TRACEPARENT, tracestate="lily=test")
        await wait_observations(managed, 1)

    span = one(spans_of(sdk, SpanKind.CONSUMER))
    assert span.name == f"process {q}"
    assert span.context.trace_id == int(TRACE_ID, 16)
    assert span.parent is not None
    assert span.parent.is_remote
    assert parent_id(span) == int(PARENT_ID, 16)
    assert span.context.trace_state.get("lily") == "test"
    attributes = dict(span.attributes or {})
    assert attributes["messaging.system"] == "rabbitmq"
    assert attributes["messaging.destination.name"] == q
    assert attributes["messaging.operation.type"] == "process"
    assert attributes["messaging.message.id"] == str(event)
    assert attributes["lily.handler.id"] == f"{q}/h"
    assert attributes["lily.outcome"] == "acked"
    assert "lily.failure.code" not in attributes
    assert span.status.status_code is StatusCode.UNSET
    # The handler ran inside the delivery span: its own spans nest under it.
    assert [(c.trace_id, c.span_id) for c in seen] == [(span.context.trace_id, span.context.span_id)]
    # No attribute carries the payload.
    assert not any('"n"' in str(value) for value in attributes.values())


async def test_absent_or_malformed_trace_context_starts_a_new_trace(
    broker: Broker, sdk: Sdk, telemetry: Telemetry
) -> None:
    q = broker.queue("fresh")

    async with running(consumer_for(broker, q, accepting(q), telemetry=telemetry)) as managed:
        await publish(broker, q, {"n": 1})
        publication = prepare_publication(JSON, q, {"n": 2}, version=1)
        malformed = {**publication.headers, "traceparent": f"00-{TRACE_ID.upper()}-{PARENT_ID}-01"}
        await broker.channel.default_exchange.publish(aio_pika.Message(publication.body, headers=malformed), q)
        observed = await wait_observations(managed, 2)
    assert [o.outcome for o in observed] == ["acked", "acked"]
    spans = spans_of(sdk, SpanKind.CONSUMER)
    assert len(spans) == 2
    assert all(s.parent is None for s in spans)
    assert len({s.context.trace_id for s in spans}) == 2
    assert int(TRACE_ID, 16) not in {s.context.trace_id for s in spans}


async def test_a_publisher_span_is_the_parent_of_the_delivery_span(
    broker: Broker, sdk: Sdk, telemetry: Telemetry
) -> None:
    q = broker.queue("pub")

    async with running(consumer_for(broker, q, accepting(q), telemetry=telemetry)) as managed:
        async with Publisher(broker.url, telemetry=telemetry) as publisher:
            event = await publisher.publish_json(q, {"n": 1}, version=1)
        await wait_observations(managed, 1)
    producer = one(spans_of(sdk, SpanKind.PRODUCER))
    consumer = one(spans_of(sdk, SpanKind.CONSUMER))
    assert producer.name == f"publish {q}"
    assert dict(producer.attributes or {})["messaging.operation.type"] == "send"
    assert dict(producer.attributes or {})["messaging.message.id"] == str(event)
    assert consumer.context.trace_id == producer.context.trace_id
    assert parent_id(consumer) == producer.context.span_id


async def test_a_dead_lettered_delivery_span_has_error_status_and_the_code(
    broker: Broker, sdk: Sdk, telemetry: Telemetry
) -> None:
    q = broker.queue("dead")

    @queue(q, version=1, content="json", guarantee="at_least_once")
    async def handle(payload: Json[dict[str, Any]]) -> None:
        raise QueueHandlerError.permanent("ORDER_INVALID", "no lines")

    async with running(consumer_for(broker, q, handle, telemetry=telemetry)) as managed:
        await publish(broker, q, {"n": 1}, traceparent=TRACEPARENT)
        observed = await wait_observations(managed, 1)
    assert observed[0].outcome == "dead_lettered"
    span = one(spans_of(sdk, SpanKind.CONSUMER))
    attributes = dict(span.attributes or {})
    assert attributes["lily.outcome"] == "dead_lettered"
    assert attributes["lily.failure.code"] == "ORDER_INVALID"
    assert attributes["error.type"] == "ORDER_INVALID"
    assert span.status.status_code is StatusCode.ERROR
    # The DLQ copy is published in a PRODUCER span under the delivery span, and carries it.
    handoff = one(spans_of(sdk, SpanKind.PRODUCER))
    assert handoff.name == f"publish {q}.dlq"
    assert parent_id(handoff) == span.context.span_id
    assert dict(handoff.attributes or {})["lily.handoff"] == "dlq"
    assert await broker.wait_for_depth(f"{q}.dlq", 1) == 1
    (copy,) = await broker.drain(f"{q}.dlq")
    assert copy.headers["traceparent"] == hex_traceparent(handoff)
    assert copy.headers["x-lily-failure-code"] == "ORDER_INVALID"


async def test_telemetry_false_emits_no_span(broker: Broker, sdk: Sdk, telemetry: Telemetry) -> None:
    q = broker.queue("off")

    async with running(consumer_for(broker, q, accepting(q), telemetry=False)) as managed:
        assert managed.telemetry is None
        await publish(broker, q, {"n": 1}, traceparent=TRACEPARENT)
        await wait_observations(managed, 1)
    assert spans_of(sdk) == []


# -- the inbox and the outbox -----------------------------------------------------------------------


@pytest.mark.parametrize("claim_in_transaction", [True, False], ids=["in-transaction", "lease-first"])
async def test_an_outbox_event_arrives_in_the_trace_of_the_delivery_that_wrote_it(
    claim_in_transaction: bool, broker: Broker, mongodb: MongoDB, sdk: Sdk, telemetry: Telemetry
) -> None:
    q, down = broker.queue("src"), await broker.declare(broker.queue("down"))

    @queue(q, version=1, content="json", handler_id=f"{q}/inbox")
    async def handle(order: Json[dict[str, Any]], event_id: EventId, mongo: MongoScope) -> None:
        await mongo.database["effects"].insert_one({"_id": str(event_id)}, session=mongo.session)
        await mongo.outbox.publish_json(down, {"order": order["n"]}, version=1)

    inbox = InboxOptions(claim_in_transaction=claim_in_transaction)
    consumer = consumer_for(
        broker,
        q,
        handle,
        telemetry=telemetry,
        name="telemetry-outbox",
        mongodb=mongodb,
        inbox=inbox,
        outbox=OutboxOptions(poll_interval=0.1),
        **ONE_AT_A_TIME,
    )
    async with running(consumer) as managed:
        await publish(broker, q, {"n": 7}, traceparent=TRACEPARENT)
        await eventually(lambda: managed.snapshot().outbox_published == 1, what="the outbox record dispatched")
        assert await broker.wait_for_depth(down, 1) == 1
    (event,) = await broker.drain(down)

    delivery = one(spans_of(sdk, SpanKind.CONSUMER))
    # A first-time copy claims inside its attempt's transaction: no claim span of its own.
    claims = [one(spans_of(sdk, name="inbox claim"))] if not claim_in_transaction else []
    assert len(spans_of(sdk, name="inbox claim")) == len(claims)
    attempt = one(spans_of(sdk, name="inbox attempt"))
    commit = one(spans_of(sdk, name="inbox commit"))
    # Published by the consumer's dispatcher right after the commit (no relay publish).
    producers = [dict(s.attributes or {})["lily.publish"] for s in spans_of(sdk, SpanKind.PRODUCER)]
    assert "relay" not in producers
    relay = one([s for s in spans_of(sdk, SpanKind.PRODUCER) if dict(s.attributes or {})["lily.publish"] == "dispatch"])
    trace_id = int(TRACE_ID, 16)
    assert {s.context.trace_id for s in (delivery, *claims, attempt, commit, relay)} == {trace_id}
    for claim in claims:
        assert parent_id(claim) == delivery.context.span_id
        assert dict(claim.attributes or {})["lily.inbox.claim"] == "leased"
    assert parent_id(attempt) == delivery.context.span_id
    assert parent_id(commit) == attempt.context.span_id
    assert parent_id(relay) == attempt.context.span_id  # the context the outbox record stored
    assert dict(attempt.attributes or {})["lily.inbox.claim_in_transaction"] == int(claim_in_transaction)
    assert dict(attempt.attributes or {})["lily.inbox.attempt"] == 1
    assert dict(attempt.attributes or {})["lily.inbox.verdict"] == "success"
    assert dict(delivery.attributes or {})["lily.outcome"] == "acked"
    assert dict(delivery.attributes or {})["lily.handler.id"] == f"{q}/inbox"
    # The event carries a traceparent of the same trace: the relay span's own.
    assert event.headers["traceparent"] == hex_traceparent(relay)
    assert headers_of(event)["traceparent"].split("-")[1] == TRACE_ID
    record = await mongodb.db["lily_outbox"].find_one({})
    assert record is not None
    assert record["headers"]["traceparent"] == hex_traceparent(attempt)


async def test_an_event_written_outside_a_handler_and_relayed_stays_in_the_writers_trace(
    broker: Broker, mongodb: MongoDB, sdk: Sdk, telemetry: Telemetry
) -> None:
    # Outbox.transaction inside a request's span, no dispatcher: the backstop relay publishes the
    # record later, as a child of the context the record stored, and records its lag on the relay path.
    down = await broker.declare(broker.queue("down"))
    outbox = Outbox(mongodb.client, mongodb.name, telemetry=telemetry)

    async def write(tx: OutboxTransaction) -> None:
        await tx.publish_json(down, {"n": 1}, version=1)

    tracer = sdk.tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("POST /orders"):
        await outbox.transaction(write)
    relay = Relay(
        mongodb.client, mongodb.name, amqp_url=broker.url, options=OutboxOptions(poll_interval=0.1), telemetry=telemetry
    )
    async with relay:
        assert await broker.wait_for_depth(down, 1) == 1
    (event,) = await broker.drain(down)
    request = one(spans_of(sdk, name="POST /orders"))
    publish = one(spans_of(sdk, SpanKind.PRODUCER))
    assert dict(publish.attributes or {})["lily.publish"] == "relay"
    assert parent_id(publish) == request.context.span_id
    assert publish.context.trace_id == request.context.trace_id
    # The same trace and span ids (the flags are the request span's own: a root span may set more than "sampled").
    assert headers_of(event)["traceparent"][:52] == hex_traceparent(publish)[:52]
    [series] = [h for h in telemetry.histograms() if h.name == "lily_outbox_relay_lag_seconds"]
    assert [dict(d.labels) for d in series.data() if d.count] == [{"path": "relay"}]


async def test_an_inbox_replay_is_one_attempt_span_each_with_the_counts(
    broker: Broker, mongodb: MongoDB, sdk: Sdk, telemetry: Telemetry
) -> None:
    q = broker.queue("replay")
    calls: list[int] = []

    @queue(q, version=1, content="json")
    async def handle(order: Json[dict[str, Any]], event_id: EventId, mongo: MongoScope) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise OperationFailure("transient", code=112, details={"errorLabels": ["TransientTransactionError"]})
        await mongo.database["effects"].insert_one({"_id": str(event_id)}, session=mongo.session)

    consumer = consumer_for(
        broker, q, handle, telemetry=telemetry, name="telemetry-replay", mongodb=mongodb, **ONE_AT_A_TIME
    )
    async with running(consumer) as managed:
        await publish(broker, q, {"n": 1})
        observed = await wait_observations(managed, 1)
    assert observed[0].outcome == "acked"
    assert observed[0].transient_replays == 1
    attempts = sorted(spans_of(sdk, name="inbox attempt"), key=lambda s: s.start_time or 0)
    assert [dict(s.attributes or {})["lily.inbox.attempt"] for s in attempts] == [1, 2]
    assert [dict(s.attributes or {})["lily.inbox.replays"] for s in attempts] == [0, 1]
    assert attempts[0].status.status_code is StatusCode.ERROR
    assert dict(attempts[0].attributes or {})["error.type"] == "transient_replay"
    delivery = one(spans_of(sdk, SpanKind.CONSUMER))
    assert dict(delivery.attributes or {})["lily.inbox.transient_replays"] == 1
    assert dict(delivery.attributes or {})["lily.attempts"] == 2


# -- metrics ------------------------------------------------------------------------------------------


async def test_metrics_count_each_outcome_by_queue(broker: Broker, sdk: Sdk, telemetry: Telemetry) -> None:
    q = broker.queue("counted")

    @queue(q, version=1, content="json", guarantee="at_least_once")
    async def handle(payload: Json[dict[str, Any]]) -> None:
        if payload["do"] == "bad":
            raise QueueHandlerError.permanent("ORDER_INVALID", "no lines")
        if payload["do"] == "retry":
            raise QueueHandlerError.retryable("PAYMENT_DOWN", "gateway 503")

    consumer = consumer_for(broker, q, handle, telemetry=telemetry, retry=RetryPolicy(max_retries=1, delays=(60,)))
    async with running(consumer) as managed:
        events = [await publish(broker, q, {"do": do}) for do in ("ok", "ok", "bad", "retry")]
        await broker.channel.default_exchange.publish(aio_pika.Message(b"{}", headers={}), q)  # poison
        await wait_observations(managed, 5)
        outcomes = {attrs["lily.outcome"]: point.value for attrs, point in metric_points(sdk, "lily.deliveries", q)}
        consumed = metric_points(sdk, "messaging.client.consumed.messages", q)
        in_flight = metric_points(sdk, "lily.deliveries.in_flight", q)
        permits = metric_points(sdk, "lily.permits", q)
    assert outcomes == {"acked": 2, "dead_lettered": 2, "retried": 1}
    assert [point.value for _, point in consumed] == [5]
    assert [point.value for _, point in in_flight] == [0]
    assert [point.value for _, point in permits] == [2]
    durations = {
        attrs["lily.outcome"]: point.count for attrs, point in metric_points(sdk, "messaging.process.duration", q)
    }
    assert durations == {"acked": 2, "dead_lettered": 2, "retried": 1}
    (handler,) = metric_points(sdk, "lily.handler.duration", q)
    assert handler[1].count == 4  # the poison message never reached a handler
    assert handler[1].sum > 0
    # Bounded cardinality: queue and outcome labels only, never an event id.
    for name in ("lily.deliveries", "messaging.process.duration", "lily.handler.duration"):
        for attributes, _ in metric_points(sdk, name, q):
            assert set(attributes) <= {
                "messaging.system",
                "messaging.operation.name",
                "messaging.destination.name",
                "lily.outcome",
            }
            assert not {str(e) for e in events} & {str(v) for v in attributes.values()}
    # After shutdown the consumer is no longer observed.
    assert metric_points(sdk, "lily.deliveries", q) == []


async def test_a_commit_reconciliation_is_a_span_under_the_commit(
    broker: Broker, mongodb: MongoDB, sdk: Sdk, telemetry: Telemetry, failpoints: Faults
) -> None:
    q = broker.queue("reconcile")

    @queue(q, version=1, content="json")
    async def handle(order: Json[dict[str, Any]], event_id: EventId, mongo: MongoScope) -> None:
        await mongo.database["effects"].insert_one({"_id": str(event_id)}, session=mongo.session)

    consumer = consumer_for(
        broker, q, handle, telemetry=telemetry, name="telemetry-rec", mongodb=mongodb, **ONE_AT_A_TIME
    )
    async with running(consumer) as managed:
        await failpoints.fail(["commitTransaction"], code=50, labels=["UnknownTransactionCommitResult"])
        await publish(broker, q, {"n": 1})
        observed = await wait_observations(managed, 1)
    assert observed[0].outcome == "acked"
    commit = one(spans_of(sdk, name="inbox commit"))
    reconcile = one(spans_of(sdk, name="inbox reconcile"))
    assert parent_id(reconcile) == commit.context.span_id
    assert dict(reconcile.attributes or {})["lily.inbox.verdict"] == "success"
    delivery = one(spans_of(sdk, SpanKind.CONSUMER))
    assert dict(delivery.attributes or {})["lily.inbox.reconciliations"] == 1
