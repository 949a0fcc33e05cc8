"""The inbox record protocol (docs/inbox.md), as pure decisions and transitions.

One record per (handler identity, event id) carries the lease and the
completion. The server side of each step (claim, completion, renewal, release)
is exercised through its Python transition; the consumer side (what a claim,
an error, a reconciliation read or a renewal answer means) through its
decision function. Times are server-clock values chosen by the test. The
expected records and verdicts are written out here from docs/inbox.md, and a
hypothesis property checks the lease's safety over arbitrary interleavings.
"""

from __future__ import annotations

import datetime
import itertools
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lily_mongo._clock import clock_offset
from lily_mongo._inbox.first_claim import (
    FirstClaim,
    claims_in_transaction,
    first_claim_falls_back,
    first_claim_transition,
    first_claim_update,
    read_first_claim,
)
from lily_mongo._inbox.protocol import (
    Claim,
    ClaimKind,
    Heartbeat,
    Reconciled,
    claim_transition,
    completion_transition,
    fence,
    heartbeat_verdict,
    may_renew,
    read_claim,
    reconcile,
    release_transition,
    renewal_transition,
)
from lily_mongo._mongo.rules import ErrorStep, classify_error, next_after_replay

FAST = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

HANDLER = "orders.created/v1/json/on_order"
EVENT = "0f8fad5b-d9cb-469f-a165-70867728950e"
KEY = f"{HANDLER}|{EVENT}"
LEASE = 30.0
STALE = 3600.0
RETENTION = 7 * 24 * 3600.0
T0 = datetime.datetime(2025, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
A = "replica-a:1"
B = "replica-b:1"
C = "replica-c:1"

# The labels MongoDB attaches to transaction errors (by label, never by code: docs/inbox.md, steps 5 and 6).
TRANSIENT = "TransientTransactionError"
UNKNOWN_COMMIT = "UnknownTransactionCommitResult"


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def claim(record: dict[str, Any] | None, owner: str, now: datetime.datetime) -> dict[str, Any]:
    return claim_transition(
        record,
        key=KEY,
        handler_id=HANDLER,
        event_id=EVENT,
        owner=owner,
        now=now,
        lease_seconds=LEASE,
        stale_seconds=STALE,
    )


def leased(owner: str = A, token: int = 1, *, expires: float = LEASE, **extra: Any) -> dict[str, Any]:
    """A record leased to ``owner`` with ``token``, expiring ``expires`` seconds after T0."""
    return {
        "_id": KEY,
        "handler": HANDLER,
        "event_id": EVENT,
        "state": "leased",
        "owner": owner,
        "token": token,
        "expires_at": at(expires),
        "purge_at": at(expires + STALE),
        "acquisitions": token,
        "deferrals": 0,
        "checked_at": T0,
        **extra,
    }


def completed(owner: str = A, token: int = 1) -> dict[str, Any]:
    return {**leased(owner, token), "state": "completed", "completed_at": at(5), "purge_at": at(5 + RETENTION)}


def complete(record: dict[str, Any] | None, owner: str, token: int, now: datetime.datetime) -> dict[str, Any] | None:
    return completion_transition(record, owner, token, now=now, retention_seconds=RETENTION)


def renew(record: dict[str, Any] | None, owner: str, token: int, now: datetime.datetime) -> dict[str, Any] | None:
    return renewal_transition(record, owner, token, now=now, lease_seconds=LEASE, stale_seconds=STALE)


# -- the claim inside the transaction (first-time copies) -------------------------------


@pytest.mark.parametrize(
    ("redelivered", "delivery_count", "expected"),
    [
        (False, None, True),  # a copy delivered for the first time
        (False, 0, True),  # a quorum queue's first delivery
        (True, None, False),  # redelivered: it probably meets a record
        (False, 1, False),  # a quorum queue counted an earlier delivery
        (True, 3, False),
        (False, "2", True),  # a malformed header says nothing: the flag decides
    ],
)
def test_only_a_copy_delivered_for_the_first_time_claims_in_its_transaction(
    redelivered: bool, delivery_count: object, expected: bool
) -> None:
    assert claims_in_transaction(redelivered=redelivered, delivery_count=delivery_count) is expected


def first(record: dict[str, Any] | None, owner: str, now: datetime.datetime) -> dict[str, Any] | None:
    return first_claim_transition(
        record, key=KEY, handler_id=HANDLER, event_id=EVENT, owner=owner, now=now, retention_seconds=RETENTION
    )


def test_a_claim_in_the_transaction_inserts_the_record_completed_and_reconcilable() -> None:
    record = first(None, A, T0)
    assert record == {
        "_id": KEY,
        "handler": HANDLER,
        "event_id": EVENT,
        "state": "completed",
        "owner": A,
        "token": 1,
        "acquisitions": 1,
        "deferrals": 0,
        "completed_at": T0,
        "purge_at": at(RETENTION),
    }
    assert first_claim_update(HANDLER, EVENT, A, now=T0, retention_seconds=RETENTION) == {
        "$setOnInsert": {k: v for k, v in record.items() if k != "_id"}
    }
    assert read_first_claim(None) is FirstClaim.CLAIMED
    assert reconcile(record, A, 1) is Reconciled.COMMITTED  # an unknown commit result is recognised
    assert reconcile(record, B, 1) is Reconciled.DUPLICATE
    assert read_claim(record, B).kind is ClaimKind.DUPLICATE  # a later lease claim sees a duplicate


def test_a_claim_in_the_transaction_never_changes_an_existing_record() -> None:
    leased = claim(None, B, T0)
    completed = complete(leased, B, 1, at(1))
    released, _ = release_transition(claim(None, C, T0), C, 1, now=at(1), deferred=True)
    assert first(leased, A, at(2)) is None
    assert first(completed, A, at(2)) is None
    assert first(released, A, at(2)) is None
    assert read_first_claim(completed) is FirstClaim.DUPLICATE
    assert read_first_claim(leased) is FirstClaim.CONTENDED
    assert read_first_claim(released) is FirstClaim.CONTENDED  # released, or expired: the lease claim decides


def test_the_server_clock_offset_is_read_against_the_round_trip_midpoint() -> None:
    sent, received = T0, at(0.2)
    # The server read its clock 5 s ahead of the consumer, halfway through the round trip.
    server = (at(0.1) + datetime.timedelta(seconds=5)).replace(tzinfo=None)  # PyMongo's naive UTC
    assert clock_offset(server, sent, received) == datetime.timedelta(seconds=5)
    assert clock_offset(at(0.1) - datetime.timedelta(seconds=3), sent, received) == datetime.timedelta(seconds=-3)
    assert clock_offset(None, sent, received) == datetime.timedelta(0)  # no localTime in the reply
    assert clock_offset("2025-01-01", sent, received) == datetime.timedelta(0)


def test_only_a_transient_error_of_the_claim_in_the_transaction_falls_back_to_the_lease_claim() -> None:
    assert first_claim_falls_back({TRANSIENT}) is True  # a concurrent copy's transaction holds the record
    assert first_claim_falls_back(set()) is False  # unlabelled: deferred like any operation's error
    assert first_claim_falls_back({UNKNOWN_COMMIT}) is False


# -- claim --------------------------------------------------------------------------------


def test_a_first_claim_creates_the_record_leased_with_token_1() -> None:
    record = claim(None, A, T0)
    assert record == leased(A, 1)  # token 1, one acquisition, no deferral: expiring LEASE after T0, purged STALE later
    assert read_claim(record, A) == Claim(ClaimKind.LEASED, token=1)


def test_a_claim_against_a_live_lease_of_another_owner_is_held_and_counts_a_deferral() -> None:
    first = claim(None, A, T0)
    snapshot = dict(first)
    held = claim(first, B, at(10))
    assert first == snapshot  # the transition does not mutate its input
    assert held["owner"] == A
    assert held["token"] == 1
    assert held["state"] == "leased"
    assert held["expires_at"] == at(LEASE)
    assert held["acquisitions"] == 1
    assert held["deferrals"] == 1
    assert read_claim(held, B) == Claim(ClaimKind.HELD, deferrals=1, remaining=20.0)

    again = claim(held, C, at(25))
    assert (again["owner"], again["token"], again["deferrals"]) == (A, 1, 2)
    assert read_claim(again, C) == Claim(ClaimKind.HELD, deferrals=2, remaining=5.0)


def test_a_lease_one_millisecond_before_expiry_is_still_held() -> None:
    held = claim(leased(A, 1), B, at(LEASE - 0.001))
    assert (held["owner"], held["token"], held["deferrals"]) == (A, 1, 1)


@pytest.mark.parametrize("when", [LEASE, LEASE + 0.001, LEASE + 3600])
def test_an_expired_lease_is_taken_over_with_the_next_token(when: float) -> None:
    # Expired means expires_at <= now on the server clock.
    before = leased(A, 4, deferrals=2)
    taken = claim(before, B, at(when))
    assert taken["state"] == "leased"
    assert taken["owner"] == B
    assert taken["token"] == 5
    assert taken["expires_at"] == at(when + LEASE)
    assert taken["purge_at"] == at(when + LEASE + STALE)
    assert taken["acquisitions"] == before["acquisitions"] + 1
    assert taken["deferrals"] == 2  # a takeover is not a deferral
    assert read_claim(taken, B) == Claim(ClaimKind.LEASED, token=5)
    assert read_claim(taken, A).kind is ClaimKind.HELD  # the old owner sees someone else's lease


def test_a_released_lease_is_taken_over_at_once() -> None:
    record, matched = release_transition(claim(None, A, T0), A, 1, now=at(3), deferred=True)
    assert matched
    assert record is not None
    taken = claim(record, B, at(3))
    assert (taken["owner"], taken["token"], taken["acquisitions"]) == (B, 2, 2)
    assert read_claim(taken, B) == Claim(ClaimKind.LEASED, token=2)


def test_a_record_without_an_owner_is_free_even_before_its_expiry() -> None:
    taken = claim({**leased(A, 3), "owner": None}, B, at(1))
    assert (taken["owner"], taken["token"]) == (B, 4)


@pytest.mark.parametrize("owner", [A, B])
def test_a_claim_on_a_completed_record_changes_nothing_and_is_a_duplicate(owner: str) -> None:
    record = completed(A, 1)
    after = claim(record, owner, at(60))
    assert after == record
    assert read_claim(after, owner) == Claim(ClaimKind.DUPLICATE)


# -- read_claim ---------------------------------------------------------------------------


def test_read_claim_leased_carries_the_records_token() -> None:
    assert read_claim(leased(A, 7), A) == Claim(ClaimKind.LEASED, token=7)


def test_read_claim_held_reports_the_holders_remaining_time() -> None:
    record = leased(A, 2, expires=42.5, checked_at=at(30), deferrals=3)
    assert read_claim(record, B) == Claim(ClaimKind.HELD, deferrals=3, remaining=12.5)


def test_read_claim_remaining_is_never_negative() -> None:
    record = leased(A, 2, expires=10, checked_at=at(11))
    assert read_claim(record, B).remaining == 0.0


def test_read_claim_accepts_the_naive_utc_datetimes_pymongo_returns() -> None:
    naive = leased(A, 1, expires=40, checked_at=at(15).replace(tzinfo=None))
    naive["expires_at"] = naive["expires_at"].replace(tzinfo=None)
    assert read_claim(naive, B).remaining == 25.0
    mixed = leased(A, 1, expires=40, checked_at=at(15).replace(tzinfo=None))
    assert read_claim(mixed, B).remaining == 25.0


def test_read_claim_without_times_has_no_remaining() -> None:
    record = {"_id": KEY, "state": "leased", "owner": A, "token": 1, "deferrals": 1}
    assert read_claim(record, B) == Claim(ClaimKind.HELD, deferrals=1, remaining=None)


def test_read_claim_duplicate_wins_over_ownership() -> None:
    assert read_claim(completed(A, 1), A) == Claim(ClaimKind.DUPLICATE)


# -- fencing: completion, renewal, release -----------------------------------------------

NOT_OURS = [
    pytest.param(leased(B, 1), id="another-owner"),
    pytest.param(leased(A, 2), id="another-token"),
    pytest.param(completed(A, 1), id="completed-by-us"),
    pytest.param(completed(B, 2), id="completed-by-another"),
    pytest.param({**leased(A, 1), "owner": None}, id="released"),
    pytest.param(None, id="absent"),
]


def test_the_completion_turns_our_lease_into_a_completed_record() -> None:
    record = leased(A, 1)
    done = complete(record, A, 1, at(8))
    assert done == {**record, "state": "completed", "completed_at": at(8), "purge_at": at(8 + RETENTION)}
    assert record["state"] == "leased"  # input untouched


def test_the_completion_matches_an_expired_lease_nobody_took_over() -> None:
    # The fence is owner and token (docs/inbox.md, step 2); expiry only lets *another* claim take over.
    done = complete(leased(A, 1, expires=10), A, 1, at(50))
    assert done is not None
    assert done["state"] == "completed"


@pytest.mark.parametrize("record", NOT_OURS)
def test_the_completion_is_fenced_by_owner_token_and_state(record: dict[str, Any] | None) -> None:
    assert complete(record, A, 1, at(8)) is None


def test_a_renewal_extends_our_lease_on_the_server_clock() -> None:
    record = leased(A, 3, deferrals=1)
    renewed = renew(record, A, 3, at(20))
    assert renewed == {**record, "expires_at": at(20 + LEASE), "purge_at": at(20 + LEASE + STALE)}


@pytest.mark.parametrize("record", NOT_OURS)
def test_a_renewal_is_fenced_by_owner_token_and_state(record: dict[str, Any] | None) -> None:
    assert renew(record, A, 1, at(20)) is None


def test_a_final_release_deletes_our_record() -> None:
    assert release_transition(leased(A, 1), A, 1, now=at(5), deferred=False) == (None, True)


def test_a_deferral_release_expires_our_lease_and_counts_the_deferral() -> None:
    record = leased(A, 2, deferrals=4)
    after, matched = release_transition(record, A, 2, now=at(5), deferred=True)
    assert matched
    assert after == {**record, "owner": None, "expires_at": at(5), "deferrals": 5}


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("record", NOT_OURS)
def test_a_release_is_fenced_and_leaves_others_records_alone(record: dict[str, Any] | None, deferred: bool) -> None:
    after, matched = release_transition(record, A, 1, now=at(5), deferred=deferred)
    assert not matched
    assert after == record


@pytest.mark.parametrize(
    "record",
    [pytest.param(leased(A, 1), id="ours"), *NOT_OURS],
)
def test_the_fence_filter_matches_exactly_what_the_transitions_accept(record: dict[str, Any] | None) -> None:
    """The filter sent to MongoDB (equality on each field) and the Python fence agree."""
    query = fence(KEY, A, 1)
    matches = record is not None and all(record.get(name) == value for name, value in query.items())
    assert matches == (complete(record, A, 1, at(8)) is not None)
    assert matches == (renew(record, A, 1, at(8)) is not None)
    assert matches == release_transition(record, A, 1, now=at(8), deferred=True)[1]


# -- classify_error -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("labels", "in_commit", "step"),
    [
        # Outside the commit: only a transient transaction error replays (docs/inbox.md, step 5).
        ((), False, ErrorStep.DEFER),
        ((TRANSIENT,), False, ErrorStep.REPLAY),
        ((UNKNOWN_COMMIT,), False, ErrorStep.DEFER),
        ((TRANSIENT, UNKNOWN_COMMIT), False, ErrorStep.REPLAY),
        (("RetryableWriteError",), False, ErrorStep.DEFER),
        # In the commit: an unknown result retries the same commit (docs/inbox.md, step 6); any other
        # failure did not commit and replays (docs/inbox.md, step 5).
        ((), True, ErrorStep.REPLAY),
        ((TRANSIENT,), True, ErrorStep.REPLAY),
        ((UNKNOWN_COMMIT,), True, ErrorStep.RETRY_COMMIT),
        ((TRANSIENT, UNKNOWN_COMMIT), True, ErrorStep.RETRY_COMMIT),
        (("RetryableWriteError", UNKNOWN_COMMIT), True, ErrorStep.RETRY_COMMIT),
        (("RetryableWriteError",), True, ErrorStep.REPLAY),
    ],
)
def test_errors_are_classified_by_label(labels: tuple[str, ...], in_commit: bool, step: ErrorStep) -> None:
    assert classify_error(labels, in_commit=in_commit) is step
    assert classify_error(frozenset(labels), in_commit=in_commit) is step
    assert classify_error(list(labels), in_commit=in_commit) is step


