"""The MongoDB lease inbox against the real broker and the MongoDB-wire server (docs/inbox.md).

"Effect once" means: exactly one document per event in the handler's ``effects``
collection and exactly one completion record in ``lily_inbox``. Failures are
injected with ``configureFailPoint failCommand``; a failpoint aimed at one
collection uses the ``namespace`` filter so lease, heartbeat and relay traffic
is never hit by accident.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from pymongo.errors import OperationFailure

from lily_mongo import (
    Consumer,
    EventId,
    InboxOptions,
    Json,
    ManagedConsumer,
    MongoScope,
    QueueHandlerError,
    RetryCount,
    RetryPolicy,
    ScopeClosedError,
    TerminalObservation,
    queue,
)
from lily_mongo.testing import Faults
from tests.support.broker import Broker
from tests.support.consumers import one_event, outcomes, running
from tests.support.handlers import accepting
from tests.support.mongo import MongoDB
from tests.support.polling import eventually
from tests.support.proxy import behind_a_cutter

Handler = Callable[..., Awaitable[None]]

RECORDS = "lily_inbox"  # one record per (handler, event): the lease and the completion
EFFECTS = "effects"
# commitTransaction answers MaxTimeMSExpired labelled UnknownTransactionCommitResult: code 50 is
# not retryable for PyMongo, so the driver does not retry the commit itself (the library does).
AMBIGUOUS = {"code": 50, "labels": ["UnknownTransactionCommitResult"]}
RETRY_COMMITS_TWICE = InboxOptions(commit_retries=2, backoff_base=0.01)
HOUR = datetime.timedelta(hours=1)


# -- helpers --------------------------------------------------------------------------------------


def settled_copies(*managed: ManagedConsumer) -> int:
    """Copies that reached a final settlement (deferred copies come back and settle later)."""
    return sum(o in ("acked", "duplicate") for m in managed for o in outcomes(m))


def inbox_consumer(broker: Broker, mongodb: MongoDB, q: str, handler: Handler, **options: Any) -> Consumer:
    """A consumer of ``q`` with an inbox in ``mongodb`` (two permits, two quick retries unless ``options`` say)."""
    defaults: dict[str, Any] = {
        "name": "inbox-test",
        "concurrency": 2,
        "prefetch": 8,
        "retry": RetryPolicy(max_retries=2, delays=(0.2,)),
    }
    return broker.consumer(q, handler, mongodb=mongodb, graceful_timeout=10.0, **(defaults | options))


def effect_handler(q: str, calls: list[uuid.UUID], *, handler_id: str | None = None) -> Handler:
    """Writes one effect document and bumps a counter, both in the attempt's transaction."""

    @queue(q, version=1, content="json", handler_id=handler_id or f"{q}/effect")
    async def handle(payload: Json[dict[str, Any]], event_id: EventId, mongo: MongoScope) -> None:
        calls.append(event_id)
        db = mongo.database
        await db[EFFECTS].insert_one({"event_id": str(event_id), "n": payload["n"]}, session=mongo.session)
        await db["counters"].update_one({"_id": "total"}, {"$inc": {"n": 1}}, upsert=True, session=mongo.session)

    return handle


async def assert_applied_once(mongodb: MongoDB, key: str, event_id: uuid.UUID) -> None:
    """One effect document for the event, and its record completed."""
    assert await mongodb.db[EFFECTS].count_documents({"event_id": str(event_id)}) == 1
    record = await mongodb.db[RECORDS].find_one({"_id": key})
    assert record is not None
    assert record["state"] == "completed"


async def assert_effect_once(mongodb: MongoDB, event_id: uuid.UUID) -> None:
    db = mongodb.db
    effects = await db[EFFECTS].find({"event_id": str(event_id)}).to_list()
    assert len(effects) == 1, effects
    records = await db[RECORDS].find({"event_id": str(event_id)}).to_list()
    assert [r["state"] for r in records] == ["completed"], records
    counter = await db["counters"].find_one({"_id": "total"})
    assert counter is not None
    assert counter["n"] == 1
    # The completed record is the release: no record of any other event is left behind.
    assert await db[RECORDS].count_documents({}) == 1


async def publish(broker: Broker, q: str, event_id: uuid.UUID, copies: int = 1, **options: Any) -> None:
    """``copies`` copies of the event (payloads ``{"n": 0}``, ``{"n": 1}``, ...)."""
    await broker.publish_all(q, [{"n": i} for i in range(copies)], event_id=event_id, **options)


def only(managed: ManagedConsumer) -> TerminalObservation:
    [observation] = managed.delivery_terminal_observations()
    return observation


@dataclasses.dataclass
class EffectRun:
    q: str
    managed: ManagedConsumer
    calls: list[uuid.UUID]  # one entry per handler call
    event: uuid.UUID


async def run_effect(
    broker: Broker,
    mongodb: MongoDB,
    q: str,
    *,
    settled: Callable[[ManagedConsumer], bool],
    inject: Callable[[], Awaitable[None]] | None = None,
    **options: Any,
) -> EffectRun:
    """One event through the effect handler on ``q``; ``inject()`` runs once the consumer is up, before the
    publish. Returns after the consumer stopped, once ``settled`` held and the queue was empty."""
    calls: list[uuid.UUID] = []
    event = uuid.uuid4()
    async with running(inbox_consumer(broker, mongodb, q, effect_handler(q, calls), **options)) as managed:
        if inject is not None:
            await inject()
        await publish(broker, q, event)
        await eventually(lambda: settled(managed), timeout=8.0, what="settlement")
        assert await broker.wait_for_depth(q, 0) == 0
    return EffectRun(q, managed, calls, event)


FailingCommits = Callable[..., Awaitable[EffectRun]]


