"""Traces and metrics through the OpenTelemetry API (``docs/observability.md``).

When ``opentelemetry-api`` is importable (the ``otel`` extra), a consumer and a
publisher use the globally configured ``TracerProvider`` and ``MeterProvider``
with no further set-up; ``Consumer(..., telemetry=False)`` turns it off, and
``telemetry=Telemetry(tracer_provider=..., meter_provider=...)`` chooses other
providers. :class:`Telemetry` is the engine's :class:`~lily_mongo._observer.Observer`;
without the API, or turned off, the engine reports to the no-op observer instead,
and each reporting point costs one call of an empty method.

What is emitted follows the OpenTelemetry messaging semantic conventions:

* one ``CONSUMER`` span per delivery, ``process <queue>``, continuing the
  delivery's W3C ``traceparent``/``tracestate`` (a new trace when absent or
  invalid), with the handler, the event id, the terminal outcome and the
  failure code; error status for dead letters and unresolved outcomes;
* ``INTERNAL`` child spans for the inbox steps (``inbox claim``, ``inbox
  attempt`` per attempt, ``inbox commit``, ``inbox reconcile``);
* a ``PRODUCER`` span for every publish (:class:`~lily_mongo.Publisher`, retry
  and DLQ hand-offs, the outbox's dispatcher and relay) that writes its own
  ``traceparent`` into the message. An outbox record stores the ``traceparent``
  of the attempt that wrote it, and its publish span (the dispatcher's right
  after the commit, or the backstop relay's) is that context's child: the event
  stays in the trace of the delivery that caused it;
* histograms recorded per delivery (``messaging.process.duration``,
  ``lily.handler.duration``, ``lily.outbox.relay.lag``) and observable
  instruments that read the consumer's snapshot when collected (deliveries by
  queue and outcome, replays, deferrals, reconciliations, hand-off failures,
  in-flight deliveries, permits, outbox pending and failed).

The metrics' names, units and descriptions are the catalogue in
:mod:`lily_mongo._metrics`; the instruments are ``_instruments``, what spans record ``_spans``, the
trace context a message carries ``_context``, the observer and a delivery's span ``_telemetry``. Nothing of the
OpenTelemetry API is imported before a :class:`Telemetry` is made (``import lily_mongo`` stays
light; docs/observability.md). Attributes never carry payloads, header values
other than the trace context, credentials or connection strings. Metric
attributes are the queue and the outcome only: event ids stay on spans.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import TYPE_CHECKING, Any

from .._errors import ConfigError
from .._metrics import DURATION_BUCKETS, LAG_BUCKETS

if TYPE_CHECKING:
    from ._instruments import HistogramData
    from ._telemetry import DeliveryTrace, Telemetry

__all__ = [
    "AVAILABLE",
    "DURATION_BUCKETS",
    "LAG_BUCKETS",
    "DeliveryTrace",
    "HistogramData",
    "Telemetry",
    "resolve_telemetry",
]

AVAILABLE = importlib.util.find_spec("opentelemetry") is not None
"""True when ``opentelemetry-api`` is installed (the ``otel`` extra)."""

_LAZY = {"Telemetry": "_telemetry", "DeliveryTrace": "_telemetry", "HistogramData": "_instruments"}


def __getattr__(name: str) -> Any:
    """The names that need the OpenTelemetry API, imported on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not AVAILABLE:
        raise ConfigError(f"{name} needs opentelemetry-api: pip install 'lily-mongo[otel]'")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def resolve_telemetry(option: bool | Telemetry | None) -> Telemetry | None:
    """``True`` (the default): the global providers when the API is installed, else off;
    ``False`` or ``None``: off; a :class:`Telemetry`: that one."""
    if option is True:
        if not AVAILABLE:
            return None
        from ._telemetry import Telemetry

        return Telemetry()
    if option is False or option is None:
        return None
    made = sys.modules.get(f"{__name__}._telemetry")  # a Telemetry exists only once its module is loaded
    if made is not None and isinstance(option, made.Telemetry):
        telemetry: Telemetry = option
        return telemetry
    raise ConfigError(f"telemetry must be True, False or a Telemetry, got {type(option).__name__}")
