"""Traces and metrics through the OpenTelemetry API (``docs/observability.md``).

When ``opentelemetry-api`` is importable (the ``otel`` extra), a consumer and a
publisher use the globally configured ``TracerProvider`` and ``MeterProvider``
with no further set-up; ``Consumer(..., telemetry=False)`` turns it off, and
``telemetry=Telemetry(tracer_provider=..., meter_provider=...)`` chooses other
providers. :class:`Telemetry` is the engine's :class:`~lily_mongo._observer.Observer`;
without the API, or turned off, the engine reports to the no-op observer instead,
and each reporting point costs one call of an empty method.

What is emitted follows the OpenTelemetry messaging semantic conventions:

* one ``CONSUMER`` span per delivery, ``process <queue>``, continuing the
  delivery's W3C ``traceparent``/``tracestate`` (a new trace when absent or
  invalid), with the handler, the event id, the terminal outcome and the
  failure code; error status for dead letters and unresolved outcomes;
* ``INTERNAL`` child spans for the inbox steps (``inbox claim``, ``inbox
  attempt`` per attempt, ``inbox commit``, ``inbox reconcile``);
* a ``PRODUCER`` span for every publish (:class:`~lily_mongo.Publisher`, retry
  and DLQ hand-offs, the outbox's dispatcher and relay) that writes its own
  ``traceparent`` into the message. An outbox record stores the ``traceparent``
  of the attempt that wrote it, and its publish span (the dispatcher's right
  after the commit, or the backstop relay's) is that context's child: the event
  stays in the trace of the delivery that caused it;
* histograms recorded per delivery (``messaging.process.duration``,
  ``lily.handler.duration``, ``lily.outbox.relay.lag``) and observable
  instruments that read the consumer's snapshot when collected (deliveries by
  queue and outcome, replays, deferrals, reconciliations, hand-off failures,
  in-flight deliveries, permits, outbox pending and failed).

The metrics' names, units and descriptions are the catalogue in
:mod:`lily_mongo._metrics`. Attributes never carry payloads, header values
other than the trace context, credentials or connection strings. Metric
attributes are the queue and the outcome only: event ids stay on spans.
"""

from __future__ import annotations

import bisect
import datetime
import itertools
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._clock import aware
from .._errors import ConfigError, EnvelopeError, ErrorCode
from .._metrics import (
    DELIVERIES,
    DURATION_BUCKETS,
    HANDLER_DURATION,
    LAG_BUCKETS,
    OUTBOX_GAUGES,
    PROCESS_DURATION,
    QUEUE_COUNTERS,
    QUEUE_GAUGES,
    RELAY_LAG,
    SENT,
    Metric,
)
from .._observer import C, PublishWith, SnapshotSource
from .._snapshots import Snapshot
from ..bounds import BOUNDS
from ..envelope import TRACEPARENT_HEADER, TRACESTATE_HEADER, valid_traceparent, validate_envelope

try:
    from opentelemetry import context as otel_context
    from opentelemetry import metrics as otel_metrics
    from opentelemetry import trace as otel_trace
    from opentelemetry.trace import (
        NonRecordingSpan,
        SpanContext,
        SpanKind,
        Status,
        StatusCode,
        TraceFlags,
        TraceState,
    )

    AVAILABLE = True
except ModuleNotFoundError:  # pragma: no cover - exercised only without the otel extra
    AVAILABLE = False

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation
    from opentelemetry.trace import Span, TracerProvider

    from .._verdicts import Execution, PipelineResult

__all__ = [
    "AVAILABLE",
    "DURATION_BUCKETS",
    "LAG_BUCKETS",
    "DeliveryTrace",
    "HistogramData",
    "Telemetry",
    "resolve_telemetry",
]

SCOPE = "lily_mongo"
SYSTEM = "rabbitmq"
# Terminal outcomes whose span ends with error status (docs/settlement.md section 10: the delivery
# failed for good, or its fate is unknown).
ERROR_OUTCOMES = frozenset({"dead_lettered", "broker_dead_lettered", "unresolved"})


@dataclass(frozen=True, slots=True)
class HistogramData:
    """One histogram series, cumulative since start: bucket upper bounds and counts, sum, count."""

    labels: tuple[tuple[str, str], ...]
    bounds: tuple[float, ...]
    buckets: tuple[int, ...]  # per bound, then the overflow bucket (not cumulative)
    total: float
    count: int


