"""The MongoDB inbox: one record per (handler, event) carries the lease and the completion (docs/inbox.md).

For one delivery of handler ``H`` and event ``E`` (record ``_id`` ``"H|E"``):

0. **A first-time copy** (not redelivered; ``InboxOptions.claim_in_transaction``)
   claims inside its attempt's transaction: the first write inserts the record
   completed (``$setOnInsert`` upsert, returning what was there). Absent: the
   handler runs and the commit makes record and effects visible together, with
   no lease to renew or release. Completed: a duplicate (the read-only
   transaction is committed). A lease record, or a transient error: abort and
   continue with the claim below.
1. **Claim**: one ``find_one_and_update(upsert=True)`` on the server clock decides:
   completed → duplicate → ACK; leased by another live owner → deferred (its
   deferral counter incremented in the same update); otherwise leased to this
   attempt with a new fencing token.
2. **Attempt** (fresh session, transaction, scope and handler call each time):
   the transaction's *first* write turns the record to completed, fenced by
   owner and token (no match: the lease was lost → deferred). The transaction
   then holds the record: on MongoDB no renewal or claim lands on it until the
   commit or abort. The handler's writes and outbox records follow; the commit
   makes all of it visible at once. Nothing is left to release afterwards.
3. **Heartbeat**: one task per consumer renews the leases of running
   deliveries, fenced, and never while their transaction holds the record.
4. **Replay** on ``TransientTransactionError`` (by label) or a commit that failed
   without ``UnknownTransactionCommitResult``: abort, back off, fresh attempt;
   bounded by the replay budget → deferred.
5. **Reconcile** an ``UnknownTransactionCommitResult``: retry the same commit
   (bounded); still unknown → read the record with majority read concern.
6. **Release** on the failure paths: a handler failure deletes the record
   (fenced), then the runtime hands off; a deferral expires the lease and counts
   the deferral.

Outside a transaction every write of the records is majority-acknowledged and
every read majority-committed, whatever the client's defaults, and every such
operation (and each commit) is bounded by a ``maxTimeMS``, cut to half the time
left before the delivery's deadline while the handler has not run: a wait ends as
a deferral (``LEASE_BUSY``, ``MONGO_UNAVAILABLE``), never as a timeout. Deferrals
the lease protocol does not count in the same write are counted in the record
(a counting record if there is none); an attempt whose transaction outlived the
server's lifetime gets one more try, then ``QUEUE_TRANSACTION_EXPIRED``
(docs/inbox.md: "Majority, always", "Bounded waits", "The transaction lifetime",
"Counting deferrals").

Budget (docs/inbox.md, commands per delivery): a first-time delivery whose handler makes ``k`` writes
sends ``2 + k`` commands (the claim in the transaction, k writes, commit), a
redelivered one ``3 + k`` (claim, completion, k writes, commit); a redelivered
copy of a completed event sends 1 (the claim), a first-time one 2 (the claim in
the transaction, its read-only commit). :mod:`lily_mongo.records` holds every
decision; this module performs them.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import logging
import random
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pymongo
from pymongo import ReturnDocument
from pymongo.errors import DuplicateKeyError, PyMongoError
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

from .._backoff import backoff
from .._checks import check_bool, check_int, check_seconds
from .._engine.settlement import Execution, Outcome, PipelineResult
from .._errors import ConfigError, ErrorCode
from .._mongo import (
    DEFAULT_TRANSACTION_LIFETIME,
    TransactionScope,
    discard_server_session,
    ensure_index,
    error_labels,
    timed_out,
    transaction_lifetime,
    wait_expired,
    write_unconfirmed,
)
from .._observer import NO_OBSERVER, Observer
from .._outbox import OutboxWriter, ProcessOutbox
from .._plan.extractors import NOT_DECODED
from .._tasks import TaskSet, raise_if_cancel_requested
from ..bounds import DELIVERY_COUNT_HEADER
from . import protocol as records
from .protocol import ClaimKind, ErrorStep, FirstClaim, Heartbeat, Reconciled

if TYPE_CHECKING:
    from pymongo import AsyncMongoClient
    from pymongo.asynchronous.client_session import AsyncClientSession
    from pymongo.asynchronous.database import AsyncDatabase

    from .._plan.extractors import RawDelivery
    from .._plan.plan import HandlerRoute

__all__ = ["STAT_COLUMNS", "Inbox", "InboxOptions", "Invoke", "MongoScope", "inbox_stats"]

log = logging.getLogger("lily_mongo")

Invoke = Callable[[int, "MongoScope", Any], Awaitable[PipelineResult]]
"""``invoke(attempt, scope, payload)``: one middleware/guards/handler call, its verdict returned.
It must re-raise database errors for which :meth:`Inbox.passthrough` is true."""

_DUPLICATE = PipelineResult(Outcome.DUPLICATE)
_SUCCESS = PipelineResult(Outcome.SUCCESS)


@dataclass(frozen=True, slots=True, kw_only=True)
class InboxOptions:
    """The record collection, lease timing, retention and replay budgets of the inbox
    (the outbox has its own: :class:`~lily_mongo.OutboxOptions`)."""

    records: str = "lily_inbox"
    lease_seconds: float = 30.0
    heartbeat_seconds: float | None = None  # default: lease_seconds / 3
    retention_seconds: float = 7 * 24 * 3600.0
    stale_lease_seconds: float = 24 * 3600.0
    replay_budget: int = 5
    commit_retries: int = 3
    backoff_base: float = 0.02
    backoff_max: float = 1.0
    passive_indexes: bool = False
    claim_in_transaction: bool = True
    max_wait_seconds: float = 10.0
    transaction_lifetime_seconds: float | None = None  # default: read from the server at start

    def __post_init__(self) -> None:
        value = self.records
        if not isinstance(value, str) or not 0 < len(value.encode()) <= 120 or "$" in value:
            raise ConfigError(f"InboxOptions.records must be a collection name of 1..120 bytes, got {value!r:.60}")
        lease_seconds = check_seconds("InboxOptions.lease_seconds", self.lease_seconds, low=0.05, high=3600)
        heartbeat = self.heartbeat_seconds if self.heartbeat_seconds is not None else lease_seconds / 3
        check_seconds("InboxOptions.heartbeat_seconds", heartbeat, low=0, high=lease_seconds, low_inclusive=False)
        if heartbeat >= self.lease_seconds:
            raise ConfigError(
                f"InboxOptions.heartbeat_seconds must be < lease_seconds ({self.lease_seconds:g}), got {heartbeat!r}"
            )
        object.__setattr__(self, "heartbeat_seconds", float(heartbeat))
        check_seconds("InboxOptions.retention_seconds", self.retention_seconds, low=60, high=366 * 24 * 3600)
        check_seconds("InboxOptions.stale_lease_seconds", self.stale_lease_seconds, low=1, high=366 * 24 * 3600)
        check_int("InboxOptions.replay_budget", self.replay_budget, 0, 100)
        check_int("InboxOptions.commit_retries", self.commit_retries, 0, 100)
        check_seconds("InboxOptions.backoff_base", self.backoff_base, low=0, high=60, low_inclusive=False)
        check_seconds("InboxOptions.backoff_max", self.backoff_max, low=0, high=600, low_inclusive=False)
        if self.backoff_base > self.backoff_max:
            raise ConfigError(
                f"InboxOptions.backoff_base must be <= backoff_max ({self.backoff_max:g}), got {self.backoff_base!r}"
            )
        check_bool("InboxOptions.passive_indexes", self.passive_indexes)
        check_bool("InboxOptions.claim_in_transaction", self.claim_in_transaction)
        check_seconds("InboxOptions.max_wait_seconds", self.max_wait_seconds, low=0.05, high=600)
        if self.transaction_lifetime_seconds is not None:
            check_seconds(
                "InboxOptions.transaction_lifetime_seconds", self.transaction_lifetime_seconds, low=1, high=86400
            )


class MongoScope(TransactionScope):
    """The handler's view of one attempt: its session, the database and the outbox.

    Valid for one attempt only; any use after the attempt ended raises
    :class:`ScopeClosedError`. Pass ``session=mongo.session`` to every operation
    that belongs to the transaction.
    """

    __slots__ = ("_outbox",)

    _closed_message = "this MongoScope belongs to a finished attempt; it cannot be used any more"

    def __init__(self, session: AsyncClientSession, database: AsyncDatabase[Any], outbox: OutboxWriter | None) -> None:
        super().__init__(session, database)
        self._outbox = outbox

    def __repr__(self) -> str:
        return f"<MongoScope open={self._open}>"

    @property
    def outbox(self) -> OutboxWriter:
        """Messages staged here commit with the transaction and are published right after the commit."""
        self._check()
        assert self._outbox is not None
        return self._outbox


class _Replay(Exception):
    """The attempt must be replayed in a fresh scope (transient error, or a commit not applied)."""

    error_type = "transient_replay"  # what an attempt's span reports
    handler_error: BaseException | None = None  # what the handler raised, when the replay came from it


class _Contended(Exception):
    """A first-time copy found a lease record: its transaction wrote nothing; take the lease claim."""

    span_outcome = "contended"  # what an attempt's span reports (no error: the lease claim follows)


@dataclass(slots=True, eq=False)
class _Lease:
    key: str
    owner: str
    token: int
    renewed_at: float  # the event loop's clock
    wait: float  # the bound on each write of the record outside a transaction (maxTimeMS)
    until: float | None = None  # the delivery's deadline (the event loop's clock), when known
    handler_id: str = ""
    event_id: str = ""
    holding: bool = False  # the attempt's transaction has written the record and not ended
    lost: bool = False
    first: bool = False  # no lease: the attempt's transaction claims the record (a first-time copy)
    started: float = 0.0  # when the current attempt's transaction started (the event loop's clock)
    cancelled_age: float | None = None  # the age of its transaction when an attempt was cancelled
    expirations: int = 0  # attempts of this delivery whose transaction outlived the lifetime


def _now() -> float:
    """The event loop's clock (monotonic seconds)."""
    return asyncio.get_running_loop().time()


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Mark a shielded task's outcome as seen (its awaiter may have been cancelled meanwhile)."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("a shielded inbox write failed", exc_info=task.exception())


