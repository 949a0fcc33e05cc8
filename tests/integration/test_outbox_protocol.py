"""Each MongoDB filter and update of the outbox record protocol against its Python transition, on a real server.

``lily_mongo._outbox.protocol`` writes every step twice: the query the relay and the
dispatcher send, and the transition the protocol model (tests/property/test_outbox_model.py)
runs. Here both run on the same records and must agree (times set by ``$$NOW`` within a
second of the test's clock).
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from pymongo.results import UpdateResult

from lily_mongo._outbox import protocol
from tests.support.mongo import MongoDB
from tests.support.outbox import written_record

SECOND = datetime.timedelta(seconds=1)


def now() -> datetime.datetime:
    """The test's clock, in milliseconds (what BSON keeps)."""
    moment = datetime.datetime.now(datetime.UTC)
    return moment.replace(microsecond=moment.microsecond // 1000 * 1000)


def aware(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v.replace(tzinfo=datetime.UTC) if isinstance(v, datetime.datetime) else v for k, v in doc.items()}


def record(record_id: str, **fields: Any) -> dict[str, Any]:
    base = written_record(record_id, written_at=now() - SECOND)
    base.update(fields)
    return base


def states(*names: str) -> list[dict[str, Any]]:
    """Records by the state they are in now: free, claimed (the claim expired or live), due later, published, failed."""
    t = now()
    every = {
        "free": record("free"),
        "expired": record("expired", claim_owner="x", claim_token="a", claim_expires=t - SECOND),
        "live": record("live", claim_owner="x", claim_token="b", claim_expires=t + 60 * SECOND),
        "later": record("later", available_at=t + 60 * SECOND),
        "published": record("published", status="published"),
        "failed": record("failed", status="failed"),
        # Born claimed by a writer whose clock read a day ahead: implausible beyond a horizon.
        "ahead": record(
            "ahead", claim_owner="x", claim_token="c", claim_expires=t + 86400 * SECOND, available_at=t + 86400 * SECOND
        ),
    }
    return [every[name] for name in names]


def close(a: Any, b: Any) -> bool:
    return bool(abs(a - b) < 2 * SECOND)


async def written(
    outbox: Any, result: UpdateResult, held: dict[str, Any], model: dict[str, Any] | None
) -> dict[str, Any]:
    """The held record after a write whose Python transition gave ``model``: where the transition
    refuses (None), the write matched nothing and the record is as it was; otherwise it matched it."""
    doc = aware(await outbox.find_one({"_id": "held"}) or {})
    assert result.matched_count == (0 if model is None else 1)
    if model is None:
        assert doc == aware(held)
    return doc


async def test_the_due_filter_finds_exactly_what_is_due_says(mongodb: MongoDB) -> None:
    outbox = mongodb.db["outbox"]
    records = states("free", "expired", "live", "later", "published", "failed")
    await outbox.insert_many(records)
    found = {doc["_id"] for doc in await outbox.find(protocol.due_filter(now())).to_list()}
    assert found == {r["_id"] for r in records if protocol.is_due(r, now())} == {"free", "expired"}


async def test_with_a_horizon_the_due_filter_also_finds_what_is_implausibly_far_ahead(mongodb: MongoDB) -> None:
    outbox = mongodb.db["outbox"]
    records = states("free", "expired", "live", "later", "published", "failed", "ahead")
    await outbox.insert_many(records)
    horizon = 120.0  # "live" and "later" are 60 s ahead: plausible; "ahead" is a day ahead
    found = {doc["_id"] for doc in await outbox.find(protocol.due_filter(now(), horizon)).to_list()}
    expected = {r["_id"] for r in records if protocol.is_due(r, now(), horizon)}
    assert found == expected == {"free", "expired", "ahead"}
    ids = [r["_id"] for r in records]
    claimed = await outbox.update_many(
        protocol.claim_filter(ids, now(), horizon), protocol.claim_update("relay", "T", claim_seconds=30)
    )
    assert claimed.matched_count == 3


async def test_the_claim_and_its_transition_agree(mongodb: MongoDB) -> None:
    outbox = mongodb.db["outbox"]
    records = states("free", "expired", "live", "later", "published")
    await outbox.insert_many(records)
    ids = [r["_id"] for r in records]
    result = await outbox.update_many(
        protocol.claim_filter(ids, now()), protocol.claim_update("relay", "T", claim_seconds=30)
    )
    assert result.matched_count == 2
    after = {doc["_id"]: aware(doc) for doc in await outbox.find(protocol.claimed_filter(ids, "T")).to_list()}
    expected = {
        r["_id"]: t2
        for r in records
        if (t2 := protocol.claim_transition(r, owner="relay", token="T", now=now(), claim_seconds=30)) is not None
    }
    assert set(after) == set(expected) == {"free", "expired"}
    for record_id, doc in after.items():
        model = expected[record_id]
        assert close(doc.pop("claim_expires"), model.pop("claim_expires"))
        assert doc == aware(model)


@pytest.mark.parametrize("token", ["T", "other"], ids=["holder", "fenced-out"])
async def test_the_mark_and_its_transition_agree(mongodb: MongoDB, token: str) -> None:
    outbox = mongodb.db["outbox"]
    held = record("held", claim_owner="relay", claim_token="T", claim_expires=now() + 30 * SECOND)
    await outbox.insert_one(dict(held))
    result = await outbox.update_many(
        protocol.mark_filter(["held"], token), protocol.mark_update(retention_seconds=3600)
    )
    model = protocol.mark_transition(held, token, now=now(), retention_seconds=3600)
    doc = await written(outbox, result, held, model)
    if model is None:
        return
    assert "claim_expires" not in doc
    assert close(doc.pop("published_at"), model.pop("published_at"))
    assert close(doc.pop("expires_at"), model.pop("expires_at"))
    assert doc == aware(model)


@pytest.mark.parametrize(("attempts", "token"), [(0, "T"), (2, "T"), (0, "other")], ids=["retry", "park", "fenced"])
async def test_a_failure_and_its_transition_agree(mongodb: MongoDB, attempts: int, token: str) -> None:
    outbox = mongodb.db["outbox"]
    held = record("held", attempts=attempts, claim_owner="relay", claim_token="T", claim_expires=now() + 30 * SECOND)
    await outbox.insert_one(dict(held))
    failure = protocol.failed_attempt(
        attempts, "unroutable", max_attempts=3, backoff_base=1.0, backoff_max=10.0, jitter=0.5
    )
    t = now()
    result = await outbox.update_one(protocol.failure_filter("held", token), protocol.failure_update(failure, t))
    model = protocol.failure_transition(held, token, failure, t)
    doc = await written(outbox, result, held, model)
    if model is None:
        return
    # BSON keeps milliseconds.
    assert close(doc.pop("available_at"), model.pop("available_at"))
    assert doc == aware(model)
    assert doc["status"] == ("failed" if attempts + 1 >= 3 else "pending")
