"""The MongoDB lease inbox against the real broker and the MongoDB-wire server (SPEC section 5).

"Effect once" means: exactly one document per event in the handler's ``effects``
collection and exactly one completion record in ``lily_inbox``. Failures are
injected with ``configureFailPoint failCommand``; a failpoint aimed at one
collection uses the ``namespace`` filter so lease, heartbeat and relay traffic
is never hit by accident.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import datetime
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aio_pika.abc
import pytest
from pymongo import AsyncMongoClient
from pymongo.errors import OperationFailure
from pymongo.uri_parser import parse_uri

from lily_mongo import (
    Consumer,
    EventId,
    InboxOptions,
    Json,
    ManagedConsumer,
    MongoScope,
    Publisher,
    QueueHandlerError,
    RetryPolicy,
    ScopeClosedError,
    TerminalObservation,
    queue,
)
from lily_mongo.testing import Faults
from tests.support import BrokerNames, drain, eventually, outcomes, queue_depth, running, wait_for_depth

Handler = Callable[..., Awaitable[None]]

RECORDS = "lily_inbox"  # one record per (handler, event): the lease and the completion
EFFECTS = "effects"


# -- helpers --------------------------------------------------------------------------------------


def settled_copies(*managed: ManagedConsumer) -> int:
    """Copies that reached a final settlement (deferred copies come back and settle later)."""
    return sum(o in ("acked", "duplicate") for m in managed for o in outcomes(m))


def make_consumer(
    amqp: str,
    client: AsyncMongoClient[Any],
    database: str,
    q: str,
    *handlers: Handler,
    name: str = "inbox-test",
    inbox: InboxOptions | None = None,
    **queue_options: Any,
) -> Consumer:
    consumer = Consumer(
        amqp_url=amqp, mongo_client=client, database=database, name=name, inbox=inbox, graceful_timeout=10.0
    )
    queue_options.setdefault("concurrency", 2)
    queue_options.setdefault("prefetch", 8)
    queue_options.setdefault("retry", RetryPolicy(max_retries=2, delays=(0.2,)))
    consumer.configure_queue(q, **queue_options)
    consumer.include(*handlers)
    return consumer


def effect_handler(q: str, calls: list[uuid.UUID], *, handler_id: str | None = None) -> Handler:
    """Writes one effect document and bumps a counter, both in the attempt's transaction."""

    @queue(q, version=1, content="json", handler_id=handler_id or f"{q}/effect")
    async def handle(payload: Json[dict[str, Any]], event_id: EventId, mongo: MongoScope) -> None:
        calls.append(event_id)
        db = mongo.database
        await db[EFFECTS].insert_one({"event_id": str(event_id), "n": payload["n"]}, session=mongo.session)
        await db["counters"].update_one({"_id": "total"}, {"$inc": {"n": 1}}, upsert=True, session=mongo.session)

    return handle


async def assert_effect_once(client: AsyncMongoClient[Any], database: str, event_id: uuid.UUID) -> None:
    db = client[database]
    effects = await db[EFFECTS].find({"event_id": str(event_id)}).to_list()
    assert len(effects) == 1, effects
    records = await db[RECORDS].find({"event_id": str(event_id)}).to_list()
    assert [r["state"] for r in records] == ["completed"], records
    counter = await db["counters"].find_one({"_id": "total"})
    assert counter is not None
    assert counter["n"] == 1
    # The completed record is the release: no record of any other event is left behind.
    assert await db[RECORDS].count_documents({}) == 1


async def publish(amqp: str, q: str, event_id: uuid.UUID, copies: int = 1, **options: Any) -> None:
    async with Publisher(amqp) as publisher:
        for i in range(copies):
            await publisher.publish_json(q, {"n": i}, version=1, event_id=event_id, **options)


def only(managed: ManagedConsumer) -> TerminalObservation:
    [observation] = managed.delivery_terminal_observations()
    return observation


@dataclasses.dataclass
class CommitRun:
    managed: ManagedConsumer
    calls: list[uuid.UUID]  # one entry per handler call
    event: uuid.UUID


FailingCommits = Callable[..., Awaitable[CommitRun]]