@pytest.fixture
def failing_commits(broker: Broker, mongodb: MongoDB, failpoints: Faults) -> FailingCommits:
    """Runs one event through the effect handler on a fresh queue (named after ``base``) while
    ``commitTransaction`` fails as the failpoint arguments say (see :func:`run_effect`)."""

    async def run(
        base: str, *, settled: Callable[[ManagedConsumer], bool], inbox: InboxOptions | None = None, **failpoint: Any
    ) -> EffectRun:
        async def inject() -> None:
            await failpoints.fail(["commitTransaction"], **failpoint)

        return await run_effect(broker, mongodb, broker.queue(base), settled=settled, inject=inject, inbox=inbox)

    return run


def one_settled(managed: ManagedConsumer) -> bool:
    return len(outcomes(managed)) == 1


def one_copy_settled(managed: ManagedConsumer) -> bool:
    return settled_copies(managed) == 1


def acked(managed: ManagedConsumer) -> bool:
    return "acked" in outcomes(managed)


# -- fast path ------------------------------------------------------------------------------------


async def test_same_event_twice_runs_the_handler_once(broker: Broker, mongodb: MongoDB) -> None:
    q = broker.queue("fast")
    calls: list[uuid.UUID] = []
    event = uuid.uuid4()
    consumer = inbox_consumer(broker, mongodb, q, effect_handler(q, calls), inbox=InboxOptions(retention_seconds=3600))
    async with running(consumer) as managed:
        await publish(broker, q, event)
        await eventually(lambda: len(outcomes(managed)) == 1, timeout=8.0, what="first copy settled")
        await publish(broker, q, event)
        await eventually(lambda: len(outcomes(managed)) == 2, timeout=8.0, what="second copy settled")
        assert await broker.wait_for_depth(q, 0) == 0
    first, second = managed.delivery_terminal_observations()
    assert (first.outcome, second.outcome) == ("acked", "duplicate")
    assert (first.ack_sent, second.ack_sent) == (True, True)
    assert first.event_id == second.event_id == event
    assert calls == [event]
    await assert_effect_once(mongodb, event)
    assert await broker.depth(f"{q}.dlq") == 0
    # Retention (docs/inbox.md): a TTL index on the record's purge time, set retention_seconds ahead.
    records = mongodb.db[RECORDS]
    record = await records.find_one({"event_id": str(event)})
    assert record is not None
    assert record["state"] == "completed"
    assert (record["purge_at"] - record["completed_at"]).total_seconds() == pytest.approx(3600, abs=1)
    ttl = [i for i in (await records.index_information()).values() if i["key"] == [("purge_at", 1)]]
    assert [i.get("expireAfterSeconds") for i in ttl] == [0]


# -- transient errors: replay the whole pipeline in a fresh scope ---------------------------------


@pytest.mark.parametrize(
    ("command", "collection", "claim_in_transaction"),
    [
        ("insert", EFFECTS, True),
        ("update", "counters", True),
        ("findAndModify", RECORDS, True),  # a first-time copy's claim, the transaction's first write
        ("update", RECORDS, False),  # the lease path's completion, the transaction's first write
    ],
    ids=["handler-insert", "handler-update", "claim-in-transaction", "completion-write"],
)
async def test_transient_error_on_an_operation_replays(
    broker: Broker, mongodb: MongoDB, failpoints: Faults, command: str, collection: str, claim_in_transaction: bool
) -> None:
    # Code 112 with TransientTransactionError is MongoDB's WriteConflict shape.
    async def inject() -> None:
        await failpoints.fail(
            [command], code=112, labels=["TransientTransactionError"], namespace=f"{mongodb.name}.{collection}"
        )

    options = InboxOptions(claim_in_transaction=claim_in_transaction)
    run = await run_effect(broker, mongodb, broker.queue("tt"), settled=one_settled, inject=inject, inbox=options)
    managed, calls, event = run.managed, run.calls, run.event
    observation = only(managed)
    assert observation.outcome == "acked"
    if command == "findAndModify":
        # The claim in the transaction met a transient error (a concurrent copy's transaction
        # holding the new record, on MongoDB): no handler ran, so no replay is counted; the
        # delivery takes the lease claim and runs its one attempt.
        assert (observation.transient_replays, observation.attempts, len(calls)) == (0, 1, 1)
        record = await mongodb.db[RECORDS].find_one({"event_id": str(event)})
        assert record is not None
        assert record["state"] == "completed"
        assert "expires_at" in record  # completed on the lease path (a record born completed has no lease)
        await assert_effect_once(mongodb, event)
        return
    assert observation.transient_replays >= 1
    assert observation.attempts == observation.transient_replays + 1
    # Each attempt is one fresh handler call, except one failing at the completion write,
    # which precedes the handler.
    failed_before_the_handler = 1 if collection == RECORDS else 0
    assert len(calls) == observation.attempts - failed_before_the_handler
    assert managed.snapshot().queues[0].transient_replays >= 1
    await assert_effect_once(mongodb, event)


@pytest.mark.parametrize(
    "labels",
    [["TransientTransactionError"], []],
    ids=["labelled-transient", "unlabelled-emulator-shape"],
)
async def test_commit_failure_without_unknown_result_replays(
    mongodb: MongoDB, broker: Broker, failing_commits: FailingCommits, labels: list[str]
) -> None:
    # A commit failing without UnknownTransactionCommitResult did not commit (docs/inbox.md, step 6);
    # the emulator reports its write conflicts as code 112 with no label at all.
    run = await failing_commits("commit", settled=one_settled, times=1, code=112, labels=labels)
    managed, calls, event = run.managed, run.calls, run.event
    observation = only(managed)
    assert observation.outcome == "acked"
    assert observation.transient_replays == 1
    assert observation.reconciliations == 0
    assert len(calls) == 2
    await assert_effect_once(mongodb, event)


