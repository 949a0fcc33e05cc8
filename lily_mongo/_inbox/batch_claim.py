"""The claim of a batch's events inside its transaction (docs/handlers.md, "Batch handlers"; docs/inbox.md).

A batch's transaction opens with one snapshot read of every event's record (``find({_id: {$in: keys}})``,
its first operation). What each record says decides the event's way, read as a first-time copy's claim
reads what it found (:func:`.first_claim.read_first_claim`), and a claimed event's record is the one that
claim writes:

* absent (``CLAIMED``): the event is claimed by the batch: its record is inserted completed with the others, in one
  ``insert_many`` before the handler runs, and commits with the handler's writes or not at all;
* completed (``DUPLICATE``): a duplicate, never handed to the handler; the batch's majority commit confirms it;
* anything else (``CONTENDED``: a live or expired lease, a released lease, a counting record): the lease protocol
  decides (its claim counts deferrals, takes expired leases over with the next fencing token, and
  carries the counts on), so the event leaves the batch and runs the single-event path.

Pure, like the rest of the record protocol.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from . import first_claim

__all__ = ["batch_records", "by_key"]


def batch_records(
    handler_id: str,
    events: Sequence[tuple[str, str]],
    owner: str,
    *,
    now: datetime.datetime,
    retention_seconds: float,
) -> list[dict[str, Any]]:
    """The records a batch's transaction inserts for its claimed ``events`` ((key, event id) pairs): each the
    record a first-time copy's claim writes, so that either path reads it, reconciles it and purges it alike."""
    return [
        first_claim.first_claim_record(key, handler_id, event_id, owner, now=now, retention_seconds=retention_seconds)
        for key, event_id in events
    ]


def by_key(found: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The records the snapshot read returned, by ``_id``."""
    return {str(record["_id"]): record for record in found}