@pytest.fixture
def failing_commits(
    amqp: str,
    mongo_client: AsyncMongoClient[Any],
    database_name: str,
    failpoints: Faults,
    amqp_channel: aio_pika.abc.AbstractChannel,
) -> FailingCommits:
    """Runs one event through the effect handler while ``commitTransaction`` fails as the failpoint
    arguments say; returns after the consumer stopped, once ``settled`` held and the queue was empty."""

    async def run(
        q: str, *, settled: Callable[[ManagedConsumer], bool], inbox: InboxOptions | None = None, **failpoint: Any
    ) -> CommitRun:
        calls: list[uuid.UUID] = []
        event = uuid.uuid4()
        consumer = make_consumer(amqp, mongo_client, database_name, q, effect_handler(q, calls), inbox=inbox)
        async with running(consumer) as managed:
            await failpoints.fail(["commitTransaction"], **failpoint)
            await publish(amqp, q, event)
            await eventually(lambda: settled(managed), timeout=8.0, what="settlement")
            assert await wait_for_depth(amqp_channel, q, 0) == 0
        return CommitRun(managed, calls, event)

    return run


def one_settled(managed: ManagedConsumer) -> bool:
    return len(outcomes(managed)) == 1


def acked(managed: ManagedConsumer) -> bool:
    return "acked" in outcomes(managed)


# -- fast path ------------------------------------------------------------------------------------


async def test_same_event_twice_runs_the_handler_once(
    amqp: str,
    mongo_client: AsyncMongoClient[Any],
    database_name: str,
    names: BrokerNames,
    amqp_channel: aio_pika.abc.AbstractChannel,
) -> None:
    q = names.queue("fast")
    calls: list[uuid.UUID] = []
    event = uuid.uuid4()
    consumer = make_consumer(
        amqp, mongo_client, database_name, q, effect_handler(q, calls), inbox=InboxOptions(retention_seconds=3600)
    )
    async with running(consumer) as managed:
        await publish(amqp, q, event)
        await eventually(lambda: len(outcomes(managed)) == 1, timeout=8.0, what="first copy settled")
        await publish(amqp, q, event)
        await eventually(lambda: len(outcomes(managed)) == 2, timeout=8.0, what="second copy settled")
        assert await wait_for_depth(amqp_channel, q, 0) == 0
    first, second = managed.delivery_terminal_observations()
    assert (first.outcome, second.outcome) == ("acked", "duplicate")
    assert (first.ack_sent, second.ack_sent) == (True, True)
    assert first.event_id == second.event_id == event
    assert calls == [event]
    await assert_effect_once(mongo_client, database_name, event)
    assert await queue_depth(amqp_channel, f"{q}.dlq") == 0
    # Retention (SPEC 5.6): a TTL index on the record's purge time, set retention_seconds ahead.
    records = mongo_client[database_name][RECORDS]
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
    amqp: str,
    mongo_client: AsyncMongoClient[Any],
    database_name: str,
    names: BrokerNames,
    failpoints: Faults,
    amqp_channel: aio_pika.abc.AbstractChannel,
    command: str,
    collection: str,
    claim_in_transaction: bool,
) -> None:
    # Code 112 with TransientTransactionError is MongoDB's WriteConflict shape.
    q = names.queue("tt")
    calls: list[uuid.UUID] = []
    event = uuid.uuid4()
    options = InboxOptions(claim_in_transaction=claim_in_transaction)
    consumer = make_consumer(amqp, mongo_client, database_name, q, effect_handler(q, calls), inbox=options)
    async with running(consumer) as managed:
        await failpoints.fail(
            [command], code=112, labels=["TransientTransactionError"], namespace=f"{database_name}.{collection}"
        )
        await publish(amqp, q, event)
        await eventually(lambda: len(outcomes(managed)) == 1, timeout=8.0, what="settlement")
        assert await wait_for_depth(amqp_channel, q, 0) == 0
    observation = only(managed)
    assert observation.outcome == "acked"
    if command == "findAndModify":
        # The claim in the transaction met a transient error (a concurrent copy's transaction
        # holding the new record, on MongoDB): no handler ran, so no replay is counted; the
        # delivery takes the lease claim and runs its one attempt.
        assert (observation.transient_replays, observation.attempts, len(calls)) == (0, 1, 1)
        record = await mongo_client[database_name][RECORDS].find_one({"event_id": str(event)})
        assert record is not None
        assert record["state"] == "completed"
        assert "expires_at" in record  # completed on the lease path (a record born completed has no lease)
        await assert_effect_once(mongo_client, database_name, event)
        return
    assert observation.transient_replays >= 1
    assert observation.attempts == observation.transient_replays + 1
    # Each attempt is one fresh handler call, except one failing at the completion write,
    # which precedes the handler.
    failed_before_the_handler = 1 if collection == RECORDS else 0
    assert len(calls) == observation.attempts - failed_before_the_handler
    assert managed.snapshot().queues[0].transient_replays >= 1
    await assert_effect_once(mongo_client, database_name, event)


