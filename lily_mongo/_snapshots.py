"""Operational snapshots and terminal observations (docs/operations.md).

:class:`QueueSnapshot` and :class:`Snapshot` are bounded aggregates: counts
only, never payloads, event ids, routing keys, endpoints or credentials.
Queues are named by their position in the plan (``queue_index``), not by name.
:class:`TerminalObservation` is the separate diagnostic record of how one
delivery ended; it may carry the event id.
"""

from __future__ import annotations

import collections
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypedDict

from .bounds import BOUNDS

__all__ = ["ObservationLog", "OutboxFigures", "QueueCounters", "QueueSnapshot", "Snapshot", "TerminalObservation"]


@dataclass(frozen=True, slots=True)
class TerminalObservation:
    """How one delivery ended, with the evidence behind it."""

    queue: str
    handler_id: str | None
    event_id: uuid.UUID | None
    outcome: str  # a settlement.Terminal value
    code: str | None
    reason: str
    handoff_confirmed: bool
    ack_sent: bool
    broker_native: bool
    attempts: int
    transient_replays: int
    reconciliations: int
    received_at: float  # wall-clock epoch seconds
    duration: float  # seconds from receipt to the terminal step


_Fields = tuple[str, str | None, uuid.UUID | None, str, str | None, str, bool, bool, bool, int, int, int, float, float]


class ObservationLog:
    """The last :data:`BOUNDS.terminal_observations` terminal outcomes, oldest first.

    Recorded as plain tuples and turned into :class:`TerminalObservation` values only
    when read: building the frozen dataclass costs about 7 µs of the 0.1 µs a tuple
    does, on every delivery (``benchmarks/bench_throughput.py``).
    """

    def __init__(self, capacity: int = BOUNDS.terminal_observations) -> None:
        self._items: collections.deque[_Fields] = collections.deque(maxlen=capacity)

    def record(
        self,
        queue: str,
        handler_id: str | None,
        event_id: uuid.UUID | None,
        outcome: str,
        code: str | None,
        reason: str,
        handoff_confirmed: bool,
        ack_sent: bool,
        broker_native: bool,
        attempts: int,
        transient_replays: int,
        reconciliations: int,
        received_at: float,
        duration: float,
    ) -> None:
        """Record one terminal outcome (the fields of :class:`TerminalObservation`)."""
        self._items.append(
            (
                queue,
                handler_id,
                event_id,
                outcome,
                code,
                reason,
                handoff_confirmed,
                ack_sent,
                broker_native,
                attempts,
                transient_replays,
                reconciliations,
                received_at,
                duration,
            )
        )

    def items(self) -> tuple[TerminalObservation, ...]:
        return tuple(TerminalObservation(*fields) for fields in self._items)

    def __len__(self) -> int:
        return len(self._items)


@dataclass(slots=True)
class QueueCounters:
    """Mutable per-queue counters owned by the runtime (aggregates only)."""

    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    transient_replays: int = 0
    reconciliations: int = 0
    deferrals: int = 0
    unresolved: int = 0
    abandoned: int = 0
    received: int = 0
    handoff_failures: int = 0  # retry/DLQ copies whose publish failed
    broker_cancels: int = 0  # consumers of the queue the broker cancelled (basic.cancel)


@dataclass(frozen=True, slots=True)
class QueueSnapshot:
    """One queue's bounded aggregate state."""

    queue_index: int
    permits: int
    in_flight: int
    buffered: int
    outcomes: Mapping[str, int]
    received: int
    transient_replays: int
    reconciliations: int
    deferrals: int
    unresolved: int
    abandoned: int
    handoff_failures: int = 0
    broker_cancels: int = 0
    """Consumers of the queue the broker cancelled (a consumer timeout, a deleted queue); each consumed again."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The consumer's bounded aggregate state: lifecycle, transport, queues, outbox."""

    state: str
    transport_generation: int
    queues: tuple[QueueSnapshot, ...]
    outbox_pending: int | None = None
    outbox_failed: int | None = None
    outbox_published: int = 0
    outbox_unroutable: int = 0
    """Relay publishes the broker returned as unroutable since start (a missing destination queue)."""
    outbox_released: int = 0
    """Outbox records released after a transport failure since start, their attempts not counted."""
    outbox_blocked_seconds: float = 0.0
    """Seconds the outbox's publishers waited while the broker blocked their connection (an alarm)."""


class OutboxFigures(TypedDict):
    """The outbox fields of a :class:`Snapshot`, as one process's outbox counted them; a consumer
    without an outbox leaves them at their defaults (none counted, nothing published)."""

    outbox_pending: int | None
    outbox_failed: int | None
    outbox_published: int
    outbox_unroutable: int
    outbox_released: int
    outbox_blocked_seconds: float