async def test_old_scope_is_closed_while_the_replay_runs(broker: Broker, mongodb: MongoDB, failpoints: Faults) -> None:
    q = broker.queue("scope")
    scopes: list[MongoScope] = []
    seen_open: list[list[bool]] = []

    @queue(q, version=1, content="json", handler_id=f"{q}/scopes")
    async def handle(event_id: EventId, mongo: MongoScope) -> None:
        seen_open.append([s.is_open for s in scopes])
        scopes.append(mongo)
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id)}, session=mongo.session)

    consumer = inbox_consumer(broker, mongodb, q, handle)
    async with running(consumer) as managed:
        await failpoints.fail(["commitTransaction"], code=112, labels=["TransientTransactionError"])
        await publish(broker, q, uuid.uuid4())
        await eventually(lambda: len(outcomes(managed)) == 1, timeout=8.0, what="settlement")
    assert outcomes(managed) == ["acked"]
    assert len(scopes) == 2
    assert scopes[0] is not scopes[1]
    assert seen_open == [[], [False]]  # the replay got a fresh scope; the first was already closed


# -- UnknownTransactionCommitResult: reconcile, never re-run to find out --------------------------


@pytest.mark.parametrize("claim_in_transaction", [True, False], ids=["in-transaction", "lease-first"])
async def test_unknown_commit_result_once_is_reconciled_by_retrying_the_commit(
    mongodb: MongoDB, broker: Broker, failing_commits: FailingCommits, claim_in_transaction: bool
) -> None:
    # Code 50 (MaxTimeMSExpired) is not a retryable code for PyMongo, so the driver does
    # not retry the commit itself: the failpoint fires exactly once, at the library.
    inbox = InboxOptions(claim_in_transaction=claim_in_transaction)
    run = await failing_commits("unknown1", settled=one_settled, inbox=inbox, times=1, **AMBIGUOUS)
    managed, calls, event = run.managed, run.calls, run.event
    observation = only(managed)
    assert observation.outcome == "acked"
    assert observation.reconciliations >= 1
    assert observation.transient_replays == 0
    assert observation.attempts == 1
    assert calls == [event]
    assert managed.snapshot().queues[0].reconciliations >= 1
    await assert_effect_once(mongodb, event)


async def test_unknown_commit_result_that_persists_defers_to_the_next_delivery(
    mongodb: MongoDB, broker: Broker, failing_commits: FailingCommits
) -> None:
    # commit_retries=2: one commit plus two retries of the same commit, all failing with
    # UnknownTransactionCommitResult (times=3). Reconciliation then reads the completion
    # record: the emulator's failpoint fires *before* the commit applies, so the record is
    # absent → deferred (bounded requeue). The redelivery runs the handler again — a new
    # delivery, not a re-run within the first one — and commits cleanly.
    run = await failing_commits("unknownN", settled=acked, inbox=RETRY_COMMITS_TWICE, times=3, **AMBIGUOUS)
    managed, calls, event = run.managed, run.calls, run.event
    first, second = managed.delivery_terminal_observations()
    assert first.outcome == "deferred"
    assert first.code == "COMMIT_AMBIGUOUS"
    assert first.reconciliations == 1
    assert first.attempts == 1  # the handler was not re-run to find out
    assert first.transient_replays == 0
    assert second.outcome == "acked"
    assert second.attempts == 1
    assert second.reconciliations == 0
    # One handler call per delivery, two deliveries.
    assert calls == [event, event]
    assert sum(o.attempts for o in managed.delivery_terminal_observations()) == len(calls)
    await assert_effect_once(mongodb, event)
    assert await broker.depth(f"{run.q}.dlq") == 0


async def test_unknown_commit_result_many_times_stays_bounded(
    mongodb: MongoDB, broker: Broker, failing_commits: FailingCommits
) -> None:
    # times=10 with commit_retries=2: each delivery consumes up to three commit failures.
    # Deliveries 1-3 consume nine and are deferred; delivery 4 sees one more failure, its
    # commit retry succeeds (reconciled) and it is ACKed. Four handler calls, one per delivery.
    run = await failing_commits("unknown10", settled=acked, inbox=RETRY_COMMITS_TWICE, times=10, **AMBIGUOUS)
    managed, calls, event = run.managed, run.calls, run.event
    observations = managed.delivery_terminal_observations()
    assert [o.outcome for o in observations] == ["deferred", "deferred", "deferred", "acked"]
    assert all(o.attempts == 1 and o.transient_replays == 0 for o in observations)
    assert [o.reconciliations for o in observations] == [1, 1, 1, 1]
    assert len(calls) == 4
    await assert_effect_once(mongodb, event)


async def test_close_connection_failpoint_on_commit(
    mongodb: MongoDB, broker: Broker, failing_commits: FailingCommits
) -> None:
    # MongoDB drops the socket (the driver sees a network error labelled
    # UnknownTransactionCommitResult and reconciles); the emulator instead answers with an
    # error reply carrying no code and no label, i.e. "did not commit" (replay). Either way
    # the effect happens once and every attempt ran the handler exactly once.
    run = await failing_commits(
        "close",
        settled=one_copy_settled,
        inbox=InboxOptions(commit_retries=1, backoff_base=0.01),
        times=3,
        close_connection=True,
    )
    managed, calls, event = run.managed, run.calls, run.event
    observations = managed.delivery_terminal_observations()
    assert observations[-1].outcome in ("acked", "duplicate")
    assert all(o.outcome == "deferred" for o in observations[:-1])
    assert sum(o.transient_replays + o.reconciliations for o in observations) >= 1
    assert len(calls) == sum(o.attempts for o in observations)
    await assert_effect_once(mongodb, event)
    assert await broker.depth(f"{run.q}.dlq") == 0


