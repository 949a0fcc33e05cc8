"""A delivery's attempts: each a fresh session, transaction, scope and handler call (docs/inbox.md, steps 0, 2,
4 and 5).

The transaction's *first* write claims the record: a first-time copy inserts it completed
(``$setOnInsert``, returning what was there), a lease holder turns its lease to completed,
fenced by owner and token. The transaction then holds the record: on MongoDB no renewal or
claim lands on it until the commit or abort. The handler's writes and outbox records follow;
the commit makes all of it visible at once. A ``TransientTransactionError`` (by label), or a
commit that did not apply, replays the whole attempt (the transaction skeleton,
:mod:`lily_mongo._mongo.transactions`); an unknown commit result is retried, then decided by
the record read with majority read concern.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import pymongo
from pymongo.errors import DuplicateKeyError, PyMongoError

from .._errors import ErrorCode
from .._mongo import discard_server_session, error_labels, timed_out
from .._mongo import rules as transaction_rules
from .._mongo import transactions as transaction
from .._mongo.transactions import Replay
from .._observer import Observer
from .._outbox import ProcessOutbox
from .._plan.extractors import NOT_DECODED
from .._verdicts import Execution, Outcome, PipelineResult
from . import first_claim, protocol
from .first_claim import FirstClaim
from .lease import Lease, LeaseDeadline, in_time, now, share
from .protocol import Reconciled
from .scope import MongoScope
from .store import RecordStore

if TYPE_CHECKING:
    from pymongo.asynchronous.client_session import AsyncClientSession

    from .._plan.routes import HandlerRoute

__all__ = ["Attempts", "Deferral", "Invoke"]

Invoke = Callable[[int, MongoScope, Any], Awaitable[PipelineResult]]
"""``invoke(attempt, scope, payload)``: one middleware/guards/handler call, its verdict returned.
It must re-raise database errors for which :meth:`Inbox.passthrough` is true."""

_DUPLICATE = PipelineResult(Outcome.DUPLICATE)
_SUCCESS = PipelineResult(Outcome.SUCCESS)


class _Contended(Exception):
    """A first-time copy found a lease record: its transaction wrote nothing; take the lease claim."""

    span_outcome = "contended"  # what an attempt's span reports (no error: the lease claim follows)


class Deferral(Exception):
    """An operation failed in a way that defers the delivery (carries the verdict)."""

    error_type = "deferred"  # what an attempt's span reports

    def __init__(self, result: PipelineResult) -> None:
        super().__init__(result.reason)
        self.result = result


def operation_failed(exc: PyMongoError, where: str) -> Exception:
    """The exception an operation's database error turns into: a replay, or a deferral verdict."""
    if transaction_rules.classify_error(error_labels(exc), in_commit=False) is transaction_rules.ErrorStep.REPLAY:
        return Replay(f"{type(exc).__name__} in {where} (TransientTransactionError)")
    return Deferral(PipelineResult(Outcome.DEFERRED, ErrorCode.MONGO_ERROR, f"{type(exc).__name__}: {exc}"[:300]))


