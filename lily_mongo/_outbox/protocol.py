"""The outbox record protocol: the record, its claims, its marks, the failure rule and the order (docs/outbox.md).

A record's life::

    written in a transaction --commit--> pending, claimed by its writer (owner, token, expiry)
        --the writer's dispatcher publishes and marks it--> published (TTL)
        --the writer dies or fails the publish: the claim expires or is released-->
            pending and free --a relay claims it (fresh token, $$NOW + claim_seconds)--> claimed
                --published, marked (fenced by the token)--> published
                --publish refused--> pending, free, ``available_at`` later (backoff); failed after max_attempts

Every write of a claim holder is fenced by its claim token, so a holder whose
claim expired and was taken over changes nothing. This module holds each step
twice, as the MongoDB filter/update a step sends and as the same transition
written in Python (what ``tests/property/test_outbox_model.py`` runs), plus the
consumer-side decisions: the failure rule, the publishing order, what a read-back
after an unknown commit proves.

Pure: no I/O library. Times are :class:`datetime.datetime` values, UTC.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._backoff import backoff
from .._clock import aware

__all__ = [
    "DUE_SORT",
    "EPOCH",
    "FAILED",
    "PENDING",
    "PUBLISHED",
    "Claim",
    "Failure",
    "claim_filter",
    "claim_lasts",
    "claim_transition",
    "claim_update",
    "claimed_filter",
    "due_filter",
    "failed_attempt",
    "failure_filter",
    "failure_transition",
    "failure_update",
    "is_due",
    "is_free",
    "mark_filter",
    "mark_transition",
    "mark_update",
    "new_record",
    "park_update",
    "publish_order",
    "released",
]

PENDING = "pending"
PUBLISHED = "published"
FAILED = "failed"
EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
# The relay's claim query walks the index lily_outbox_due in this order, so records of one
# transaction (same available_at, seq 0, 1, ...) are claimed in their write order.
DUE_SORT: list[tuple[str, int]] = [("available_at", 1), ("seq", 1)]

Record = Mapping[str, Any]


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


# -- the record -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Claim:
    """Who may publish a record now: its owner, the fencing token, and when the claim expires (server clock)."""

    owner: str
    token: str
    expires: datetime.datetime


def new_record(
    *,
    record_id: str,
    event_id: str,
    exchange: str,
    routing_key: str,
    body: bytes,
    headers: dict[str, Any],
    content_type: str | None,
    writer: str,
    written_at: datetime.datetime,
    seq: int,
    claim: Claim | None,
) -> dict[str, Any]:
    """The document a transaction inserts for one outgoing message.

    ``written_at`` is the same for every record of one transaction and ``seq`` counts
    them from 0 in write order: the relay's order (:data:`DUE_SORT`) keeps them in
    that order. With ``claim``, the record is born claimed by its writer's dispatcher
    (an insert takes no ``$$NOW``: ``claim.expires`` is the writer's clock corrected
    by its offset to the server's) and ``available_at`` is that expiry; without, it
    is free for a relay at once.
    """
    record: dict[str, Any] = {
        "_id": record_id,
        "event_id": event_id,
        "exchange": exchange,
        "routing_key": routing_key,
        "body": body,
        "headers": headers,
        "content_type": content_type,
        "handler": writer,
        "status": PENDING,
        "attempts": 0,
        "created_at": written_at,
        # Born claimed, it is due when the claim expires: until then the due query's index range
        # (status, available_at) leaves it out, and an idle relay's poll does not fetch it.
        "available_at": written_at if claim is None else claim.expires,
        "seq": seq,
    }
    if claim is not None:
        record["claim_owner"] = claim.owner
        record["claim_token"] = claim.token
        record["claim_expires"] = claim.expires
    return record


# -- claims ---------------------------------------------------------------------------------------

# A record is free when it has no claim or its claim expired, on the server clock.
_LAPSED_EXPR: dict[str, Any] = {"$lte": [{"$ifNull": ["$claim_expires", EPOCH]}, "$$NOW"]}


def _free_expr(horizon: float | None) -> dict[str, Any]:
    """:data:`_LAPSED_EXPR`, or, with ``horizon``, also a claim expiring more than ``horizon`` seconds
    past the server's now: no holder claims that far ahead, so its writer's clock was wrong."""
    if horizon is None:
        return _LAPSED_EXPR
    return {"$or": [_LAPSED_EXPR, {"$gt": ["$claim_expires", {"$add": ["$$NOW", _ms(horizon)]}]}]}


def _implausible(value: datetime.datetime | None, now: datetime.datetime, horizon: float | None) -> bool:
    return horizon is not None and value is not None and value > now + datetime.timedelta(milliseconds=_ms(horizon))


def is_free(record: Record, now: datetime.datetime, horizon: float | None = None) -> bool:
    """No live claim on ``record`` at server time ``now`` (what ``$expr`` of :func:`due_filter` tests); with
    ``horizon``, a claim expiring more than that many seconds after ``now`` counts as none."""
    expires = aware(record.get("claim_expires"))
    return expires is None or expires <= now or _implausible(expires, now, horizon)


def claim_lasts(record: Record, now: datetime.datetime, seconds: float) -> bool:
    """``record``'s claim is still live ``seconds`` after ``now``: its holder may publish and mark it in time."""
    expires = aware(record.get("claim_expires"))
    return expires is not None and expires - now >= datetime.timedelta(seconds=seconds)


def is_due(record: Record, now: datetime.datetime, horizon: float | None = None) -> bool:
    """Pending, available and free at ``now``: what a relay may claim (:func:`due_filter`). With
    ``horizon``, a claim further ahead than that counts as none, and so does the ``available_at`` of a
    record born with it (a record without a claim may be meant for later)."""
    available = aware(record.get("available_at")) or EPOCH
    expires = aware(record.get("claim_expires"))
    in_time = available <= now or (_implausible(available, now, horizon) and _implausible(expires, now, horizon))
    return record.get("status") == PENDING and in_time and is_free(record, now, horizon)


def _due(now: datetime.datetime, horizon: float | None) -> dict[str, Any]:
    if horizon is None:
        return {"status": PENDING, "available_at": {"$lte": now}}
    ahead = now + datetime.timedelta(milliseconds=_ms(horizon))
    # Two ranges of the index (status, available_at): what is due, and a born claim no writer can
    # have meant (its available_at is its claim's expiry).
    return {
        "$or": [
            {"status": PENDING, "available_at": {"$lte": now}},
            {"status": PENDING, "available_at": {"$gt": ahead}, "claim_expires": {"$gt": ahead}},
        ]
    }


def due_filter(now: datetime.datetime, horizon: float | None = None) -> dict[str, Any]:
    """Records a relay may claim: pending, available by ``now`` (the relay's corrected clock, for the
    index range), and free on the server clock; with ``horizon``, see :func:`is_due`."""
    return {**_due(now, horizon), "$expr": _free_expr(horizon)}


def claim_filter(ids: Sequence[str], now: datetime.datetime, horizon: float | None = None) -> dict[str, Any]:
    """The batch claim's filter: those of ``ids`` still due at ``now``: pending, available and free (another
    relay may have taken some, or taken one, been refused and released it with a backoff)."""
    return {"_id": {"$in": list(ids)}, **_due(now, horizon), "$expr": _free_expr(horizon)}


def claim_update(owner: str, token: str, *, claim_seconds: float) -> list[dict[str, Any]]:
    """The batch claim: one ``update_many`` with :func:`claim_filter`, expiry on the server clock."""
    return [
        {
            "$set": {
                "claim_owner": owner,
                "claim_token": token,
                "claim_expires": {"$add": ["$$NOW", _ms(claim_seconds)]},
            }
        }
    ]


def claim_transition(
    record: Record,
    *,
    owner: str,
    token: str,
    now: datetime.datetime,
    claim_seconds: float,
    horizon: float | None = None,
) -> dict[str, Any] | None:
    """The record after :func:`claim_update`, or None when :func:`claim_filter` does not match it."""
    if not is_due(record, now, horizon):
        return None
    doc = dict(record)
    doc["claim_owner"], doc["claim_token"] = owner, token
    doc["claim_expires"] = now + datetime.timedelta(milliseconds=_ms(claim_seconds))
    return doc


def claimed_filter(ids: Sequence[str], token: str) -> dict[str, Any]:
    """The records of ``ids`` this claim holds (read back after the claim, through the ``_id`` index)."""
    return {"_id": {"$in": list(ids)}, "claim_token": token}


# -- marks and failures ----------------------------------------------------------------------------


def mark_filter(ids: Sequence[str], token: str) -> dict[str, Any]:
    """Published records to mark, fenced by the claim token: one ``update_many`` for the whole batch."""
    return {"_id": {"$in": list(ids)}, "claim_token": token, "status": PENDING}


def mark_update(*, retention_seconds: float) -> list[dict[str, Any]]:
    """Mark published on the server clock; the TTL index on ``expires_at`` removes it after retention."""
    return [
        {
            "$set": {
                "status": PUBLISHED,
                "published_at": "$$NOW",
                "expires_at": {"$add": ["$$NOW", _ms(retention_seconds)]},
            }
        },
        {"$unset": ["claim_expires"]},
    ]


def mark_transition(
    record: Record, token: str, *, now: datetime.datetime, retention_seconds: float
) -> dict[str, Any] | None:
    """The record after the mark, or None when the fence does not match (the claim was taken over)."""
    if record.get("status") != PENDING or record.get("claim_token") != token:
        return None
    doc = {key: value for key, value in record.items() if key != "claim_expires"}
    doc["status"] = PUBLISHED
    doc["published_at"] = now
    doc["expires_at"] = now + datetime.timedelta(milliseconds=_ms(retention_seconds))
    return doc


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed publish of one record: its attempts now, whether it is parked, the wait before the next.

    ``counted`` is False for a transport failure (:func:`released`): the attempt was not the
    record's, so its ``attempts`` stay as they were and it is never parked (docs/outbox.md,
    "Failure classes").
    """

    attempts: int
    parked: bool
    delay: float
    last_error: str
    counted: bool = True


def failed_attempt(
    attempts_before: object, kind: str, *, max_attempts: int, backoff_base: float, backoff_max: float, jitter: float
) -> Failure:
    """The failure rule: one more attempt; parked as failed at ``max_attempts``; otherwise the record
    waits the backoff rule's delay for its ``attempts``-th retry (docs/outbox.md)."""
    before = attempts_before if type(attempts_before) is int and attempts_before >= 0 else 0
    attempts = before + 1
    delay = backoff(attempts - 1, base=backoff_base, cap=backoff_max, jitter=jitter)
    return Failure(attempts, attempts >= max_attempts, delay, f"publish {kind}"[:200])


