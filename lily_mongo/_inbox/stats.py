"""``lily-mongo inbox stats``: the records and outbox records per handler, by state (docs/operations.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import protocol
from .options import InboxOptions

if TYPE_CHECKING:
    from pymongo.asynchronous.database import AsyncDatabase

__all__ = ["STAT_COLUMNS", "inbox_stats"]


STAT_COLUMNS = ("completed", "live_leases", "stale_leases", "outbox_pending", "outbox_published", "outbox_failed")
"""The columns of :func:`inbox_stats`, in the order ``lily-mongo inbox stats`` prints them."""


async def inbox_stats(
    database: AsyncDatabase[Any], options: InboxOptions, *, outbox: str = "lily_outbox"
) -> dict[str, dict[str, int]]:
    """Per handler: completed records, live and expired leases, outbox records (collection ``outbox``) by status.

    A lease is live while it has an owner and its expiry is ahead of the server clock.
    """
    stats: dict[str, dict[str, int]] = {}

    def row(handler: object) -> dict[str, int]:
        return stats.setdefault(str(handler), dict.fromkeys(STAT_COLUMNS, 0))

    live = {"$and": [{"$ne": [{"$ifNull": ["$owner", None]}, None]}, {"$gt": ["$expires_at", "$$NOW"]}]}
    by_state = {"$group": {"_id": {"h": "$handler", "s": "$state", "live": live}, "n": {"$sum": 1}}}
    async for doc in await database[options.records].aggregate([by_state]):
        key = doc["_id"]
        if key.get("s") == protocol.COMPLETED:
            column = "completed"
        else:
            column = "live_leases" if key.get("live") else "stale_leases"
        row(key.get("h"))[column] += int(doc["n"])
    by_status = {"$group": {"_id": {"h": "$handler", "s": "$status"}, "n": {"$sum": 1}}}
    async for doc in await database[outbox].aggregate([by_status]):
        status = str(doc["_id"].get("s"))
        if status in ("pending", "published", "failed"):
            row(doc["_id"].get("h"))[f"outbox_{status}"] += int(doc["n"])
    return stats
