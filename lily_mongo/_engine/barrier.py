"""The ACKs of one batch, written together (docs/handlers.md, "Batch handlers"; docs/settlement.md, section 2).

Each delivery of a committed batch settles in its own task, as any delivery does. Its ACK waits at the
batch's :class:`SettleBarrier` until every delivery of the batch has reached its own settlement write (or
will write nothing): the retry and DLQ copies of its failed events are confirmed first, and the ACKs are
then marked in one turn of the event loop, so the channel's ACK coalescer writes them as one
``basic.ack`` with ``multiple`` set.
"""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["SettleBarrier"]


class SettleBarrier:
    """Counts the deliveries of one batch that have reached their settlement write; releases the ACKs at the last.

    ``bound`` caps the wait of an ACK (seconds): a delivery that never reaches a write (its task was
    cancelled) holds the others that long at most.
    """

    __slots__ = ("_arrived", "_bound", "_members", "_released")

    def __init__(self, members: int, bound: float) -> None:
        self._members = members
        self._bound = bound
        self._arrived: set[int] = set()
        self._released = asyncio.Event()
        if members <= 0:
            self._released.set()

    def arrive(self, member: object) -> None:
        """``member`` reached its settlement write, or decided to write none (idempotent)."""
        self._arrived.add(id(member))
        if len(self._arrived) >= self._members:
            self._released.set()

    async def ready_to_ack(self, member: object) -> None:
        """``member`` is about to ACK: wait until every member of the batch has arrived (bounded)."""
        self.arrive(member)
        if not self._released.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._released.wait(), self._bound)
