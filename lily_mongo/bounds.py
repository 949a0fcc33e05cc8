"""The single table of every limit (docs/contracts.md section 6, docs/configuration.md).

Every check in the package reads its limit from :data:`BOUNDS`; tests import
the same table for the limits only and state expected outcomes independently.
Sizes are UTF-8 bytes, not characters.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BOUNDS",
    "Bounds",
    "utf8_len",
]

KiB = 1024
MiB = 1024 * KiB


@dataclass(frozen=True, slots=True)
class Bounds:
    """Hard limits of a consumer plan and of every delivery (docs/contracts.md section 6)."""

    physical_queues: int = 256
    linked_handlers: int = 512
    trace_cells: int = 256
    consumer_descriptor_bytes: int = 1024
    aggregate_plan_bytes: int = 256 * KiB
    middleware: int = 64
    guards: int = 64
    handler_parameters: int = 16
    terminal_extractors: int = 1
    concurrency_min: int = 1
    concurrency_max: int = 1024
    prefetch_max: int = 4096
    ack_delay_max: float = 0.1  # seconds an ACK may wait to share a frame (QueueOptions.ack_delay)
    retry_buckets_per_queue: int = 32
    retry_buckets_total: int = 4096
    max_retries: int = 100
    queue_body_default: int = 1 * MiB
    queue_body_max: int = 16 * MiB
    outbox_body_default: int = 8 * MiB
    outbox_body_max: int = 16 * MiB
    name_min_bytes: int = 1
    name_max_bytes: int = 200
    content_kind_max_bytes: int = 64
    header_entries: int = 64
    header_key_bytes: int = 128
    header_value_bytes: int = 8 * KiB
    metadata_aggregate_bytes: int = 32 * KiB
    metadata_depth: int = 4
    metadata_elements: int = 256
    traceparent_bytes: int = 55
    tracestate_bytes: int = 512
    schema_version_min: int = 1
    schema_version_max: int = 65535
    retry_count_max: int = 100
    failure_reason_bytes: int = 512
    failure_code_bytes: int = 64
    # Room kept free in every accepted delivery's metadata for the headers the
    # framework adds on a retry/DLQ handoff (docs/settlement.md section 7): an incoming message
    # is accepted only if its metadata plus this reserve fits the aggregate bound.
    handoff_reserve_bytes: int = 2 * KiB
    terminal_observations: int = 4096


BOUNDS = Bounds()


def utf8_len(text: str) -> int:
    """Length of ``text`` in UTF-8 bytes (surrogates count as replaced)."""
    if text.isascii():
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))