@pytest.mark.parametrize(
    "labels",
    [["TransientTransactionError"], []],
    ids=["labelled-transient", "unlabelled-emulator-shape"],
)
async def test_commit_failure_without_unknown_result_replays(
    mongo_client: AsyncMongoClient[Any],
    database_name: str,
    names: BrokerNames,
    failing_commits: FailingCommits,
    labels: list[str],
) -> None:
    # A commit failing without UnknownTransactionCommitResult did not commit (SPEC 5.5);
    # the emulator reports its write conflicts as code 112 with no label at all.
    q = names.queue("commit")
    run = await failing_commits(q, settled=one_settled, times=1, code=112, labels=labels)
    managed, calls, event = run.managed, run.calls, run.event
    observation = only(managed)
    assert observation.outcome == "acked"
    assert observation.transient_replays == 1
    assert observation.reconciliations == 0
    assert len(calls) == 2
    await assert_effect_once(mongo_client, database_name, event)


async def test_old_scope_is_closed_while_the_replay_runs(
    amqp: str,
    mongo_client: AsyncMongoClient[Any],
    database_name: str,
    names: BrokerNames,
    failpoints: Faults,
) -> None:
    q = names.queue("scope")
    scopes: list[MongoScope] = []
    seen_open: list[list[bool]] = []

    @queue(q, version=1, content="json", handler_id=f"{q}/scopes")
    async def handle(event_id: EventId, mongo: MongoScope) -> None:
        seen_open.append([s.is_open for s in scopes])
        scopes.append(mongo)
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id)}, session=mongo.session)

    consumer = make_consumer(amqp, mongo_client, database_name, q, handle)
    async with running(consumer) as managed:
        await failpoints.fail(["commitTransaction"], code=112, labels=["TransientTransactionError"])
        await publish(amqp, q, uuid.uuid4())
        await eventually(lambda: len(outcomes(managed)) == 1, timeout=8.0, what="settlement")
    assert outcomes(managed) == ["acked"]
    assert len(scopes) == 2
    assert scopes[0] is not scopes[1]
    assert seen_open == [[], [False]]  # the replay got a fresh scope; the first was already closed


# -- UnknownTransactionCommitResult: reconcile, never re-run to find out --------------------------


@pytest.mark.parametrize("claim_in_transaction", [True, False], ids=["in-transaction", "lease-first"])
async def test_unknown_commit_result_once_is_reconciled_by_retrying_the_commit(
    mongo_client: AsyncMongoClient[Any],
    database_name: str,
    names: BrokerNames,
    failing_commits: FailingCommits,
    claim_in_transaction: bool,
) -> None:
    # Code 50 (MaxTimeMSExpired) is not a retryable code for PyMongo, so the driver does
    # not retry the commit itself: the failpoint fires exactly once, at the library.
    q = names.queue("unknown1")
    run = await failing_commits(
        q,
        settled=one_settled,
        inbox=InboxOptions(claim_in_transaction=claim_in_transaction),
        times=1,
        code=50,
        labels=["UnknownTransactionCommitResult"],
    )
    managed, calls, event = run.managed, run.calls, run.event
    observation = only(managed)
    assert observation.outcome == "acked"
    assert observation.reconciliations >= 1
    assert observation.transient_replays == 0
    assert observation.attempts == 1
    assert calls == [event]
    assert managed.snapshot().queues[0].reconciliations >= 1
    await assert_effect_once(mongo_client, database_name, event)


