"""Seeded mutants of :mod:`lily_mongo.records` for the inbox protocol model, and their score.

Each mutant replaces one function of ``lily_mongo.records`` with a plausibly wrong version.
The model (``tests/property/test_inbox_model.py``) calls the lease functions through the
module, so patching the module attribute is enough. Two ways to run them:

* ``LILY_MUTANTS=1 uv_run pytest --noconftest tests/property/test_inbox_model.py -k mutant``
  (every non-equivalent mutant must be caught, by the invariant it names);
* ``uv_run python -m tests.property.inbox_mutants [examples]`` prints the score table.

A mutant marked ``equivalent`` cannot be told apart from the original by any run of the
model; ``why`` says why (the table still runs it, to show that it survives).
"""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any
from unittest import mock

import lily_mongo.records as records
from lily_mongo.records import COMPLETED, LEASED, Claim, ClaimKind, ErrorStep, FirstClaim, Heartbeat, Reconciled

Record = Any

# The originals, captured before any patching (a mutant delegates to them).
read_claim = records.read_claim
claim_transition = records.claim_transition
completion_transition = records.completion_transition
renewal_transition = records.renewal_transition
release_transition = records.release_transition
classify_error = records.classify_error
next_after_replay = records.next_after_replay
reconcile = records.reconcile
may_renew = records.may_renew
heartbeat_verdict = records.heartbeat_verdict
read_first_claim = records.read_first_claim
first_claim_falls_back = records.first_claim_falls_back
first_claim_transition = records.first_claim_transition


@dataclass(frozen=True)
class Mutant:
    name: str
    target: str  # the lily_mongo.records attribute it replaces
    function: Callable[..., Any]
    caught_by: tuple[str, ...]  # the invariants that may report it (none: equivalent)
    why: str = ""  # for an equivalent mutant: why no run of the model can tell

    @property
    def equivalent(self) -> bool:
        return not self.caught_by


# -- read_claim ---------------------------------------------------------------------------------


def held_as_leased(record: Record, owner: str) -> Claim:
    got = read_claim(record, owner)
    return Claim(ClaimKind.LEASED, token=int(record["token"])) if got.kind is ClaimKind.HELD else got


def held_as_duplicate(record: Record, owner: str) -> Claim:
    got = read_claim(record, owner)
    return Claim(ClaimKind.DUPLICATE) if got.kind is ClaimKind.HELD else got


def completed_as_leased(record: Record, owner: str) -> Claim:
    if record.get("state") == COMPLETED:
        return Claim(ClaimKind.LEASED, token=int(record["token"]))
    return read_claim(record, owner)


# -- claim_transition ---------------------------------------------------------------------------


def _claim(
    record: Record | None,
    *,
    free: Callable[[dict[str, Any], datetime.datetime], bool] | None = None,
    token_step: int = 1,
    deferral_step: int = 1,
    completed_is_final: bool = True,
    **kw: Any,
) -> dict[str, Any]:
    """claim_transition written out again, with one of its rules changed by the arguments."""
    now: datetime.datetime = kw["now"]
    doc: dict[str, Any] = dict(record) if record is not None else {"_id": kw["key"]}
    if completed_is_final and doc.get("state") == COMPLETED:
        return doc
    if free is None:
        expires = doc.get("expires_at")
        is_free = doc.get("owner") is None or expires is None or expires <= now
    else:
        is_free = free(doc, now)
    doc["handler"], doc["event_id"], doc["checked_at"] = kw["handler_id"], kw["event_id"], now
    if is_free:
        doc["state"], doc["owner"] = LEASED, kw["owner"]
        doc["token"] = int(doc.get("token", 0)) + token_step
        doc["expires_at"] = now + datetime.timedelta(seconds=kw["lease_seconds"])
        doc["purge_at"] = doc["expires_at"] + datetime.timedelta(seconds=kw["stale_seconds"])
        doc["acquisitions"] = int(doc.get("acquisitions", 0)) + 1
        doc.setdefault("deferrals", 0)
    else:
        doc.setdefault("acquisitions", 0)
        doc["deferrals"] = int(doc.get("deferrals", 0)) + deferral_step
    return doc


def claim_ignores_expiry(record: Record | None, **kw: Any) -> Any:
    return _claim(record, free=lambda doc, now: doc.get("owner") is None, **kw)


def claim_ignores_live_lease(record: Record | None, **kw: Any) -> Any:
    return _claim(record, free=lambda doc, now: True, **kw)