# -- replay budget ------------------------------------------------------------------------


def test_a_zero_replay_budget_defers_the_first_replay() -> None:
    assert next_after_replay(1, 0) is ErrorStep.DEFER


@pytest.mark.parametrize("budget", [0, 1, 2, 5, 100])
def test_a_replay_budget_of_n_allows_exactly_n_replays(budget: int) -> None:
    replays = 0
    while next_after_replay(replays + 1, budget) is ErrorStep.REPLAY:
        replays += 1
        assert replays <= budget, "replayed past the budget"
    assert replays == budget


# -- reconcile ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("record", "verdict"),
    [
        pytest.param(completed(A, 1), Reconciled.COMMITTED, id="completed-by-this-attempt"),
        pytest.param(completed(B, 2), Reconciled.DUPLICATE, id="completed-by-another-owner"),
        pytest.param(completed(A, 2), Reconciled.DUPLICATE, id="completed-under-another-token"),
        pytest.param(leased(A, 1), Reconciled.AMBIGUOUS, id="still-our-lease"),
        pytest.param(leased(B, 2), Reconciled.AMBIGUOUS, id="leased-to-another"),
        pytest.param({**leased(A, 1), "owner": None}, Reconciled.AMBIGUOUS, id="released"),
        pytest.param(None, Reconciled.AMBIGUOUS, id="absent"),
    ],
)
def test_reconciliation_reads_the_majority_record(record: dict[str, Any] | None, verdict: Reconciled) -> None:
    assert reconcile(record, A, 1) is verdict