async def test_unknown_commit_result_that_persists_defers_to_the_next_delivery(
    mongo_client: AsyncMongoClient[Any],
    database_name: str,
    names: BrokerNames,
    failing_commits: FailingCommits,
    amqp_channel: aio_pika.abc.AbstractChannel,
) -> None:
    # commit_retries=2: one commit plus two retries of the same commit, all failing with
    # UnknownTransactionCommitResult (times=3). Reconciliation then reads the completion
    # record: the emulator's failpoint fires *before* the commit applies, so the record is
    # absent → deferred (bounded requeue). The redelivery runs the handler again — a new
    # delivery, not a re-run within the first one — and commits cleanly.
    q = names.queue("unknownN")
    run = await failing_commits(
        q,
        settled=acked,
        inbox=InboxOptions(commit_retries=2, backoff_base=0.01),
        times=3,
        code=50,
        labels=["UnknownTransactionCommitResult"],
    )
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
    await assert_effect_once(mongo_client, database_name, event)
    assert await queue_depth(amqp_channel, f"{q}.dlq") == 0


async def test_unknown_commit_result_many_times_stays_bounded(
    mongo_client: AsyncMongoClient[Any],
    database_name: str,
    names: BrokerNames,
    failing_commits: FailingCommits,
) -> None:
    # times=10 with commit_retries=2: each delivery consumes up to three commit failures.
    # Deliveries 1-3 consume nine and are deferred; delivery 4 sees one more failure, its
    # commit retry succeeds (reconciled) and it is ACKed. Four handler calls, one per delivery.
    q = names.queue("unknown10")
    run = await failing_commits(
        q,
        settled=acked,
        inbox=InboxOptions(commit_retries=2, backoff_base=0.01),
        times=10,
        code=50,
        labels=["UnknownTransactionCommitResult"],
    )
    managed, calls, event = run.managed, run.calls, run.event
    observations = managed.delivery_terminal_observations()
    assert [o.outcome for o in observations] == ["deferred", "deferred", "deferred", "acked"]
    assert all(o.attempts == 1 and o.transient_replays == 0 for o in observations)
    assert [o.reconciliations for o in observations] == [1, 1, 1, 1]
    assert len(calls) == 4
    await assert_effect_once(mongo_client, database_name, event)


