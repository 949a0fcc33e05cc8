"""The inbox record protocol: its updates, their Python transitions, the consumer-side decisions.

docs/inbox.md describes the protocol step by step; this module is its single
definition, as data and pure decisions.

One record per (handler identity, event id) carries the lease and the
completion. Its life::

    (absent) --claim--> leased(owner, token) --completion in the transaction + commit--> completed
                         |  ^                                                             |
                         |  +-- claim by another owner once expired (token + 1)           +-- claim: duplicate
                         +-- release: deleted (final failure) or expired with deferrals + 1 (deferral)

    (absent) --first-time copy: inserted completed by its transaction's first write + commit--> completed

This module holds both halves of every step:

* the **server side**: the MongoDB update each step sends (:func:`claim_pipeline`,
  :func:`completion_update`, ...) and, beside it, the same transition written in
  Python (:func:`claim_transition`, ...). The protocol model
  (``tests/property/test_inbox_model.py``) runs the inbox against a simulated
  MongoDB that evaluates the updates it sends through these transitions; an
  integration test holds each pipeline equal to its transition on a real server;
* the **consumer side**: what the consumer concludes from what the server
  answered (:func:`read_claim`, :func:`reconcile`, :func:`heartbeat_verdict`). What a
  transaction error's labels mean and how many replays a delivery gets are the rules every
  transaction shares (:mod:`lily_mongo._mongo.rules`).

Pure: no I/O library. Times are server-clock :class:`datetime.datetime` values
(``$$NOW`` in the pipelines); the consumer's clock never decides an expiry.
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._clock import aware
from .._mongo.rules import ReadBack, read_back_verdict

__all__ = [
    "COMPLETED",
    "DEFERRALS",
    "EXPIRATIONS",
    "LEASED",
    "Claim",
    "ClaimKind",
    "Heartbeat",
    "Reconciled",
    "cancelled_release_filter",
    "claim_pipeline",
    "claim_transition",
    "completion_transition",
    "completion_update",
    "count_transition",
    "count_update",
    "counts_nothing",
    "deferral_release_update",
    "fence",
    "heartbeat_verdict",
    "may_renew",
    "may_try_again_after_expiry",
    "outlived",
    "read_claim",
    "read_count",
    "reconcile",
    "record_key",
    "release_transition",
    "released_transition",
    "released_update",
    "renewal_transition",
    "renewal_update",
]

LEASED = "leased"
COMPLETED = "completed"
# The transaction labels MongoDB attaches to errors: errors are classified by label,
# never by code or message. ``_mongo.error_labels`` reads exactly these.
# The record's two counters outside the lease (docs/inbox.md, "Counting deferrals"):
# deliveries deferred, and attempts whose transaction outlived the server's lifetime limit.
DEFERRALS = "deferrals"
EXPIRATIONS = "expirations"

Record = Mapping[str, Any]


def record_key(handler_id: str, event_id: object) -> str:
    """The record's ``_id``: ``"<handler_id>|<event_id>"`` (a string that shards well when hashed)."""
    return f"{handler_id}|{event_id}"


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


# -- 1. claim ------------------------------------------------------------------------------------


class ClaimKind(enum.Enum):
    DUPLICATE = "duplicate"  # the record is completed: ACK without running anything
    HELD = "held"  # another live owner holds it: deferred (its deferral counter was incremented)
    LEASED = "leased"  # leased to this attempt


@dataclass(frozen=True, slots=True)
class Claim:
    """What one claim concluded."""

    kind: ClaimKind
    token: int = 0  # the fencing token of this attempt's lease (LEASED)
    deferrals: int = 0  # deliveries of this event deferred so far (HELD: including this one)
    remaining: float | None = None  # seconds left on the holder's lease, server clock (HELD)
    expirations: int = 0  # attempts of this event whose transaction outlived the lifetime (LEASED)