class Attempts:
    """Runs a delivery's attempts in transactions; one per inbox."""

    def __init__(self, store: RecordStore, outbox: ProcessOutbox, observer: Observer) -> None:
        self._store = store
        self._outbox = outbox
        self._observer = observer
        self._rules = store.rules

    async def run(self, route: HandlerRoute, lease: Lease, execution: Execution, payload: Any, invoke: Invoke) -> bool:
        """The replay loop: each pass is a fresh scope; transient failures replay the whole pipeline.

        True once ``execution.result`` is the verdict. False only for a first-time copy
        (``lease.first``) whose record turned out contended: the lease claim decides. A
        first-time copy's replay claims in its transaction again (its failed attempt wrote
        nothing), so a replay costs 2 + k commands on either path.
        """
        contended = False

        async def attempt() -> PipelineResult:
            nonlocal contended
            execution.attempts += 1
            if lease.lost:
                return PipelineResult(Outcome.DEFERRED, ErrorCode.LEASE_LOST, "the lease was lost between attempts")
            # The first attempt reuses the body decoded while preparing; a replay decodes
            # afresh so a handler that mutated its payload cannot leak into the replay.
            first = payload if execution.attempts == 1 else NOT_DECODED
            try:
                return await self._observer.inbox_attempt(
                    self._attempt(route, lease, execution, first, invoke),
                    execution.attempts,
                    execution.transient_replays,
                    first=lease.first,
                )
            except Deferral as deferral:
                return deferral.result
            except _Contended:
                execution.attempts -= 1  # no handler ran: the lease claim's attempt is the first
                contended = True
                return _DUPLICATE  # not a verdict: the lease claim decides

        async def stop(replay: Replay, replays: int) -> PipelineResult | None:
            execution.transient_replays = replays
            if protocol.outlived(now() - lease.started, self._store.lifetime) and not await self._may_try_again(lease):
                return PipelineResult(
                    Outcome.PERMANENT,
                    ErrorCode.TRANSACTION_EXPIRED,
                    f"the attempt's transaction outlived the server's transaction lifetime "
                    f"({self._store.lifetime:g} s) again; last: {replay}",
                )
            return None

        def spent(replay: Replay, replays: int) -> PipelineResult:
            return PipelineResult(
                Outcome.DEFERRED,
                ErrorCode.REPLAY_BUDGET_SPENT,
                f"{replays - 1} transient replays (budget {self._rules.replay_budget}); last: {replay}",
                replay.handler_error,
            )

        result = await transaction.replaying(
            attempt, self._rules, stop=stop, spent=spent, replays=execution.transient_replays
        )
        if contended:
            return False
        execution.result = result
        return True

    async def _may_try_again(self, lease: Lease) -> bool:
        """An attempt's transaction outlived the lifetime: count it in the record (it holds across
        deliveries) and in this delivery; the first expiry gets one more try, the second none."""
        lease.expirations += 1
        counted = await self._store.count(lease, protocol.EXPIRATIONS, bound=in_time(lease))
        return protocol.may_try_again_after_expiry(max(lease.expirations, counted or 0))

    async def _attempt(
        self, route: HandlerRoute, lease: Lease, execution: Execution, payload: Any, invoke: Invoke
    ) -> PipelineResult:
        store = self._store
        session = await transaction.start_transaction(store.client)
        try:
            lease.holding = True  # from the completion write until the commit or abort ends
            lease.started = now()
            if lease.first:
                found = await self._first_claim(session, route, lease)
                if found is FirstClaim.DUPLICATE:
                    # Commit, not abort: a majority commit of this read-only transaction waits
                    # until the snapshot that showed the completion is majority-committed, so a
                    # failover cannot roll back the completion this ACK relies on. The wait is
                    # bounded like every wait for the majority (docs/inbox.md, "Bounded waits").
                    try:
                        with pymongo.timeout(in_time(lease)):
                            await session.commit_transaction()
                    except PyMongoError:
                        discard_server_session(session)
                        raise _Contended from None  # not confirmed: the lease claim decides
                    return _DUPLICATE
                if found is FirstClaim.CONTENDED:
                    await self._store.abort(session)
                    raise _Contended
            else:
                bound = in_time(lease)
                try:
                    with pymongo.timeout(bound):
                        done = await store.records.update_one(
                            protocol.fence(lease.key, lease.owner, lease.token),
                            protocol.completion_update(retention_seconds=store.options.retention_seconds),
                            session=session,
                        )
                except PyMongoError as exc:
                    await self._store.abort(session)
                    if timed_out(exc):  # a wait before the handler ran: infrastructure, not a retry
                        raise Deferral(store.claim_failed(exc, bound)) from exc
                    raise operation_failed(exc, "the completion write") from exc
                if done.matched_count == 0:
                    await self._store.abort(session)
                    return PipelineResult(Outcome.DEFERRED, ErrorCode.LEASE_LOST, "the lease was taken over")
            scope: MongoScope | None = None
            outbox = self._outbox.writer(session, route.handler_id, lambda: scope is not None and scope.is_open)
            scope = MongoScope(session, store.database, outbox)
            try:
                result = await invoke(execution.attempts, scope, payload)
            except PyMongoError as exc:  # only what passthrough() let through: labelled transient
                await self._store.abort(session)
                failure = operation_failed(exc, "the handler")
                if isinstance(failure, Replay):
                    failure.handler_error = exc  # shown by the failure log if the budget runs out
                raise failure from exc
            finally:
                scope.close()
            if result.outcome is not Outcome.SUCCESS:
                await self._store.abort(session)
                return result
            result = await self._observer.inbox_commit(self._commit(session, lease, execution))
            if result is _SUCCESS and outbox.written:
                self._outbox.committed(outbox)  # dispatched after the commit; the ACK does not wait
            return result
        except asyncio.CancelledError:
            if lease.holding:  # cancelled from outside while its transaction was open
                lease.cancelled_age = now() - lease.started
            raise
        finally:
            lease.holding = False
            await session.end_session()

    async def _first_claim(self, session: AsyncClientSession, route: HandlerRoute, lease: Lease) -> FirstClaim:
        """A first-time copy's claim: the transaction's first write inserts the record completed, or finds it."""
        store = self._store
        update = first_claim.first_claim_update(
            route.handler_id,
            lease.event_id,
            lease.owner,
            now=store.now(),
            retention_seconds=store.options.retention_seconds,
        )
        bound = in_time(lease)
        try:
            with pymongo.timeout(bound):
                before = await store.records.find_one_and_update(
                    {"_id": lease.key}, update, upsert=True, projection={"state": 1}, session=session
                )
        except DuplicateKeyError:
            return FirstClaim.CONTENDED  # inserted meanwhile by someone else: the lease claim decides
        except PyMongoError as exc:
            if timed_out(exc):  # a wait before the handler ran: infrastructure, not a retry
                await self._store.abort(session)
                raise Deferral(store.claim_failed(exc, bound)) from exc
            if first_claim.first_claim_falls_back(error_labels(exc)):
                await self._store.abort(session)
                return FirstClaim.CONTENDED
            await self._store.abort(session)
            raise operation_failed(exc, "the claim in the transaction") from exc
        return first_claim.read_first_claim(before)

    async def _commit(self, session: AsyncClientSession, lease: Lease, execution: Execution) -> PipelineResult:
        """Commit; on an unknown result retry the same commit, then read the record (two separate loops).

        Each commit's wait for the majority is bounded (``maxTimeMS``): one that runs out is
        an unknown result, reconciled like a lost reply (docs/inbox.md, "Bounded waits").
        """
        if await transaction.commit(session, share(lease, self._rules.commit_retries + 2)) is None:
            return _SUCCESS
        execution.reconciliations += 1
        return await self._observer.inbox_reconcile(self._reconcile(session, lease))

    async def _reconcile(self, session: AsyncClientSession, lease: Lease) -> PipelineResult:
        """An unknown commit result: retry the same commit (bounded), then read the record."""
        if await transaction.retry_commit(session, self._rules, LeaseDeadline(lease)):
            return _SUCCESS
        try:
            record = await transaction.read_back(self._store.read_backs, lease.key, share(lease, 1))
        except PyMongoError:
            record = None  # unread: not known to be completed, so the next delivery decides
        verdict = protocol.reconcile(record, lease.owner, lease.token)
        if verdict is Reconciled.COMMITTED:
            return _SUCCESS
        if verdict is Reconciled.DUPLICATE:
            return _DUPLICATE
        return PipelineResult(
            Outcome.DEFERRED,
            ErrorCode.COMMIT_AMBIGUOUS,
            "the commit result stayed unknown and the record is not completed; the next delivery decides",
        )