async def test_close_connection_failpoint_on_commit(
    mongo_client: AsyncMongoClient[Any],
    database_name: str,
    names: BrokerNames,
    failing_commits: FailingCommits,
    amqp_channel: aio_pika.abc.AbstractChannel,
) -> None:
    # MongoDB drops the socket (the driver sees a network error labelled
    # UnknownTransactionCommitResult and reconciles); the emulator instead answers with an
    # error reply carrying no code and no label, i.e. "did not commit" (replay). Either way
    # the effect happens once and every attempt ran the handler exactly once.
    q = names.queue("close")
    run = await failing_commits(
        q,
        settled=lambda managed: settled_copies(managed) == 1,
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
    await assert_effect_once(mongo_client, database_name, event)
    assert await queue_depth(amqp_channel, f"{q}.dlq") == 0


class CommitCutter:
    """A TCP proxy in front of the MongoDB server that drops connections around ``commitTransaction``.

    ``cut_requests``: drop the connection instead of forwarding the next N commits (the
    commit never reaches the server). ``cut_replies``: forward the next N commits, then
    drop the connection instead of forwarding the reply (the commit applied, the client
    cannot know). Both are real network errors: the driver labels them
    ``UnknownTransactionCommitResult``.
    """

    MARK = b"commitTransaction\x00"

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.cut_requests = 0
        self.cut_replies = 0
        self.cuts = 0
        self.uri = ""
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> CommitCutter:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.uri = f"mongodb://{host}:{port}/?directConnection=true"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        await self._server.wait_closed()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection(*self.upstream)
        self._writers |= {client_writer, server_writer}
        reply_doomed = False

        def cut() -> None:
            self.cuts += 1
            client_writer.transport.abort()
            server_writer.transport.abort()

        async def upstream() -> None:
            nonlocal reply_doomed
            while data := await client_reader.read(65536):
                if self.MARK in data:
                    if self.cut_requests > 0:
                        self.cut_requests -= 1
                        cut()
                        return
                    if self.cut_replies > 0:
                        self.cut_replies -= 1
                        reply_doomed = True
                server_writer.write(data)
                await server_writer.drain()

        async def downstream() -> None:
            while data := await server_reader.read(65536):
                if reply_doomed:
                    cut()
                    return
                client_writer.write(data)
                await client_writer.drain()

        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            await asyncio.gather(upstream(), downstream())
        for writer in (client_writer, server_writer):
            writer.transport.abort()
            self._writers.discard(writer)


@contextlib.asynccontextmanager
async def cut_client(mongo_uri: str) -> AsyncIterator[tuple[CommitCutter, AsyncMongoClient[Any]]]:
    nodes = parse_uri(mongo_uri)["nodelist"]
    if len(nodes) != 1:
        pytest.skip("the commit-cutting proxy fronts a single server")
    host, port = nodes[0]
    async with CommitCutter(host, port) as cutter:
        client: AsyncMongoClient[Any] = AsyncMongoClient(cutter.uri, serverSelectionTimeoutMS=10_000)
        try:
            yield cutter, client
        finally:
            await client.close()


@pytest.mark.parametrize(
    ("cuts", "expected"),
    [(1, ["acked"]), (2, ["deferred", "acked"])],
    ids=["commit-retry-succeeds", "retries-exhausted-record-absent"],
)
async def test_commit_request_lost_on_the_network(
    amqp: str,
    mongo_uri: str,
    mongo_client: AsyncMongoClient[Any],
    database_name: str,
    names: BrokerNames,
    amqp_channel: aio_pika.abc.AbstractChannel,
    cuts: int,
    expected: list[str],
) -> None:
    # commit_retries=1: one commit plus one retry of the same commit. One lost request:
    # the retry commits (reconciled, ACK). Two: the record is absent (nothing reached the
    # server) → deferred; the redelivery runs the handler once more and commits.
    q = names.queue("lostreq")
    calls: list[uuid.UUID] = []
    event = uuid.uuid4()
    async with cut_client(mongo_uri) as (cutter, client):
        consumer = make_consumer(
            amqp,
            client,
            database_name,
            q,
            effect_handler(q, calls),
            inbox=InboxOptions(commit_retries=1, backoff_base=0.01),
        )
        async with running(consumer) as managed:
            cutter.cut_requests = cuts
            await publish(amqp, q, event)
            await eventually(lambda: settled_copies(managed) == 1, timeout=8.0, what="settled")
            assert await wait_for_depth(amqp_channel, q, 0) == 0
        assert cutter.cuts == cuts
    observations = managed.delivery_terminal_observations()
    assert [o.outcome for o in observations] == expected
    assert observations[0].reconciliations == 1
    assert all(o.attempts == 1 and o.transient_replays == 0 for o in observations)
    if len(observations) > 1:
        assert observations[0].code == "COMMIT_AMBIGUOUS"
    assert len(calls) == len(expected)  # one handler call per delivery
    await assert_effect_once(mongo_client, database_name, event)


@pytest.mark.parametrize("claim_in_transaction", [True, False], ids=["in-transaction", "lease-first"])
async def test_commit_reply_lost_is_reconciled_from_the_completion_record(
    claim_in_transaction: bool,
    amqp: str,
    mongo_uri: str,
    mongo_client: AsyncMongoClient[Any],
    database_name: str,
    names: BrokerNames,
    amqp_channel: aio_pika.abc.AbstractChannel,
) -> None:
    # The commit applies but its reply is lost, twice (the commit and its one retry):
    # the commit result stays unknown, so reconciliation reads the completion record with
    # majority read concern, finds this attempt's token and ACKs — without running the
    # handler again.
    q = names.queue("lostreply")
    calls: list[uuid.UUID] = []
    event = uuid.uuid4()
    async with cut_client(mongo_uri) as (cutter, client):
        consumer = make_consumer(
            amqp,
            client,
            database_name,
            q,
            effect_handler(q, calls),
            inbox=InboxOptions(commit_retries=1, backoff_base=0.01, claim_in_transaction=claim_in_transaction),
        )
        async with running(consumer) as managed:
            cutter.cut_replies = 2
            await publish(amqp, q, event)
            await eventually(lambda: settled_copies(managed) == 1, timeout=8.0, what="settled")
            assert await wait_for_depth(amqp_channel, q, 0) == 0
        assert cutter.cuts == 2
    observation = only(managed)
    assert observation.outcome == "acked"
    assert (observation.attempts, observation.transient_replays, observation.reconciliations) == (1, 0, 1)
    assert calls == [event]
    await assert_effect_once(mongo_client, database_name, event)


# -- concurrency: competing consumers ------------------------------------------------------------


async def test_two_consumers_six_concurrent_copies_effect_once(
    amqp: str,
    mongo_uri: str,
    mongo_client: AsyncMongoClient[Any],
    database_name: str,
    names: BrokerNames,
    amqp_channel: aio_pika.abc.AbstractChannel,
) -> None:
    q = names.queue("race")
    event = uuid.uuid4()
    calls_a: list[uuid.UUID] = []
    calls_b: list[uuid.UUID] = []
    handler_id = f"{q}/race"
    options = InboxOptions(lease_seconds=2.0)
    other: AsyncMongoClient[Any] = AsyncMongoClient(mongo_uri, serverSelectionTimeoutMS=10_000)
    try:
        # prefetch 2 = concurrency 2: the broker spreads the six copies over both consumers.
        consumer_a = make_consumer(
            amqp,
            mongo_client,
            database_name,
            q,
            effect_handler(q, calls_a, handler_id=handler_id),
            name="race-a",
            inbox=options,
            prefetch=2,
        )
        consumer_b = make_consumer(
            amqp,
            other,
            database_name,
            q,
            effect_handler(q, calls_b, handler_id=handler_id),
            name="race-b",
            inbox=options,
            prefetch=2,
        )
        async with running(consumer_a) as a, running(consumer_b) as b:
            await publish(amqp, q, event, copies=6)
            await eventually(lambda: settled_copies(a, b) == 6, timeout=15.0, what="all six copies settled")
            assert await wait_for_depth(amqp_channel, q, 0) == 0
    finally:
        await other.close()
    every = [*outcomes(a), *outcomes(b)]
    counts = collections.Counter(every)
    assert counts["acked"] == 1, counts
    assert counts["acked"] + counts["duplicate"] == 6, counts
    assert set(counts) <= {"acked", "duplicate", "deferred"}, counts
    assert outcomes(a), "consumer A received no copy"
    assert outcomes(b), "consumer B received no copy"
    assert len(calls_a) + len(calls_b) >= 1
    await assert_effect_once(mongo_client, database_name, event)
    assert await queue_depth(amqp_channel, q) == 0
    assert await queue_depth(amqp_channel, f"{q}.dlq") == 0


# -- deferral bound -------------------------------------------------------------------------------


async def test_held_lease_defers_until_the_bound_then_dead_letters(
    amqp: str,
    mongo_client: AsyncMongoClient[Any],
    database_name: str,
    names: BrokerNames,
    amqp_channel: aio_pika.abc.AbstractChannel,
) -> None:
    q = names.queue("held")
    calls: list[uuid.UUID] = []
    event = uuid.uuid4()
    handler_id = f"{q}/held"
    key = f"{handler_id}|{event}"
    now = datetime.datetime.now(datetime.UTC)
    consumer = make_consumer(
        amqp,
        mongo_client,
        database_name,
        q,
        effect_handler(q, calls, handler_id=handler_id),
        max_deferrals=3,
        retry=RetryPolicy(max_retries=3, delays=(30.0,)),
    )
    async with running(consumer) as managed:
        # Another live owner holds the lease for an hour.
        await mongo_client[database_name][RECORDS].insert_one(
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
        await publish(amqp, q, event, retry_count=1)
        await eventually(lambda: "dead_lettered" in outcomes(managed), timeout=8.0, what="dead-lettering")
        assert await wait_for_depth(amqp_channel, f"{q}.dlq", 1) == 1
    observations = managed.delivery_terminal_observations()
    assert [o.outcome for o in observations] == ["deferred", "deferred", "dead_lettered"]
    assert [o.code for o in observations] == ["LEASE_HELD", "LEASE_HELD", "QUEUE_DEFERRALS_EXHAUSTED"]
    assert (observations[-1].handoff_confirmed, observations[-1].ack_sent) == (True, True)
    assert calls == []
    [copy] = await drain(amqp_channel, f"{q}.dlq")
    assert copy.headers["x-lily-failure-code"] == "QUEUE_DEFERRALS_EXHAUSTED"
    assert copy.headers["x-lily-event-id"] == str(event)
    assert copy.headers["x-retry-count"] == 1  # deferrals are not application retries
    assert copy.headers["x-lily-failed-queue"] == q
    assert await queue_depth(amqp_channel, q) == 0
    assert await queue_depth(amqp_channel, f"{q}.retry.0") == 0
    db = mongo_client[database_name]
    record = await db[RECORDS].find_one({"_id": key})
    assert record is not None
    assert (record["state"], record["owner"], record["token"], record["deferrals"]) == ("leased", "elsewhere:0:0", 7, 3)
    assert await db[EFFECTS].count_documents({}) == 0


# -- the scope is valid for one attempt only ------------------------------------------------------


async def test_scope_used_after_the_attempt_raises(
    amqp: str,
    mongo_client: AsyncMongoClient[Any],
    database_name: str,
    names: BrokerNames,
) -> None:
    q = names.queue("stale")
    kept: list[MongoScope] = []
    event = uuid.uuid4()

    @queue(q, version=1, content="json", handler_id=f"{q}/keep")
    async def handle(event_id: EventId, mongo: MongoScope) -> None:
        kept.append(mongo)
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id)}, session=mongo.session)

    consumer = make_consumer(amqp, mongo_client, database_name, q, handle)
    async with running(consumer) as managed:
        await publish(amqp, q, event)
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
    assert await mongo_client[database_name][EFFECTS].count_documents({}) == 1


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
    amqp: str,
    mongo_client: AsyncMongoClient[Any],
    database_name: str,
    names: BrokerNames,
    amqp_channel: aio_pika.abc.AbstractChannel,
    failure: Exception,
    destination: str,
    outcome: str,
    code: str,
) -> None:
    q = names.queue("fail")
    event = uuid.uuid4()
    calls: list[uuid.UUID] = []

    @queue(q, version=1, content="json", handler_id=f"{q}/fail")
    async def handle(event_id: EventId, mongo: MongoScope) -> None:
        calls.append(event_id)
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id)}, session=mongo.session)
        await mongo.outbox.publish_json(f"{q}.downstream", {"from": str(event_id)}, version=1)
        raise failure

    # A long retry delay keeps the retry copy parked in its bucket for inspection.
    consumer = make_consumer(
        amqp,
        mongo_client,
        database_name,
        q,
        handle,
        inbox=InboxOptions(claim_in_transaction=claim_in_transaction),
        retry=RetryPolicy(max_retries=2, delays=(60,)),
    )
    async with running(consumer) as managed:
        await publish(amqp, q, event)
        await eventually(lambda: len(outcomes(managed)) == 1, timeout=8.0, what="handoff")
        assert await wait_for_depth(amqp_channel, f"{q}.{destination}", 1) == 1
    observation = only(managed)
    assert (observation.outcome, observation.code) == (outcome, code)
    assert (observation.handoff_confirmed, observation.ack_sent) == (True, True)
    assert calls == [event]
    db = mongo_client[database_name]
    assert await db[EFFECTS].count_documents({}) == 0  # aborted: nothing the handler wrote survived
    assert await db["lily_outbox"].count_documents({}) == 0
    # Lease first: released (deleted), not left to expire. In the transaction: never committed.
    assert await db[RECORDS].count_documents({}) == 0
    [copy] = await drain(amqp_channel, f"{q}.{destination}")
    assert copy.headers["x-lily-failure-code"] == code
    assert copy.headers["x-lily-event-id"] == str(event)
    assert copy.headers["x-retry-count"] == (1 if outcome == "retried" else 0)
    assert await queue_depth(amqp_channel, q) == 0