def claim_pipeline(
    handler_id: str, event_id: str, owner: str, *, lease_seconds: float, stale_seconds: float
) -> list[dict[str, Any]]:
    """The claim: one ``find_one_and_update(upsert=True)`` pipeline, see :func:`claim_transition`."""
    lease_ms = _ms(lease_seconds)
    state = {"$ifNull": ["$state", None]}
    done = {"$eq": [state, COMPLETED]}
    expired = {
        "$or": [
            {"$eq": [{"$ifNull": ["$owner", None]}, None]},
            {"$lte": [{"$ifNull": ["$expires_at", None]}, "$$NOW"]},
        ]
    }
    free = "$_lily_free"
    return [
        # ``$ne`` rather than ``$not: [done]``: the same test, in an operator every server supports.
        {"$set": {"_lily_done": done, "_lily_free": {"$and": [{"$ne": [state, COMPLETED]}, expired]}}},
        {
            "$set": {
                "handler": handler_id,
                "event_id": event_id,
                "state": {"$cond": [free, LEASED, "$state"]},
                "owner": {"$cond": [free, owner, "$owner"]},
                "token": {"$cond": [free, {"$add": [{"$ifNull": ["$token", 0]}, 1]}, "$token"]},
                "expires_at": {"$cond": [free, {"$add": ["$$NOW", lease_ms]}, "$expires_at"]},
                "purge_at": {"$cond": [free, {"$add": ["$$NOW", lease_ms + _ms(stale_seconds)]}, "$purge_at"]},
                "acquisitions": {"$add": [{"$ifNull": ["$acquisitions", 0]}, {"$cond": [free, 1, 0]}]},
                "deferrals": {
                    "$add": [
                        {"$ifNull": ["$deferrals", 0]},
                        {"$cond": [{"$or": ["$_lily_done", free]}, 0, 1]},
                    ]
                },
                "checked_at": {"$cond": ["$_lily_done", "$checked_at", "$$NOW"]},
            }
        },
        {"$unset": ["_lily_done", "_lily_free"]},
    ]


def claim_transition(
    record: Record | None,
    *,
    key: str,
    handler_id: str,
    event_id: str,
    owner: str,
    now: datetime.datetime,
    lease_seconds: float,
    stale_seconds: float,
) -> dict[str, Any]:
    """The record after a claim (what :func:`claim_pipeline` computes on the server).

    Completed: unchanged. Absent, released, or its lease expired (``expires_at <= now``):
    leased to ``owner`` with token + 1. Otherwise held: ``deferrals`` + 1.
    """
    doc: dict[str, Any] = dict(record) if record is not None else {"_id": key}
    if doc.get("state") == COMPLETED:
        return doc
    expires = doc.get("expires_at")
    free = doc.get("owner") is None or expires is None or expires <= now
    doc["handler"], doc["event_id"] = handler_id, event_id
    doc["checked_at"] = now
    if free:
        doc["state"] = LEASED
        doc["owner"] = owner
        doc["token"] = int(doc.get("token", 0)) + 1
        doc["expires_at"] = now + datetime.timedelta(seconds=lease_seconds)
        doc["purge_at"] = doc["expires_at"] + datetime.timedelta(seconds=stale_seconds)
        doc["acquisitions"] = int(doc.get("acquisitions", 0)) + 1
        doc.setdefault("deferrals", 0)
    else:
        doc.setdefault("acquisitions", 0)
        doc["deferrals"] = int(doc.get("deferrals", 0)) + 1
    return doc


def read_claim(record: Record, owner: str) -> Claim:
    """What the claim's returned record (the record after the update) means for this attempt.

    "The record's owner is ``owner``" is taken as proof that this claim holds the lease
    (and :func:`reconcile` takes owner and token as proof of this attempt's commit): an
    owner id must be unique to one claim. The inbox makes each one from the consumer
    name, a per-process random instance id and a per-process counter.
    """
    if record.get("state") == COMPLETED:
        return Claim(ClaimKind.DUPLICATE)
    if record.get("owner") == owner:
        return Claim(ClaimKind.LEASED, token=int(record["token"]), expirations=read_count(record, EXPIRATIONS))
    expires, checked = aware(record.get("expires_at")), aware(record.get("checked_at"))
    remaining = max((expires - checked).total_seconds(), 0.0) if expires and checked else None
    return Claim(ClaimKind.HELD, deferrals=int(record.get("deferrals", 0)), remaining=remaining)


# -- fencing, completion, renewal, release -------------------------------------------------------


def fence(key: str, owner: str, token: int) -> dict[str, Any]:
    """The filter every write of a lease holder carries: its owner and token, still leased."""
    return {"_id": key, "owner": owner, "token": token, "state": LEASED}


def _fenced(record: Record | None, owner: str, token: int) -> bool:
    return (
        record is not None
        and record.get("state") == LEASED
        and record.get("owner") == owner
        and record.get("token") == token
    )