# -- heartbeat ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("matched", "unrenewed_for", "verdict"),
    [
        (True, 1.0, Heartbeat.RENEWED),
        (True, LEASE * 2, Heartbeat.RENEWED),  # the fence matched: nobody took it over
        (False, 0.1, Heartbeat.LOST),  # the fence matched nothing: taken over or completed
        (False, LEASE * 2, Heartbeat.LOST),
        (None, 0.1, Heartbeat.RETRY),  # the renewal itself failed: try on the next beat
        (None, LEASE - 0.001, Heartbeat.RETRY),
        (None, LEASE + 0.001, Heartbeat.LOST),  # unrenewable for longer than the lease
        (None, LEASE * 10, Heartbeat.LOST),
    ],
)
def test_heartbeat_verdicts(matched: bool | None, unrenewed_for: float, verdict: Heartbeat) -> None:
    assert heartbeat_verdict(matched=matched, unrenewed_for=unrenewed_for, lease_seconds=LEASE) is verdict


def test_no_renewal_while_the_transaction_holds_the_record() -> None:
    # docs/inbox.md, step 3: a renewal committed after the transaction's snapshot would fail it with a WriteConflict.
    assert may_renew(holding=True) is False
    assert may_renew(holding=False) is True


# -- the lease's safety over arbitrary interleavings --------------------------------------