# -- a lost lease cancels the attempt -------------------------------------------------------------


async def test_a_lease_taken_over_between_attempts_defers_at_the_next_attempt(
    amqp: str,
    mongo_client: AsyncMongoClient[Any],
    database_name: str,
    names: BrokerNames,
    amqp_channel: aio_pika.abc.AbstractChannel,
) -> None:
    # While its transaction holds the record nobody can take the lease over (MongoDB makes
    # other writers wait). Between attempts it can: the first attempt meets a transient
    # error, and during the replay's backoff (at least 1 s here) another owner takes the
    # record. The next attempt must not run the handler: deferred with LEASE_LOST.
    q = names.queue("lost")
    handler_id = f"{q}/lost"
    event = uuid.uuid4()
    key = f"{handler_id}|{event}"
    calls: list[uuid.UUID] = []
    records = mongo_client[database_name][RECORDS]
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
    consumer = make_consumer(amqp, mongo_client, database_name, q, handle, inbox=options)
    async with running(consumer) as managed:
        await publish(amqp, q, event)
        await eventually(lambda: "acked" in outcomes(managed), timeout=10.0, what="the redelivery to complete")
        assert await wait_for_depth(amqp_channel, q, 0) == 0
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
    assert await mongo_client[database_name][EFFECTS].count_documents({}) == 1


