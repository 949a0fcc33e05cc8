"""``Telemetry``: the engine's observer, through the OpenTelemetry API (docs/observability.md), and
``DeliveryTrace``: one delivery's ``CONSUMER`` span and what it records until the terminal outcome."""

from __future__ import annotations

import datetime
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import metrics as otel_metrics
from opentelemetry import trace as otel_trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from .._clock import aware
from .._headers import TRACEPARENT_HEADER
from .._metrics import (
    BATCH_SIZE,
    HANDLER_DURATION,
    PROCESS_DURATION,
    RELAY_LAG,
)
from .._observer import C, DeliveryObserver, PublishWith, SnapshotSource
from ._context import inject, parent_context, with_trace_context
from ._instruments import SCOPE, SYSTEM, Histogram, instruments_for
from ._spans import ERROR_OUTCOMES, mark_failed, result_attributes

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import Span, TracerProvider

    from .._verdicts import Execution, PipelineResult


class Telemetry:
    """The tracer and meter a consumer or publisher reports to (the global providers by default).

    Pass one to ``Consumer(..., telemetry=...)`` or ``Publisher(..., telemetry=...)`` to
    use other providers than the global ones (tests do, since the SDK lets a process set
    the global providers once). Needs ``opentelemetry-api`` (the ``otel`` extra).
    """

    def __init__(
        self, *, tracer_provider: TracerProvider | None = None, meter_provider: MeterProvider | None = None
    ) -> None:
        self._tracer = otel_trace.get_tracer(SCOPE, tracer_provider=tracer_provider)
        self._instruments = instruments_for(meter_provider or otel_metrics.get_meter_provider())
        self._started: dict[str, tuple[str, dict[str, str]]] = {}  # per queue: span name, start attributes
        self._process_attributes: dict[tuple[str, str], dict[str, str]] = {}
        self._queue_attributes: dict[str, dict[str, str]] = {}
        # What the Prometheus exposition reads (the snapshot holds no durations).
        self.process_duration = Histogram(PROCESS_DURATION)
        self.handler_duration = Histogram(HANDLER_DURATION)
        self.relay_lag = Histogram(RELAY_LAG)
        self.batch_size = Histogram(BATCH_SIZE)

    def histograms(self) -> tuple[Histogram, ...]:
        """The in-process histograms (for the Prometheus exposition)."""
        return (self.process_duration, self.handler_duration, self.relay_lag, self.batch_size)

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
        parent = parent_context(headers)
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

    def finished(self, trace: DeliveryTrace, outcome: str, duration: float) -> None:
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
                mark_failed(span, exc)
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
        return self.traced("inbox attempt", attempt, numbers, result_attributes)

    def inbox_commit(self, commit: Awaitable[PipelineResult]) -> Awaitable[PipelineResult]:
        return self.traced("inbox commit", commit, describe=result_attributes)

    async def batch[T](self, run: Awaitable[T], queue: str, size: int, deliveries: Sequence[DeliveryObserver]) -> T:
        """One ``CONSUMER`` span per batch, ``process batch <queue>``, linked to each delivery's span (each in
        its own trace, the producer's); the batch-size histogram. The deliveries keep their own spans and
        per-event outcome metrics."""
        links = [Link(d.span.get_span_context()) for d in deliveries if isinstance(d, DeliveryTrace)]
        attributes: dict[str, str | int] = {
            "messaging.system": SYSTEM,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": queue,
            "messaging.batch.message_count": size,
        }
        self._instruments.batch_size.record(size, {"messaging.system": SYSTEM, "messaging.destination.name": queue})
        self.batch_size.record((("queue", queue),), size)
        with self._tracer.start_as_current_span(
            f"process batch {queue}",
            otel_context.Context(),
            SpanKind.CONSUMER,
            attributes,
            links,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                return await run
            except BaseException as exc:
                mark_failed(span, exc)
                raise

    def inbox_reconcile(self, reconcile: Awaitable[PipelineResult]) -> Awaitable[PipelineResult]:
        return self.traced("inbox reconcile", reconcile, describe=result_attributes)

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
        inject(carrier, otel_trace.get_current_span().get_span_context())
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
            context = parent_context(headers)
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
            await send(with_trace_context(headers, span.get_span_context()))
        except BaseException as exc:
            mark_failed(span, exc)
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

    __slots__ = ("_owner", "_token", "context", "handler_seconds", "queue", "span", "started")

    def __init__(self, owner: Telemetry, queue: str, span: Span, context: Context, token: object) -> None:
        self._owner = owner
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
            self._owner.finished(self, outcome, time.monotonic() - self.started)
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
        self._owner.finished(self, outcome, time.monotonic() - self.started)
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
        await self._owner.produce(
            send,
            exchange="",
            routing_key=routing_key,
            headers=headers,
            operation="dlq" if dead_letter else "retry",
            parent=self,
            attributes=attributes,
        )