class _Histogram:
    """A fixed-bucket histogram per label set, kept in process for the Prometheus exposition
    (``lily-mongo run --http-port``), which cannot read the OpenTelemetry SDK's aggregates."""

    __slots__ = ("bounds", "description", "name", "series")

    def __init__(self, metric: Metric) -> None:
        self.name = metric.prometheus_name
        self.description = metric.description
        self.bounds = metric.buckets
        self.series: dict[tuple[tuple[str, str], ...], list[Any]] = {}

    def record(self, labels: tuple[tuple[str, str], ...], value: float) -> None:
        series = self.series.get(labels)
        if series is None:
            series = self.series[labels] = [[0] * (len(self.bounds) + 1), 0.0, 0]
        series[0][bisect.bisect_left(self.bounds, value)] += 1
        series[1] += value
        series[2] += 1

    def data(self) -> list[HistogramData]:
        return [
            HistogramData(labels, self.bounds, tuple(counts), total, count)
            for labels, (counts, total, count) in list(self.series.items())
        ]


class _Instruments:
    """The instruments of one meter provider, created once: OpenTelemetry keeps instruments
    per provider and name, so every :class:`Telemetry` on one provider shares them."""

    def __init__(self, provider: MeterProvider) -> None:
        meter = provider.get_meter(SCOPE)
        self.sources: dict[int, SnapshotSource] = {}
        self.keys = itertools.count()
        self.process_duration, self.handler_duration, self.relay_lag = (
            meter.create_histogram(
                m.name, unit=m.unit, description=m.description, explicit_bucket_boundaries_advisory=m.buckets
            )
            for m in (PROCESS_DURATION, HANDLER_DURATION, RELAY_LAG)
        )
        self.sent = meter.create_counter(SENT.name, unit=SENT.unit, description=SENT.description)
        for m in QUEUE_COUNTERS:
            meter.create_observable_counter(
                m.name, callbacks=[self._per_queue(m.field)], unit=m.unit, description=m.description
            )
        meter.create_observable_counter(
            DELIVERIES.name, callbacks=[self._outcomes], unit=DELIVERIES.unit, description=DELIVERIES.description
        )
        for m in QUEUE_GAUGES:
            meter.create_observable_up_down_counter(
                m.name, callbacks=[self._per_queue(m.field)], unit=m.unit, description=m.description
            )
        for m in OUTBOX_GAUGES:
            meter.create_observable_up_down_counter(
                m.name, callbacks=[self._outbox(m.field)], unit=m.unit, description=m.description
            )

    def _snapshots(self) -> Iterator[tuple[Snapshot, tuple[str, ...]]]:
        # Collection may run on a metric reader's thread: a snapshot copies plain ints
        # and dicts under the GIL, and the source list is copied before iterating.
        for source in list(self.sources.values()):
            yield source()

    def _per_queue(self, field_name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            totals: dict[str, int] = {}
            for snapshot, names in self._snapshots():
                for queue in snapshot.queues:
                    name = names[queue.queue_index]
                    totals[name] = totals.get(name, 0) + int(getattr(queue, field_name))
            return [
                otel_metrics.Observation(value, {"messaging.system": SYSTEM, "messaging.destination.name": name})
                for name, value in totals.items()
            ]

        return observe

    def _outcomes(self, _options: CallbackOptions) -> Iterable[Observation]:
        totals: dict[tuple[str, str], int] = {}
        for snapshot, names in self._snapshots():
            for queue in snapshot.queues:
                for outcome, count in queue.outcomes.items():
                    key = (names[queue.queue_index], outcome)
                    totals[key] = totals.get(key, 0) + count
        return [
            otel_metrics.Observation(
                value, {"messaging.system": SYSTEM, "messaging.destination.name": name, "lily.outcome": outcome}
            )
            for (name, outcome), value in totals.items()
        ]

    def _outbox(self, field_name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            values = [getattr(snapshot, field_name) for snapshot, _ in self._snapshots()]
            known = [int(v) for v in values if v is not None]
            return [otel_metrics.Observation(sum(known))] if known else []

        return observe


# One instrument set per meter provider, for the life of the provider (see _Instruments).
_INSTRUMENTS: weakref.WeakKeyDictionary[Any, _Instruments] = weakref.WeakKeyDictionary()


def _instruments_for(provider: MeterProvider) -> _Instruments:
    instruments = _INSTRUMENTS.get(provider)
    if instruments is None:
        instruments = _INSTRUMENTS[provider] = _Instruments(provider)
    return instruments


class Telemetry:
    """The tracer and meter a consumer or publisher reports to (the global providers by default).

    Pass one to ``Consumer(..., telemetry=...)`` or ``Publisher(..., telemetry=...)`` to
    use other providers than the global ones (tests do, since the SDK lets a process set
    the global providers once). Needs ``opentelemetry-api`` (the ``otel`` extra).
    """

    def __init__(
        self, *, tracer_provider: TracerProvider | None = None, meter_provider: MeterProvider | None = None
    ) -> None:
        if not AVAILABLE:
            raise ConfigError("Telemetry needs opentelemetry-api: pip install 'lily-mongo[otel]'")
        self._tracer = otel_trace.get_tracer(SCOPE, tracer_provider=tracer_provider)
        self._instruments = _instruments_for(meter_provider or otel_metrics.get_meter_provider())
        self._started: dict[str, tuple[str, dict[str, str]]] = {}  # per queue: span name, start attributes
        self._process_attributes: dict[tuple[str, str], dict[str, str]] = {}
        self._queue_attributes: dict[str, dict[str, str]] = {}
        # What the Prometheus exposition reads (the snapshot holds no durations).
        self.process_duration = _Histogram(PROCESS_DURATION)
        self.handler_duration = _Histogram(HANDLER_DURATION)
        self.relay_lag = _Histogram(RELAY_LAG)

    def histograms(self) -> tuple[_Histogram, ...]:
        """The in-process histograms (for the Prometheus exposition)."""
        return (self.process_duration, self.handler_duration, self.relay_lag)

    # -- metric sources ---------------------------------------------------------------------------

    def watch(self, source: SnapshotSource) -> Callable[[], None]:
        """Let the observable instruments read ``source`` when collected; returns the un-watcher."""
        sources = self._instruments.sources
        key = next(self._instruments.keys)
        sources[key] = source

        def unwatch() -> None:
            sources.pop(key, None)

        return unwatch

    # -- one delivery -----------------------------------------------------------------------------

    def delivery_started(self, queue: str, headers: Mapping[str, Any]) -> DeliveryTrace:
        """Start the delivery's ``CONSUMER`` span (continuing its trace context) and make it current."""
        parent = _parent_context(headers)
        started = self._started.get(queue)
        if started is None:
            started = self._started[queue] = (
                f"process {queue}",
                {
                    "messaging.system": SYSTEM,
                    "messaging.operation.type": "process",
                    "messaging.operation.name": "process",
                    "messaging.destination.name": queue,
                },
            )
        span = self._tracer.start_span(started[0], parent, SpanKind.CONSUMER, started[1])
        context = otel_trace.set_span_in_context(span, parent)
        return DeliveryTrace(self, queue, span, context, otel_context.attach(context))

    def _finished(self, trace: DeliveryTrace, outcome: str, duration: float) -> None:
        key = (trace.queue, outcome)
        attributes = self._process_attributes.get(key)
        if attributes is None:
            attributes = self._process_attributes[key] = {
                "messaging.system": SYSTEM,
                "messaging.operation.name": "process",
                "messaging.destination.name": trace.queue,
                "lily.outcome": outcome,
            }
        instruments = self._instruments
        labels = (("queue", trace.queue), ("outcome", outcome))
        # The delivery's context, passed rather than looked up: an exemplar filter sees its span.
        instruments.process_duration.record(duration, attributes, trace.context)
        self.process_duration.record(labels, duration)
        if trace.handler_seconds is not None:
            queue_attributes = self._queue_attributes.get(trace.queue)
            if queue_attributes is None:
                queue_attributes = self._queue_attributes[trace.queue] = {
                    "messaging.system": SYSTEM,
                    "messaging.destination.name": trace.queue,
                }
            instruments.handler_duration.record(trace.handler_seconds, queue_attributes, trace.context)
            self.handler_duration.record(labels[:1], trace.handler_seconds)

    # -- inbox steps ------------------------------------------------------------------------------

    async def traced[T](
        self,
        name: str,
        step: Awaitable[T],
        attributes: Mapping[str, str | int] | None = None,
        describe: Callable[[T], Mapping[str, str | int]] | None = None,
    ) -> T:
        """Await ``step`` inside a current ``INTERNAL`` span; ``describe`` adds attributes from its result.

        An exception sets error status and ``error.type`` (the exception's ``error_type``
        attribute, else its class name); its message is not recorded (it may quote data).
        """
        with self._tracer.start_as_current_span(
            name, kind=SpanKind.INTERNAL, attributes=attributes, record_exception=False, set_status_on_exception=False
        ) as span:
            try:
                result = await step
            except BaseException as exc:
                _fail(span, exc)
                raise
            if describe is not None:
                span.set_attributes(describe(result))
            return result

    def inbox_claim(self, claim: Awaitable[C]) -> Awaitable[C]:
        """The ``inbox claim`` span: how the claim ended and the event's deferrals so far."""

        def describe(answer: C) -> Mapping[str, str | int]:
            return {"lily.inbox.claim": answer.kind.value, "lily.inbox.deferrals": answer.deferrals}

        return self.traced("inbox claim", claim, describe=describe)

    def inbox_attempt(
        self, attempt: Awaitable[PipelineResult], number: int, replays: int, *, first: bool
    ) -> Awaitable[PipelineResult]:
        """One ``inbox attempt`` span per attempt, with its number and the replays before it."""
        numbers = {
            "lily.inbox.attempt": number,
            "lily.inbox.replays": replays,
            "lily.inbox.claim_in_transaction": int(first),
        }
        return self.traced("inbox attempt", attempt, numbers, _result_attributes)

    def inbox_commit(self, commit: Awaitable[PipelineResult]) -> Awaitable[PipelineResult]:
        return self.traced("inbox commit", commit, describe=_result_attributes)

    def inbox_reconcile(self, reconcile: Awaitable[PipelineResult]) -> Awaitable[PipelineResult]:
        return self.traced("inbox reconcile", reconcile, describe=_result_attributes)

    # -- publishing -------------------------------------------------------------------------------

    def outbox_record(self, options: MutableMapping[str, Any]) -> None:
        """An outbox record keeps the attempt's trace context: the relay publishes in that trace."""
        if "traceparent" in options:
            return
        context = self.trace_headers()
        if "traceparent" in context:
            options["traceparent"] = context["traceparent"]
            if "tracestate" in context:
                options["tracestate"] = context["tracestate"]

    def relay_publish(self, send: PublishWith, record: Mapping[str, Any], *, via: str = "relay") -> Awaitable[None]:
        """A ``PRODUCER`` span, child of the context the record stored (the attempt that wrote it).

        ``via`` (``dispatch`` or ``relay``) is its ``lily.publish``. The relay lag runs from the
        commit (known to the dispatcher) or, for the backstop relay, from the record's creation.
        """
        return self.produce(
            send,
            exchange=record["exchange"],
            routing_key=record["routing_key"],
            headers=record["headers"],
            operation=via,
            enqueued_at=record.get("committed_at") or record.get("created_at"),
        )

    def publish(
        self, send: PublishWith, *, exchange: str, routing_key: str, headers: dict[str, Any], event_id: object
    ) -> Awaitable[None]:
        """A :class:`~lily_mongo.Publisher` publish: a ``PRODUCER`` span of the current context."""
        return self.produce(
            send,
            exchange=exchange,
            routing_key=routing_key,
            headers=headers,
            operation="publish",
            attributes={"messaging.message.id": str(event_id)},
        )

    def trace_headers(self) -> dict[str, str]:
        """The current span's ``traceparent`` (and ``tracestate``): what an outbox record stores."""
        carrier: dict[str, str] = {}
        _inject(carrier, otel_trace.get_current_span().get_span_context())
        return carrier

    async def produce(
        self,
        send: PublishWith,
        *,
        exchange: str,
        routing_key: str,
        headers: Mapping[str, Any],
        operation: str,
        parent: DeliveryTrace | None = None,
        attributes: Mapping[str, str | int] | None = None,
        enqueued_at: datetime.datetime | None = None,
    ) -> None:
        """Publish through ``send(headers)`` inside a ``PRODUCER`` span whose ``traceparent`` it carries.

        The span's parent is ``parent``'s span (a hand-off), else the context stored in
        ``headers`` (an outbox record), else the current context. ``enqueued_at`` (an
        outbox record's creation) records the relay lag once confirmed.
        """
        if parent is not None:
            context: Context | None = parent.context
        elif TRACEPARENT_HEADER in headers:
            context = _parent_context(headers)
        else:
            context = None
        destination = exchange or routing_key
        span_attributes: dict[str, str | int] = {
            "messaging.system": SYSTEM,
            "messaging.operation.type": "send",
            "messaging.operation.name": "publish",
            "messaging.destination.name": exchange,
            "messaging.rabbitmq.destination.routing_key": routing_key,
            "lily.publish": operation,
        }
        if attributes:
            span_attributes.update(attributes)
        span = self._tracer.start_span(f"publish {destination}", context, SpanKind.PRODUCER, span_attributes)
        try:
            await send(_with_trace_context(headers, span.get_span_context()))
        except BaseException as exc:
            _fail(span, exc)
            raise
        finally:
            span.end()
        self._instruments.sent.add(1, {"messaging.system": SYSTEM, "lily.publish": operation})
        if enqueued_at is not None:
            now = datetime.datetime.now(datetime.UTC)
            lag = max((now - (aware(enqueued_at) or now)).total_seconds(), 0.0)
            self._instruments.relay_lag.record(lag, {"messaging.system": SYSTEM, "lily.publish": operation})
            self.relay_lag.record((("path", operation),), lag)


class DeliveryTrace:
    """One delivery's span, the context it is current in, its token and its timings; ended by :meth:`finish`."""

    __slots__ = ("_telemetry", "_token", "context", "handler_seconds", "queue", "span", "started")

    def __init__(self, telemetry: Telemetry, queue: str, span: Span, context: Context, token: object) -> None:
        self._telemetry = telemetry
        self._token: object | None = token
        self.queue = queue
        self.span = span
        self.context = context
        self.started = time.monotonic()
        self.handler_seconds: float | None = None

    def executed(self, started: float) -> None:
        """The execution (started at ``time.monotonic()`` value ``started``) returned its verdict."""
        self.handler_seconds = time.monotonic() - started

    def finish(
        self, handler_id: str | None, event_id: object, outcome: str, code: str | None, execution: Execution
    ) -> None:
        """End the span with the terminal outcome and record the delivery's histograms (once)."""
        span = self.span
        if not span.is_recording():
            self._telemetry._finished(self, outcome, time.monotonic() - self.started)
            span.end()
            return
        attributes: dict[str, str | int] = {"lily.outcome": outcome}
        if handler_id is not None:
            attributes["lily.handler.id"] = handler_id
        if event_id is not None:
            attributes["messaging.message.id"] = str(event_id)
        if code:
            attributes["lily.failure.code"] = code
        if execution.attempts > 1:
            attributes["lily.attempts"] = execution.attempts
        if execution.transient_replays:
            attributes["lily.inbox.transient_replays"] = execution.transient_replays
        if execution.reconciliations:
            attributes["lily.inbox.reconciliations"] = execution.reconciliations
        if execution.deferrals:
            attributes["lily.inbox.deferrals"] = execution.deferrals
        span.set_attributes(attributes)
        if outcome in ERROR_OUTCOMES:
            span.set_attribute("error.type", code or outcome)
            span.set_status(Status(StatusCode.ERROR, f"{outcome}: {code}" if code else outcome))
        self._telemetry._finished(self, outcome, time.monotonic() - self.started)
        span.end()

    def detach(self) -> None:
        """Restore the context that was current before the delivery (in the delivery's own task)."""
        token, self._token = self._token, None
        if token is not None:
            otel_context.detach(token)  # type: ignore[arg-type]

    async def handoff(
        self,
        send: PublishWith,
        routing_key: str,
        headers: Mapping[str, Any],
        *,
        dead_letter: bool,
        code: str | None,
    ) -> None:
        """A retry or DLQ copy, published in a ``PRODUCER`` span that is this delivery span's child."""
        attributes: dict[str, str | int] = {"lily.handoff": "dlq" if dead_letter else "retry"}
        if code:
            attributes["lily.failure.code"] = code
        await self._telemetry.produce(
            send,
            exchange="",
            routing_key=routing_key,
            headers=headers,
            operation="dlq" if dead_letter else "retry",
            parent=self,
            attributes=attributes,
        )


def resolve_telemetry(option: bool | Telemetry | None) -> Telemetry | None:
    """``True`` (the default): the global providers when the API is installed, else off;
    ``False`` or ``None``: off; a :class:`Telemetry`: that one."""
    if isinstance(option, Telemetry):
        return option
    if option is True:
        return Telemetry() if AVAILABLE else None
    if option is False or option is None:
        return None
    raise ConfigError(f"telemetry must be True, False or a Telemetry, got {type(option).__name__}")


# -- helpers ------------------------------------------------------------------------------------------


if AVAILABLE:
    _EMPTY = otel_context.Context()


def _result_attributes(result: PipelineResult) -> Mapping[str, str | int]:
    """What an attempt, commit or reconciliation span reports: its verdict and code."""
    attributes: dict[str, str | int] = {"lily.inbox.verdict": result.outcome.value}
    if result.code:
        attributes["lily.failure.code"] = result.code
    return attributes


def _fail(span: Span, exc: BaseException) -> None:
    outcome = getattr(exc, "span_outcome", None)
    if outcome is not None:  # an expected turn of the protocol, not an error
        span.set_attribute("lily.inbox.verdict", str(outcome))
        return
    error_type = getattr(exc, "error_type", None) or getattr(exc, "kind", None) or type(exc).__name__
    span.set_attribute("error.type", str(error_type))
    span.set_status(Status(StatusCode.ERROR, str(error_type)))


_TRACESTATE_BYTES = BOUNDS.tracestate_bytes


def _parent_context(headers: Mapping[str, Any]) -> Context:
    """The context a delivery's (or an outbox record's) trace headers continue; empty without a valid one.

    The W3C format is the message contract (docs/contracts.md sections 3 and 6 bound exactly these two
    headers), so it is read whatever global propagator the application configured, with the
    envelope's validity rule: text only (a byte-array or numeric value is invalid), no ``ff``
    version, no all-zero id. A ``tracestate`` counts only with a valid ``traceparent`` and
    within its bound. The W3C propagator's ``extract`` gives the same context and takes
    about twice as long (4.9 against 2.8 µs per delivery with a ``traceparent``, ``timeit``).
    """
    text = headers.get(TRACEPARENT_HEADER)
    if type(text) is not str or not valid_traceparent(text):
        return _EMPTY
    state = headers.get(TRACESTATE_HEADER)
    span_context = SpanContext(
        int(text[3:35], 16),
        int(text[36:52], 16),
        True,
        TraceFlags(int(text[53:55], 16)),
        TraceState.from_header([state]) if type(state) is str and 0 < len(state) <= _TRACESTATE_BYTES else None,
    )
    return otel_trace.set_span_in_context(NonRecordingSpan(span_context), _EMPTY)


def _inject(carrier: dict[str, Any], span_context: SpanContext) -> None:
    """Write ``span_context`` as W3C ``traceparent`` (and ``tracestate`` when it has one) into ``carrier``."""
    if not span_context.is_valid:
        return
    carrier[TRACEPARENT_HEADER] = (
        f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{span_context.trace_flags:02x}"
    )
    if span_context.trace_state:
        carrier[TRACESTATE_HEADER] = span_context.trace_state.to_header()


def _with_trace_context(headers: Mapping[str, Any], span_context: SpanContext) -> dict[str, Any]:
    """A copy of ``headers`` carrying ``span_context`` (a publish's ``PRODUCER`` span).

    A ``traceparent`` already there is replaced (same size). One that was absent is
    added only while the table stays within the metadata bounds a consumer enforces
    (docs/contracts.md section 6): a copy a consumer would reject is worse than a broken trace.
    """
    carrier = dict(headers)
    carrier.pop(TRACESTATE_HEADER, None)
    _inject(carrier, span_context)
    if TRACEPARENT_HEADER in headers:
        return carrier
    try:
        validate_envelope(carrier, 0)
    except EnvelopeError as exc:
        if exc.code == ErrorCode.METADATA_BOUNDS_EXCEEDED:
            return dict(headers)
    return carrier