async def run_timing_out_handler(
    amqp: str,
    client: AsyncMongoClient[Any],
    database: str,
    q: str,
    channel: aio_pika.abc.AbstractChannel,
    claim_in_transaction: bool,
) -> tuple[TerminalObservation, dict[str, Any] | None]:
    """One delivery whose handler writes, then overruns a 0.5 s deadline; returns its observation and lease doc."""
    handler_id = f"{q}/slow"
    event = uuid.uuid4()

    @queue(q, version=1, content="json", handler_id=handler_id)
    async def handle(event_id: EventId, mongo: MongoScope) -> None:
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id)}, session=mongo.session)
        await asyncio.sleep(8.0)

    consumer = make_consumer(
        amqp,
        client,
        database,
        q,
        handle,
        inbox=InboxOptions(claim_in_transaction=claim_in_transaction),
        deadline=0.5,
        cooperation_window=1.0,
        retry=RetryPolicy(max_retries=2, delays=(60,)),
    )
    async with running(consumer) as managed:
        await publish(amqp, q, event)
        await eventually(lambda: len(outcomes(managed)) == 1, timeout=8.0, what="the timeout handoff")
        assert await wait_for_depth(channel, f"{q}.retry.0", 1) == 1
    record = await client[database][RECORDS].find_one({"_id": f"{handler_id}|{event}"})
    return only(managed), record


