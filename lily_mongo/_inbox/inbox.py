"""The inbox: runs inbox handlers under the record protocol (docs/inbox.md).

For one delivery of handler ``H`` and event ``E`` (record ``_id`` ``"H|E"``):

0. **A first-time copy** (not redelivered; ``InboxOptions.claim_in_transaction``)
   claims inside its attempt's transaction (:mod:`.attempts`): absent, the handler
   runs and the commit makes record and effects visible together, with no lease to
   renew or release; completed, a duplicate; a lease record, or a transient error:
   abort and continue with the claim below.
1. **Claim** (:mod:`.store`): one ``find_one_and_update(upsert=True)`` on the server
   clock decides: completed → duplicate → ACK; leased by another live owner →
   deferred (its deferral counter incremented in the same update); otherwise leased
   to this attempt with a new fencing token.
2. **Attempts** (:mod:`.attempts`): a fresh session, transaction, scope and handler
   call each time; the transaction's first write turns the record to completed, fenced.
3. **Heartbeat** (:mod:`.heartbeat`): renews the leases of running deliveries, fenced,
   and never while their transaction holds the record.
4. **Replay** and 5. **reconcile**: the transaction skeleton's (``lily_mongo._mongo.transactions``).
6. **Release** on the failure paths: a handler failure deletes the record (fenced),
   then the engine hands off; a deferral expires the lease and counts the deferral.

Budget (docs/inbox.md, commands per delivery): a first-time delivery whose handler makes ``k``
writes sends ``2 + k`` commands (the claim in the transaction, k writes, commit), a redelivered
one ``3 + k`` (claim, completion, k writes, commit); a redelivered copy of a completed event
sends 1 (the claim), a first-time one 2 (the claim in the transaction, its read-only commit).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pymongo.errors import PyMongoError

from .._errors import ErrorCode
from .._headers import DELIVERY_COUNT_HEADER
from .._mongo import error_labels
from .._mongo import rules as transaction_rules
from .._observer import NO_OBSERVER, Observer
from .._outbox import ProcessOutbox
from .._tasks import TaskSet
from .._verdicts import Execution, Outcome, PipelineResult
from . import first_claim, protocol
from .attempts import Attempts, Invoke
from .batch import BatchAttempts
from .heartbeat import LeaseHeartbeat
from .lease import Lease, in_time, now, retrieved
from .options import InboxOptions
from .protocol import ClaimKind
from .store import RecordStore

if TYPE_CHECKING:
    from pymongo import AsyncMongoClient

    from .._plan.extractors import RawDelivery
    from .._plan.routes import HandlerRoute

__all__ = ["Inbox"]

log = logging.getLogger("lily_mongo")

_DUPLICATE = PipelineResult(Outcome.DUPLICATE)


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
        self._options = options
        self._observer = observer
        self._store = RecordStore(client, database, options, deadlines=deadlines)
        self._attempts = Attempts(self._store, outbox, observer)
        assert options.heartbeat_seconds is not None
        self._heartbeat = LeaseHeartbeat(self._store, options.heartbeat_seconds)
        # Owner ids: "<consumer>:<process instance>:<attempt number>", unique without a uuid per delivery.
        self._owner_prefix = f"{owner_prefix[:64]}:{uuid.uuid4().hex[:12]}:"
        self._owner_numbers = itertools.count(1)
        # A batch handler's sets of entries, each in one transaction (docs/handlers.md, "Batch handlers").
        self.batches = BatchAttempts(self._store, outbox, observer, self._new_owner)

    @property
    def records(self) -> str:
        """The name of the record collection."""
        return self._options.records

    @property
    def transaction_lifetime(self) -> float:
        """The server's transaction lifetime in seconds, as read at start (docs/inbox.md)."""
        return self._store.lifetime

    def wait_for(self, queue: str) -> float:
        """How long a write of a ``queue`` delivery's record outside a transaction may wait (its ``maxTimeMS``)."""
        return self._store.wait_for(queue)

    async def prepare(self) -> None:
        """Read the server's clock and transaction lifetime; create (or verify) the TTL index."""
        await self._store.prepare()

    def start(self, tasks: TaskSet) -> None:
        """Start the heartbeat, a task of the supervisor's."""
        self._heartbeat.start(tasks)

    @staticmethod
    def passthrough(exc: BaseException) -> bool:
        """Database errors the handler's verdict must not swallow: the replay loop handles them."""
        return isinstance(exc, PyMongoError) and transaction_rules.ErrorStep.REPLAY is transaction_rules.classify_error(
            error_labels(exc), in_commit=False
        )

    async def execute(self, route: HandlerRoute, delivery: RawDelivery, payload: Any, invoke: Invoke) -> Execution:
        """Run one delivery under the record protocol; ``payload`` is the body decoded while preparing."""
        event_id = str(delivery.envelope.event_id)
        handler_id = route.handler_id
        key = protocol.record_key(handler_id, event_id)
        wait = self._store.wait_for(route.queue)
        deadline = self._store.deadlines.get(route.queue)
        until = None if deadline is None else now() + deadline
        execution = Execution(PipelineResult(Outcome.DEFERRED, ErrorCode.REPLAY_BUDGET_SPENT, ""))
        expirations = 0
        if self._options.claim_in_transaction and first_claim.claims_in_transaction(
            redelivered=delivery.redelivered, delivery_count=delivery.headers.get(DELIVERY_COUNT_HEADER)
        ):
            # A first-time copy: the claim is the transaction's first write (2 + k commands).
            # It leaves no lease behind: nothing to renew, nothing to release.
            first = Lease(
                key,
                self._new_owner(),
                1,
                now(),
                wait,
                until,
                handler_id=handler_id,
                event_id=event_id,
                first=True,
            )
            if await self._first_time(route, first, execution, payload, invoke):
                return execution
            expirations = first.expirations
        owner = self._new_owner()
        claimant = Lease(key, owner, 0, now(), wait, until, handler_id=handler_id, event_id=event_id)
        bound = in_time(claimant)
        try:
            claim = await self._observer.inbox_claim(self._store.claim(key, handler_id, event_id, owner, bound))
        except PyMongoError as exc:
            # The database is unreachable, refused, or kept the claim waiting past its maxTimeMS
            # behind a transaction that holds the record: infrastructure, not an application
            # failure. Requeue (bounded, counted) without running the handler.
            execution.result = self._store.claim_failed(exc, bound)
            await self._count_into(execution, claimant)
            return execution
        if claim.kind is ClaimKind.DUPLICATE:
            execution.result = _DUPLICATE
            return execution
        if claim.kind is ClaimKind.HELD:
            execution.result = PipelineResult(
                Outcome.DEFERRED, ErrorCode.LEASE_HELD, "the lease is held by another live owner"
            )
            execution.deferrals, execution.backoff_limit = claim.deferrals, claim.remaining
            return execution
        lease = Lease(
            key,
            owner,
            claim.token,
            now(),
            wait,
            until,
            handler_id=handler_id,
            event_id=event_id,
            expirations=expirations,
        )
        await self._leased(route, lease, claim, execution, payload, invoke)
        return execution

    async def _first_time(
        self, route: HandlerRoute, first: Lease, execution: Execution, payload: Any, invoke: Invoke
    ) -> bool:
        """A first-time copy's attempts; False when its record turned out contended (the lease claim decides)."""
        try:
            done = await self._attempts.run(route, first, execution, payload, invoke)
        except asyncio.CancelledError:
            await self._store.count_if_outlived(first)
            raise
        if done and execution.result.outcome is Outcome.DEFERRED:
            # No record of its own counts this deferral: a counting record does.
            await self._count_into(execution, first)
        return done

    async def _leased(
        self,
        route: HandlerRoute,
        lease: Lease,
        claim: protocol.Claim,
        execution: Execution,
        payload: Any,
        invoke: Invoke,
    ) -> None:
        """The attempts of a delivery that holds the lease, then the release its verdict asks for."""
        self._heartbeat.leases.add(lease)
        settled = False
        try:
            if protocol.may_try_again_after_expiry(claim.expirations):
                settled = await self._attempts.run(route, lease, execution, payload, invoke)
            else:  # its attempts outlived the lifetime twice already: no third (docs/inbox.md)
                execution.result = PipelineResult(
                    Outcome.PERMANENT,
                    ErrorCode.TRANSACTION_EXPIRED,
                    f"{claim.expirations} attempts outlived the server's transaction lifetime "
                    f"({self._store.lifetime:g} s)",
                )
                settled = True
        finally:
            self._heartbeat.leases.discard(lease)
            outcome = execution.result.outcome if settled else None
            if outcome is not Outcome.SUCCESS and outcome is not Outcome.DUPLICATE:
                await self._release(lease, outcome, execution)

    async def _release(self, lease: Lease, outcome: Outcome | None, execution: Execution) -> None:
        """Release the lease even if this task is being cancelled. Cancelled from outside (deadline,
        forced shutdown), the attempt is not a deferral: the engine settles it otherwise, so the
        record is released without a count."""
        release = asyncio.ensure_future(self._store.release(lease, outcome))
        release.add_done_callback(retrieved)  # its failure is logged below, unless cancelled meanwhile
        try:
            deferrals = await asyncio.shield(release)
        except PyMongoError:
            log.warning("releasing an inbox lease failed; it will expire", exc_info=True)
            deferred = outcome is Outcome.DEFERRED
            deferrals = await self._store.count(lease, protocol.DEFERRALS, bound=in_time(lease)) if deferred else None
        if deferrals is not None:
            execution.deferrals = deferrals

    async def count_deferral(self, route: HandlerRoute, delivery: RawDelivery) -> int | None:
        """Count a deferral the inbox did not decide (a forced shutdown's) in the event's record.

        Returns the event's deferrals so far, or None when the database could not count it
        (the caller's in-process count is the fallback).
        """
        event_id = str(delivery.envelope.event_id)
        key = protocol.record_key(route.handler_id, event_id)
        lease = Lease(key, "", 0, now(), self.wait_for(route.queue), handler_id=route.handler_id, event_id=event_id)
        return await self._store.count(lease, protocol.DEFERRALS)

    def _new_owner(self) -> str:
        return f"{self._owner_prefix}{next(self._owner_numbers)}"

    async def _count_into(self, execution: Execution, lease: Lease) -> None:
        """Count the deferral ``execution`` concluded in the record; on failure the engine's count stands.

        Counted before the delivery's deadline, as the claim is: the handler has not run.
        """
        count = await self._store.count(lease, protocol.DEFERRALS, bound=in_time(lease))
        if count is not None:
            execution.deferrals = count