def claim_expires_early(record: Record | None, **kw: Any) -> Any:
    def free(doc: dict[str, Any], now: datetime.datetime) -> bool:
        expires = doc.get("expires_at")
        return doc.get("owner") is None or expires is None or expires <= now + datetime.timedelta(seconds=1)

    return _claim(record, free=free, **kw)


def claim_keeps_token(record: Record | None, **kw: Any) -> Any:
    return _claim(record, token_step=0, **kw) if record is not None else claim_transition(record, **kw)


def claim_takes_completed(record: Record | None, **kw: Any) -> Any:
    return _claim(record, completed_is_final=False, **kw)


def claim_counts_no_deferral(record: Record | None, **kw: Any) -> Any:
    return _claim(record, deferral_step=0, **kw)


# -- fenced writes ------------------------------------------------------------------------------


def _as_fenced(record: Record | None, owner: str, token: int) -> Record | None:
    return None if record is None else {**record, "owner": owner, "token": token}


def _restore(after: dict[str, Any] | None, record: Record) -> dict[str, Any] | None:
    if after is not None and record is not None:
        after["owner"], after["token"] = record.get("owner"), record.get("token")
    return after


def completion_ignores_token(record: Record | None, owner: str, token: int, **kw: Any) -> Any:
    if record is not None and record.get("owner") == owner:
        return _restore(completion_transition(_as_fenced(record, owner, token), owner, token, **kw), record)
    return completion_transition(record, owner, token, **kw)


def completion_ignores_fence(record: Record | None, owner: str, token: int, **kw: Any) -> Any:
    return _restore(completion_transition(_as_fenced(record, owner, token), owner, token, **kw), record)


def renewal_ignores_fence(record: Record | None, owner: str, token: int, **kw: Any) -> Any:
    return _restore(renewal_transition(_as_fenced(record, owner, token), owner, token, **kw), record)


def release_ignores_fence(record: Record | None, owner: str, token: int, **kw: Any) -> Any:
    if record is None:
        return release_transition(record, owner, token, **kw)
    after, _ = release_transition({**record, "owner": owner, "token": token, "state": LEASED}, owner, token, **kw)
    if after is not None:
        after["token"], after["state"] = record.get("token"), record.get("state")
    return after, True


def release_counts_no_deferral(record: Record | None, owner: str, token: int, **kw: Any) -> Any:
    after, matched = release_transition(record, owner, token, **kw)
    if matched and after is not None and record is not None:
        after["deferrals"] = int(record.get("deferrals", 0))
    return after, matched


# -- consumer-side decisions --------------------------------------------------------------------


def replays_unknown_commit(labels: Collection[str], *, in_commit: bool) -> ErrorStep:
    step = classify_error(labels, in_commit=in_commit)
    return ErrorStep.REPLAY if step is ErrorStep.RETRY_COMMIT else step


def retries_failed_commit(labels: Collection[str], *, in_commit: bool) -> ErrorStep:
    return ErrorStep.RETRY_COMMIT if in_commit else classify_error(labels, in_commit=in_commit)


def defers_transient(labels: Collection[str], *, in_commit: bool) -> ErrorStep:
    step = classify_error(labels, in_commit=in_commit)
    return ErrorStep.DEFER if step is ErrorStep.REPLAY and not in_commit else step


def replay_one_short(replays: int, budget: int) -> ErrorStep:
    return ErrorStep.REPLAY if replays < budget else ErrorStep.DEFER


def replay_one_extra(replays: int, budget: int) -> ErrorStep:
    return ErrorStep.REPLAY if replays <= budget + 1 else ErrorStep.DEFER


def replay_unbounded(replays: int, budget: int) -> ErrorStep:
    return ErrorStep.REPLAY


def others_completion_is_committed(record: Record | None, owner: str, token: int) -> Reconciled:
    found = reconcile(record, owner, token)
    return Reconciled.COMMITTED if found is Reconciled.DUPLICATE else found


def own_completion_is_duplicate(record: Record | None, owner: str, token: int) -> Reconciled:
    found = reconcile(record, owner, token)
    return Reconciled.DUPLICATE if found is Reconciled.COMMITTED else found


def own_lease_is_committed(record: Record | None, owner: str, token: int) -> Reconciled:
    if record is not None and record.get("owner") == owner and record.get("token") == token:
        return Reconciled.COMMITTED
    return reconcile(record, owner, token)


def renews_while_holding(*, holding: bool) -> bool:
    return True


