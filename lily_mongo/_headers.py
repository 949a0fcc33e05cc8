"""Every header name the framework reads or writes, spelled once (docs/contracts.md, docs/settlement.md).

The envelope's own (re-exported by :mod:`lily_mongo.envelope`), the ones a handoff copy carries,
and the broker's.
"""

from __future__ import annotations

__all__ = [
    "BROKER_COUNT_HEADERS",
    "CONTENT_KIND_HEADER",
    "DEATH_HEADER",
    "DELIVERY_COUNT_HEADER",
    "EVENT_ID_HEADER",
    "FAILED_AT_HEADER",
    "FAILED_QUEUE_HEADER",
    "FAILURE_CODE_HEADER",
    "FAILURE_HEADER_KEYS",
    "FAILURE_REASON_HEADER",
    "HANDOFF_HEADER_KEYS",
    "RETRY_COUNT_HEADER",
    "SCHEMA_VERSION_HEADER",
    "TRACEPARENT_HEADER",
    "TRACESTATE_HEADER",
]

# The envelope (docs/contracts.md, section 2).
EVENT_ID_HEADER = "x-lily-event-id"
SCHEMA_VERSION_HEADER = "x-lily-schema-version"
CONTENT_KIND_HEADER = "x-lily-content-kind"
# The W3C trace context.
TRACEPARENT_HEADER = "traceparent"
TRACESTATE_HEADER = "tracestate"

# The headers the framework writes on a handoff copy (docs/settlement.md section 7), spelled once:
# every module that reads or writes them imports these names.
RETRY_COUNT_HEADER = "x-retry-count"
FAILURE_CODE_HEADER = "x-lily-failure-code"
FAILURE_REASON_HEADER = "x-lily-failure-reason"
FAILED_QUEUE_HEADER = "x-lily-failed-queue"
FAILED_AT_HEADER = "x-lily-failed-at"
# The four that say why and where a copy failed (a retry copy and a DLQ copy carry them).
FAILURE_HEADER_KEYS: tuple[str, ...] = (
    FAILURE_CODE_HEADER,
    FAILURE_REASON_HEADER,
    FAILED_QUEUE_HEADER,
    FAILED_AT_HEADER,
)
# They are replaced, not added, when an incoming copy already carries them (a replayed DLQ message).
HANDOFF_HEADER_KEYS: frozenset[str] = frozenset({RETRY_COUNT_HEADER, *FAILURE_HEADER_KEYS})
# The header RabbitMQ adds each time it dead-letters a message: an array of tables, latest first.
DEATH_HEADER = "x-death"
# Set by RabbitMQ on quorum-queue redeliveries; bounds deferrals across processes.
DELIVERY_COUNT_HEADER = "x-delivery-count"
# The broker's per-message delivery counters (``x-acquired-count``: RabbitMQ 4). A copy made
# from a message (a retry or DLQ hand-off, a DLQ replay) is a new message: it drops them.
BROKER_COUNT_HEADERS = (DELIVERY_COUNT_HEADER, "x-acquired-count")