def released(attempts_before: object, kind: str, *, delay: float) -> Failure:
    """A transport failure (a timeout, a closed channel, a blocked connection, a nack): the record is
    released to wait ``delay``, its attempts left alone."""
    before = attempts_before if type(attempts_before) is int and attempts_before >= 0 else 0
    return Failure(before, False, delay, f"publish {kind}"[:200], counted=False)


def failure_filter(record_id: object, token: object) -> dict[str, Any]:
    """A failure's fence: the record, still pending, still held with this claim token."""
    return {"_id": record_id, "claim_token": token, "status": PENDING}


def failure_update(failure: Failure, now: datetime.datetime) -> dict[str, Any]:
    """Count the attempt (unless a transport failure: :func:`released`), release the claim, make the
    record available again after the delay (or park it).

    Records that fail together share ``now`` and, with the same attempts, the delay: they
    become due at one ``available_at``, and ``seq`` keeps a transaction's in write order.
    """
    values: dict[str, Any] = {
        "last_error": failure.last_error,
        "available_at": now + datetime.timedelta(seconds=failure.delay),
        "status": FAILED if failure.parked else PENDING,
    }
    if failure.counted:
        values["attempts"] = failure.attempts
    return {"$set": values, "$unset": {"claim_expires": ""}}


def park_update(last_error: str) -> dict[str, Any]:
    """Park a record its relay cannot even read (undecodable BSON): failed at once, with its cause."""
    return {
        "$set": {"status": FAILED, "last_error": last_error[:200]},
        "$inc": {"attempts": 1},
        "$unset": {"claim_expires": ""},
    }


def failure_transition(
    record: Record, token: object, failure: Failure, now: datetime.datetime
) -> dict[str, Any] | None:
    """The record after :func:`failure_update` sent with :func:`failure_filter`, or None when fenced out."""
    if record.get("status") != PENDING or record.get("claim_token") != token:
        return None
    doc = {key: value for key, value in record.items() if key != "claim_expires"}
    doc.update(failure_update(failure, now)["$set"])
    return doc


# -- order, counts, read-back -------------------------------------------------------------------------


def publish_order(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """A claimed batch in publishing order: by availability, then write order within a transaction."""

    def key(record: dict[str, Any]) -> tuple[datetime.datetime, int]:
        seq = record.get("seq")
        return (aware(record.get("available_at")) or EPOCH, seq if type(seq) is int else -1)

    return sorted(records, key=key)
