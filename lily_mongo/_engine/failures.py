"""The handler-failure log (docs/handlers.md, section 5): what a handler raised, where an operator sees it.

An unexpected exception (anything but :class:`QueueHandlerError`) from a handler, its
middleware, guards or dependencies is logged at WARNING with its traceback, naming
the queue, the handler, the event id, the attempt, the outcome and the code, each time
a delivery ends with it (retried, dead-lettered, deferred after a spent replay budget).
A poison flood must not flood the log: per handler at most one traceback per window
(10 s); the failures in between are logged at DEBUG only and counted, and the count is
shown with the handler's next traceback, or by :meth:`FailureLog.flush` at shutdown.

A :class:`QueueHandlerError` is the handler's own decision: one INFO line with its code
and message, no traceback.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._errors import QueueHandlerError
from .._lru import Lru
from .._text import truncate_utf8
from ..bounds import BOUNDS

__all__ = ["TRACEBACK_WINDOW", "FailureLog"]

log = logging.getLogger("lily_mongo")

TRACEBACK_WINDOW = 10.0
"""Seconds between two tracebacks of one handler."""
_MESSAGE_BYTES = 300  # the exception's message in the line itself (the traceback shows it whole)


@dataclass(slots=True)
class _Window:
    shown_at: float  # time.monotonic() of the handler's last traceback
    suppressed: int = 0  # failures since, logged without a traceback


_NEVER = _Window(float("-inf"))  # a handler without a traceback yet (never written to)


class FailureLog:
    """Per handler, one traceback per window and a count of the failures in between."""

    __slots__ = ("_clock", "_window", "_windows")

    def __init__(self, *, window: float = TRACEBACK_WINDOW, clock: Callable[[], float] = time.monotonic) -> None:
        self._window = window
        self._clock = clock
        # At most one entry per linked handler; the bound keeps the memory fixed whatever happens.
        self._windows: Lru[str, _Window] = Lru(BOUNDS.linked_handlers)

    def report(
        self,
        exc: BaseException,
        *,
        queue: str,
        handler_id: str | None,
        event_id: uuid.UUID | None,
        attempt: int,
        retry_count: int | None,
        outcome: str,
        code: str | None,
    ) -> None:
        """One failed delivery: ``exc`` is what its last attempt raised."""
        handler = handler_id or "-"
        where = f"queue={queue} handler={handler} event_id={event_id} attempt={attempt}"
        if retry_count is not None:
            where += f" retry_count={retry_count}"
        where += f" outcome={outcome}" + (f" code={code}" if code is not None else "")
        fields: dict[str, Any] = {
            "queue": queue,
            "handler": handler_id,
            "event_id": str(event_id) if event_id is not None else None,
            "outcome": outcome,
            "code": code,
            "attempt": attempt,
        }
        if isinstance(exc, QueueHandlerError):
            log.info(
                "handler refused the delivery: %s (%s)", _describe(exc, exc.code, exc.message), where, extra=fields
            )
            return
        now = self._clock()
        window = self._windows.get(handler, _NEVER)
        if now - window.shown_at < self._window:
            window.suppressed += 1
            log.debug("handler failed (traceback not shown): %s (%s)", _describe(exc), where, extra=fields)
            return
        earlier = ""
        if window.suppressed:
            earlier = f"; {window.suppressed} more failures of this handler since its last traceback were not shown"
        self._windows.put(handler, _Window(now))
        log.warning("handler failed: %s (%s)%s", _describe(exc), where, earlier, exc_info=exc, extra=fields)

    def flush(self) -> None:
        """Say how many failures each handler had since its last traceback (at shutdown)."""
        now = self._clock()
        for handler, window in self._windows.items():
            if window.suppressed:
                log.warning(
                    "handler %s: %d more failures since its last traceback (%.0f s ago) were not shown",
                    handler,
                    window.suppressed,
                    now - window.shown_at,
                    extra={"handler": handler},
                )
                window.suppressed = 0


def _describe(exc: BaseException, code: str | None = None, message: str | None = None) -> str:
    if code is not None:
        return truncate_utf8(f"{code}: {message}" if message else code, _MESSAGE_BYTES)
    return truncate_utf8(f"{type(exc).__name__}: {exc}", _MESSAGE_BYTES)