def _in_time(lease: _Lease) -> float:
    """The bound of a wait before the handler runs: the lease's, and at most half the time left
    before the delivery's deadline, so that a wait ends as a deferral, never cut off by the
    deadline as a timeout (an application retry). PyMongo answers a bound smaller than a round
    trip with ``ExecutionTimeout`` without sending anything."""
    if lease.until is None:
        return lease.wait
    return min(lease.wait, max((lease.until - _now()) / 2, 0.001))


_MIN_COMMIT_WAIT = 0.05  # a commit retry with less than this to wait for the majority is not worth sending


def _share(lease: _Lease, parts: int) -> float:
    """The bound of one of ``parts`` waits still to come after the handler ran (the commit, its
    retries, the read that decides): the lease's, and at most an equal share of nine tenths of
    the time left before the delivery's deadline, so that the last of them still ends before it
    (an ambiguous commit ends as a deferral, never cut off as a timeout)."""
    if lease.until is None:
        return lease.wait
    return min(lease.wait, max((lease.until - _now()) * 0.9 / parts, 0.001))


class Inbox:
    """Runs inbox handlers under the record protocol; one per started consumer."""

    def __init__(
        self,
        client: AsyncMongoClient[Any],
        database: str,
        options: InboxOptions,
        *,
        owner_prefix: str,
        outbox: ProcessOutbox,
        deadlines: Mapping[str, float] | None = None,
        observer: Observer = NO_OBSERVER,
    ) -> None:
        """``deadlines``: each queue's delivery deadline (seconds), which bounds the waits of its
        deliveries and is compared with the server's transaction lifetime at start."""
        self._client = client
        self._observer = observer
        self._database = client[database]
        self._options = options
        # Inside a transaction the transaction's read and write concerns apply.
        self._records = self._database[options.records]
        # Outside one, every write is majority-acknowledged and every read majority-committed,
        # whatever the client's defaults: a w:1 write can be rolled back, and a claim that read
        # a completion a failover then undoes would ACK an event that never committed
        # (docs/inbox.md, "Majority, always").
        self._outside = self._records.with_options(
            write_concern=WriteConcern("majority"), read_concern=ReadConcern("majority")
        )
        self._outbox = outbox
        self._deadlines = dict(deadlines or {})
        self._lifetime = options.transaction_lifetime_seconds or DEFAULT_TRANSACTION_LIFETIME
        # Owner ids: "<consumer>:<process instance>:<attempt number>", unique without a uuid per delivery.
        self._owner_prefix = f"{owner_prefix[:64]}:{uuid.uuid4().hex[:12]}:"
        self._owner_numbers = itertools.count(1)
        self._leases: set[_Lease] = set()
        self._clock_offset = datetime.timedelta(0)  # server clock - consumer clock, read by prepare()
        assert options.heartbeat_seconds is not None
        self._heartbeat_seconds = options.heartbeat_seconds

    @property
    def records(self) -> str:
        """The name of the record collection."""
        return self._options.records

    @property
    def transaction_lifetime(self) -> float:
        """The server's transaction lifetime in seconds, as read at start (docs/inbox.md)."""
        return self._lifetime

    def wait_for(self, queue: str) -> float:
        """How long a write of a ``queue`` delivery's record outside a transaction may wait (its
        ``maxTimeMS``): ``max_wait_seconds``, at most a quarter of the queue's delivery deadline."""
        deadline = self._deadlines.get(queue)
        wait = self._options.max_wait_seconds
        return wait if deadline is None else min(wait, deadline / 4)

    # -- set-up and the heartbeat --------------------------------------------------------------

    async def prepare(self) -> None:
        """Create the record collection's TTL index (idempotent), or only verify it in passive mode.

        Also reads the server's clock (``hello``'s ``localTime``): a first-time copy's
        record is written with ``$setOnInsert``, which takes no ``$$NOW``, so its
        retention is counted from the consumer's clock corrected by this offset.
        """
        sent = datetime.datetime.now(datetime.UTC)
        hello = await self._client.admin.command("hello")
        received = datetime.datetime.now(datetime.UTC)
        self._clock_offset = records.clock_offset(hello.get("localTime"), sent, received)
        await self._read_lifetime()
        await ensure_index(
            self._outside,
            "lily_purge_at_ttl",
            [("purge_at", 1)],
            passive=self._options.passive_indexes,
            expireAfterSeconds=0,
        )

    async def _read_lifetime(self) -> None:
        """Read the server's transaction lifetime; warn about queues whose deadline exceeds it.

        A deadline longer than the lifetime lets an attempt run until the server aborts its
        transaction for its age; the inbox then gives it one more try and dead-letters it
        with ``QUEUE_TRANSACTION_EXPIRED`` (docs/inbox.md, "The transaction lifetime"). That
        is a warning, not a refusal to start: the limit is a server parameter an operator
        may change while consumers run, and where the server does not say it is a guess.
        """
        lifetime = self._options.transaction_lifetime_seconds
        read = "InboxOptions.transaction_lifetime_seconds"
        if lifetime is None:
            lifetime = await transaction_lifetime(self._client)
            read = "the server's transactionLifetimeLimitSeconds"
            if lifetime is None:
                lifetime = DEFAULT_TRANSACTION_LIFETIME
                read = "MongoDB's default transaction lifetime (the server did not answer getParameter)"
                log.info(
                    "the server did not say its transactionLifetimeLimitSeconds (getParameter refused); the inbox "
                    "assumes %g s: set InboxOptions.transaction_lifetime_seconds if it differs",
                    lifetime,
                )
        self._lifetime = lifetime
        for queue, deadline in sorted(self._deadlines.items()):
            if deadline > lifetime:
                log.warning(
                    "queue %s: its delivery deadline (%g s) exceeds %s (%g s): an attempt that runs longer is "
                    "aborted by the server, tried once more, then dead-lettered with %s",
                    queue,
                    deadline,
                    read,
                    lifetime,
                    ErrorCode.TRANSACTION_EXPIRED.value,
                )

    def start(self, tasks: TaskSet) -> None:
        """Start the heartbeat, a task of the supervisor's."""
        tasks.spawn(self._heartbeat(), name="lily-heartbeat")

    async def _heartbeat(self) -> None:
        """Renew the lease of every running delivery whose last renewal is a beat old, fenced.

        The renewals of one beat run concurrently, each bounded by its ``maxTimeMS``: one
        record held by a transaction (its renewal waits on MongoDB) never holds up the others.
        """
        interval = self._heartbeat_seconds
        while True:
            await asyncio.sleep(interval / 2)
            now = _now()
            due = [
                lease
                for lease in self._leases
                if not lease.lost and now - lease.renewed_at >= interval and records.may_renew(holding=lease.holding)
            ]
            if due:
                await asyncio.gather(*(self._renew(lease) for lease in due))

    async def _renew(self, lease: _Lease) -> None:
        options = self._options
        try:
            with pymongo.timeout(min(lease.wait, self._heartbeat_seconds)):
                result = await self._outside.update_one(
                    records.fence(lease.key, lease.owner, lease.token),
                    records.renewal_update(
                        lease_seconds=options.lease_seconds, stale_seconds=options.stale_lease_seconds
                    ),
                )
            matched: bool | None = result.matched_count > 0
        except PyMongoError:
            matched = None
        verdict = records.heartbeat_verdict(
            matched=matched, unrenewed_for=_now() - lease.renewed_at, lease_seconds=options.lease_seconds
        )
        if verdict is Heartbeat.RENEWED:
            lease.renewed_at = _now()
        elif verdict is Heartbeat.LOST:
            lease.lost = True

    # -- one delivery --------------------------------------------------------------------------

    @staticmethod
    def passthrough(exc: BaseException) -> bool:
        """Database errors the handler's verdict must not swallow: the replay loop handles them."""
        return isinstance(exc, PyMongoError) and ErrorStep.REPLAY is records.classify_error(
            error_labels(exc), in_commit=False
        )

    async def execute(self, route: HandlerRoute, delivery: RawDelivery, payload: Any, invoke: Invoke) -> Execution:
        """Run one delivery under the record protocol; ``payload`` is the body decoded while preparing."""
        event_id = str(delivery.envelope.event_id)
        handler_id = route.handler_id
        key = records.record_key(handler_id, event_id)
        wait = self.wait_for(route.queue)
        deadline = self._deadlines.get(route.queue)
        until = None if deadline is None else _now() + deadline
        execution = Execution(PipelineResult(Outcome.DEFERRED, ErrorCode.REPLAY_BUDGET_SPENT, ""))
        expirations = 0
        if self._options.claim_in_transaction and records.claims_in_transaction(
            redelivered=delivery.redelivered, delivery_count=delivery.headers.get(DELIVERY_COUNT_HEADER)
        ):
            # A first-time copy: the claim is the transaction's first write (2 + k commands).
            # It leaves no lease behind: nothing to renew, nothing to release.
            first = _Lease(
                key,
                self._new_owner(),
                1,
                _now(),
                wait,
                until,
                handler_id=handler_id,
                event_id=event_id,
                first=True,
            )
            try:
                done = await self._attempts(route, first, execution, payload, invoke)
            except asyncio.CancelledError:
                await self._count_if_outlived(first)
                raise
            if done:
                if execution.result.outcome is Outcome.DEFERRED:
                    # No record of its own counts this deferral: a counting record does.
                    await self._count_into(execution, first)
                return execution
            expirations = first.expirations
        owner = self._new_owner()
        claimant = _Lease(key, owner, 0, _now(), wait, until, handler_id=handler_id, event_id=event_id)
        bound = _in_time(claimant)
        try:
            record = await self._observer.inbox_claim(self._claim(key, handler_id, event_id, owner, bound), owner)
        except PyMongoError as exc:
            # The database is unreachable, refused, or kept the claim waiting past its maxTimeMS
            # behind a transaction that holds the record: infrastructure, not an application
            # failure. Requeue (bounded, counted) without running the handler.
            execution.result = self._claim_failed(exc, bound)
            await self._count_into(execution, claimant)
            return execution
        claim = records.read_claim(record, owner)
        if claim.kind is ClaimKind.DUPLICATE:
            execution.result = _DUPLICATE
            return execution
        if claim.kind is ClaimKind.HELD:
            execution.result = PipelineResult(
                Outcome.DEFERRED, ErrorCode.LEASE_HELD, "the lease is held by another live owner"
            )
            execution.deferrals, execution.backoff_limit = claim.deferrals, claim.remaining
            return execution
        lease = _Lease(
            key,
            owner,
            claim.token,
            _now(),
            wait,
            until,
            handler_id=handler_id,
            event_id=event_id,
            expirations=expirations,
        )
        self._leases.add(lease)
        settled = False
        try:
            if records.may_try_again_after_expiry(claim.expirations):
                settled = await self._attempts(route, lease, execution, payload, invoke)
            else:  # its attempts outlived the lifetime twice already: no third (docs/inbox.md)
                execution.result = PipelineResult(
                    Outcome.PERMANENT,
                    ErrorCode.TRANSACTION_EXPIRED,
                    f"{claim.expirations} attempts outlived the server's transaction lifetime ({self._lifetime:g} s)",
                )
                settled = True
        finally:
            self._leases.discard(lease)
            outcome = execution.result.outcome if settled else None
            if outcome is not Outcome.SUCCESS and outcome is not Outcome.DUPLICATE:
                # Release even if this task is being cancelled. Cancelled from outside
                # (deadline, forced shutdown), the attempt is not a deferral: the runtime
                # settles it otherwise, so the record is released without a count.
                release = asyncio.ensure_future(self._release(lease, outcome))
                release.add_done_callback(_retrieved)  # its failure is logged below, unless cancelled meanwhile
                try:
                    deferrals = await asyncio.shield(release)
                except PyMongoError:
                    log.warning("releasing an inbox lease failed; it will expire", exc_info=True)
                    deferred = outcome is Outcome.DEFERRED
                    deferrals = await self._count(lease, records.DEFERRALS, bound=_in_time(lease)) if deferred else None
                if deferrals is not None:
                    execution.deferrals = deferrals
        return execution

    async def count_deferral(self, route: HandlerRoute, delivery: RawDelivery) -> int | None:
        """Count a deferral the inbox did not decide (a forced shutdown's) in the event's record.

        Returns the event's deferrals so far, or None when the database could not count it
        (the caller's in-process count is the fallback).
        """
        event_id = str(delivery.envelope.event_id)
        key = records.record_key(route.handler_id, event_id)
        lease = _Lease(key, "", 0, _now(), self.wait_for(route.queue), handler_id=route.handler_id, event_id=event_id)
        return await self._count(lease, records.DEFERRALS)

    def _new_owner(self) -> str:
        return f"{self._owner_prefix}{next(self._owner_numbers)}"

    @staticmethod
    def _claim_failed(exc: PyMongoError, wait: float) -> PipelineResult:
        """The deferral a failed claim becomes: it never ran the handler."""
        if wait_expired(exc):
            reason = f"the claim waited {wait:g} s (its maxTimeMS) for a transaction that holds the record"
            return PipelineResult(Outcome.DEFERRED, ErrorCode.LEASE_BUSY, reason)
        if write_unconfirmed(exc):
            reason = f"the claim was not majority-acknowledged: {type(exc).__name__}"
            return PipelineResult(Outcome.DEFERRED, ErrorCode.MONGO_UNAVAILABLE, reason)
        return PipelineResult(Outcome.DEFERRED, ErrorCode.MONGO_UNAVAILABLE, f"inbox unavailable: {type(exc).__name__}")

    async def _claim(self, key: str, handler_id: str, event_id: str, owner: str, wait: float) -> dict[str, Any]:
        pipeline = records.claim_pipeline(
            handler_id,
            event_id,
            owner,
            lease_seconds=self._options.lease_seconds,
            stale_seconds=self._options.stale_lease_seconds,
        )
        with pymongo.timeout(wait):
            for _ in range(3):
                try:
                    record: dict[str, Any] | None = await self._outside.find_one_and_update(
                        {"_id": key}, pipeline, upsert=True, return_document=ReturnDocument.AFTER
                    )
                except DuplicateKeyError:
                    continue  # two concurrent upserts of a new key: the loser retries as an update
                assert record is not None
                return record
        raise DuplicateKeyError("the inbox claim kept colliding on upsert")  # pragma: no cover - the caller defers

    async def _release(self, lease: _Lease, outcome: Outcome | None) -> int | None:
        """Fenced release: delete on a final verdict; on a deferral expire it and return the deferral count.

        ``outcome`` None: cancelled from outside; the record is deleted unless it counts
        deferrals or expired transactions, which a plain release keeps. A cancelled attempt
        whose transaction had outlived the lifetime is counted as such first.
        """
        fence = records.fence(lease.key, lease.owner, lease.token)
        if outcome is None:
            await self._count_if_outlived(lease)
        # A verdict is settled before the delivery's deadline: its release must end in time
        # (docs/inbox.md, "Bounded waits"). Cancelled from outside, the deadline is past.
        bound = lease.wait if outcome is None else _in_time(lease)
        with pymongo.timeout(bound):
            if outcome is None:
                deleted = await self._outside.delete_one(
                    records.cancelled_release_filter(lease.key, lease.owner, lease.token)
                )
                if deleted.deleted_count == 0:
                    await self._outside.update_one(fence, records.released_update())
                return None
            if outcome is not Outcome.DEFERRED:
                await self._outside.delete_one(fence)
                return None
            record = await self._outside.find_one_and_update(
                fence, records.deferral_release_update(), return_document=ReturnDocument.AFTER
            )
        if record is None:  # lost (or committed) meanwhile: count this deferral on whatever is there
            return await self._count(lease, records.DEFERRALS, bound=_in_time(lease))
        return records.read_count(record, records.DEFERRALS)

    async def _count(self, lease: _Lease, counter: str, *, bound: float | None = None) -> int | None:
        """Count one more ``counter`` in the event's record (created if absent); None when that fails."""
        update = records.count_update(
            counter, lease.handler_id, lease.event_id, stale_seconds=self._options.stale_lease_seconds
        )
        try:
            with pymongo.timeout(lease.wait if bound is None else bound):
                for _ in range(3):
                    try:
                        record = await self._outside.find_one_and_update(
                            {"_id": lease.key},
                            update,
                            upsert=True,
                            projection={counter: 1},
                            return_document=ReturnDocument.AFTER,
                        )
                    except DuplicateKeyError:
                        continue  # two concurrent upserts of a new key: the loser retries as an update
                    return records.read_count(record, counter)
        except PyMongoError:
            log.debug("counting %s in the inbox record failed", counter, exc_info=True)
        return None

    async def _count_if_outlived(self, lease: _Lease) -> None:
        """An attempt cancelled from outside while its transaction was older than the lifetime
        (the server has aborted it, or will): it counts as one that outlived it."""
        age = lease.cancelled_age
        if age is not None and records.outlived(age, self._lifetime):
            await asyncio.shield(self._count(lease, records.EXPIRATIONS))

    async def _count_into(self, execution: Execution, lease: _Lease) -> None:
        """Count the deferral ``execution`` concluded in the record; on failure the runtime's count stands.

        Counted before the delivery's deadline, as the claim is: the handler has not run.
        """
        count = await self._count(lease, records.DEFERRALS, bound=_in_time(lease))
        if count is not None:
            execution.deferrals = count

    async def _attempts(
        self, route: HandlerRoute, lease: _Lease, execution: Execution, payload: Any, invoke: Invoke
    ) -> bool:
        """The replay loop: each pass is a fresh scope; transient failures replay the whole pipeline.

        True once ``execution.result`` is the verdict. False only for a first-time copy
        (``lease.first``) whose record turned out contended: the lease claim decides. A
        first-time copy's replay claims in its transaction again (its failed attempt wrote
        nothing), so a replay costs 2 + k commands on either path.
        """
        options = self._options
        while True:
            execution.attempts += 1
            if lease.lost:
                execution.result = PipelineResult(
                    Outcome.DEFERRED, ErrorCode.LEASE_LOST, "the lease was lost between attempts"
                )
                return True
            # The first attempt reuses the body decoded while preparing; a replay decodes
            # afresh so a handler that mutated its payload cannot leak into the replay.
            first = payload if execution.attempts == 1 else NOT_DECODED
            try:
                execution.result = await self._observer.inbox_attempt(
                    self._attempt(route, lease, execution, first, invoke),
                    execution.attempts,
                    execution.transient_replays,
                    first=lease.first,
                )
                return True
            except _Deferral as deferral:
                execution.result = deferral.result
                return True
            except _Contended:
                execution.attempts -= 1  # no handler ran: the lease claim's attempt is the first
                return False
            except _Replay as replay:
                execution.transient_replays += 1
                if records.outlived(_now() - lease.started, self._lifetime) and not await self._may_try_again(lease):
                    execution.result = PipelineResult(
                        Outcome.PERMANENT,
                        ErrorCode.TRANSACTION_EXPIRED,
                        f"the attempt's transaction outlived the server's transaction lifetime "
                        f"({self._lifetime:g} s) again; last: {replay}",
                    )
                    return True
                if records.next_after_replay(execution.transient_replays, options.replay_budget) is ErrorStep.DEFER:
                    execution.result = PipelineResult(
                        Outcome.DEFERRED,
                        ErrorCode.REPLAY_BUDGET_SPENT,
                        f"{execution.transient_replays - 1} transient replays (budget "
                        f"{options.replay_budget}); last: {replay}",
                        replay.handler_error,
                    )
                    return True
                raise_if_cancel_requested()  # cancelled while the attempt ignored it: no replay
                await asyncio.sleep(
                    backoff(
                        execution.transient_replays,
                        base=options.backoff_base,
                        cap=options.backoff_max,
                        jitter=random.random(),
                    )
                )

    async def _may_try_again(self, lease: _Lease) -> bool:
        """An attempt's transaction outlived the lifetime: count it in the record (it holds across
        deliveries) and in this delivery; the first expiry gets one more try, the second none."""
        lease.expirations += 1
        counted = await self._count(lease, records.EXPIRATIONS, bound=_in_time(lease))
        return records.may_try_again_after_expiry(max(lease.expirations, counted or 0))

    async def _attempt(
        self, route: HandlerRoute, lease: _Lease, execution: Execution, payload: Any, invoke: Invoke
    ) -> PipelineResult:
        session = self._client.start_session(causal_consistency=False)
        try:
            await session.start_transaction(
                read_concern=ReadConcern("snapshot"), write_concern=WriteConcern("majority")
            )
            lease.holding = True  # from the completion write until the commit or abort ends
            lease.started = _now()
            if lease.first:
                found = await self._first_claim(session, route, lease)
                if found is FirstClaim.DUPLICATE:
                    # Commit, not abort: a majority commit of this read-only transaction waits
                    # until the snapshot that showed the completion is majority-committed, so a
                    # failover cannot roll back the completion this ACK relies on. The wait is
                    # bounded like every wait for the majority (docs/inbox.md, "Bounded waits").
                    try:
                        with pymongo.timeout(_in_time(lease)):
                            await session.commit_transaction()
                    except PyMongoError:
                        discard_server_session(session)
                        raise _Contended from None  # not confirmed: the lease claim decides
                    return _DUPLICATE
                if found is FirstClaim.CONTENDED:
                    await self._abort(session)
                    raise _Contended
            else:
                bound = _in_time(lease)
                try:
                    with pymongo.timeout(bound):
                        done = await self._records.update_one(
                            records.fence(lease.key, lease.owner, lease.token),
                            records.completion_update(retention_seconds=self._options.retention_seconds),
                            session=session,
                        )
                except PyMongoError as exc:
                    await self._abort(session)
                    if timed_out(exc):  # a wait before the handler ran: infrastructure, not a retry
                        raise _Deferral(self._claim_failed(exc, bound)) from exc
                    raise self._failed(exc, "the completion write") from exc
                if done.matched_count == 0:
                    await self._abort(session)
                    return PipelineResult(Outcome.DEFERRED, ErrorCode.LEASE_LOST, "the lease was taken over")
            scope: MongoScope | None = None
            outbox = self._outbox.writer(session, route.handler_id, lambda: scope is not None and scope.is_open)
            scope = MongoScope(session, self._database, outbox)
            try:
                result = await invoke(execution.attempts, scope, payload)
            except PyMongoError as exc:  # only what passthrough() let through: labelled transient
                await self._abort(session)
                failure = self._failed(exc, "the handler")
                if isinstance(failure, _Replay):
                    failure.handler_error = exc  # shown by the failure log if the budget runs out
                raise failure from exc
            finally:
                scope.close()
            if result.outcome is not Outcome.SUCCESS:
                await self._abort(session)
                return result
            result = await self._observer.inbox_commit(self._commit(session, lease, execution))
            if result is _SUCCESS and outbox.written:
                self._outbox.committed(outbox)  # dispatched after the commit; the ACK does not wait
            return result
        except asyncio.CancelledError:
            if lease.holding:  # cancelled from outside while its transaction was open
                lease.cancelled_age = _now() - lease.started
            raise
        finally:
            lease.holding = False
            await session.end_session()

    async def _first_claim(self, session: AsyncClientSession, route: HandlerRoute, lease: _Lease) -> FirstClaim:
        """A first-time copy's claim: the transaction's first write inserts the record completed, or finds it."""
        update = records.first_claim_update(
            route.handler_id,
            lease.event_id,
            lease.owner,
            now=datetime.datetime.now(datetime.UTC) + self._clock_offset,
            retention_seconds=self._options.retention_seconds,
        )
        bound = _in_time(lease)
        try:
            with pymongo.timeout(bound):
                before = await self._records.find_one_and_update(
                    {"_id": lease.key}, update, upsert=True, projection={"state": 1}, session=session
                )
        except DuplicateKeyError:
            return FirstClaim.CONTENDED  # inserted meanwhile by someone else: the lease claim decides
        except PyMongoError as exc:
            if timed_out(exc):  # a wait before the handler ran: infrastructure, not a retry
                await self._abort(session)
                raise _Deferral(self._claim_failed(exc, bound)) from exc
            if records.first_claim_falls_back(error_labels(exc)):
                await self._abort(session)
                return FirstClaim.CONTENDED
            await self._abort(session)
            raise self._failed(exc, "the claim in the transaction") from exc
        return records.read_first_claim(before)

    @staticmethod
    def _failed(exc: PyMongoError, where: str) -> Exception:
        """The exception an operation's database error turns into: a replay, or a deferral verdict."""
        if records.classify_error(error_labels(exc), in_commit=False) is ErrorStep.REPLAY:
            return _Replay(f"{type(exc).__name__} in {where} (TransientTransactionError)")
        return _Deferral(PipelineResult(Outcome.DEFERRED, ErrorCode.MONGO_ERROR, f"{type(exc).__name__}: {exc}"[:300]))

    async def _abort(self, session: AsyncClientSession) -> None:
        if session.in_transaction:
            try:
                with pymongo.timeout(self._options.max_wait_seconds):
                    await session.abort_transaction()
            except PyMongoError:
                discard_server_session(session)

    async def _commit(self, session: AsyncClientSession, lease: _Lease, execution: Execution) -> PipelineResult:
        """Commit; on an unknown result retry the same commit, then read the record (two separate loops).

        Each commit's wait for the majority is bounded (``maxTimeMS``): one that runs out is
        an unknown result, reconciled like a lost reply (docs/inbox.md, "Bounded waits").
        """
        try:
            with pymongo.timeout(_share(lease, self._options.commit_retries + 2)):
                await session.commit_transaction()
            return _SUCCESS
        except PyMongoError as exc:
            if records.classify_error(error_labels(exc), in_commit=True) is ErrorStep.REPLAY:
                discard_server_session(session)  # not committed (MongoDB aborts it): replay
                raise _Replay(f"commit failed: {type(exc).__name__}") from exc
        execution.reconciliations += 1
        return await self._observer.inbox_reconcile(self._reconcile(session, lease))

    async def _reconcile(self, session: AsyncClientSession, lease: _Lease) -> PipelineResult:
        """An unknown commit result: retry the same commit (bounded), then read the record."""
        options = self._options
        for retry in range(options.commit_retries):
            delay = backoff(retry, base=options.backoff_base, cap=options.backoff_max, jitter=random.random())
            parts = options.commit_retries - retry + 1  # this retry, the ones after it, the read
            if lease.until is not None and (lease.until - _now() - delay) * 0.9 / parts < _MIN_COMMIT_WAIT:
                break  # no time left for another commit: the read decides before the deadline
            await asyncio.sleep(delay)
            try:
                with pymongo.timeout(_share(lease, parts)):
                    await session.commit_transaction()
                return _SUCCESS
            except PyMongoError as exc:
                if records.classify_error(error_labels(exc), in_commit=True) is not ErrorStep.RETRY_COMMIT:
                    break
        discard_server_session(session)
        try:
            with pymongo.timeout(_share(lease, 1)):
                record = await self._outside.find_one({"_id": lease.key})
        except PyMongoError:
            record = None  # unread: not known to be completed, so the next delivery decides
        verdict = records.reconcile(record, lease.owner, lease.token)
        if verdict is Reconciled.COMMITTED:
            return _SUCCESS
        if verdict is Reconciled.DUPLICATE:
            return _DUPLICATE
        return PipelineResult(
            Outcome.DEFERRED,
            ErrorCode.COMMIT_AMBIGUOUS,
            "the commit result stayed unknown and the record is not completed; the next delivery decides",
        )


