"""The command's log lines: JSON objects one per line, text lines without ``code=None``, and small rules
of the command (bind errors, worker restarts)."""

from __future__ import annotations

import errno
import json
import logging
import sys

import pytest

from lily_mongo._cli.logs import COMMAND_LOGGER, JsonFormatter, TextFormatter
from lily_mongo._cli.workers import MAX_RESTARTS, exit_status, restart_delay
from lily_mongo._engine.logs import log_fields
from lily_mongo._text import bind_reason


def record(name: str, level: int, message: str, **extra: object) -> logging.LogRecord:
    made = logging.LogRecord(name, level, __file__, 1, "%s", (message,), None)
    made.__dict__.update(extra)
    return made


def test_a_json_line_holds_the_fields_that_are_set_and_the_traceback_in_one_field() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        failed = record("lily_mongo", logging.ERROR, "it failed", queue="q", code=None)
        failed.exc_info = sys.exc_info()
    line = JsonFormatter().format(failed)
    assert "\n" not in line
    document = json.loads(line)
    assert document["message"] == "it failed"
    assert document["level"] == "error"
    assert document["queue"] == "q"
    assert "code" not in document  # None: left out
    assert document["error"].startswith("Traceback (most recent call last):")
    assert document["error"].rstrip().endswith("ValueError: boom")


def test_the_delivery_fields_leave_out_a_missing_code_and_give_milliseconds() -> None:
    acked = log_fields("q", "h", "e", "acked", None, 0.0123456)
    assert acked == {"queue": "q", "handler": "h", "event_id": "e", "outcome": "acked", "duration_ms": 12.346}
    dead = log_fields("q", "h", None, "dead_lettered", "ORDER_INVALID", 0.5)
    assert dead["code"] == "ORDER_INVALID"
    assert dead["event_id"] is None


def test_text_lines_of_the_command_are_plain_and_errors_say_so() -> None:
    formatter = TextFormatter()
    assert formatter.format(record(COMMAND_LOGGER, logging.INFO, "running svc")) == "running svc"
    assert formatter.format(record(COMMAND_LOGGER, logging.ERROR, "it broke")) == "error: it broke"
    traced = record(COMMAND_LOGGER, logging.ERROR, "it broke", traceback="Traceback ...\nValueError")
    assert formatter.format(traced).splitlines() == ["Traceback ...", "ValueError", "error: it broke"]
    worker = record(COMMAND_LOGGER, logging.INFO, "running svc", worker=2)
    assert formatter.format(worker) == "[worker 2] running svc"
    library = formatter.format(record("lily_mongo", logging.WARNING, "delivery dead_lettered: queue=q", worker=1))
    assert library.startswith("[worker 1] ")
    assert library.endswith(" WARNING lily_mongo: delivery dead_lettered: queue=q")


@pytest.mark.parametrize(
    ("error", "says"),
    [
        (OSError(errno.EADDRINUSE, "x"), "address already in use"),
        (OSError("could not bind on any address out of [('10.255.255.1', 9467)]"), "is not an address of this machine"),
        (OSError(errno.EACCES, "x"), "permission denied"),
        (OSError(errno.ENETDOWN, "x"), "network is down"),
    ],
)
def test_a_bind_error_names_its_reason(error: OSError, says: str) -> None:
    reason = bind_reason(error, "10.255.255.1")
    assert says in reason
    assert "None" not in reason


def test_a_dying_worker_is_restarted_with_growing_waits_then_given_up() -> None:
    low = [restart_delay(n, jitter=0.0) for n in range(1, MAX_RESTARTS + 1)]
    high = [restart_delay(n, jitter=0.999) for n in range(1, MAX_RESTARTS + 1)]
    assert low == [0.25, 0.5, 1.0, 2.0, 4.0]  # half the step at least: 0.5 s doubling
    assert all(h is not None and l_ is not None and l_ < h < 2 * l_ for l_, h in zip(low, high, strict=True))
    assert restart_delay(MAX_RESTARTS + 1, jitter=0.5) is None


@pytest.mark.parametrize(
    ("finals", "status"),
    [
        ([0, 0], 0),
        ([0, 130], 130),  # one was stopped while it started
        ([0, -15], 130),  # ... before it could even handle the signal
        ([0, 1], 1),  # a forced or failed shutdown
        ([0, None], 1),  # a worker that was dead at the end
        ([130, 1], 1),
    ],
)
def test_the_supervisor_exits_0_only_when_every_worker_shut_down_gracefully(
    finals: list[int | None], status: int
) -> None:
    assert exit_status(finals) == status
