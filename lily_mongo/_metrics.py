"""The metric catalogue, written once: every metric's name, unit, description and source.

OpenTelemetry (:mod:`lily_mongo.telemetry`) and the command's Prometheus exposition
(``lily-mongo run --http-port``) both read it, so a dashboard sees the same series
either way (docs/observability.md, section 2). A metric is named here as
OpenTelemetry names it; its Prometheus name follows from it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BATCH_SIZE",
    "BATCH_SIZE_BUCKETS",
    "DELIVERIES",
    "DURATION_BUCKETS",
    "HANDLER_DURATION",
    "LAG_BUCKETS",
    "OUTBOX_COUNTERS",
    "OUTBOX_GAUGES",
    "OUTBOX_PUBLISHED",
    "PROCESS_DURATION",
    "QUEUE_COUNTERS",
    "QUEUE_GAUGES",
    "READY",
    "RELAY_LAG",
    "SENT",
    "TRANSPORT_GENERATION",
    "Metric",
]


@dataclass(frozen=True, slots=True)
class Metric:
    """One metric: ``field`` names the snapshot field it reads (``QueueSnapshot`` or ``Snapshot``),
    ``buckets`` a histogram's bucket upper bounds."""

    name: str
    unit: str
    description: str
    field: str = ""
    buckets: tuple[float, ...] = ()

    @property
    def prometheus_name(self) -> str:
        """The Prometheus name: underscores for dots, ``_seconds`` for a duration in seconds
        (the exposition adds ``_total`` to a counter's samples)."""
        name = self.name.replace(".", "_")
        return f"{name}_seconds" if self.unit == "s" else name


# Seconds. The messaging conventions' advisory boundaries, with finer steps below 5 ms:
# a delivery of a no-op handler settles in well under a millisecond.
DURATION_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    30.0,
    60.0,
)
LAG_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

# -- recorded as they happen (telemetry on) -------------------------------------------------------

PROCESS_DURATION = Metric(
    "messaging.process.duration",
    "s",
    "Duration of processing a delivery, from its receipt to its terminal settlement step.",
    buckets=DURATION_BUCKETS,
)
HANDLER_DURATION = Metric(
    "lily.handler.duration",
    "s",
    "Duration of a delivery's execution: handler, middleware and inbox attempts.",
    buckets=DURATION_BUCKETS,
)
RELAY_LAG = Metric(
    "lily.outbox.relay.lag",
    "s",
    "Seconds from an outbox record's commit (its creation, when the backstop relay publishes it) to its "
    "publisher confirm.",
    buckets=LAG_BUCKETS,
)
# Deliveries per batch of a batch handler (docs/handlers.md, "Batch handlers").
BATCH_SIZE_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 4096)
BATCH_SIZE = Metric(
    "lily.batch.size",
    "{delivery}",
    "Deliveries per batch of a batch handler, as dispatched (max_size reached, max_wait passed, or intake stopped).",
    buckets=BATCH_SIZE_BUCKETS,
)
SENT = Metric(
    "messaging.client.sent.messages",
    "{message}",
    "Messages published and confirmed (publisher, hand-offs and outbox relay).",
)

# -- read from the consumer's snapshot when collected or scraped -----------------------------------

QUEUE_COUNTERS = (
    Metric("messaging.client.consumed.messages", "{message}", "Deliveries received.", "received"),
    Metric("lily.inbox.replays", "{replay}", "Transient-error replays of inbox attempts.", "transient_replays"),
    Metric("lily.inbox.reconciliations", "{reconciliation}", "Commit-result reconciliations.", "reconciliations"),
    Metric("lily.deferrals", "{deferral}", "Deferred deliveries (bounded requeues).", "deferrals"),
    Metric("lily.handoff.failures", "{failure}", "Retry or DLQ hand-off publishes that failed.", "handoff_failures"),
    Metric(
        "lily.consumer.cancels",
        "{cancel}",
        "Consumers the broker cancelled (a consumer timeout, a deleted queue), each consumed again.",
        "broker_cancels",
    ),
)
DELIVERIES = Metric("lily.deliveries", "{delivery}", "Deliveries by queue and terminal outcome.", "outcomes")
QUEUE_GAUGES = (
    Metric("lily.deliveries.in_flight", "{delivery}", "Deliveries holding a permit now.", "in_flight"),
    Metric("lily.deliveries.buffered", "{delivery}", "Deliveries waiting in the local buffer.", "buffered"),
    Metric("lily.permits", "{permit}", "Admission permits (handler concurrency).", "permits"),
)
OUTBOX_GAUGES = (
    Metric("lily.outbox.pending", "{record}", "Outbox records waiting for the relay (last pass).", "outbox_pending"),
    Metric("lily.outbox.failed", "{record}", "Outbox records parked as failed.", "outbox_failed"),
)
# Only on the command's /metrics (the probes' view of the process).
OUTBOX_PUBLISHED = Metric("lily.outbox.published", "{record}", "Outbox records published.", "outbox_published")
OUTBOX_COUNTERS = (
    OUTBOX_PUBLISHED,
    Metric(
        "lily.outbox.released",
        "{record}",
        "Outbox records released after a transport failure, their attempts not counted.",
        "outbox_released",
    ),
    Metric(
        "lily.outbox.blocked",
        "s",
        "Seconds the outbox waited, publishing nothing, while the broker blocked its connection.",
        "outbox_blocked_seconds",
    ),
)
READY = Metric("lily.ready", "", "1 while the consumer runs with every queue consumed and its channels open.")
TRANSPORT_GENERATION = Metric(
    "lily.transport.generation", "", "AMQP transport generation (1 + reconnects).", "transport_generation"
)
