"""The claim inside the transaction, for a copy the broker delivers for the first time (docs/inbox.md,
"Claiming inside the transaction"): the attempt's first write inserts its record completed, or finds
what is there. Pure, like the rest of the record protocol (:mod:`.protocol`), and beside it the
same transition in Python, which the protocol model's simulated server runs."""

from __future__ import annotations

import datetime
import enum
from collections.abc import Collection
from typing import Any

from .._mongo.rules import TRANSIENT_LABEL
from .protocol import COMPLETED, Record

__all__ = [
    "FirstClaim",
    "claims_in_transaction",
    "first_claim_falls_back",
    "first_claim_record",
    "first_claim_transition",
    "first_claim_update",
    "read_first_claim",
]


def claims_in_transaction(*, redelivered: bool, delivery_count: object) -> bool:
    """Should this copy claim its record inside the handler's transaction?

    Only a copy the broker delivers for the first time (not ``redelivered``, no
    ``x-delivery-count`` above 0; a retry copy is a new message and qualifies):
    its record is almost always absent, and then the claim *is* the completion.
    A redelivered copy usually meets a record (a crashed owner's lease, a
    completion whose ACK was lost, a deferral), which the lease claim answers in
    one command. Either way is safe: this only chooses the cheaper one.
    """
    return not redelivered and not (type(delivery_count) is int and delivery_count > 0)


class FirstClaim(enum.Enum):
    CLAIMED = "claimed"  # the record was absent: this transaction wrote it, completed, as its first write
    DUPLICATE = "duplicate"  # completed: abort, ACK as a duplicate
    CONTENDED = "contended"  # a lease record exists: abort, take the lease claim (it decides held or leased)


def first_claim_update(
    handler_id: str, event_id: str, owner: str, *, now: datetime.datetime, retention_seconds: float
) -> dict[str, Any]:
    """The transaction's first write for a first-time copy: insert the record completed, or change nothing.

    Sent as ``find_one_and_update({"_id": key}, this, upsert=True)`` returning the
    record *before* (see :func:`first_claim_transition`). The record commits with
    the handler's writes or not at all, so no lease is needed while it runs: on
    MongoDB the transaction holds the record from this write, a concurrent
    transaction writing it fails at once with a labelled ``WriteConflict`` (before
    its handler ran), and a concurrent lease claim waits for the commit or abort.
    ``owner`` and token 1 let :func:`reconcile` recognise this attempt's commit.
    ``$setOnInsert`` takes no ``$$NOW``: ``now`` is the consumer's clock corrected
    by its offset to the server's (``lily_mongo._clock.clock_offset``, read at start).
    """
    return {
        "$setOnInsert": {
            "handler": handler_id,
            "event_id": event_id,
            "state": COMPLETED,
            "owner": owner,
            "token": 1,
            "acquisitions": 1,
            "deferrals": 0,
            "completed_at": now,
            "purge_at": now + datetime.timedelta(seconds=retention_seconds),
        }
    }


def first_claim_transition(
    record: Record | None,
    *,
    key: str,
    handler_id: str,
    event_id: str,
    owner: str,
    now: datetime.datetime,
    retention_seconds: float,
) -> dict[str, Any] | None:
    """The record :func:`first_claim_update` writes, or None (an existing record is left unchanged)."""
    if record is not None:
        return None
    return first_claim_record(key, handler_id, event_id, owner, now=now, retention_seconds=retention_seconds)


def first_claim_record(
    key: str, handler_id: str, event_id: str, owner: str, *, now: datetime.datetime, retention_seconds: float
) -> dict[str, Any]:
    """The record a first-time copy's claim inserts: completed, ``owner``'s, token 1."""
    insert = first_claim_update(handler_id, event_id, owner, now=now, retention_seconds=retention_seconds)
    return {"_id": key, **insert["$setOnInsert"]}


def first_claim_falls_back(labels: Collection[str]) -> bool:
    """After the claim in the transaction failed: take the lease claim instead (True), or treat
    it as any operation's error (:func:`classify_error`)?

    A ``TransientTransactionError`` there is a concurrent copy's transaction holding the new
    record (MongoDB's ``WriteConflict`` at the write): no handler ran, so it is no replay of
    this delivery; the lease claim waits for that transaction and then decides.
    """
    return TRANSIENT_LABEL in labels


def read_first_claim(before: Record | None) -> FirstClaim:
    """What the first claim found (the record as it was before the write, in the transaction's snapshot)."""
    if before is None:
        return FirstClaim.CLAIMED
    if before.get("state") == COMPLETED:
        return FirstClaim.DUPLICATE
    return FirstClaim.CONTENDED
