"""One delivery's ``CONSUMER`` span and what it records until the delivery's terminal outcome."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from opentelemetry import context as otel_context
from opentelemetry.trace import Status, StatusCode

from .._observer import PublishWith

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

    from .._verdicts import Execution, PipelineResult


ERROR_OUTCOMES = frozenset({"dead_lettered", "broker_dead_lettered", "unresolved"})


class TraceOwner(Protocol):
    """What a delivery's trace reports to (its :class:`~lily_mongo.telemetry.Telemetry`)."""

    def finished(self, trace: DeliveryTrace, outcome: str, duration: float) -> None: ...

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
    ) -> None: ...


class DeliveryTrace:
    """One delivery's span, the context it is current in, its token and its timings; ended by :meth:`finish`."""

    __slots__ = ("_owner", "_token", "context", "handler_seconds", "queue", "span", "started")

    def __init__(self, owner: TraceOwner, queue: str, span: Span, context: Context, token: object) -> None:
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


def result_attributes(result: PipelineResult) -> Mapping[str, str | int]:
    """What an attempt, commit or reconciliation span reports: its verdict and code."""
    attributes: dict[str, str | int] = {"lily.inbox.verdict": result.outcome.value}
    if result.code:
        attributes["lily.failure.code"] = result.code
    return attributes


def mark_failed(span: Span, exc: BaseException) -> None:
    outcome = getattr(exc, "span_outcome", None)
    if outcome is not None:  # an expected turn of the protocol, not an error
        span.set_attribute("lily.inbox.verdict", str(outcome))
        return
    error_type = getattr(exc, "error_type", None) or getattr(exc, "kind", None) or type(exc).__name__
    span.set_attribute("error.type", str(error_type))
    span.set_status(Status(StatusCode.ERROR, str(error_type)))