async def run_behind_a_cutter(
    broker: Broker, mongodb: MongoDB, base: str, *, cut_requests: int = 0, cut_replies: int = 0, **options: Any
) -> tuple[EffectRun, int]:
    """One event through the effect handler (see :func:`run_effect`) with the consumer's MongoDB behind a
    :class:`CommitCutter` cutting that many commit requests or replies; the run and the cuts made."""
    async with behind_a_cutter(mongodb) as (cutter, cut):

        async def arm() -> None:
            cutter.cut_requests, cutter.cut_replies = cut_requests, cut_replies

        run = await run_effect(broker, cut, broker.queue(base), settled=one_copy_settled, inject=arm, **options)
        return run, cutter.cuts


@pytest.mark.parametrize(
    ("cuts", "expected"),
    [(1, ["acked"]), (2, ["deferred", "acked"])],
    ids=["commit-retry-succeeds", "retries-exhausted-record-absent"],
)
async def test_commit_request_lost_on_the_network(
    broker: Broker, mongodb: MongoDB, cuts: int, expected: list[str]
) -> None:
    # commit_retries=1: one commit plus one retry of the same commit. One lost request:
    # the retry commits (reconciled, ACK). Two: the record is absent (nothing reached the
    # server) → deferred; the redelivery runs the handler once more and commits.
    inbox = InboxOptions(commit_retries=1, backoff_base=0.01)
    run, cut = await run_behind_a_cutter(broker, mongodb, "lostreq", cut_requests=cuts, inbox=inbox)
    assert cut == cuts
    managed, calls, event = run.managed, run.calls, run.event
    observations = managed.delivery_terminal_observations()
    assert [o.outcome for o in observations] == expected
    assert observations[0].reconciliations == 1
    assert all(o.attempts == 1 and o.transient_replays == 0 for o in observations)
    if len(observations) > 1:
        assert observations[0].code == "COMMIT_AMBIGUOUS"
    assert len(calls) == len(expected)  # one handler call per delivery
    await assert_effect_once(mongodb, event)


@pytest.mark.parametrize("claim_in_transaction", [True, False], ids=["in-transaction", "lease-first"])
async def test_commit_reply_lost_is_reconciled_from_the_completion_record(
    claim_in_transaction: bool, broker: Broker, mongodb: MongoDB
) -> None:
    # The commit applies but its reply is lost, twice (the commit and its one retry):
    # the commit result stays unknown, so reconciliation reads the completion record with
    # majority read concern, finds this attempt's token and ACKs — without running the
    # handler again.
    inbox = InboxOptions(commit_retries=1, backoff_base=0.01, claim_in_transaction=claim_in_transaction)
    run, cut = await run_behind_a_cutter(broker, mongodb, "lostreply", cut_replies=2, inbox=inbox)
    assert cut == 2
    managed, calls, event = run.managed, run.calls, run.event
    observation = only(managed)
    assert observation.outcome == "acked"
    assert (observation.attempts, observation.transient_replays, observation.reconciliations) == (1, 0, 1)
    assert calls == [event]
    await assert_effect_once(mongodb, event)


# -- concurrency: competing consumers ------------------------------------------------------------


async def test_two_consumers_six_concurrent_copies_effect_once(broker: Broker, mongodb: MongoDB) -> None:
    q = broker.queue("race")
    event = uuid.uuid4()
    calls_a: list[uuid.UUID] = []
    calls_b: list[uuid.UUID] = []
    handler_id = f"{q}/race"
    options = InboxOptions(lease_seconds=2.0)
    async with mongodb.second_client() as other:
        # prefetch 2 = concurrency 2: the broker spreads the six copies over both consumers.
        handler_a = effect_handler(q, calls_a, handler_id=handler_id)
        handler_b = effect_handler(q, calls_b, handler_id=handler_id)
        consumer_a = inbox_consumer(broker, mongodb, q, handler_a, name="race-a", inbox=options, prefetch=2)
        consumer_b = inbox_consumer(broker, other, q, handler_b, name="race-b", inbox=options, prefetch=2)
        async with running(consumer_a) as a, running(consumer_b) as b:
            await publish(broker, q, event, copies=6)
            await eventually(lambda: settled_copies(a, b) == 6, timeout=15.0, what="all six copies settled")
            assert await broker.wait_for_depth(q, 0) == 0
    every = [*outcomes(a), *outcomes(b)]
    counts = collections.Counter(every)
    assert counts["acked"] == 1, counts
    assert counts["acked"] + counts["duplicate"] == 6, counts
    assert set(counts) <= {"acked", "duplicate", "deferred"}, counts
    assert outcomes(a), "consumer A received no copy"
    assert outcomes(b), "consumer B received no copy"
    assert len(calls_a) + len(calls_b) >= 1
    await assert_effect_once(mongodb, event)
    assert await broker.depth(q) == 0
    assert await broker.depth(f"{q}.dlq") == 0


# -- deferral bound -------------------------------------------------------------------------------


