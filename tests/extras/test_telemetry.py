"""Telemetry through the optional extras, without servers: spans and metrics on the OpenTelemetry SDK
(trace context in and out of header tables, option resolution, the in-process histograms), and the
``http`` extra's Prometheus exposition and probes."""

from __future__ import annotations

import asyncio
import datetime
import uuid
from collections.abc import Iterator
from types import MappingProxyType, SimpleNamespace
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lily_mongo import ConfigError, PublishError
from lily_mongo._cli.probes import ProbeServer
from lily_mongo._snapshots import QueueSnapshot, Snapshot
from lily_mongo._verdicts import Execution, Outcome, PipelineResult
from lily_mongo.bounds import BOUNDS
from lily_mongo.envelope import validate_envelope
from lily_mongo.publisher import JSON, prepare_publication
from lily_mongo.telemetry import Telemetry, resolve_telemetry

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@pytest.fixture(scope="module")
def providers() -> Iterator[tuple[InMemorySpanExporter, TracerProvider, MeterProvider]]:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    meter_provider = MeterProvider()
    yield spans, tracer_provider, meter_provider
    tracer_provider.shutdown()
    meter_provider.shutdown()


@pytest.fixture
def telemetry(providers: tuple[InMemorySpanExporter, TracerProvider, MeterProvider]) -> Telemetry:
    spans, tracer_provider, meter_provider = providers
    spans.clear()
    return Telemetry(tracer_provider=tracer_provider, meter_provider=meter_provider)


def finished(providers: tuple[InMemorySpanExporter, TracerProvider, MeterProvider]) -> list[Any]:
    return list(providers[0].get_finished_spans())


# -- the delivery span's parent -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("traceparent", "continued"),
    [
        (TRACEPARENT, True),
        (TRACEPARENT.encode(), False),  # a byte array is not text: ignored
        (f"00-{TRACE_ID}-0000000000000000-01", False),  # all-zero parent id
        (f"00-{'0' * 32}-00f067aa0ba902b7-01", False),  # all-zero trace id
        (f"ff-{TRACE_ID}-00f067aa0ba902b7-01", False),  # version ff is invalid
        (TRACEPARENT.upper(), False),  # W3C hex is lower case
        (f"00-{TRACE_ID}-00f067aa0ba902b7-01-extra", False),
        (f" {TRACEPARENT}", False),
        (f"7f-{TRACE_ID}-00f067aa0ba902b7-01", True),  # a later version of the same shape
        ("garbage", False),
        (None, False),
    ],
)
def test_a_delivery_continues_only_a_valid_text_traceparent(
    telemetry: Telemetry,
    providers: tuple[InMemorySpanExporter, TracerProvider, MeterProvider],
    traceparent: object,
    continued: bool,
) -> None:
    headers: dict[str, object] = {} if traceparent is None else {"traceparent": traceparent}
    trace = telemetry.delivery_started("orders", headers)
    trace.finish("orders/h", uuid.uuid4(), "acked", None, Execution(PipelineResult(Outcome.SUCCESS), attempts=1))
    trace.detach()
    (span,) = finished(providers)
    assert span.kind is SpanKind.CONSUMER
    assert (span.context.trace_id == int(TRACE_ID, 16)) is continued
    assert (span.parent is not None) is continued


