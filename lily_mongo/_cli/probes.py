"""Health, readiness and Prometheus metrics over HTTP for ``lily-mongo run --http-port`` (and ``relay``).

Needs the ``http`` extra: aiohttp's web server runs inside the consumer's event
loop (so every request reads the consumer's state in the thread that changes
it), and prometheus_client writes the text exposition. The library itself
opens no HTTP port (docs/observability.md, section 3); only the command does, when asked.

* ``GET /healthz``: 200 while the process is alive and the supervisor has not
  failed (503 once it ended with an error);
* ``GET /readyz``: 200 only while the consumer runs with every queue consumed and
  its channels open; 503 while starting, reconnecting, without a consumer on a queue
  (the broker cancelled it), draining or stopped;
* ``GET /metrics``: the snapshot's counters and gauges by queue (and outcome),
  and the duration histograms that telemetry keeps (when it is on).

With ``--workers N`` the supervisor serves :class:`WorkerProbes` on the port
instead: each worker runs its own :class:`ProbeServer` on a free loopback port,
and the supervisor asks every worker when it is asked. prometheus_client's
multiprocess mode cannot serve here: it aggregates only its own instruments,
written to shared files, while these metrics are read from each consumer's
snapshot when scraped (docs/deployment.md, section 2).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, GCCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from .._metrics import (
    DELIVERIES,
    OUTBOX_COUNTERS,
    OUTBOX_GAUGES,
    QUEUE_COUNTERS,
    QUEUE_GAUGES,
    READY,
    TRANSPORT_GENERATION,
)

if TYPE_CHECKING:
    from .._snapshots import Snapshot
    from .._supervision import ShutdownReport
    from ..telemetry import Telemetry

__all__ = ["MetricsCollector", "ProbeServer", "Served", "WorkerProbes", "merge_worker_metrics"]


class Served(Protocol):
    """What the probes read: a started :class:`~lily_mongo.ManagedConsumer` or :class:`~lily_mongo.Relay`."""

    @property
    def ready(self) -> bool: ...

    @property
    def state(self) -> str: ...

    def not_ready_because(self) -> str | None: ...

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
        for metric in OUTBOX_COUNTERS:
            yield CounterMetricFamily(metric.prometheus_name, metric.description, value=getattr(snapshot, metric.field))
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
        """Listen (raises OSError when the address is taken); with port 0, :attr:`port` is then the one chosen."""
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        addresses = self._runner.addresses
        if addresses:
            self.port = int(addresses[0][1])

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
        reason = "starting" if managed is None else (managed.not_ready_because() or managed.state)
        return web.Response(status=503, text=f"not ready: {reason}\n")

    async def _metrics(self, _request: web.Request) -> web.Response:
        body = generate_latest(self._registry)
        response = web.Response(body=body)
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response


# -- run --workers: the supervisor's probes --------------------------------------------------------

_ASK_SECONDS = 2.0  # how long the supervisor waits for one worker's answer


def merge_worker_metrics(expositions: Iterable[tuple[int, str]]) -> list[Metric]:
    """The families of several workers' ``/metrics`` texts as one, each sample labelled ``worker``."""
    merged: dict[str, Metric] = {}
    for index, text in expositions:
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation, family.type)
            for sample in family.samples:
                labels = {**sample.labels, "worker": str(index)}
                target.samples.append(Sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar))
    return list(merged.values())


class WorkerView(Protocol):
    """One worker process, as the probes read it."""

    @property
    def index(self) -> int: ...
    @property
    def alive(self) -> bool: ...
    @property
    def http_port(self) -> int | None: ...


class WorkerCount(Protocol):
    @property
    def workers(self) -> int: ...


class SupervisorView(Protocol):
    """What ``/healthz``, ``/readyz`` and ``/metrics`` read from the ``run --workers`` supervisor."""

    @property
    def options(self) -> WorkerCount: ...
    @property
    def workers(self) -> Mapping[int, WorkerView]: ...
    @property
    def restarts(self) -> int: ...
    @property
    def stopping(self) -> bool: ...
    @property
    def failed(self) -> bool: ...


class _WorkerMetrics:
    """Collector of the supervisor's own series and the last merged worker families."""

    def __init__(self, probes: WorkerProbes) -> None:
        self._probes = probes

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        supervisor = self._probes.supervisor
        yield GaugeMetricFamily(
            "lily_workers", "Worker processes configured (run --workers)", value=supervisor.options.workers
        )
        alive = sum(1 for worker in supervisor.workers.values() if worker.alive)
        yield GaugeMetricFamily("lily_workers_alive", "Worker processes running now", value=alive)
        yield CounterMetricFamily(
            "lily_worker_restarts", "Workers restarted after they died", value=supervisor.restarts
        )
        yield from self._probes.families


class WorkerProbes:
    """``/healthz``, ``/readyz`` and ``/metrics`` for every worker of ``run --workers``, on ``host:port``.

    Ready only when every worker answers ready; ``/metrics`` is every worker's, each sample
    labelled ``worker="<n>"``, and the supervisor's own series (workers, restarts).
    """

    def __init__(self, host: str, port: int, supervisor: SupervisorView) -> None:
        self.host = host
        self.port = port
        self.supervisor = supervisor
        self.families: list[Metric] = []
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_WorkerMetrics(self))
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Listen (raises OSError when the address cannot be used)."""
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        addresses = self._runner.addresses
        if addresses:
            self.port = int(addresses[0][1])
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_ASK_SECONDS))

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
        await self._runner.cleanup()

    async def _ask(self, port: int, path: str) -> tuple[int, str] | None:
        assert self._session is not None
        try:
            async with self._session.get(f"http://127.0.0.1:{port}{path}") as response:
                return response.status, await response.text()
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def _healthz(self, _request: web.Request) -> web.Response:
        if self.supervisor.failed:
            return web.Response(status=503, text="gave up on a worker\n")
        return web.Response(text="ok\n")

    async def _readyz(self, _request: web.Request) -> web.Response:
        supervisor = self.supervisor
        indexes = range(1, supervisor.options.workers + 1)

        async def state(index: int) -> str | None:
            worker = supervisor.workers.get(index)
            if supervisor.stopping:
                return "stopping"
            if worker is None or not worker.alive or worker.http_port is None:
                return "starting"
            answer = await self._ask(worker.http_port, "/readyz")
            if answer is None:
                return "not answering"
            return None if answer[0] == 200 else answer[1].strip().removeprefix("not ready: ")

        states = await asyncio.gather(*(state(index) for index in indexes))
        waiting = [f"worker {index}: {text}" for index, text in zip(indexes, states, strict=True) if text is not None]
        if waiting:
            return web.Response(status=503, text=f"not ready: {'; '.join(waiting)}\n")
        return web.Response(text="ready\n")

    async def _metrics(self, _request: web.Request) -> web.Response:
        ports = [
            (worker.index, worker.http_port)
            for worker in sorted(self.supervisor.workers.values(), key=lambda w: w.index)
            if worker.alive and worker.http_port is not None
        ]
        answers = await asyncio.gather(*(self._ask(port, "/metrics") for _, port in ports))
        texts = [(index, answer[1]) for (index, _), answer in zip(ports, answers, strict=True) if answer is not None]
        self.families = merge_worker_metrics(texts)
        body = generate_latest(self._registry)
        response = web.Response(body=body)
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response
