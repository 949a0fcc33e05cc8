"""Each update the inbox sends computes, on a real server, what its Python transition says.

:mod:`lily_mongo._inbox.protocol` writes every step twice: the MongoDB update (on the
server clock) and the same transition in Python, which the protocol model runs.
These tests hold the two equal, record state by record state.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from pymongo import AsyncMongoClient, ReturnDocument

from lily_mongo._inbox import first_claim
from lily_mongo._inbox import protocol as records

LEASE, STALE, RETENTION = 30.0, 3600.0, 7200.0
HOUR = datetime.timedelta(hours=1)


def utcnow() -> datetime.datetime:
    # Naive UTC with millisecond precision: what the server stores and returns.
    now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
    return now.replace(microsecond=now.microsecond // 1000 * 1000)


def base(state: str, owner: str | None, expires: datetime.datetime, **extra: Any) -> dict[str, Any]:
    doc = {
        "_id": "h|e",
        "handler": "h",
        "event_id": "e",
        "state": state,
        "owner": owner,
        "token": 4,
        "expires_at": expires,
        "purge_at": expires + HOUR,
        "acquisitions": 4,
        "deferrals": 2,
        "checked_at": expires - HOUR,
    }
    doc.update(extra)
    return doc


def records_before() -> dict[str, dict[str, Any] | None]:
    now = utcnow()
    return {
        "absent": None,
        "held-by-a-live-owner": base("leased", "other:1", now + HOUR),
        "lease-expired": base("leased", "other:1", now - HOUR),
        "released-after-a-deferral": base("leased", None, now - HOUR),
        "completed": base("completed", "other:1", now - HOUR, completed_at=now - HOUR),
    }


def claimed(record: dict[str, Any] | None, owner: str, now: datetime.datetime) -> dict[str, Any] | None:
    """What a lease claim by ``owner`` at ``now`` makes of ``record``, by the Python transition."""
    return records.claim_transition(
        record, key="h|e", handler_id="h", event_id="e", owner=owner, now=now, lease_seconds=LEASE, stale_seconds=STALE
    )


def claim_kind(record: dict[str, Any] | None, owner: str, now: datetime.datetime) -> records.ClaimKind:
    """The kind of claim ``owner`` reads back from what its claim at ``now`` makes of ``record``."""
    made = claimed(record, owner, now)
    assert made is not None
    return records.read_claim(made, owner).kind


@pytest.fixture
async def collection(mongo_client: AsyncMongoClient[Any], database_name: str) -> Any:
    return mongo_client[database_name]["records"]


@pytest.mark.parametrize("case", list(records_before()))
async def test_the_claim_pipeline_is_the_claim_transition(collection: Any, case: str) -> None:
    before = records_before()[case]
    if before is not None:
        await collection.insert_one(before)
    after = await collection.find_one_and_update(
        {"_id": "h|e"},
        records.claim_pipeline("h", "e", "me:1", lease_seconds=LEASE, stale_seconds=STALE),
        upsert=True,
        return_document=ReturnDocument.AFTER,
    )
    # The server's clock at the claim: what the update stored as checked_at (or, for a
    # completed record, which the claim leaves alone, any time will do).
    now = after.get("checked_at") or utcnow()
    expected = claimed(before, "me:1", now)
    assert after == expected
    claim = records.read_claim(after, "me:1")
    assert (
        claim.kind
        is {
            "absent": records.ClaimKind.LEASED,
            "held-by-a-live-owner": records.ClaimKind.HELD,
            "lease-expired": records.ClaimKind.LEASED,
            "released-after-a-deferral": records.ClaimKind.LEASED,
            "completed": records.ClaimKind.DUPLICATE,
        }[case]
    )


@pytest.mark.parametrize("fenced", [True, False], ids=["own-lease", "stale-owner"])
async def test_renewal_completion_and_release_are_their_transitions(
    mongo_client: AsyncMongoClient[Any], collection: Any, fenced: bool
) -> None:
    now = utcnow()
    mine = base("leased", "me:1", now + datetime.timedelta(seconds=5))
    token = 4 if fenced else 3  # a stale owner carries an older token
    fence = records.fence("h|e", "me:1", token)

    await collection.insert_one(mine)
    result = await collection.update_one(fence, records.renewal_update(lease_seconds=LEASE, stale_seconds=STALE))
    after = await collection.find_one({"_id": "h|e"})
    server_now = after["expires_at"] - datetime.timedelta(seconds=LEASE) if fenced else now
    expected = records.renewal_transition(mine, "me:1", token, now=server_now, lease_seconds=LEASE, stale_seconds=STALE)
    assert (result.matched_count == 1) is fenced
    assert after == (expected if fenced else mine)

    await collection.replace_one({"_id": "h|e"}, mine)
    async with mongo_client.start_session() as session:
        await session.start_transaction()
        result = await collection.update_one(
            fence, records.completion_update(retention_seconds=RETENTION), session=session
        )
        await session.commit_transaction()
    after = await collection.find_one({"_id": "h|e"})
    expected = records.completion_transition(
        mine, "me:1", token, now=after.get("completed_at", now), retention_seconds=RETENTION
    )
    assert (result.matched_count == 1) is fenced
    assert after == (expected if fenced else mine)

    await collection.replace_one({"_id": "h|e"}, mine)
    after = await collection.find_one_and_update(
        fence, records.deferral_release_update(), return_document=ReturnDocument.AFTER
    )
    expected, matched = records.release_transition(
        mine, "me:1", token, now=after["expires_at"] if after else now, deferred=True
    )
    assert matched is fenced
    assert after == (expected if fenced else None)

    await collection.replace_one({"_id": "h|e"}, mine)
    result = await collection.delete_one(fence)
    expected, matched = records.release_transition(mine, "me:1", token, now=now, deferred=False)
    assert (result.deleted_count == 1) is fenced is matched
    assert await collection.find_one({"_id": "h|e"}) == (None if fenced else mine)


@pytest.mark.parametrize("case", list(records_before()))
async def test_the_claim_in_a_transaction_is_its_transition(
    mongo_client: AsyncMongoClient[Any], collection: Any, case: str
) -> None:
    before = records_before()[case]
    if before is not None:
        await collection.insert_one(before)
    now = utcnow()
    async with mongo_client.start_session() as session:
        await session.start_transaction()
        found = await collection.find_one_and_update(
            {"_id": "h|e"},
            first_claim.first_claim_update("h", "e", "me:1", now=now, retention_seconds=RETENTION),
            upsert=True,
            session=session,
        )
        await session.commit_transaction()
    assert found == before  # the record as it was: what read_first_claim reads
    after = await collection.find_one({"_id": "h|e"})
    written = first_claim.first_claim_transition(
        before, key="h|e", handler_id="h", event_id="e", owner="me:1", now=now, retention_seconds=RETENTION
    )
    assert after == (written if before is None else before)  # an existing record is never changed
    assert (
        first_claim.read_first_claim(found)
        is {
            "absent": first_claim.FirstClaim.CLAIMED,
            "held-by-a-live-owner": first_claim.FirstClaim.CONTENDED,
            "lease-expired": first_claim.FirstClaim.CONTENDED,
            "released-after-a-deferral": first_claim.FirstClaim.CONTENDED,
            "completed": first_claim.FirstClaim.DUPLICATE,
        }[case]
    )
    if before is None:
        assert (after["state"], after["owner"], after["token"]) == ("completed", "me:1", 1)
        assert records.reconcile(after, "me:1", 1) is records.Reconciled.COMMITTED


@pytest.mark.parametrize("counter", [records.DEFERRALS, records.EXPIRATIONS])
@pytest.mark.parametrize("case", list(records_before()))
async def test_counting_is_its_transition(collection: Any, case: str, counter: str) -> None:
    before = records_before()[case]
    if before is not None:
        await collection.insert_one(before)
    now = utcnow()
    after = await collection.find_one_and_update(
        {"_id": "h|e"},
        records.count_update(counter, "h", "e", stale_seconds=STALE),
        upsert=True,
        return_document=ReturnDocument.AFTER,
    )
    # The server's clock at the count: a purge time the count set says it; otherwise any time
    # near now will do (an existing purge time it kept lies more than STALE ahead).
    pushed = before is None or after["purge_at"] != before["purge_at"]
    server_now = after["purge_at"] - datetime.timedelta(seconds=STALE) if pushed else now
    expected = records.count_transition(
        before, counter, key="h|e", handler_id="h", event_id="e", now=server_now, stale_seconds=STALE
    )
    assert after == expected
    assert records.read_count(after, counter) == records.read_count(before, counter) + 1
    if before is None:  # a counting record: the next claim takes it as a free lease, the count kept
        assert claim_kind(after, "me:1", now) is records.ClaimKind.LEASED
        assert first_claim.read_first_claim(after) is first_claim.FirstClaim.CONTENDED


@pytest.mark.parametrize("counts", [{}, {"deferrals": 0}, {"deferrals": 2}, {"deferrals": 0, "expirations": 1}])
async def test_a_cancelled_attempts_release_keeps_what_the_record_counts(
    collection: Any, counts: dict[str, int]
) -> None:
    now = utcnow()
    mine = base("leased", "me:1", now + datetime.timedelta(seconds=5))
    mine.pop("deferrals")
    mine.update(counts)
    await collection.insert_one(mine)
    result = await collection.delete_one(records.cancelled_release_filter("h|e", "me:1", 4))
    assert (result.deleted_count == 1) is records.counts_nothing(mine)
    if result.deleted_count:
        return
    update = await collection.update_one(records.fence("h|e", "me:1", 4), records.released_update())
    after = await collection.find_one({"_id": "h|e"})
    assert update.matched_count == 1
    assert after == records.released_transition(mine, "me:1", 4, now=after["expires_at"])
    assert claim_kind(after, "me:2", now) is records.ClaimKind.LEASED