def test_a_delivery_keeps_the_parents_flags_and_tracestate(
    telemetry: Telemetry, providers: tuple[InMemorySpanExporter, TracerProvider, MeterProvider]
) -> None:
    unsampled = f"00-{TRACE_ID}-00f067aa0ba902b7-00"
    trace = telemetry.delivery_started("orders", {"traceparent": unsampled, "tracestate": "congo=t61rcWkgMzE"})
    context = trace.span.get_span_context()
    trace.finish(None, None, "acked", None, Execution(PipelineResult(Outcome.SUCCESS), attempts=1))
    trace.detach()
    # The default sampler is parent-based: an unsampled parent leaves the delivery unrecorded.
    assert not finished(providers)
    assert context.trace_id == int(TRACE_ID, 16)
    assert not context.trace_flags.sampled
    assert context.trace_state.to_header() == "congo=t61rcWkgMzE"

    trace = telemetry.delivery_started("orders", {"traceparent": TRACEPARENT, "tracestate": "congo=t61rcWkgMzE"})
    sent: list[dict[str, Any]] = []

    async def send(traced: dict[str, Any]) -> None:
        sent.append(traced)

    asyncio.run(trace.handoff(send, "orders.retry", {"tracestate": "stale=1"}, dead_letter=False, code="X"))
    trace.finish(None, None, "retried", "X", Execution(PipelineResult(Outcome.RETRYABLE, "X"), attempts=1))
    trace.detach()
    producer, consumer = finished(providers)
    assert producer.parent.span_id == consumer.context.span_id
    assert sent[0]["traceparent"] == f"00-{TRACE_ID}-{producer.context.span_id:016x}-01"
    assert sent[0]["tracestate"] == "congo=t61rcWkgMzE"


def test_unresolved_and_dead_lettered_outcomes_end_with_error_status(
    telemetry: Telemetry, providers: tuple[InMemorySpanExporter, TracerProvider, MeterProvider]
) -> None:
    for outcome, code in (("unresolved", None), ("dead_lettered", "ORDER_INVALID"), ("retried", "PAYMENT_DOWN")):
        trace = telemetry.delivery_started("orders", {})
        result = PipelineResult(Outcome.RETRYABLE, code)
        trace.finish("orders/h", None, outcome, code, Execution(result, attempts=1, deferrals=2))
        trace.detach()
    spans = {dict(s.attributes)["lily.outcome"]: s for s in finished(providers)}
    assert spans["unresolved"].status.status_code is StatusCode.ERROR
    assert dict(spans["unresolved"].attributes)["error.type"] == "unresolved"
    assert spans["dead_lettered"].status.status_code is StatusCode.ERROR
    assert dict(spans["dead_lettered"].attributes)["lily.failure.code"] == "ORDER_INVALID"
    assert spans["retried"].status.status_code is StatusCode.UNSET
    assert dict(spans["retried"].attributes)["lily.inbox.deferrals"] == 2


# -- trace context into published headers -----------------------------------------------------------


def produce(telemetry: Telemetry, headers: dict[str, Any], **options: Any) -> dict[str, Any]:
    sent: list[dict[str, Any]] = []

    async def send(traced: dict[str, Any]) -> None:
        sent.append(traced)

    asyncio.run(
        telemetry.produce(send, exchange="", routing_key="orders", headers=headers, operation="publish", **options)
    )
    (traced,) = sent
    return traced


def test_a_publish_replaces_a_stored_traceparent_with_its_own_span_in_that_trace(
    telemetry: Telemetry, providers: tuple[InMemorySpanExporter, TracerProvider, MeterProvider]
) -> None:
    headers = dict(prepare_publication(JSON, "orders", {}, version=1, traceparent=TRACEPARENT).headers)
    traced = produce(telemetry, headers)
    (span,) = finished(providers)
    assert span.kind is SpanKind.PRODUCER
    assert span.parent.span_id == int("00f067aa0ba902b7", 16)
    assert traced["traceparent"] == f"00-{TRACE_ID}-{span.context.span_id:016x}-01"
    assert headers["traceparent"] == TRACEPARENT  # the caller's table is not changed


def test_a_traceparent_is_added_only_while_the_table_stays_within_the_bounds(telemetry: Telemetry) -> None:
    headers = dict(prepare_publication(JSON, "orders", {}, version=1).headers)
    assert "traceparent" in produce(telemetry, headers)
    # Fill the table to the entry bound a consumer enforces (it reserves room for the handoff headers).
    room = BOUNDS.header_entries - 5 - len(headers)
    full = {**headers, **{f"x-app-{i}": "v" for i in range(room)}}
    validate_envelope(full, 0)
    traced = produce(telemetry, full)
    assert "traceparent" not in traced
    validate_envelope(traced, 0)


