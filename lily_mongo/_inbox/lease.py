"""One delivery's claim on its record: the lease, and the bounds of the waits made for it (docs/inbox.md,
"Bounded waits")."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

__all__ = ["Lease", "LeaseDeadline", "in_time", "now", "retrieved", "share"]

log = logging.getLogger("lily_mongo")


@dataclass(slots=True, eq=False)
class Lease:
    """One delivery's claim on its record ``key``: owner, fencing token, and where its attempt is."""

    key: str
    owner: str
    token: int
    renewed_at: float  # the event loop's clock
    wait: float  # the bound on each write of the record outside a transaction (maxTimeMS)
    until: float | None = None  # the delivery's deadline (the event loop's clock), when known
    handler_id: str = ""
    event_id: str = ""
    holding: bool = False  # the attempt's transaction has written the record and not ended
    lost: bool = False
    first: bool = False  # no lease: the attempt's transaction claims the record (a first-time copy)
    started: float = 0.0  # when the current attempt's transaction started (the event loop's clock)
    cancelled_age: float | None = None  # the age of its transaction when an attempt was cancelled
    expirations: int = 0  # attempts of this delivery whose transaction outlived the lifetime


def now() -> float:
    """The event loop's clock (monotonic seconds)."""
    return asyncio.get_running_loop().time()


def retrieved(task: asyncio.Future[Any]) -> None:
    """Mark a shielded task's outcome as seen (its awaiter may have been cancelled meanwhile)."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("a shielded inbox write failed", exc_info=task.exception())


def in_time(lease: Lease) -> float:
    """The bound of a wait before the handler runs: the lease's, and at most half the time left
    before the delivery's deadline, so that a wait ends as a deferral, never cut off by the
    deadline as a timeout (an application retry). PyMongo answers a bound smaller than a round
    trip with ``ExecutionTimeout`` without sending anything."""
    if lease.until is None:
        return lease.wait
    return min(lease.wait, max((lease.until - now()) / 2, 0.001))


MIN_COMMIT_WAIT = 0.05  # a commit retry with less than this to wait for the majority is not worth sending


def share(lease: Lease, parts: int) -> float:
    """The bound of one of ``parts`` waits still to come after the handler ran (the commit, its
    retries, the read that decides): the lease's, and at most an equal share of nine tenths of
    the time left before the delivery's deadline, so that the last of them still ends before it
    (an ambiguous commit ends as a deferral, never cut off as a timeout)."""
    if lease.until is None:
        return lease.wait
    return min(lease.wait, max((lease.until - now()) * 0.9 / parts, 0.001))


class LeaseDeadline:
    """The delivery's deadline as the transaction skeleton's waits share it (its ``Deadline``)."""

    __slots__ = ("lease",)

    def __init__(self, lease: Lease) -> None:
        self.lease = lease

    def bound(self, parts: int) -> float:
        return share(self.lease, parts)

    def allows(self, delay: float, parts: int) -> bool:
        until = self.lease.until
        return until is None or (until - now() - delay) * 0.9 / parts >= MIN_COMMIT_WAIT
