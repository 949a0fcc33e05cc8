"""One physical queue's state in the engine: its options, admission permits, local buffer and counters."""

from __future__ import annotations

import collections

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
        c = self.counters
        return QueueSnapshot(
            queue_index=self.index,
            permits=self.options.concurrency,
            in_flight=self.in_flight,
            buffered=len(self.buffer),
            outcomes=dict(c.outcomes),
            received=c.received,
            transient_replays=c.transient_replays,
            reconciliations=c.reconciliations,
            deferrals=c.deferrals,
            unresolved=c.unresolved,
            abandoned=c.abandoned,
            handoff_failures=c.handoff_failures,
            broker_cancels=c.broker_cancels,
        )