async def test_held_lease_defers_until_the_bound_then_dead_letters(broker: Broker, mongodb: MongoDB) -> None:
    q, handler_id, event, key = one_event(broker, "held")
    calls: list[uuid.UUID] = []
    now = datetime.datetime.now(datetime.UTC)
    consumer = inbox_consumer(
        broker,
        mongodb,
        q,
        effect_handler(q, calls, handler_id=handler_id),
        max_deferrals=3,
        retry=RetryPolicy(max_retries=3, delays=(30.0,)),
    )
    async with running(consumer) as managed:
        # Another live owner holds the lease for an hour.
        await mongodb.db[RECORDS].insert_one(
            {
                "_id": key,
                "state": "leased",
                "owner": "elsewhere:0:0",
                "token": 7,
                "expires_at": now + datetime.timedelta(hours=1),
                "purge_at": now + datetime.timedelta(hours=2),
                "acquisitions": 1,
                "deferrals": 0,
            }
        )
        await publish(broker, q, event, retry_count=1)
        await eventually(lambda: "dead_lettered" in outcomes(managed), timeout=8.0, what="dead-lettering")
        assert await broker.wait_for_depth(f"{q}.dlq", 1) == 1
    observations = managed.delivery_terminal_observations()
    assert [o.outcome for o in observations] == ["deferred", "deferred", "dead_lettered"]
    assert [o.code for o in observations] == ["LEASE_HELD", "LEASE_HELD", "QUEUE_DEFERRALS_EXHAUSTED"]
    assert (observations[-1].handoff_confirmed, observations[-1].ack_sent) == (True, True)
    assert calls == []
    [copy] = await broker.drain(f"{q}.dlq")
    assert copy.headers["x-lily-failure-code"] == "QUEUE_DEFERRALS_EXHAUSTED"
    assert copy.headers["x-lily-event-id"] == str(event)
    assert copy.headers["x-retry-count"] == 1  # deferrals are not application retries
    assert copy.headers["x-lily-failed-queue"] == q
    assert await broker.depth(q) == 0
    assert await broker.depth(f"{q}.retry.0") == 0
    db = mongodb.db
    record = await db[RECORDS].find_one({"_id": key})
    assert record is not None
    assert (record["state"], record["owner"], record["token"], record["deferrals"]) == ("leased", "elsewhere:0:0", 7, 3)
    assert await db[EFFECTS].count_documents({}) == 0


# -- a claim that waits behind a transaction: a deferral, never an application retry ---------------
#
# On MongoDB a claim waits while another transaction holds the record (a crashed consumer's
# for up to about 1.5 x transactionLifetimeLimitSeconds) and gives up at its maxTimeMS with
# MaxTimeMSExpired (code 50). The emulator makes no writer wait (docs/emulator.md), so the
# answer is injected on the claim; the protocol model shows the wait itself.


@pytest.mark.parametrize("max_deferrals", [5, 1], ids=["then-completes", "at-the-bound"])
async def test_a_claim_that_times_out_is_a_counted_deferral_and_spends_no_retry(
    broker: Broker, mongodb: MongoDB, failpoints: Faults, max_deferrals: int
) -> None:
    q, handler_id, event, key = one_event(broker, "busy")
    retries_seen: list[int] = []

    @queue(q, version=1, content="json", handler_id=handler_id)
    async def handle(event_id: EventId, retry_count: RetryCount, mongo: MongoScope) -> None:
        retries_seen.append(retry_count)
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id)}, session=mongo.session)

    # Lease first: the claim is the write outside a transaction that waits on MongoDB.
    consumer = inbox_consumer(
        broker,
        mongodb,
        q,
        handle,
        inbox=InboxOptions(claim_in_transaction=False),
        max_deferrals=max_deferrals,
        retry=RetryPolicy(max_retries=3, delays=(30.0,)),
    )
    async with running(consumer) as managed:
        await failpoints.fail(["findAndModify"], code=50, namespace=f"{mongodb.name}.{RECORDS}")
        await publish(broker, q, event, retry_count=1)
        await eventually(lambda: len(outcomes(managed)) == 2 - (max_deferrals == 1), timeout=8.0, what="settlement")
        assert await broker.wait_for_depth(q, 0) == 0
    observations = managed.delivery_terminal_observations()
    assert (observations[0].code, observations[0].attempts) == (
        "LEASE_BUSY" if max_deferrals > 1 else "QUEUE_DEFERRALS_EXHAUSTED",
        0,
    )
    assert "maxTimeMS" in observations[0].reason
    record = await mongodb.db[RECORDS].find_one({"_id": key})
    assert await broker.depth(f"{q}.retry.0") == 0  # no application retry was spent
    if max_deferrals > 1:
        assert [o.outcome for o in observations] == ["deferred", "acked"]
        assert retries_seen == [1]  # the redelivered original, x-retry-count unchanged
        assert record is not None
        assert (record["state"], record["deferrals"]) == ("completed", 1)  # counted, kept by the completion
        return
    [copy] = await broker.drain(f"{q}.dlq")
    assert copy.headers["x-lily-failure-code"] == "QUEUE_DEFERRALS_EXHAUSTED"
    assert copy.headers["x-retry-count"] == 1
    assert retries_seen == []
    assert record is not None
    assert record["deferrals"] == 1  # the counting record: no lease, no state
    assert (record.get("state"), record.get("owner")) == (None, None)


def short_deadline_consumer(
    broker: Broker,
    mongodb: MongoDB,
    q: str,
    handler_id: str,
    calls: list[uuid.UUID],
    *,
    inbox: InboxOptions,
    first_run: float = 0.0,
) -> Consumer:
    """A 2 s delivery deadline and one slow retry bucket; the handler writes one effect, records each run
    in ``calls``, and its first run lasts ``first_run`` seconds longer."""

    @queue(q, version=1, content="json", handler_id=handler_id)
    async def handle(event_id: EventId, mongo: MongoScope) -> None:
        calls.append(event_id)
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id)}, session=mongo.session)
        if len(calls) == 1:
            await asyncio.sleep(first_run)

    return inbox_consumer(
        broker,
        mongodb,
        q,
        handle,
        inbox=inbox,
        deadline=2.0,
        cooperation_window=0.5,
        retry=RetryPolicy(max_retries=3, delays=(30.0,)),
    )


