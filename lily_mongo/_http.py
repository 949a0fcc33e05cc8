"""Health, readiness and Prometheus metrics over HTTP for ``lily-mongo run --http-port`` (and ``relay``).

Needs the ``http`` extra: aiohttp's web server runs inside the consumer's event
loop (so every request reads the consumer's state in the thread that changes
it), and prometheus_client writes the text exposition. The library itself
opens no HTTP port (docs/observability.md, section 3); only the command does, when asked.

* ``GET /healthz``: 200 while the process is alive and the supervisor has not
  failed (503 once it ended with an error);
* ``GET /readyz``: 200 only while the consumer runs with its channels open;
  503 while starting, reconnecting, draining or stopped;
* ``GET /metrics``: the snapshot's counters and gauges by queue (and outcome),
  and the duration histograms that telemetry keeps (when it is on).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, GCCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from ._metrics import (
    DELIVERIES,
    OUTBOX_GAUGES,
    OUTBOX_PUBLISHED,
    QUEUE_COUNTERS,
    QUEUE_GAUGES,
    READY,
    TRANSPORT_GENERATION,
)

if TYPE_CHECKING:
    from .lifecycle import ShutdownReport
    from .observe import Snapshot
    from .telemetry import Telemetry

__all__ = ["MetricsCollector", "ProbeServer", "Served"]


class Served(Protocol):
    """What the probes read: a started :class:`~lily_mongo.ManagedConsumer` or :class:`~lily_mongo.Relay`."""

    @property
    def ready(self) -> bool: ...

    @property
    def state(self) -> str: ...

    @property
    def telemetry(self) -> Telemetry | None: ...

    @property
    def queue_names(self) -> tuple[str, ...]: ...

    def snapshot(self) -> Snapshot: ...

    async def wait(self) -> ShutdownReport: ...


class MetricsCollector:
    """A prometheus_client collector that reads the consumer's snapshot when scraped."""

    def __init__(self, server: ProbeServer) -> None:
        self._server = server

    def describe(self) -> list[Metric]:
        return []  # the families depend on the consumer attached; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        managed = self._server.managed
        ready = GaugeMetricFamily(READY.prometheus_name, READY.description)
        ready.add_metric([], 1.0 if managed is not None and managed.ready else 0.0)
        yield ready
        if managed is None:
            return
        snapshot = managed.snapshot()
        names = managed.queue_names
        generation = GaugeMetricFamily(TRANSPORT_GENERATION.prometheus_name, TRANSPORT_GENERATION.description)
        generation.add_metric([], getattr(snapshot, TRANSPORT_GENERATION.field))
        yield generation
        outcomes = CounterMetricFamily(DELIVERIES.prometheus_name, DELIVERIES.description, labels=["queue", "outcome"])
        for queue in snapshot.queues:
            for outcome, count in sorted(getattr(queue, DELIVERIES.field).items()):
                outcomes.add_metric([names[queue.queue_index], outcome], count)
        yield outcomes
        for metric in QUEUE_COUNTERS:
            counter = CounterMetricFamily(metric.prometheus_name, metric.description, labels=["queue"])
            for queue in snapshot.queues:
                counter.add_metric([names[queue.queue_index]], getattr(queue, metric.field))
            yield counter
        for metric in QUEUE_GAUGES:
            gauge = GaugeMetricFamily(metric.prometheus_name, metric.description, labels=["queue"])
            for queue in snapshot.queues:
                gauge.add_metric([names[queue.queue_index]], getattr(queue, metric.field))
            yield gauge
        for metric in OUTBOX_GAUGES:
            value = getattr(snapshot, metric.field)
            if value is not None:
                yield GaugeMetricFamily(metric.prometheus_name, metric.description, value=value)
        yield CounterMetricFamily(
            OUTBOX_PUBLISHED.prometheus_name, OUTBOX_PUBLISHED.description, value=snapshot.outbox_published
        )
        telemetry = managed.telemetry
        if telemetry is None:
            return
        for histogram in telemetry.histograms():
            series = histogram.data()
            labels = [key for key, _ in series[0].labels] if series else []
            family = HistogramMetricFamily(histogram.name, histogram.description, labels=labels)
            for data in series:
                cumulative, buckets = 0, []
                for bound, count in zip((*data.bounds, float("inf")), data.buckets, strict=True):
                    cumulative += count
                    buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
                family.add_metric([value for _, value in data.labels], buckets, data.total)
            yield family


class ProbeServer:
    """``/healthz``, ``/readyz`` and ``/metrics`` on ``host:port``, started before the consumer."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.managed: Served | None = None
        self._supervisor: asyncio.Future[ShutdownReport] | None = None
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(MetricsCollector(self))
        ProcessCollector(registry=self._registry)
        GCCollector(registry=self._registry)
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)

    async def start(self) -> None:
        """Listen (raises OSError when the address is taken)."""
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()

    def attach(self, managed: Served) -> None:
        """Serve this started consumer's (or relay's) state from now on."""
        self.managed = managed
        self._supervisor = asyncio.ensure_future(managed.wait())  # an observer: cancelling it stops nothing

    async def stop(self) -> None:
        if self._supervisor is not None and not self._supervisor.done():
            self._supervisor.cancel()
        await self._runner.cleanup()

    def _failed(self) -> bool:
        supervisor = self._supervisor
        if supervisor is None or not supervisor.done() or supervisor.cancelled():
            return False
        return supervisor.exception() is not None

    async def _healthz(self, _request: web.Request) -> web.Response:
        if self._failed():
            return web.Response(status=503, text="supervisor failed\n")
        return web.Response(text="ok\n")

    async def _readyz(self, _request: web.Request) -> web.Response:
        managed = self.managed
        if managed is not None and managed.ready:
            return web.Response(text="ready\n")
        state = managed.state if managed is not None else "starting"
        return web.Response(status=503, text=f"not ready: {state}\n")

    async def _metrics(self, _request: web.Request) -> web.Response:
        body = generate_latest(self._registry)
        response = web.Response(body=body)
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response