def completion_update(*, retention_seconds: float) -> list[dict[str, Any]]:
    """The completion: the transaction's *first* write, so the transaction holds the record.

    MongoDB fails a transaction's write to a document that anyone committed a write
    to after the transaction's snapshot (its first operation), and makes writes from
    outside wait while a transaction holds a document it wrote. Writing the record
    first closes that window: no renewal or claim can land between the snapshot and
    this write, and none lands after it until the transaction commits or aborts.
    An abort undoes it, leaving the lease as it was.
    """
    return [
        {
            "$set": {
                "state": COMPLETED,
                "completed_at": "$$NOW",
                "purge_at": {"$add": ["$$NOW", _ms(retention_seconds)]},
            }
        }
    ]


def completion_transition(
    record: Record | None, owner: str, token: int, *, now: datetime.datetime, retention_seconds: float
) -> dict[str, Any] | None:
    """The record after the completion write, or None when the fence matches nothing (lease lost)."""
    if not _fenced(record, owner, token):
        return None
    assert record is not None
    doc = dict(record)
    doc["state"] = COMPLETED
    doc["completed_at"] = now
    doc["purge_at"] = now + datetime.timedelta(seconds=retention_seconds)
    return doc


def renewal_update(*, lease_seconds: float, stale_seconds: float) -> list[dict[str, Any]]:
    """The heartbeat: extend the lease on the server clock (sent with :func:`fence`)."""
    lease_ms = _ms(lease_seconds)
    return [
        {
            "$set": {
                "expires_at": {"$add": ["$$NOW", lease_ms]},
                "purge_at": {"$add": ["$$NOW", lease_ms + _ms(stale_seconds)]},
            }
        }
    ]


def renewal_transition(
    record: Record | None,
    owner: str,
    token: int,
    *,
    now: datetime.datetime,
    lease_seconds: float,
    stale_seconds: float,
) -> dict[str, Any] | None:
    """The record after a renewal, or None when the fence matches nothing (the lease is lost)."""
    if not _fenced(record, owner, token):
        return None
    assert record is not None
    doc = dict(record)
    doc["expires_at"] = now + datetime.timedelta(seconds=lease_seconds)
    doc["purge_at"] = doc["expires_at"] + datetime.timedelta(seconds=stale_seconds)
    return doc


def deferral_release_update() -> list[dict[str, Any]]:
    """Give the lease up after a deferral: no owner, expired now, one more deferral counted."""
    return [
        {"$set": {"owner": None, "expires_at": "$$NOW", "deferrals": {"$add": [{"$ifNull": ["$deferrals", 0]}, 1]}}}
    ]


def release_transition(
    record: Record | None, owner: str, token: int, *, now: datetime.datetime, deferred: bool
) -> tuple[dict[str, Any] | None, bool]:
    """(record after, matched). A final failure deletes the record; a deferral expires it."""
    if not _fenced(record, owner, token):
        return (dict(record) if record is not None else None), False
    if not deferred:
        return None, True
    assert record is not None
    doc = dict(record)
    doc["owner"] = None
    doc["expires_at"] = now
    doc["deferrals"] = int(doc.get("deferrals", 0)) + 1
    return doc, True


def cancelled_release_filter(key: str, owner: str, token: int) -> dict[str, Any]:
    """The fenced delete of an attempt cancelled from outside: only while the record counts nothing.

    A record that counts deferrals or expired transactions keeps them (the copy may be
    requeued, by a forced shutdown for one): it is released with :func:`released_update`
    instead, so no count is lost (docs/inbox.md, "Counting deferrals").
    """
    return {**fence(key, owner, token), DEFERRALS: {"$in": [0, None]}, EXPIRATIONS: {"$in": [0, None]}}


def counts_nothing(record: Record | None) -> bool:
    """Whether the record counts no deferral and no expired transaction (:func:`cancelled_release_filter`)."""
    return record is not None and not record.get(DEFERRALS) and not record.get(EXPIRATIONS)


def released_update() -> list[dict[str, Any]]:
    """Give the lease up without counting anything: no owner, expired now (sent with :func:`fence`)."""
    return [{"$set": {"owner": None, "expires_at": "$$NOW"}}]


def released_transition(
    record: Record | None, owner: str, token: int, *, now: datetime.datetime
) -> dict[str, Any] | None:
    """The record after :func:`released_update`, or None when the fence matches nothing."""
    if not _fenced(record, owner, token):
        return None
    assert record is not None
    return {**record, "owner": None, "expires_at": now}


# -- counters a delivery adds without holding the lease --------------------------------------------