def test_a_failed_publish_ends_its_span_with_the_error_kind(
    telemetry: Telemetry, providers: tuple[InMemorySpanExporter, TracerProvider, MeterProvider]
) -> None:
    async def refuse(_headers: dict[str, Any]) -> None:
        raise PublishError("unroutable", "returned by the broker")

    with pytest.raises(PublishError):
        asyncio.run(telemetry.produce(refuse, exchange="", routing_key="nowhere", headers={}, operation="publish"))
    (span,) = finished(providers)
    assert span.status.status_code is StatusCode.ERROR
    assert dict(span.attributes)["error.type"] == "unroutable"


def test_a_step_that_turns_the_protocol_ends_its_span_without_error(
    telemetry: Telemetry, providers: tuple[InMemorySpanExporter, TracerProvider, MeterProvider]
) -> None:
    class Turn(Exception):
        span_outcome = "contended"

    class Broken(Exception):
        error_type = "transient_replay"

    async def raising(exc: Exception) -> None:
        raise exc

    for exc in (Turn(), Broken()):
        with pytest.raises(type(exc)):
            asyncio.run(telemetry.traced("inbox attempt", raising(exc)))
    turned, broken = finished(providers)
    assert turned.status.status_code is StatusCode.UNSET
    assert dict(turned.attributes)["lily.inbox.verdict"] == "contended"
    assert "error.type" not in dict(turned.attributes)
    assert broken.status.status_code is StatusCode.ERROR
    assert dict(broken.attributes)["error.type"] == "transient_replay"


def test_telemetry_option_resolution(telemetry: Telemetry) -> None:
    assert resolve_telemetry(False) is None
    assert resolve_telemetry(telemetry) is telemetry
    assert isinstance(resolve_telemetry(True), Telemetry)  # the API is installed in the test environment
    with pytest.raises(ConfigError, match="telemetry must be"):
        resolve_telemetry("yes")  # type: ignore[arg-type]


# -- the Prometheus exposition -------------------------------------------------------------------------


def fake_consumer(telemetry: Telemetry | None) -> Any:
    queue = QueueSnapshot(
        queue_index=0,
        permits=8,
        in_flight=3,
        buffered=1,
        outcomes=MappingProxyType({"acked": 5, "dead_lettered": 2}),
        received=10,
        transient_replays=4,
        reconciliations=1,
        deferrals=2,
        unresolved=0,
        abandoned=0,
        handoff_failures=1,
    )
    snapshot = Snapshot("running", 1, (queue,), outbox_pending=6, outbox_failed=0, outbox_published=9)
    return SimpleNamespace(
        snapshot=lambda: snapshot,
        queue_names=("orders.created",),
        ready=True,
        state="running",
        not_ready_because=lambda: None,
        telemetry=telemetry,
    )