@pytest.mark.parametrize(
    ("claim_in_transaction", "command"),
    [(True, "findAndModify"), (False, "update")],
    ids=["the-claim-in-the-transaction", "the-completion-write"],
)
async def test_a_wait_in_the_transaction_before_the_handler_is_a_deferral_not_a_timeout(
    broker: Broker, mongodb: MongoDB, failpoints: Faults, claim_in_transaction: bool, command: str
) -> None:
    # The transaction's first write (the first claim, or the lease holder's completion) stalls:
    # the server holds it for 6 s and the delivery's deadline is 2 s. Bounded like the waits
    # outside a transaction, it ends as a deferral before the deadline: the handler never ran,
    # so no application retry is spent, and the redelivered copy applies the event.
    q, handler_id, event, key = one_event(broker, "stall")
    calls: list[uuid.UUID] = []
    consumer = short_deadline_consumer(
        broker, mongodb, q, handler_id, calls, inbox=InboxOptions(claim_in_transaction=claim_in_transaction)
    )
    async with running(consumer, expect_clean=False) as managed:
        await failpoints.fail([command], code=112, block_ms=6000, times=1, namespace=f"{mongodb.name}.{RECORDS}")
        await publish(broker, q, event)
        await eventually(lambda: len(outcomes(managed)) == 2, timeout=20.0, what="the deferral and the redelivery")
    observations = managed.delivery_terminal_observations()
    assert [(o.outcome, o.code) for o in observations] == [("deferred", "MONGO_UNAVAILABLE"), ("acked", None)]
    assert calls == [event]  # the stalled attempt never ran its handler
    assert await broker.depth(f"{q}.retry.0") == 0  # no application retry was spent
    await assert_applied_once(mongodb, key, event)


async def test_an_unknown_commit_that_keeps_waiting_ends_ambiguous_before_the_deadline(
    broker: Broker, mongodb: MongoDB, failpoints: Faults
) -> None:
    # The handler takes 0.6 s; then every commit waits 600 ms and answers an unknown result (a
    # majority that cannot be reached): the commit, its retries and the read that decides share
    # the time left before the 2 s deadline, so the delivery is deferred COMMIT_AMBIGUOUS (the next copy decides),
    # not cut off as a timeout (an application retry, while the commit may have applied).
    q, handler_id, event, key = one_event(broker, "ambiguous")
    calls: list[uuid.UUID] = []
    # The handler's first run takes its time: less is left for the commits.
    consumer = short_deadline_consumer(
        broker, mongodb, q, handler_id, calls, inbox=InboxOptions(backoff_base=0.01, backoff_max=0.05), first_run=0.6
    )
    async with running(consumer, expect_clean=False) as managed:
        await failpoints.fail(
            ["commitTransaction"], code=50, labels=["UnknownTransactionCommitResult"], block_ms=600, times=None
        )
        await publish(broker, q, event)
        await eventually(lambda: len(outcomes(managed)) >= 1, timeout=15.0, what="the first settlement")
        await failpoints.clear()
        await eventually(lambda: "acked" in outcomes(managed), timeout=15.0, what="the redelivered copy")
    first = managed.delivery_terminal_observations()[0]
    assert (first.outcome, first.code) == ("deferred", "COMMIT_AMBIGUOUS")
    assert await broker.depth(f"{q}.retry.0") == 0
    await assert_applied_once(mongodb, key, event)


@pytest.mark.parametrize("claim_in_transaction", [True, False], ids=["in-transaction", "lease-first"])
async def test_a_forced_shutdowns_deferral_is_counted_in_the_record(
    claim_in_transaction: bool, broker: Broker, mongodb: MongoDB
) -> None:
    # A forced shutdown cancels the handler: deferred (SHUTDOWN), and counted in the event's record
    # where the next process finds it (docs/inbox.md, "Counting deferrals"), not only in the memory
    # of the process that is going away.
    q, handler_id, event, key = one_event(broker, "forced")
    entered = asyncio.Event()

    @queue(q, version=1, content="json", handler_id=handler_id)
    async def hold(event_id: EventId, mongo: MongoScope) -> None:
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id)}, session=mongo.session)
        entered.set()
        await asyncio.sleep(30)

    consumer = inbox_consumer(
        broker, mongodb, q, hold, inbox=InboxOptions(claim_in_transaction=claim_in_transaction), force_timeout=5.0
    )
    managed = await consumer.start()
    await publish(broker, q, event)
    await asyncio.wait_for(entered.wait(), 8.0)
    report = await managed.shutdown(force=True)
    assert report.forced is True
    [observation] = managed.delivery_terminal_observations()
    assert (observation.outcome, observation.code) == ("deferred", "SHUTDOWN")
    record = await mongodb.db[RECORDS].find_one({"_id": key})
    assert record is not None
    # The aborted attempt left no lease (its record, counting nothing, was deleted; or never
    # committed): a counting record holds the deferral.
    assert (record.get("state"), record.get("owner"), record["deferrals"]) == (None, None, 1)
    assert await mongodb.db[EFFECTS].count_documents({}) == 0
    assert await broker.wait_for_depth(q, 1) == 1


# -- the transaction lifetime ---------------------------------------------------------------------


async def test_the_transaction_lifetime_is_read_at_start_and_long_deadlines_are_warned_about(
    broker: Broker, mongodb: MongoDB, caplog: pytest.LogCaptureFixture
) -> None:
    # The emulator does not answer getParameter (docs/emulator.md): the inbox assumes MongoDB's
    # default of 60 s and says so at DEBUG; a queue whose deadline exceeds the limit is warned about at start.
    slow, quick = broker.queue("slow"), broker.queue("quick")
    consumer = broker.consumer(
        (slow, quick), accepting(slow), accepting(quick), mongodb=mongodb, name="lifetime", deadline=90.0
    )
    consumer.configure_queue(quick, deadline=8.0)
    with caplog.at_level(logging.DEBUG, logger="lily_mongo"):
        async with running(consumer):
            pass
    lines = [r.getMessage() for r in caplog.records if r.name == "lily_mongo"]
    refused = any("getParameter refused" in line and ", 60 s" in line for line in lines)
    said = [r for r in caplog.records if "getParameter" in r.getMessage()]
    assert all(r.levelno == logging.DEBUG for r in said), said
    warned = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "delivery deadline" in r.getMessage()
    ]
    assert len(warned) == 1, warned
    assert f"queue {slow}:" in warned[0]
    assert "(90 s) exceeds" in warned[0]
    assert "QUEUE_TRANSACTION_EXPIRED" in warned[0]
    # A MongoDB that answers (LILY_MONGO_URI) is named as the source of the limit instead.
    assert refused or "the server's transactionLifetimeLimitSeconds" in warned[0], lines