def never_lost(*, matched: bool | None, unrenewed_for: float, lease_seconds: float) -> Heartbeat:
    verdict = heartbeat_verdict(matched=matched, unrenewed_for=unrenewed_for, lease_seconds=lease_seconds)
    return Heartbeat.RETRY if verdict is Heartbeat.LOST else verdict


# -- the claim inside the transaction (first-time copies) ----------------------------------------


def contended_as_claimed(before: Record | None) -> FirstClaim:
    got = read_first_claim(before)
    return FirstClaim.CLAIMED if got is FirstClaim.CONTENDED else got


def duplicate_as_claimed(before: Record | None) -> FirstClaim:
    got = read_first_claim(before)
    return FirstClaim.CLAIMED if got is FirstClaim.DUPLICATE else got


def contended_as_duplicate(before: Record | None) -> FirstClaim:
    got = read_first_claim(before)
    return FirstClaim.DUPLICATE if got is FirstClaim.CONTENDED else got


def first_claim_overwrites(record: Record | None, **kwargs: Any) -> dict[str, Any] | None:
    return first_claim_transition(None, **kwargs)


def first_claim_writes_a_lease(record: Record | None, **kwargs: Any) -> dict[str, Any] | None:
    doc = first_claim_transition(record, **kwargs)
    return None if doc is None else {**doc, "state": LEASED}


def constantly(answer: bool) -> Callable[..., bool]:
    """A decision that ignores its inputs and always answers ``answer``."""

    def decide(*args: object, **kwargs: object) -> bool:
        return answer

    return decide


COST_ONLY = (
    "claiming inside the transaction is safe for any copy (a record found there, or written meanwhile, sends it "
    "to the lease claim); which copies do it only changes the commands they cost"
)

OWNER_UNIQUE = (
    "owner ids are unique per claim (inbox.py draws one per delivery), so the owner alone fences; "
    "the token matters only if an owner id were reused"
)
COMPLETION_FIRST = (
    "the completion is the transaction's first write and is fenced: a lost lease is found there before the "
    "handler runs, whatever the heartbeat concluded"
)

MUTANTS: list[Mutant] = [
    Mutant("read_claim-held-as-leased", "read_claim", held_as_leased, ("claim-reading",)),
    Mutant("read_claim-held-as-duplicate", "read_claim", held_as_duplicate, ("claim-reading",)),
    Mutant("read_claim-completed-as-leased", "read_claim", completed_as_leased, ("claim-reading",)),
    Mutant("claim-ignores-expiry", "claim_transition", claim_ignores_expiry, ("liveness",)),
    Mutant("claim-ignores-live-lease", "claim_transition", claim_ignores_live_lease, ("exclusive-lease",)),
    Mutant("claim-expires-1s-early", "claim_transition", claim_expires_early, ("exclusive-lease",)),
    Mutant("claim-keeps-token", "claim_transition", claim_keeps_token, (), OWNER_UNIQUE),
    Mutant("claim-takes-completed", "claim_transition", claim_takes_completed, ("exclusive-lease",)),
    Mutant("claim-counts-no-deferral", "claim_transition", claim_counts_no_deferral, ("bounded-requeue",)),
    Mutant("completion-ignores-token", "completion_transition", completion_ignores_token, (), OWNER_UNIQUE),
    Mutant("completion-ignores-fence", "completion_transition", completion_ignores_fence, ("fencing",)),
    Mutant("renewal-ignores-fence", "renewal_transition", renewal_ignores_fence, ("fencing",)),
    Mutant("release-ignores-fence", "release_transition", release_ignores_fence, ("fencing",)),
    Mutant("release-counts-no-deferral", "release_transition", release_counts_no_deferral, ("bounded-requeue",)),
    Mutant("classify-replays-unknown-commit", "classify_error", replays_unknown_commit, ("reconciliation",)),
    Mutant("classify-retries-failed-commit", "classify_error", retries_failed_commit, ("replay",)),
    Mutant("classify-defers-transient", "classify_error", defers_transient, ("replay",)),
    Mutant("replay-one-short", "next_after_replay", replay_one_short, ("replay",)),
    Mutant("replay-one-extra", "next_after_replay", replay_one_extra, ("replay",)),
    Mutant("replay-unbounded", "next_after_replay", replay_unbounded, ("replay",)),
    Mutant("reconcile-others-as-committed", "reconcile", others_completion_is_committed, ("ack-proof",)),
    Mutant("reconcile-own-as-duplicate", "reconcile", own_completion_is_duplicate, ("reconciliation",)),
    Mutant("reconcile-lease-as-committed", "reconcile", own_lease_is_committed, ("ack-proof",)),
    Mutant(
        "may_renew-while-holding",
        "may_renew",
        renews_while_holding,
        (),
        "a renewal of a record the attempt's own transaction holds waits for that transaction (MongoDB), and "
        "after it the fence no longer matches or the lease is as before: nothing observable changes",
    ),
    Mutant("heartbeat-never-lost", "heartbeat_verdict", never_lost, (), COMPLETION_FIRST),
    Mutant("first-claim-contended-as-claimed", "read_first_claim", contended_as_claimed, ("claim-reading",)),
    Mutant("first-claim-duplicate-as-claimed", "read_first_claim", duplicate_as_claimed, ("claim-reading",)),
    Mutant("first-claim-contended-as-duplicate", "read_first_claim", contended_as_duplicate, ("claim-reading",)),
    Mutant("first-claim-overwrites", "first_claim_transition", first_claim_overwrites, ("exclusive-lease",)),
    Mutant(
        "first-claim-writes-a-lease",
        "first_claim_transition",
        first_claim_writes_a_lease,
        ("claim-reading", "at-most-once"),
    ),
    Mutant(
        "first-claim-falls-back-on-any-error",
        "first_claim_falls_back",
        constantly(True),
        (),
        "an unlabelled error of the claim in the transaction then takes the lease claim instead of deferring: "
        "the claim meets the same server and defers if it fails too (a command more, not a guarantee)",
    ),
    Mutant(
        "first-claim-never-falls-back",
        "first_claim_falls_back",
        constantly(False),
        (),
        "a transient error of the claim in the transaction then replays through the lease claim instead: "
        "the same path, one replay counted and a backoff more (a cost, not a guarantee)",
    ),
    Mutant("first-claim-for-every-copy", "claims_in_transaction", constantly(True), (), COST_ONLY),
    Mutant("first-claim-never", "claims_in_transaction", constantly(False), (), COST_ONLY),
]


