"""Telemetry pieces that need no extra: the JSON log lines, and telemetry off without the OpenTelemetry API.

Spans, metrics and the Prometheus exposition need the extras: tests/extras/test_telemetry.py."""

from __future__ import annotations

import json
import logging

import pytest

from lily_mongo import ConfigError
from lily_mongo import telemetry as telemetry_module
from lily_mongo._cli.logs import JsonFormatter, configure_logging
from lily_mongo.telemetry import resolve_telemetry

# -- log lines -------------------------------------------------------------------------------------------


def test_json_log_lines_carry_the_delivery_fields() -> None:
    record = logging.LogRecord("lily_mongo", logging.WARNING, __file__, 1, "delivery %s", ("dead_lettered",), None)
    fields = {"queue": "orders", "handler": "orders/h", "event_id": "e", "outcome": "dead_lettered", "code": "X"}
    record.__dict__.update(fields, password="never")
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "delivery dead_lettered"
    assert line["level"] == "warning"
    assert {k: line[k] for k in fields} == fields
    assert "password" not in line


def test_configure_logging_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="--log-level"):
        configure_logging("verbose", "text")
    with pytest.raises(ValueError, match="--log-format"):
        configure_logging("info", "xml")


def test_without_the_api_telemetry_is_off_by_default_and_cannot_be_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(telemetry_module, "AVAILABLE", False)
    monkeypatch.delitem(vars(telemetry_module), "Telemetry", raising=False)  # as if never imported
    assert resolve_telemetry(True) is None
    with pytest.raises(ConfigError, match="opentelemetry-api"):
        telemetry_module.Telemetry  # noqa: B018 - the name needs the API


def test_a_consumer_without_telemetry_imports_nothing_of_the_api() -> None:
    import subprocess
    import sys

    script = (
        "import sys, lily_mongo\n"
        "lily_mongo.Consumer(amqp_url='amqp://unused/', name='t', telemetry=False)\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
