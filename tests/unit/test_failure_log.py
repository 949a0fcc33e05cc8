"""The handler-failure log (docs/handlers.md, section 4): one traceback per handler per 10 s, the rest counted.

A fake clock drives the window; what is logged is read from the records pytest captures.
"""

from __future__ import annotations

import logging
import uuid

import pytest

from lily_mongo import QueueHandlerError
from lily_mongo._engine.failures import FailureLog

WINDOW = 10.0  # seconds between two tracebacks of one handler (docs/handlers.md)
EVENT = uuid.UUID("0f8fad5b-d9cb-469f-a165-70867728950e")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fail(log: FailureLog, exc: BaseException, handler: str = "orders/v1/json/on_order", attempt: int = 1) -> None:
    log.report(
        exc,
        queue="orders",
        handler_id=handler,
        event_id=EVENT,
        attempt=attempt,
        retry_count=0,
        outcome="retried",
        code="QUEUE_HANDLER_FAILED",
    )


def raised(message: str) -> RuntimeError:
    try:
        raise RuntimeError(message)
    except RuntimeError as exc:
        return exc


def records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "lily_mongo" and r.levelno == level]


def test_an_unexpected_exception_is_a_warning_with_its_traceback_naming_where_it_happened(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="lily_mongo")
    fail(FailureLog(clock=Clock()), raised("unexpected bug"), attempt=2)
    [record] = records(caplog, logging.WARNING)
    assert record.getMessage() == (
        "handler failed: RuntimeError: unexpected bug (queue=orders handler=orders/v1/json/on_order "
        f"event_id={EVENT} attempt=2 retry_count=0 outcome=retried code=QUEUE_HANDLER_FAILED)"
    )
    assert record.exc_info is not None
    assert "raise RuntimeError(message)" in logging.Formatter().formatException(record.exc_info)
    assert (record.queue, record.handler, record.event_id, record.attempt) == (  # type: ignore[attr-defined]
        "orders",
        "orders/v1/json/on_order",
        str(EVENT),
        2,
    )


def test_within_the_window_failures_are_counted_and_shown_with_the_next_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="lily_mongo")
    clock = Clock()
    log = FailureLog(clock=clock)
    fail(log, raised("first"))
    for n in range(5):
        clock.now += 1.0
        fail(log, raised(f"burst {n}"))
    warnings = records(caplog, logging.WARNING)
    assert [r.getMessage().split(" (")[0] for r in warnings] == ["handler failed: RuntimeError: first"]
    debug = records(caplog, logging.DEBUG)
    assert len(debug) == 5
    assert all(r.exc_info is None for r in debug)
    clock.now += WINDOW  # the window since the first traceback is over
    fail(log, raised("later"))
    later = records(caplog, logging.WARNING)[-1]
    assert later.exc_info is not None
    assert later.getMessage().endswith("; 5 more failures of this handler since its last traceback were not shown")


def test_the_window_is_per_handler(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="lily_mongo")
    log = FailureLog(clock=Clock())
    fail(log, raised("a"), handler="h1")
    fail(log, raised("b"), handler="h2")
    fail(log, raised("c"), handler="h1")
    assert [r.getMessage().split(" (")[0] for r in records(caplog, logging.WARNING)] == [
        "handler failed: RuntimeError: a",
        "handler failed: RuntimeError: b",
    ]


def test_flush_reports_what_was_not_shown_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="lily_mongo")
    clock = Clock()
    log = FailureLog(clock=clock)
    for _ in range(3):
        fail(log, raised("x"), handler="h1")
    fail(log, raised("y"), handler="h2")
    clock.now += 4.0
    log.flush()
    log.flush()  # nothing new to say
    messages = [r.getMessage() for r in records(caplog, logging.WARNING)][2:]
    assert messages == ["handler h1: 2 more failures since its last traceback (4 s ago) were not shown"]


def test_a_queue_handler_error_is_one_info_line_with_its_code_and_message(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="lily_mongo")
    log = FailureLog(clock=Clock())
    for _ in range(2):  # not rate-limited: each is the handler's own decision
        fail(log, QueueHandlerError.retryable("PAYMENT_DOWN", "gateway 503"))
    infos = records(caplog, logging.INFO)
    assert [r.getMessage().split(" (")[0] for r in infos] == [
        "handler refused the delivery: PAYMENT_DOWN: gateway 503"
    ] * 2
    assert all(r.exc_info is None for r in infos)
    assert records(caplog, logging.WARNING) == []


def test_a_long_message_is_bounded_in_the_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="lily_mongo")
    fail(FailureLog(clock=Clock()), raised("x" * 10_000))
    [record] = records(caplog, logging.WARNING)
    assert len(record.getMessage()) < 600
