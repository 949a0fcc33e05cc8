"""The command's log set-up: ``--log-level``, ``--log-format text|json`` and ``--debug``.

The library logs to the ``lily_mongo`` logger and configures nothing itself;
the command does. Delivery lines carry structured fields (``queue``,
``handler``, ``event_id``, ``outcome``, ``code`` when there is one,
``duration_ms``; ``step`` for shutdown steps) as ``LogRecord`` attributes,
which the JSON format writes as keys, with ``trace_id`` and ``span_id`` while
an OpenTelemetry span is current. No line carries a payload or a credential.

The command's own lines (the banner, the shutdown report, its errors) go
through the ``lily_mongo.cli`` logger, so with ``--log-format json`` every line
on stderr is one JSON object; as text they are printed as they are (an error
as ``error: ...``). Python warnings are routed through logging too.

JSON lines are written with the standard library's logging and orjson, which
the library already depends on: a formatter of a few lines needs no further
package.
"""

from __future__ import annotations

import datetime
import logging
import sys
from collections.abc import Callable
from typing import Any

import orjson

__all__ = ["COMMAND_LOGGER", "FIELDS", "LEVELS", "JsonFormatter", "TextFormatter", "configure_logging", "json_line"]

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
FORMATS = ("text", "json")
# Structured fields a record may carry (``extra=``), written as JSON keys when set.
FIELDS = (
    "queue",
    "handler",
    "event_id",
    "outcome",
    "code",
    "duration_ms",
    "attempt",
    "retry_count",
    "step",
    "signal",
    "worker",
    "pid",
    "uri",
    "report",
    "progress",
    "traceback",
    "trace_id",
    "span_id",
)
COMMAND_LOGGER = "lily_mongo.cli"
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def json_line(
    level: str, logger: str, message: str, fields: dict[str, Any], *, created: float, error: str | None = None
) -> str:
    """One JSON object on one line: time, level, logger, message, the fields that are set, the error."""
    document: dict[str, Any] = {
        "time": datetime.datetime.fromtimestamp(created, datetime.UTC).isoformat(timespec="milliseconds"),
        "level": level,
        "logger": logger,
        "message": message,
    }
    for name in FIELDS:
        value = fields.get(name)
        if value is not None:
            document[name] = value
    if error is not None:
        document["error"] = error
    return orjson.dumps(document, default=str).decode()


class JsonFormatter(logging.Formatter):
    """One JSON object per line; a traceback (``exc_info``, ``stack_info``) is the ``error`` field, never more lines."""

    def format(self, record: logging.LogRecord) -> str:
        error = None
        if record.exc_info:
            error = self.formatException(record.exc_info)
        if record.stack_info:
            stack = self.formatStack(record.stack_info)
            error = f"{error}\n{stack}" if error else stack
        return json_line(
            record.levelname.lower(),
            record.name,
            record.getMessage(),
            record.__dict__,
            created=record.created,
            error=error,
        )


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message`` (and a traceback's lines); the command's own lines as they are."""

    def __init__(self) -> None:
        super().__init__(_TEXT)

    def format(self, record: logging.LogRecord) -> str:
        worker = getattr(record, "worker", None)
        prefix = f"[worker {worker}] " if worker is not None else ""
        if record.name != COMMAND_LOGGER:
            return prefix + super().format(record)
        text = record.getMessage()
        if record.levelno >= logging.ERROR:
            text = f"error: {text}"
        traceback = getattr(record, "traceback", None)
        if traceback:
            text = f"{traceback}\n{text}"
        return "\n".join(prefix + line for line in text.splitlines()) if prefix else text


class _Context(logging.Filter):
    """Adds the worker index and the current span's trace and span ids to every record."""

    def __init__(self, worker: int | None, span_ids: Callable[[], tuple[str, str] | None]) -> None:
        super().__init__()
        self._worker = worker
        self._span_ids = span_ids

    def filter(self, record: logging.LogRecord) -> bool:
        if self._worker is not None:
            record.worker = self._worker
        if getattr(record, "trace_id", None) is None:
            ids = self._span_ids()
            if ids is not None:
                record.trace_id, record.span_id = ids
        return True


def _span_ids_reader() -> Callable[[], tuple[str, str] | None]:
    """Reads the current OpenTelemetry span's ids (W3C hex). The API is not imported for it: while
    nothing else imported ``opentelemetry.trace``, no span can be current (and a command that makes
    none, ``--help``, does not pay for the import)."""

    def span_ids() -> tuple[str, str] | None:
        trace = sys.modules.get("opentelemetry.trace")
        if trace is None:
            return None
        context = trace.get_current_span().get_span_context()
        if not context.is_valid:
            return None
        return f"{context.trace_id:032x}", f"{context.span_id:016x}"

    return span_ids


def configure_logging(
    level: str = "warning", fmt: str = "text", *, debug: bool = False, worker: int | None = None
) -> None:
    """The ``lily-mongo`` command's one log set-up (each call replaces the previous one).

    One stderr handler on the root logger; ``lily_mongo`` at ``level``, other libraries at
    WARNING or above (so ``debug`` shows one line per delivery, not every AMQP frame); the
    command's own lines (``lily_mongo.cli``) at INFO whatever the level. The AMQP client's
    own connection-error records repeat the one line the command reports: they are shown
    only with ``debug`` (``--debug``). ``worker`` tags every line of a ``--workers`` process.
    """
    if level not in LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LEVELS)}, got {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_Context(worker, _span_ids_reader()))
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(max(LEVELS[level], logging.WARNING))
    package = logging.getLogger("lily_mongo")
    for existing in list(package.handlers):  # the console script's default handler: this one replaces it
        package.removeHandler(existing)
    package.propagate = True
    package.setLevel(LEVELS[level])
    logging.getLogger(COMMAND_LOGGER).setLevel(logging.INFO)
    for name in ("aiormq", "aio_pika"):
        logging.getLogger(name).setLevel(logging.WARNING if debug else logging.CRITICAL)
    logging.captureWarnings(True)  # a warning is one line (one JSON object) like the rest