def count_update(counter: str, handler_id: str, event_id: str, *, stale_seconds: float) -> list[dict[str, Any]]:
    """Count one more deferral (``counter`` :data:`DEFERRALS`) or expired transaction (:data:`EXPIRATIONS`).

    Sent as ``find_one_and_update({"_id": key}, this, upsert=True)`` returning the record
    after, outside any transaction and majority-acknowledged, whenever a delivery must count
    something the lease protocol did not count in the same write (a claim that failed or
    timed out, a first-time copy deferred without a record, a release that matched
    nothing). Absent, the record is created as a *counting record*: no state, no owner, so
    the next claim takes it as a free lease and the count carries on. ``purge_at`` is kept,
    or pushed to ``stale_seconds`` from now if that is later (see :func:`count_transition`).
    """
    return [
        {
            "$set": {
                "handler": {"$ifNull": ["$handler", handler_id]},
                "event_id": {"$ifNull": ["$event_id", event_id]},
                counter: {"$add": [{"$ifNull": [f"${counter}", 0]}, 1]},
                "purge_at": {"$max": ["$purge_at", {"$add": ["$$NOW", _ms(stale_seconds)]}]},
            }
        }
    ]


def count_transition(
    record: Record | None,
    counter: str,
    *,
    key: str,
    handler_id: str,
    event_id: str,
    now: datetime.datetime,
    stale_seconds: float,
) -> dict[str, Any]:
    """The record after :func:`count_update`: ``counter`` + 1, created if absent; nothing else changes."""
    doc: dict[str, Any] = dict(record) if record is not None else {"_id": key}
    if doc.get("handler") is None:
        doc["handler"] = handler_id
    if doc.get("event_id") is None:
        doc["event_id"] = event_id
    doc[counter] = int(doc.get(counter) or 0) + 1
    stale = now + datetime.timedelta(seconds=stale_seconds)
    purge, later = aware(doc.get("purge_at")), aware(stale)
    if purge is None or (later is not None and purge < later):
        doc["purge_at"] = stale
    return doc


def read_count(record: Record | None, counter: str) -> int:
    """The count ``counter`` a record holds (0 when it holds none)."""
    return int((record or {}).get(counter) or 0)


# -- consumer-side decisions ---------------------------------------------------------------------


def outlived(age: float, lifetime: float) -> bool:
    """Did an attempt whose transaction failed ``age`` seconds after it started outlive the server's
    transaction lifetime (``transactionLifetimeLimitSeconds``)? Then the server has probably
    aborted it for its age: replaying it as it was would meet the same end."""
    return age >= lifetime


def may_try_again_after_expiry(expirations: int) -> bool:
    """After the ``expirations``-th attempt of an event whose transaction outlived the lifetime:
    one more try (the first time), then no more: the delivery is dead-lettered
    (``QUEUE_TRANSACTION_EXPIRED``, docs/inbox.md, "The transaction lifetime")."""
    return expirations < 2


class Reconciled(enum.Enum):
    COMMITTED = "committed"  # our completion is there: ACK
    DUPLICATE = "duplicate"  # another attempt's completion is there: ACK as a duplicate
    AMBIGUOUS = "ambiguous"  # nothing completed is visible: defer, the next claim tells the truth


_RECONCILED = {
    ReadBack.COMMITTED: Reconciled.COMMITTED,
    ReadBack.OTHERS: Reconciled.DUPLICATE,
    ReadBack.UNKNOWN: Reconciled.AMBIGUOUS,
}


def reconcile(record: Record | None, owner: str, token: int) -> Reconciled:
    """Commit-result reconciliation from the record read with majority read concern (docs/inbox.md, step 6)."""
    verdict = read_back_verdict(record, completed={"state": COMPLETED}, ours={"owner": owner, "token": token})
    return _RECONCILED[verdict]


class Heartbeat(enum.Enum):
    RENEWED = "renewed"
    LOST = "lost"  # taken over, or unrenewable for longer than the lease
    RETRY = "retry"  # the renewal failed; try again on the next beat


def may_renew(*, holding: bool) -> bool:
    """May the heartbeat write the record now?

    Not while the attempt's transaction holds it (from its completion write to its
    commit or abort): on MongoDB the renewal would wait for the transaction, and a
    write committed after the transaction's snapshot would fail the transaction.
    """
    return not holding


def heartbeat_verdict(*, matched: bool | None, unrenewed_for: float, lease_seconds: float) -> Heartbeat:
    """After a fenced renewal: ``matched`` is its answer, None when the renewal failed."""
    if matched is None:
        return Heartbeat.LOST if unrenewed_for > lease_seconds else Heartbeat.RETRY
    return Heartbeat.RENEWED if matched else Heartbeat.LOST
