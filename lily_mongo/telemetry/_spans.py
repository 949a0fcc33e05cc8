"""What the telemetry's spans record of a verdict, an error and a terminal outcome."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from opentelemetry.trace import Status, StatusCode

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from .._verdicts import PipelineResult


ERROR_OUTCOMES = frozenset({"dead_lettered", "broker_dead_lettered", "unresolved"})


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
