"""The claim of a batch's events inside its transaction (docs/handlers.md, "Batch handlers"; docs/inbox.md).

A batch's transaction opens with one snapshot read of every event's record (``find({_id: {$in: keys}})``,
its first operation). What each record says decides the event's way, with the record protocol's own
states (:mod:`.protocol`) and the first-time claim's record format (:mod:`.first_claim`):

* absent: the event is claimed by the batch: its record is inserted completed with the others, in one
  ``insert_many`` before the handler runs, and commits with the handler's writes or not at all;
* completed: a duplicate, never handed to the handler; the batch's majority commit confirms it;
* anything else (a live or expired lease, a released lease, a counting record): the lease protocol
  decides (its claim counts deferrals, takes expired leases over with the next fencing token, and
  carries the counts on), so the event leaves the batch and runs the single-event path.

Pure, like the rest of the record protocol.
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Mapping, Sequence
from typing import Any

from . import first_claim
from .protocol import COMPLETED, Record

__all__ = ["Found", "batch_records", "by_key", "found_in_batch"]


class Found(enum.Enum):
    ABSENT = "absent"  # claimed by the batch's transaction
    COMPLETED = "completed"  # a duplicate
    LEASE = "lease"  # a lease or counting record: the single-event lease path decides


def found_in_batch(record: Record | None) -> Found:
    """What the snapshot read found for one event of the batch."""
    if record is None:
        return Found.ABSENT
    if record.get("state") == COMPLETED:
        return Found.COMPLETED
    return Found.LEASE


def batch_records(
    handler_id: str,
    events: Sequence[tuple[str, str]],
    owner: str,
    *,
    now: datetime.datetime,
    retention_seconds: float,
) -> list[dict[str, Any]]:
    """The records a batch's transaction inserts for its claimed ``events`` ((key, event id) pairs): each the
    record a first-time copy's claim writes (completed, ``owner``, token 1), so that either path reads it,
    reconciles it and purges it alike."""
    records: list[dict[str, Any]] = []
    for key, event_id in events:
        record = first_claim.first_claim_transition(
            None,
            key=key,
            handler_id=handler_id,
            event_id=event_id,
            owner=owner,
            now=now,
            retention_seconds=retention_seconds,
        )
        assert record is not None
        records.append(record)
    return records


def by_key(found: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The records the snapshot read returned, by ``_id``."""
    return {str(record["_id"]): record for record in found}