async def test_a_configured_transaction_lifetime_is_not_read_from_the_server(
    broker: Broker, mongodb: MongoDB, caplog: pytest.LogCaptureFixture
) -> None:
    q = broker.queue("told")
    consumer = broker.consumer(
        q,
        accepting(q),
        mongodb=mongodb,
        name="lifetime",
        deadline=90.0,
        inbox=InboxOptions(transaction_lifetime_seconds=120),
    )
    with caplog.at_level(logging.INFO, logger="lily_mongo"):
        async with running(consumer):
            pass
    lines = [r.getMessage() for r in caplog.records if r.name == "lily_mongo"]
    assert not any("getParameter" in line or "delivery deadline" in line for line in lines), lines


async def test_an_event_whose_attempts_outlived_the_lifetime_twice_is_dead_lettered_without_running(
    broker: Broker, mongodb: MongoDB
) -> None:
    # The record counts two attempts whose transaction outlived the lifetime (the emulator never
    # reaps, so the count is written here; the protocol model shows the reaping): the claim
    # dead-letters the delivery with QUEUE_TRANSACTION_EXPIRED and the handler does not run again.
    q, handler_id, event, key = one_event(broker, "expired")
    calls: list[uuid.UUID] = []
    now = datetime.datetime.now(datetime.UTC)
    await mongodb.db[RECORDS].insert_one(
        {"_id": key, "handler": handler_id, "event_id": str(event), "expirations": 2, "purge_at": now + HOUR}
    )
    consumer = inbox_consumer(broker, mongodb, q, effect_handler(q, calls, handler_id=handler_id))
    async with running(consumer) as managed:
        await publish(broker, q, event)
        await eventually(lambda: len(outcomes(managed)) == 1, timeout=8.0, what="settlement")
        assert await broker.wait_for_depth(f"{q}.dlq", 1) == 1
    assert (only(managed).outcome, only(managed).code) == ("dead_lettered", "QUEUE_TRANSACTION_EXPIRED")
    assert calls == []
    [copy] = await broker.drain(f"{q}.dlq")
    assert copy.headers["x-lily-failure-code"] == "QUEUE_TRANSACTION_EXPIRED"
    assert await mongodb.db[RECORDS].count_documents({"_id": key}) == 0  # a final verdict releases it


# -- the scope is valid for one attempt only ------------------------------------------------------


async def test_scope_used_after_the_attempt_raises(broker: Broker, mongodb: MongoDB) -> None:
    q = broker.queue("stale")
    kept: list[MongoScope] = []
    event = uuid.uuid4()

    @queue(q, version=1, content="json", handler_id=f"{q}/keep")
    async def handle(event_id: EventId, mongo: MongoScope) -> None:
        kept.append(mongo)
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id)}, session=mongo.session)

    consumer = inbox_consumer(broker, mongodb, q, handle)
    async with running(consumer) as managed:
        await publish(broker, q, event)
        await eventually(lambda: len(outcomes(managed)) == 1, timeout=8.0, what="settlement")
        [scope] = kept
        assert not scope.is_open
        with pytest.raises(ScopeClosedError):
            _ = scope.session
        with pytest.raises(ScopeClosedError):
            _ = scope.database
        with pytest.raises(ScopeClosedError):
            _ = scope.outbox
    assert outcomes(managed) == ["acked"]
    assert await mongodb.db[EFFECTS].count_documents({}) == 1


# -- application failures abort, release the lease, then hand off ---------------------------------


@pytest.mark.parametrize(
    ("failure", "destination", "outcome", "code"),
    [
        (QueueHandlerError.retryable("PAYMENT_DOWN", "gateway 503"), "retry.0", "retried", "PAYMENT_DOWN"),
        (QueueHandlerError.permanent("ORDER_INVALID", "no lines"), "dlq", "dead_lettered", "ORDER_INVALID"),
        (RuntimeError("boom"), "retry.0", "retried", "QUEUE_HANDLER_FAILED"),
    ],
    ids=["retryable", "permanent", "unexpected"],
)
@pytest.mark.parametrize("claim_in_transaction", [True, False], ids=["in-transaction", "lease-first"])
async def test_failure_aborts_releases_the_lease_and_hands_off(
    claim_in_transaction: bool,
    broker: Broker,
    mongodb: MongoDB,
    failure: Exception,
    destination: str,
    outcome: str,
    code: str,
) -> None:
    q = broker.queue("fail")
    event = uuid.uuid4()
    calls: list[uuid.UUID] = []

    @queue(q, version=1, content="json", handler_id=f"{q}/fail")
    async def handle(event_id: EventId, mongo: MongoScope) -> None:
        calls.append(event_id)
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id)}, session=mongo.session)
        await mongo.outbox.publish_json(f"{q}.downstream", {"from": str(event_id)}, version=1)
        raise failure

    # A long retry delay keeps the retry copy parked in its bucket for inspection.
    consumer = inbox_consumer(
        broker,
        mongodb,
        q,
        handle,
        inbox=InboxOptions(claim_in_transaction=claim_in_transaction),
        retry=RetryPolicy(max_retries=2, delays=(60,)),
    )
    async with running(consumer) as managed:
        await publish(broker, q, event)
        await eventually(lambda: len(outcomes(managed)) == 1, timeout=8.0, what="handoff")
        assert await broker.wait_for_depth(f"{q}.{destination}", 1) == 1
    observation = only(managed)
    assert (observation.outcome, observation.code) == (outcome, code)
    assert (observation.handoff_confirmed, observation.ack_sent) == (True, True)
    assert calls == [event]
    db = mongodb.db
    assert await db[EFFECTS].count_documents({}) == 0  # aborted: nothing the handler wrote survived
    assert await db["lily_outbox"].count_documents({}) == 0
    # Lease first: released (deleted), not left to expire. In the transaction: never committed.
    assert await db[RECORDS].count_documents({}) == 0
    [copy] = await broker.drain(f"{q}.{destination}")
    assert copy.headers["x-lily-failure-code"] == code
    assert copy.headers["x-lily-event-id"] == str(event)
    assert copy.headers["x-retry-count"] == (1 if outcome == "retried" else 0)
    assert await broker.depth(q) == 0