@dataclass
class Attempt:
    """One claim that was granted: what its owner believes it holds."""

    owner: str
    token: int
    expires_at: datetime.datetime | None  # None once it let go (released, completed, lost)


@dataclass
class World:
    record: dict[str, Any] | None = None
    now: datetime.datetime = T0
    attempts: list[Attempt] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # tokens granted, in order
    granted: int = 0
    deferred: int = 0
    names: itertools.count[int] = field(default_factory=itertools.count)

    def live(self) -> list[Attempt]:
        return [a for a in self.attempts if a.expires_at is not None and a.expires_at > self.now]

    def pick(self, index: int) -> Attempt | None:
        return self.attempts[index % len(self.attempts)] if self.attempts else None


OPS = st.lists(
    st.tuples(
        st.sampled_from(["claim", "claim", "renew", "release", "complete"]),
        st.integers(0, 7),  # which replica claims, or which earlier attempt acts
        st.one_of(st.sampled_from([0, 1, 29_999, 30_000, 30_001]), st.integers(0, 45_000)),  # ms elapsed
    ),
    max_size=30,
)


@FAST
@given(ops=OPS)
def test_at_most_one_owner_holds_an_unexpired_lease_and_tokens_increase(ops: list[tuple[str, int, int]]) -> None:
    world = World()
    for op, which, elapsed_ms in ops:
        world.now += datetime.timedelta(milliseconds=elapsed_ms)  # the server clock never goes back
        before = world.record
        if op == "claim":
            owner = f"replica-{which % 3}:{next(world.names)}"  # a fresh owner id per attempt
            world.record = claim(before, owner, world.now)
            verdict = read_claim(world.record, owner)
            if verdict.kind is ClaimKind.LEASED:
                # Each takeover gets a token above every token granted before.
                assert all(verdict.token > t for t in world.tokens)
                world.tokens.append(verdict.token)
                world.granted += 1
                world.attempts.append(Attempt(owner, verdict.token, world.record["expires_at"]))
            elif verdict.kind is ClaimKind.HELD:
                world.deferred += 1
                assert before is not None
                for name in ("owner", "token", "expires_at", "state"):
                    assert world.record[name] == before[name]
            else:
                assert before is not None
                assert before["state"] == "completed"
                assert world.record == before
        else:
            attempt = world.pick(which)
            if attempt is None or attempt.expires_at is None:
                continue
            if op == "renew":
                renewed = renew(before, attempt.owner, attempt.token, world.now)
                if renewed is None:
                    attempt.expires_at = None  # Heartbeat.LOST: the attempt gives up
                else:
                    world.record = renewed
                    attempt.expires_at = renewed["expires_at"]
            elif op == "release":
                after, matched = release_transition(before, attempt.owner, attempt.token, now=world.now, deferred=True)
                world.record = after
                world.deferred += matched
                attempt.expires_at = None
            else:
                done = complete(before, attempt.owner, attempt.token, world.now)
                if done is not None:
                    world.record = done
                attempt.expires_at = None

        live = world.live()
        assert len(live) <= 1, f"two live leases at {world.now}: {live}"
        if live:
            holder = live[0]
            assert world.record is not None
            assert (world.record["owner"], world.record["token"]) == (holder.owner, holder.token)
            assert world.record["state"] == "leased"
        if world.record is not None:
            assert world.record["acquisitions"] == world.granted
            assert world.record["deferrals"] == world.deferred
    if world.record is not None and world.record["state"] == "completed":
        # Exactly one attempt's completion is there; every other attempt reconciles to a duplicate.
        verdicts = [reconcile(world.record, a.owner, a.token) for a in world.attempts]
        assert verdicts.count(Reconciled.COMMITTED) == 1