def score(examples: int, *, only: str = "") -> int:
    """Run every mutant against the scenarios and the random machine; print the table.

    Returns how many mutants scored otherwise than expected. The random runs are not shrunk
    (a mutant is only detected, not minimised) and are derandomised, so the table is stable.
    """
    from hypothesis import Phase, settings
    from hypothesis.reporting import with_reporter
    from hypothesis.stateful import run_state_machine_as_test

    from tests.property.test_inbox_model import MODEL, SCENARIO_CASES, InboxModel, first_violation

    budget = settings(
        MODEL,
        max_examples=examples,
        report_multiple_bugs=False,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
    )

    def machine() -> None:
        run_state_machine_as_test(InboxModel, settings=budget)

    unexpected = 0
    counts = {"scenarios": 0, "machine": 0, "either": 0}
    print(f"{'mutant':34} {'scenarios':16} {f'{examples} random runs':18} {'seconds':>7}  expected")
    for mutant in [m for m in MUTANTS if only in m.name]:
        started = time.perf_counter()
        with mock.patch.object(records, mutant.target, mutant.function), with_reporter(lambda _: None):
            by_scenario = first_violation(SCENARIO_CASES)
            by_machine = first_violation([machine])
        found = [v.invariant for v in (by_scenario, by_machine) if v is not None]
        counts["scenarios"] += by_scenario is not None
        counts["machine"] += by_machine is not None
        counts["either"] += bool(found)
        unexpected += not (set(found) <= set(mutant.caught_by)) or (bool(found) == mutant.equivalent)
        cells = [v.invariant if v is not None else "-" for v in (by_scenario, by_machine)]
        print(
            f"{mutant.name:34} {cells[0]:16} {cells[1]:18} {time.perf_counter() - started:7.1f}  "
            f"{'/'.join(mutant.caught_by) or 'equivalent'}"
        )
    live = sum(not m.equivalent for m in MUTANTS if only in m.name)
    print(
        f"caught: scenarios {counts['scenarios']}, random runs {counts['machine']}, either {counts['either']} "
        f"of {live} non-equivalent mutants"
    )
    return unexpected


if __name__ == "__main__":
    examples = int(sys.argv[1]) if len(sys.argv) > 1 else 250
    sys.exit(1 if score(examples, only=sys.argv[2] if len(sys.argv) > 2 else "") else 0)
