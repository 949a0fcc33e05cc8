"""The command's log set-up: ``--log-level``, ``--log-format text|json`` and ``--debug``.

The library logs to the ``lily_mongo`` logger and configures nothing itself;
the command does. Delivery lines carry structured fields (``queue``,
``handler``, ``event_id``, ``outcome``, ``code``; ``step`` for shutdown
steps) as ``LogRecord`` attributes, which the JSON format writes as keys.
No line carries a payload or a credential.

JSON lines are written with the standard library's logging and orjson, which
the library already depends on: a formatter of a few lines needs no further
package.
"""

from __future__ import annotations

import datetime
import logging
import sys
from typing import Any

import orjson

__all__ = ["FIELDS", "LEVELS", "JsonFormatter", "configure_logging"]

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
FORMATS = ("text", "json")
FIELDS = ("queue", "handler", "event_id", "outcome", "code", "step")
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the structured fields, the error."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = record.__dict__
        for name in FIELDS:
            value = fields.get(name)
            if value is not None:
                document[name] = value
        if record.exc_info:
            document["error"] = self.formatException(record.exc_info)
        return orjson.dumps(document, default=str).decode()


def configure_logging(level: str = "warning", fmt: str = "text", *, debug: bool = False) -> None:
    """The ``lily-mongo`` command's one log set-up (each call replaces the previous one).

    One stderr handler on the root logger; ``lily_mongo`` at ``level``, other libraries at
    WARNING or above (so ``debug`` shows one line per delivery, not every AMQP frame). The
    AMQP client's own connection-error records repeat the one line the command reports:
    they are shown only with ``debug`` (``--debug``).
    """
    if level not in LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LEVELS)}, got {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT))
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
    for name in ("aiormq", "aio_pika"):
        logging.getLogger(name).setLevel(logging.WARNING if debug else logging.CRITICAL)