@pytest.mark.parametrize("claim_in_transaction", [True, False], ids=["in-transaction", "lease-first"])
async def test_handler_timeout_is_not_counted_as_a_deferral(
    claim_in_transaction: bool,
    amqp: str,
    mongo_client: AsyncMongoClient[Any],
    database_name: str,
    names: BrokerNames,
    amqp_channel: aio_pika.abc.AbstractChannel,
) -> None:
    # A timeout is an application retry (SPEC section 6); the deferral bound counts deferred
    # requeues only. A stale count makes a later LEASE_HELD copy hit max_deferrals early.
    _, lease = await run_timing_out_handler(
        amqp, mongo_client, database_name, names.queue("tdefer"), amqp_channel, claim_in_transaction
    )
    assert lease is None or lease.get("deferrals", 0) == 0, lease


@pytest.mark.parametrize("claim_in_transaction", [True, False], ids=["in-transaction", "lease-first"])
async def test_handler_timeout_aborts_and_frees_the_lease(
    claim_in_transaction: bool,
    amqp: str,
    mongo_client: AsyncMongoClient[Any],
    database_name: str,
    names: BrokerNames,
    amqp_channel: aio_pika.abc.AbstractChannel,
) -> None:
    observation, lease = await run_timing_out_handler(
        amqp, mongo_client, database_name, names.queue("timeout"), amqp_channel, claim_in_transaction
    )
    assert (observation.outcome, observation.code) == ("retried", "QUEUE_HANDLER_TIMEOUT")
    db = mongo_client[database_name]
    assert await db[EFFECTS].count_documents({}) == 0
    # Cancelled from outside, the attempt is no deferral: the lease is deleted (lease first),
    # or was never committed (in the transaction).
    assert lease is None, lease
