"""One physical queue's state in the engine: its options, admission permits, local buffer and counters."""

from __future__ import annotations

import collections
import dataclasses

from .._lru import LruCounter
from .._plan.options import QueueOptions
from .._snapshots import QueueCounters, QueueSnapshot
from .message import InboundMessage

__all__ = ["QueueState"]

_COUNTER_MEMORY = 4096  # events remembered per queue for the handoff-failure and deferral counts


class QueueState:
    """Per physical queue: options, free permits, the buffer of admitted-later messages, counters.

    A message is admitted at once while a permit is free and buffered otherwise; at most
    ``concurrency`` deliveries hold permits (docs/lifecycle.md, section 3).
    """

    def __init__(self, index: int, options: QueueOptions) -> None:
        self.index = index
        self.options = options
        self.free_permits = options.concurrency
        self.buffer: collections.deque[InboundMessage] = collections.deque()
        self.in_flight = 0
        self.counters = QueueCounters()
        self.handoff_failures: LruCounter[bytes] = LruCounter(_COUNTER_MEMORY)
        self.dlq_unroutable = False
        self.deferral_counts: LruCounter[bytes] = LruCounter(_COUNTER_MEMORY)

    def snapshot(self) -> QueueSnapshot:
        """The queue's figures now: every counter of :class:`QueueCounters` under its own name."""
        counters = self.counters
        figures = {field.name: getattr(counters, field.name) for field in dataclasses.fields(counters)}
        figures["outcomes"] = dict(counters.outcomes)  # a copy: the counter goes on counting
        return QueueSnapshot(
            queue_index=self.index,
            permits=self.options.concurrency,
            in_flight=self.in_flight,
            buffered=len(self.buffer),
            **figures,
        )