class _Deferral(Exception):
    """An operation failed in a way that defers the delivery (carries the verdict)."""

    error_type = "deferred"  # what an attempt's span reports

    def __init__(self, result: PipelineResult) -> None:
        super().__init__(result.reason)
        self.result = result


STAT_COLUMNS = ("completed", "live_leases", "stale_leases", "outbox_pending", "outbox_published", "outbox_failed")
"""The columns of :func:`inbox_stats`, in the order ``lily-mongo inbox stats`` prints them."""


async def inbox_stats(
    database: AsyncDatabase[Any], options: InboxOptions, *, outbox: str = "lily_outbox"
) -> dict[str, dict[str, int]]:
    """Per handler: completed records, live and expired leases, outbox records (collection ``outbox``) by status.

    A lease is live while it has an owner and its expiry is ahead of the server clock.
    """
    stats: dict[str, dict[str, int]] = {}

    def row(handler: object) -> dict[str, int]:
        return stats.setdefault(str(handler), dict.fromkeys(STAT_COLUMNS, 0))

    live = {"$and": [{"$ne": [{"$ifNull": ["$owner", None]}, None]}, {"$gt": ["$expires_at", "$$NOW"]}]}
    by_state = {"$group": {"_id": {"h": "$handler", "s": "$state", "live": live}, "n": {"$sum": 1}}}
    async for doc in await database[options.records].aggregate([by_state]):
        key = doc["_id"]
        if key.get("s") == records.COMPLETED:
            column = "completed"
        else:
            column = "live_leases" if key.get("live") else "stale_leases"
        row(key.get("h"))[column] += int(doc["n"])
    by_status = {"$group": {"_id": {"h": "$handler", "s": "$status"}, "n": {"$sum": 1}}}
    async for doc in await database[outbox].aggregate([by_status]):
        status = str(doc["_id"].get("s"))
        if status in ("pending", "published", "failed"):
            row(doc["_id"].get("h"))[f"outbox_{status}"] += int(doc["n"])
    return stats
