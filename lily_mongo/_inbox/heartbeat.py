"""The heartbeat: one task per consumer renews the leases of running deliveries, fenced, and never while
their transaction holds the record (docs/inbox.md, step 3)."""

from __future__ import annotations

import asyncio

import pymongo

from .._tasks import TaskSet
from . import protocol
from .lease import Lease, now
from .store import RecordStore

__all__ = ["LeaseHeartbeat"]


class LeaseHeartbeat:
    """Renews the live leases of one inbox every ``seconds``."""

    def __init__(self, store: RecordStore, seconds: float) -> None:
        self._store = store
        self._seconds = seconds
        self.leases: set[Lease] = set()  # the leases of running deliveries

    def start(self, tasks: TaskSet) -> None:
        """Start the heartbeat, a task of the supervisor's."""
        tasks.spawn(self._beat(), name="lily-heartbeat")

    async def _beat(self) -> None:
        """Renew the lease of every running delivery whose last renewal is a beat old, fenced.

        The renewals of one beat run concurrently, each bounded by its ``maxTimeMS``: one
        record held by a transaction (its renewal waits on MongoDB) never holds up the others.
        """
        interval = self._seconds
        while True:
            await asyncio.sleep(interval / 2)
            moment = now()
            due = [
                lease
                for lease in self.leases
                if not lease.lost
                and moment - lease.renewed_at >= interval
                and protocol.may_renew(holding=lease.holding)
            ]
            if due:
                await asyncio.gather(*(self._renew(lease) for lease in due))

    async def _renew(self, lease: Lease) -> None:
        with pymongo.timeout(min(lease.wait, self._seconds)):
            matched = await self._store.renew(lease)
        verdict = protocol.heartbeat_verdict(
            matched=matched, unrenewed_for=now() - lease.renewed_at, lease_seconds=self._store.options.lease_seconds
        )
        if verdict is protocol.Heartbeat.RENEWED:
            lease.renewed_at = now()
        elif verdict is protocol.Heartbeat.LOST:
            lease.lost = True
