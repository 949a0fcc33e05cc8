"""Inbox statistics per handler id: what ``lily-mongo inbox stats`` shows (operations.md, section 7).

Read-only aggregations over a consumer database's inbox, lease and outbox
collections: completed records (the dedup window), live and stale leases, and
outbox records by status.
"""

from __future__ import annotations

import datetime
from dataclasses import asdict, dataclass
from typing import Any

from pymongo.asynchronous.database import AsyncDatabase

__all__ = ["HandlerStats", "inbox_statistics"]


@dataclass(slots=True)
class HandlerStats:
    """The records of one handler id."""

    completed: int = 0
    live_leases: int = 0
    stale_leases: int = 0
    outbox_pending: int = 0
    outbox_published: int = 0
    outbox_failed: int = 0

    def as_json(self) -> dict[str, int]:
        return asdict(self)


async def inbox_statistics(
    database: AsyncDatabase[Any],
    *,
    completions: str = "lily_inbox",
    leases: str = "lily_leases",
    outbox: str = "lily_outbox",
) -> dict[str, HandlerStats]:
    """Counts per handler id. A lease is live while it has an owner and its expiry is ahead of now."""
    stats: dict[str, HandlerStats] = {}
    async for doc in await database[completions].aggregate([{"$group": {"_id": "$handler", "n": {"$sum": 1}}}]):
        stats.setdefault(str(doc["_id"]), HandlerStats()).completed = doc["n"]
    now = datetime.datetime.now(datetime.UTC)
    async for doc in database[leases].find({}, {"_id": 1, "owner": 1, "expires_at": 1}):
        # Lease documents are keyed "<handler id>|<event id>".
        row = stats.setdefault(str(doc["_id"]).rsplit("|", 1)[0], HandlerStats())
        expires = doc.get("expires_at")
        if isinstance(expires, datetime.datetime) and expires.tzinfo is None:
            expires = expires.replace(tzinfo=datetime.UTC)
        if doc.get("owner") is not None and isinstance(expires, datetime.datetime) and expires > now:
            row.live_leases += 1
        else:
            row.stale_leases += 1
    group = {"$group": {"_id": {"h": "$handler", "s": "$status"}, "n": {"$sum": 1}}}
    async for doc in await database[outbox].aggregate([group]):
        status = str(doc["_id"].get("s"))
        if status in ("pending", "published", "failed"):
            row = stats.setdefault(str(doc["_id"].get("h")), HandlerStats())
            setattr(row, f"outbox_{status}", doc["n"])
    return stats
