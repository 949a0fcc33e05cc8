"""A delivery's log lines: one per terminal outcome, with structured fields (docs/observability.md, section 3)."""

from __future__ import annotations

import logging
from typing import Any

from .settlement import Terminal

__all__ = ["log_fields", "log_terminal"]

log = logging.getLogger("lily_mongo")

# Terminal outcomes an operator must hear about (one line each); the others are logged at DEBUG.
_WARNED = frozenset({Terminal.DEAD_LETTERED.value, Terminal.BROKER_DEAD_LETTERED.value, Terminal.UNRESOLVED.value})


def log_fields(
    queue: str, handler_id: str | None, event_id: object, outcome: str, code: str | None, duration: float | None = None
) -> dict[str, Any]:
    """The structured fields of a delivery's log line (read by JSON formatters); never payloads.

    ``code`` and ``duration_ms`` only when there is one (docs/observability.md, section 3).
    """
    fields: dict[str, Any] = {
        "queue": queue,
        "handler": handler_id,
        "event_id": str(event_id) if event_id is not None else None,
        "outcome": outcome,
    }
    if code is not None:
        fields["code"] = code
    if duration is not None:
        fields["duration_ms"] = round(duration * 1000, 3)
    return fields


def log_terminal(
    queue: str, handler_id: str | None, event_id: object, outcome: str, code: str | None, duration: float
) -> None:
    """One line per delivery: WARNING for dead letters and unresolved outcomes, DEBUG for the rest.

    ``duration`` is receipt to terminal outcome, in seconds (the line says milliseconds).
    """
    level = logging.WARNING if outcome in _WARNED else logging.DEBUG
    if log.isEnabledFor(level):
        extra = log_fields(queue, handler_id, event_id, outcome, code, duration)
        if code is None:
            message = "delivery %s: queue=%s handler=%s event_id=%s duration_ms=%.3f"
            log.log(level, message, outcome, queue, handler_id, event_id, extra["duration_ms"], extra=extra)
        else:
            message = "delivery %s: queue=%s handler=%s event_id=%s code=%s duration_ms=%.3f"
            log.log(level, message, outcome, queue, handler_id, event_id, code, extra["duration_ms"], extra=extra)