def test_metrics_exposition_reads_the_snapshot_and_the_histograms(telemetry: Telemetry) -> None:
    for seconds in (0.0004, 0.02, 3.0):
        trace = telemetry.delivery_started("orders.created", {})
        trace.handler_seconds = seconds / 2
        trace.started -= seconds
        trace.finish(None, None, "acked", None, Execution(PipelineResult(Outcome.SUCCESS), attempts=1))
        trace.detach()
    server = ProbeServer("127.0.0.1", 0)
    server.managed = fake_consumer(telemetry)
    text = generate_latest(server._registry).decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}

    def value(family: str, sample: str | None = None, **labels: str) -> float:
        name = sample or family
        return next(s.value for s in families[family].samples if s.name == name and s.labels == labels)

    assert value("lily_ready") == 1
    assert value("lily_deliveries", "lily_deliveries_total", queue="orders.created", outcome="acked") == 5
    assert value("lily_deliveries", "lily_deliveries_total", queue="orders.created", outcome="dead_lettered") == 2
    consumed = "messaging_client_consumed_messages"
    assert value(consumed, f"{consumed}_total", queue="orders.created") == 10
    assert value("lily_inbox_replays", "lily_inbox_replays_total", queue="orders.created") == 4
    assert value("lily_handoff_failures", "lily_handoff_failures_total", queue="orders.created") == 1
    assert value("lily_deliveries_in_flight", queue="orders.created") == 3
    assert value("lily_permits", queue="orders.created") == 8
    assert value("lily_outbox_pending") == 6
    histogram = "messaging_process_duration_seconds"
    labels = {"queue": "orders.created", "outcome": "acked"}
    assert value(histogram, f"{histogram}_count", **labels) == 3
    assert value(histogram, f"{histogram}_bucket", le="0.0005", **labels) == 1
    assert value(histogram, f"{histogram}_bucket", le="0.025", **labels) == 2
    assert value(histogram, f"{histogram}_bucket", le="+Inf", **labels) == 3
    assert "# HELP lily_deliveries_total Deliveries by queue and terminal outcome." in text
    assert "lily_outbox_relay_lag_seconds" in text
    assert "# TYPE messaging_process_duration_seconds histogram" in text


def test_metrics_exposition_without_a_consumer_or_telemetry() -> None:
    server = ProbeServer("127.0.0.1", 0)
    text = generate_latest(server._registry).decode()
    assert "lily_ready 0.0" in text
    server.managed = fake_consumer(None)
    text = generate_latest(server._registry).decode()
    assert "lily_deliveries_total" in text
    assert "messaging_process_duration_seconds" not in text


async def test_probes_answer_from_the_consumer_state() -> None:
    server = ProbeServer("127.0.0.1", 0)
    assert (await server._readyz(None)).status == 503  # type: ignore[arg-type]  # starting: no consumer yet
    assert (await server._healthz(None)).status == 200  # type: ignore[arg-type]
    failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    managed = fake_consumer(None)
    managed.wait = lambda: failed
    server.attach(managed)
    assert (await server._readyz(None)).status == 200  # type: ignore[arg-type]
    managed.ready, managed.state = False, "draining"
    response = await server._readyz(None)  # type: ignore[arg-type]
    assert (response.status, response.text) == (503, "not ready: draining\n")
    failed.set_exception(RuntimeError("supervisor crashed"))
    await asyncio.sleep(0)
    assert (await server._healthz(None)).status == 503  # type: ignore[arg-type]
    await server.stop()


def test_an_outbox_publish_records_its_lag_by_path_from_the_commit_or_the_creation(telemetry: Telemetry) -> None:
    """The relay lag runs from the commit the dispatcher knows, else (the backstop relay) from the record's creation."""
    publication = prepare_publication(JSON, "orders.confirmed", {"n": 1}, version=1)
    now = datetime.datetime.now(datetime.UTC)
    record = {"exchange": "", "routing_key": "orders.confirmed", "headers": publication.headers}
    sent: list[dict[str, Any]] = []

    async def send(headers: dict[str, Any]) -> None:
        sent.append(headers)

    async def publish(record: dict[str, Any], via: str) -> None:
        await telemetry.relay_publish(send, record, via=via)

    dispatched = {**record, "created_at": now - datetime.timedelta(seconds=60), "committed_at": now}
    asyncio.run(publish(dispatched, "dispatch"))
    relayed = {**record, "created_at": now - datetime.timedelta(seconds=2)}
    asyncio.run(publish(relayed, "relay"))
    assert len(sent) == 2
    [series] = [h for h in telemetry.histograms() if h.name == "lily_outbox_relay_lag_seconds"]
    by_path = {dict(data.labels)["path"]: data for data in series.data()}
    assert set(by_path) == {"dispatch", "relay"}
    assert by_path["dispatch"].count == 1
    assert by_path["dispatch"].total < 1.0  # from the commit, not from the creation a minute earlier
    assert 2.0 <= by_path["relay"].total < 3.0
