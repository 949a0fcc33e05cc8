"""A batch handler's transaction: many events, each with its own inbox record (docs/handlers.md, "Batch handlers").

One run is one set of entries in one transaction, replayed as a whole on a transient error (the
transaction skeleton, :mod:`lily_mongo._mongo.transactions`):

1. the snapshot read of every entry's record is the transaction's first operation
   (:mod:`.batch_claim`): completed records are duplicates, lease and counting records leave the
   batch for the single-event lease path, absent ones are claimed;
2. one ``insert_many`` of the claimed entries' records, completed, before the handler runs: on
   MongoDB a concurrent transaction inserting one of them fails with a labelled ``WriteConflict``,
   and a record committed after the snapshot fails the insert with ``DuplicateKey`` (which aborts
   the transaction): either replays the batch, whose new snapshot finds the record;
3. the handler, once, with the claimed entries; an entry it failed (``Batch.fail``) has its record
   deleted in the same transaction (one ``delete``), so it commits nothing;
4. the commit makes every remaining record complete at once; an unknown result is retried, then
   each record is read back with majority read concern and decides its own event.

A happy batch costs four commands whatever its size: the read, the records' insert, the handler's
writes (one ``insert_many``, say), the commit. What a whole-batch failure means (a verdict for every
entry, or a bisection) is the engine's decision (``lily_mongo._engine.batches``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pymongo
from pymongo.errors import BulkWriteError, DuplicateKeyError, PyMongoError

from .._errors import ErrorCode
from .._mongo import timed_out
from .._mongo import transactions as transaction
from .._mongo.transactions import Replay
from .._observer import Observer
from .._outbox import ProcessOutbox
from .._plan.batch import Batch, BatchEntry
from .._verdicts import Outcome, PipelineResult
from . import batch_claim, first_claim, protocol
from .attempts import Deferral, operation_failed
from .first_claim import FirstClaim
from .lease import Lease, LeaseDeadline, in_time, now, share
from .protocol import Reconciled
from .scope import MongoScope
from .store import RecordStore

if TYPE_CHECKING:
    from pymongo.asynchronous.client_session import AsyncClientSession

    from .._plan.routes import HandlerRoute

__all__ = ["BatchAttempts", "BatchRun", "InvokeBatch"]

InvokeBatch = Callable[[int, MongoScope, Batch[Any]], Awaitable[PipelineResult]]
"""``invoke(attempt, scope, batch)``: one handler call with the batch; labelled transaction errors re-raised."""

_DUPLICATE = PipelineResult(Outcome.DUPLICATE)
_SUCCESS = PipelineResult(Outcome.SUCCESS)
_DUPLICATE_KEY = 11000


@dataclass(slots=True)
class BatchRun:
    """What one run of a set of entries concluded (indices into the run's entries)."""

    verdicts: dict[int, PipelineResult] = field(default_factory=dict)  # final for this event
    contended: list[int] = field(default_factory=list)  # lease or counting records: the lease path decides
    failure: PipelineResult | None = None  # the handler failed: the entries without a verdict did not commit
    failed: dict[int, BaseException] = field(default_factory=dict)  # what Batch.fail recorded (not committed)
    handled: list[int] = field(default_factory=list)  # the entries the handler was called with, last attempt
    # Duplicates seen in a snapshot whose transaction was aborted: no majority commit confirmed them, so they
    # run again (a read-only transaction that commits) rather than being ACKed on that read alone.
    unconfirmed: list[int] = field(default_factory=list)
    split: bool = False  # the transaction outlived the server's lifetime: run the entries in smaller sets
    attempts: int = 0
    transient_replays: int = 0
    reconciliations: int = 0


class BatchAttempts:
    """Runs sets of a batch handler's entries in transactions; one per inbox."""

    def __init__(
        self,
        store: RecordStore,
        outbox: ProcessOutbox,
        observer: Observer,
        new_owner: Callable[[], str],
    ) -> None:
        self._store = store
        self._outbox = outbox
        self._observer = observer
        self._new_owner = new_owner

    async def run(
        self, route: HandlerRoute, entries: Sequence[BatchEntry[Any]], invoke: InvokeBatch, *, until: float | None
    ) -> BatchRun:
        """Run ``entries`` in one transaction, replayed on transient errors within the replay budget;
        ``until`` is the batch's deadline (the event loop's clock), which bounds every wait."""
        store = self._store
        keys = [protocol.record_key(route.handler_id, entry.event_id) for entry in entries]
        lease = Lease(
            keys[0], self._new_owner(), 1, now(), store.wait_for(route.queue), until, handler_id=route.handler_id
        )
        lease.first = True
        run = BatchRun()

        async def attempt() -> BatchRun:
            run.attempts += 1
            try:
                return await self._attempt(route, entries, keys, lease, run, invoke)
            except Deferral as deferral:
                return self._every(run, entries, deferral.result)

        async def stop(replay: Replay, replays: int) -> BatchRun | None:
            run.transient_replays = replays
            if not protocol.outlived(now() - lease.started, store.lifetime):
                return None
            if len(entries) > 1:  # a smaller set runs for a shorter time: the engine splits it
                run.split = True
                return run
            lease.key, lease.event_id = keys[0], str(entries[0].event_id)
            lease.expirations += 1
            counted = await store.count(lease, protocol.EXPIRATIONS, bound=in_time(lease))
            if protocol.may_try_again_after_expiry(max(lease.expirations, counted or 0)):
                return None
            reason = f"the batch's transaction outlived the server's transaction lifetime ({store.lifetime:g} s) again"
            return self._every(run, entries, PipelineResult(Outcome.PERMANENT, ErrorCode.TRANSACTION_EXPIRED, reason))

        def spent(replay: Replay, replays: int) -> BatchRun:
            run.transient_replays = replays
            reason = f"{replays - 1} transient replays (budget {self._store.rules.replay_budget}); last: {replay}"
            return self._every(
                run,
                entries,
                PipelineResult(Outcome.DEFERRED, ErrorCode.REPLAY_BUDGET_SPENT, reason, replay.handler_error),
            )

        return await transaction.replaying(attempt, self._store.rules, stop=stop, spent=spent)

    @staticmethod
    def _every(run: BatchRun, entries: Sequence[BatchEntry[Any]], result: PipelineResult) -> BatchRun:
        """``result`` for every entry but the contended ones: nothing committed, so a duplicate its snapshot
        showed is not confirmed either (it is requeued, and its next delivery finds the completion)."""
        run.failed.clear()
        run.unconfirmed.clear()
        for i in range(len(entries)):
            if i not in run.contended:
                run.verdicts[i] = result
        return run

    async def _attempt(
        self,
        route: HandlerRoute,
        entries: Sequence[BatchEntry[Any]],
        keys: list[str],
        lease: Lease,
        run: BatchRun,
        invoke: InvokeBatch,
    ) -> BatchRun:
        store = self._store
        run.verdicts.clear()
        run.contended.clear()
        run.failed.clear()
        run.unconfirmed.clear()
        run.failure = None
        session = await transaction.start_transaction(store.client)
        try:
            lease.holding = True
            lease.started = now()
            found = await self._read(session, keys, lease)
            claimed: list[int] = []
            for i, key in enumerate(keys):
                kind = first_claim.read_first_claim(found.get(key))
                if kind is FirstClaim.DUPLICATE:
                    run.verdicts[i] = _DUPLICATE
                elif kind is FirstClaim.CONTENDED:
                    run.contended.append(i)
                else:
                    claimed.append(i)
            run.handled = claimed
            if not claimed:
                if run.verdicts:  # duplicates only: a majority commit confirms the snapshot that showed them
                    await self._commit(session, keys, [], lease, run)
                else:
                    await self._store.abort(session)
                return run
            await self._claim(session, route, [(keys[i], str(entries[i].event_id)) for i in claimed], lease)
            batch = Batch([self._fresh(route, entries[i], run.attempts) for i in claimed])
            outbox = self._outbox.writer(session, route.handler_id, lambda: scope.is_open)
            scope = MongoScope(session, store.database, outbox)
            try:
                result = await invoke(run.attempts, scope, batch)
            except PyMongoError as exc:  # only what passthrough() let through: labelled transient
                await self._store.abort(session)
                replay = Replay(f"{type(exc).__name__} in the batch handler (TransientTransactionError)")
                replay.handler_error = exc
                raise replay from exc
            finally:
                scope.close()
            if result.outcome is not Outcome.SUCCESS:
                await self._store.abort(session)
                run.failure = result
                run.unconfirmed = [i for i, verdict in run.verdicts.items() if verdict is _DUPLICATE]
                for i in run.unconfirmed:
                    del run.verdicts[i]
                return run
            failed = [i for i, entry in zip(claimed, batch, strict=True) if batch.failure_of(entry) is not None]
            if failed:
                await self._unclaim(session, [keys[i] for i in failed], lease)
                for i, entry in zip(claimed, batch, strict=True):
                    error = batch.failure_of(entry)
                    if error is not None:
                        run.failed[i] = error  # its verdict is the engine's, as for any handler error
            committing = [i for i in claimed if i not in failed]
            if await self._commit(session, keys, committing, lease, run) and outbox.written:
                self._outbox.committed(outbox)  # dispatched after the commit; the ACKs do not wait
            return run
        finally:
            lease.holding = False
            await session.end_session()

    @staticmethod
    def _fresh(route: HandlerRoute, entry: BatchEntry[Any], attempt: int) -> BatchEntry[Any]:
        """The entry as the handler gets it: a replay decodes the body afresh (a handler that mutated it
        cannot leak into the replay)."""
        if attempt == 1 or route.terminal is None or route.terminal.extractor is None:
            return entry
        body = route.terminal.extractor.extract(entry.delivery)
        return BatchEntry(entry.event_id, entry.retry_count, body, entry.delivery)

    async def _read(self, session: AsyncClientSession, keys: list[str], lease: Lease) -> dict[str, Any]:
        """The transaction's first operation: every entry's record, in its snapshot."""
        bound = in_time(lease)
        try:
            with pymongo.timeout(bound):
                found = await self._store.records.find(
                    {"_id": {"$in": keys}}, projection={"state": 1}, session=session
                ).to_list()
        except PyMongoError as exc:
            await self._store.abort(session)
            raise self._before_handler(exc, bound, "the batch's record read") from exc
        return batch_claim.by_key(found)

    async def _claim(
        self, session: AsyncClientSession, route: HandlerRoute, events: list[tuple[str, str]], lease: Lease
    ) -> None:
        """Insert the claimed entries' records, completed, in the transaction: before the handler runs."""
        store = self._store
        records = batch_claim.batch_records(
            route.handler_id, events, lease.owner, now=store.now(), retention_seconds=store.options.retention_seconds
        )
        bound = in_time(lease)
        try:
            with pymongo.timeout(bound):
                await store.records.insert_many(records, session=session)
        except (DuplicateKeyError, BulkWriteError) as exc:
            await self._store.abort(session)
            if isinstance(exc, DuplicateKeyError) or _duplicate_key(exc):
                # Committed after the snapshot by another delivery: the replay's snapshot finds it.
                raise Replay("a record of the batch was committed after its snapshot (DuplicateKey)") from exc
            raise self._before_handler(exc, bound, "the batch's claim") from exc
        except PyMongoError as exc:
            await self._store.abort(session)
            raise self._before_handler(exc, bound, "the batch's claim") from exc

    async def _unclaim(self, session: AsyncClientSession, keys: list[str], lease: Lease) -> None:
        """Delete the records of entries the handler failed, in the transaction: they commit nothing."""
        try:
            with pymongo.timeout(share(lease, self._store.rules.commit_retries + 3)):
                await self._store.records.delete_many({"_id": {"$in": keys}}, session=session)
        except PyMongoError as exc:
            await self._store.abort(session)
            raise operation_failed(exc, "the failed entries' release") from exc

    def _before_handler(self, exc: PyMongoError, bound: float, where: str) -> Exception:
        if timed_out(exc):  # a wait before the handler ran: infrastructure, not a retry
            return Deferral(self._store.claim_failed(exc, bound))
        return operation_failed(exc, where)

    async def _commit(
        self, session: AsyncClientSession, keys: list[str], committing: list[int], lease: Lease, run: BatchRun
    ) -> bool:
        """Commit; True once committed. An unknown result is retried, then every record read back decides its
        own event (committed, a duplicate, or ambiguous: deferred)."""
        if await transaction.commit(session, share(lease, self._store.rules.commit_retries + 2)) is None:
            for i in committing:
                run.verdicts[i] = _SUCCESS
            return True
        run.reconciliations += 1
        if await transaction.retry_commit(session, self._store.rules, LeaseDeadline(lease)):
            for i in committing:
                run.verdicts[i] = _SUCCESS
            return True
        deciding = [*committing, *(i for i, v in run.verdicts.items() if v is _DUPLICATE)]
        try:
            records = await transaction.read_backs(self._store.read_backs, [keys[i] for i in deciding], share(lease, 1))
        except PyMongoError:
            records = {}  # unread: not known to be completed, so the next delivery decides
        ambiguous = PipelineResult(
            Outcome.DEFERRED,
            ErrorCode.COMMIT_AMBIGUOUS,
            "the batch's commit result stayed unknown and the record is not completed; the next delivery decides",
        )
        committed = False
        for i in deciding:
            verdict = protocol.reconcile(records.get(keys[i]), lease.owner, lease.token)
            if verdict is Reconciled.COMMITTED:
                run.verdicts[i], committed = _SUCCESS, True
            else:
                run.verdicts[i] = _DUPLICATE if verdict is Reconciled.DUPLICATE else ambiguous
        return committed

    async def count_deferrals(
        self, route: HandlerRoute, entries: Sequence[BatchEntry[Any]], wait: float
    ) -> list[int | None]:
        """Count one deferral in each entry's record (a counting record where there is none), concurrently;
        None where the database could not count it (the engine's own count stands in)."""

        def lease_of(entry: BatchEntry[Any]) -> Lease:
            key = protocol.record_key(route.handler_id, entry.event_id)
            return Lease(key, "", 0, now(), wait, handler_id=route.handler_id, event_id=str(entry.event_id))

        return list(
            await asyncio.gather(*(self._store.count(lease_of(entry), protocol.DEFERRALS) for entry in entries))
        )


def _duplicate_key(exc: BulkWriteError) -> bool:
    errors = (exc.details or {}).get("writeErrors") or []
    return any(error.get("code") == _DUPLICATE_KEY for error in errors)
