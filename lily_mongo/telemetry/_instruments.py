"""The metric instruments a :class:`Telemetry` records to, made once per meter provider (the catalogue is
:mod:`lily_mongo._metrics`)."""

from __future__ import annotations

import bisect
import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry import metrics as otel_metrics

from .._metrics import (
    BATCH_SIZE,
    DELIVERIES,
    HANDLER_DURATION,
    OUTBOX_GAUGES,
    PROCESS_DURATION,
    QUEUE_COUNTERS,
    QUEUE_GAUGES,
    RELAY_LAG,
    SENT,
    Metric,
)
from .._observer import SnapshotSource
from .._snapshots import Snapshot

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation


SCOPE = "lily_mongo"  # the instrumentation scope of every tracer and meter
SYSTEM = "rabbitmq"  # messaging.system


@dataclass(frozen=True, slots=True)
class HistogramData:
    """One histogram series, cumulative since start: bucket upper bounds and counts, sum, count."""

    labels: tuple[tuple[str, str], ...]
    bounds: tuple[float, ...]
    buckets: tuple[int, ...]  # per bound, then the overflow bucket (not cumulative)
    total: float
    count: int


class Histogram:
    """A fixed-bucket histogram per label set, kept in process for the Prometheus exposition
    (``lily-mongo run --http-port``), which cannot read the OpenTelemetry SDK's aggregates."""

    __slots__ = ("bounds", "description", "name", "series")

    def __init__(self, metric: Metric) -> None:
        self.name = metric.prometheus_name
        self.description = metric.description
        self.bounds = metric.buckets
        self.series: dict[tuple[tuple[str, str], ...], list[Any]] = {}

    def record(self, labels: tuple[tuple[str, str], ...], value: float) -> None:
        series = self.series.get(labels)
        if series is None:
            series = self.series[labels] = [[0] * (len(self.bounds) + 1), 0.0, 0]
        series[0][bisect.bisect_left(self.bounds, value)] += 1
        series[1] += value
        series[2] += 1

    def data(self) -> list[HistogramData]:
        return [
            HistogramData(labels, self.bounds, tuple(counts), total, count)
            for labels, (counts, total, count) in list(self.series.items())
        ]


class Instruments:
    """The instruments of one meter provider, created once: OpenTelemetry keeps instruments
    per provider and name, so every :class:`Telemetry` on one provider shares them."""

    def __init__(self, provider: MeterProvider) -> None:
        meter = provider.get_meter(SCOPE)
        self.sources: dict[int, SnapshotSource] = {}
        self.keys = itertools.count()
        self.process_duration, self.handler_duration, self.relay_lag, self.batch_size = (
            meter.create_histogram(
                m.name, unit=m.unit, description=m.description, explicit_bucket_boundaries_advisory=m.buckets
            )
            for m in (PROCESS_DURATION, HANDLER_DURATION, RELAY_LAG, BATCH_SIZE)
        )
        self.sent = meter.create_counter(SENT.name, unit=SENT.unit, description=SENT.description)
        for m in QUEUE_COUNTERS:
            meter.create_observable_counter(
                m.name, callbacks=[self._per_queue(m.field)], unit=m.unit, description=m.description
            )
        meter.create_observable_counter(
            DELIVERIES.name, callbacks=[self._outcomes], unit=DELIVERIES.unit, description=DELIVERIES.description
        )
        for m in QUEUE_GAUGES:
            meter.create_observable_up_down_counter(
                m.name, callbacks=[self._per_queue(m.field)], unit=m.unit, description=m.description
            )
        for m in OUTBOX_GAUGES:
            meter.create_observable_up_down_counter(
                m.name, callbacks=[self._outbox(m.field)], unit=m.unit, description=m.description
            )

    def _snapshots(self) -> Iterator[tuple[Snapshot, tuple[str, ...]]]:
        # Collection may run on a metric reader's thread: a snapshot copies plain ints
        # and dicts under the GIL, and the source list is copied before iterating.
        for source in list(self.sources.values()):
            yield source()

    def _per_queue(self, field_name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            totals: dict[str, int] = {}
            for snapshot, names in self._snapshots():
                for queue in snapshot.queues:
                    name = names[queue.queue_index]
                    totals[name] = totals.get(name, 0) + int(getattr(queue, field_name))
            return [
                otel_metrics.Observation(value, {"messaging.system": SYSTEM, "messaging.destination.name": name})
                for name, value in totals.items()
            ]

        return observe

    def _outcomes(self, _options: CallbackOptions) -> Iterable[Observation]:
        totals: dict[tuple[str, str], int] = {}
        for snapshot, names in self._snapshots():
            for queue in snapshot.queues:
                for outcome, count in queue.outcomes.items():
                    key = (names[queue.queue_index], outcome)
                    totals[key] = totals.get(key, 0) + count
        return [
            otel_metrics.Observation(
                value, {"messaging.system": SYSTEM, "messaging.destination.name": name, "lily.outcome": outcome}
            )
            for (name, outcome), value in totals.items()
        ]

    def _outbox(self, field_name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            values = [getattr(snapshot, field_name) for snapshot, _ in self._snapshots()]
            known = [int(v) for v in values if v is not None]
            return [otel_metrics.Observation(sum(known))] if known else []

        return observe


_INSTRUMENTS: weakref.WeakKeyDictionary[Any, Instruments] = weakref.WeakKeyDictionary()


def instruments_for(provider: MeterProvider) -> Instruments:
    instruments = _INSTRUMENTS.get(provider)
    if instruments is None:
        instruments = _INSTRUMENTS[provider] = Instruments(provider)
    return instruments