# -- a lost lease cancels the attempt -------------------------------------------------------------


async def test_a_lease_taken_over_between_attempts_defers_at_the_next_attempt(broker: Broker, mongodb: MongoDB) -> None:
    # While its transaction holds the record nobody can take the lease over (MongoDB makes
    # other writers wait). Between attempts it can: the first attempt meets a transient
    # error, and during the replay's backoff (at least 1 s here) another owner takes the
    # record. The next attempt must not run the handler: deferred with LEASE_LOST.
    q, handler_id, event, key = one_event(broker, "lost")
    calls: list[uuid.UUID] = []
    records = mongodb.db[RECORDS]
    thieves: list[asyncio.Task[Any]] = []

    async def take_over() -> None:
        expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=0.5)
        await records.update_one({"_id": key}, {"$set": {"owner": "thief:0:0", "token": 99, "expires_at": expires}})

    @queue(q, version=1, content="json", handler_id=handler_id)
    async def handle(event_id: EventId, mongo: MongoScope) -> None:
        calls.append(event_id)
        if len(calls) == 1:
            thieves.append(asyncio.create_task(take_over()))  # lands once this transaction ended
            raise OperationFailure("write conflict", code=112, details={"errorLabels": ["TransientTransactionError"]})
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id)}, session=mongo.session)

    options = InboxOptions(
        lease_seconds=0.6, heartbeat_seconds=0.1, backoff_base=1.0, backoff_max=2.0, claim_in_transaction=False
    )
    consumer = inbox_consumer(broker, mongodb, q, handle, inbox=options)
    async with running(consumer) as managed:
        await publish(broker, q, event)
        await eventually(lambda: "acked" in outcomes(managed), timeout=10.0, what="the redelivery to complete")
        assert await broker.wait_for_depth(q, 0) == 0
    await asyncio.gather(*thieves)
    observations = managed.delivery_terminal_observations()
    assert (observations[0].outcome, observations[0].code) == ("deferred", "LEASE_LOST")
    assert observations[0].transient_replays == 1
    assert observations[-1].outcome == "acked"
    assert all(o.outcome == "deferred" for o in observations[:-1])
    assert len(calls) == 2  # the attempt after the takeover never ran the handler
    record = await records.find_one({"_id": key})
    assert record is not None
    assert (record["state"], record["token"]) == ("completed", 100)  # re-claimed once the thief's lease expired
    assert await mongodb.db[EFFECTS].count_documents({}) == 1


async def run_timing_out_handler(
    broker: Broker, mongodb: MongoDB, q: str, claim_in_transaction: bool
) -> tuple[TerminalObservation, dict[str, Any] | None]:
    """One delivery whose handler writes, then overruns a 0.5 s deadline; returns its observation and lease doc."""
    handler_id = f"{q}/slow"
    event = uuid.uuid4()

    @queue(q, version=1, content="json", handler_id=handler_id)
    async def handle(event_id: EventId, mongo: MongoScope) -> None:
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id)}, session=mongo.session)
        await asyncio.sleep(8.0)

    consumer = inbox_consumer(
        broker,
        mongodb,
        q,
        handle,
        inbox=InboxOptions(claim_in_transaction=claim_in_transaction),
        deadline=0.5,
        cooperation_window=1.0,
        retry=RetryPolicy(max_retries=2, delays=(60,)),
    )
    async with running(consumer) as managed:
        await publish(broker, q, event)
        await eventually(lambda: len(outcomes(managed)) == 1, timeout=8.0, what="the timeout handoff")
        assert await broker.wait_for_depth(f"{q}.retry.0", 1) == 1
    record = await mongodb.db[RECORDS].find_one({"_id": f"{handler_id}|{event}"})
    return only(managed), record


@pytest.mark.parametrize("claim_in_transaction", [True, False], ids=["in-transaction", "lease-first"])
async def test_handler_timeout_is_not_counted_as_a_deferral(
    claim_in_transaction: bool, broker: Broker, mongodb: MongoDB
) -> None:
    # A timeout is an application retry (docs/lifecycle.md section 5); the deferral bound counts deferred
    # requeues only. A stale count makes a later LEASE_HELD copy hit max_deferrals early.
    _, lease = await run_timing_out_handler(broker, mongodb, broker.queue("tdefer"), claim_in_transaction)
    assert lease is None or lease.get("deferrals", 0) == 0, lease


@pytest.mark.parametrize("claim_in_transaction", [True, False], ids=["in-transaction", "lease-first"])
async def test_handler_timeout_aborts_and_frees_the_lease(
    claim_in_transaction: bool, broker: Broker, mongodb: MongoDB
) -> None:
    observation, lease = await run_timing_out_handler(broker, mongodb, broker.queue("timeout"), claim_in_transaction)
    assert (observation.outcome, observation.code) == ("retried", "QUEUE_HANDLER_TIMEOUT")
    db = mongodb.db
    assert await db[EFFECTS].count_documents({}) == 0
    # Cancelled from outside, the attempt is no deferral: the lease is deleted (lease first),
    # or was never committed (in the transaction).
    assert lease is None, lease
