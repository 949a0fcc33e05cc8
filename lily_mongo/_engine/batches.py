"""Batch handlers in the engine: forming batches, running them, and each event's own verdict (docs/handlers.md,
"Batch handlers").

A delivery of a batch handler is admitted, prepared (envelope, handler, body decoded) and settled like any
other, in its own worker; only its execution differs: it joins its handler's forming batch
(:meth:`Batcher.join`) and waits for the batch's verdict on its event. A batch is dispatched once it holds
``max_size`` deliveries or ``max_wait`` seconds after its first, at once when intake stops (a graceful
shutdown never leaves a batch half-formed), and runs once one of the queue's ``concurrency`` batch slots
is free, under the queue's deadline for the whole batch.

Each event keeps its own fate (:meth:`Batcher._execute`):

* a copy of an event already in the batch waits for the first copy: a duplicate once it committed;
* events the handler failed (``Batch.fail``) get their own verdict; the others commit;
* ``BatchItemFailed(entry, error)``: that entry gets ``error``'s verdict, the rest run again without it;
* a ``QueueHandlerError`` for the whole batch is every event's verdict;
* any other exception is *bisected*: the batch runs again as two halves, each its own transaction, until
  the failing events are alone (a batch of ``n`` with one poison event: at most ``2 * ceil(log2 n)``
  more runs); a poison event alone gets the handler's failure, every other event commits once;
* an event whose record is a lease or a counting record runs the single-event lease path.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from .._errors import ErrorCode, QueueHandlerError
from .._inbox.batch import BatchRun
from .._observer import Observer
from .._plan.batch import Batch, BatchEntry, BatchItemFailed, batch_permits
from .._plan.extractors import NOT_DECODED
from .._plan.plan import Plan
from .._plan.routes import HandlerRoute
from .._tasks import TaskSet
from .._text import truncate_utf8
from .._verdicts import SUCCESS, Execution, Outcome, PipelineResult
from ..bounds import BOUNDS
from .barrier import SettleBarrier
from .delivery import SETTLING, Delivery
from .dispatch import Prepared, Services, invoke
from .queues import QueueState

if TYPE_CHECKING:
    from .._inbox import Inbox, MongoScope

__all__ = ["BatchEngine", "Batcher"]

log = logging.getLogger("lily_mongo")

_DUPLICATE = PipelineResult(Outcome.DUPLICATE)


class BatchEngine(Protocol):
    """What the batches need of the engine that owns them."""

    plan: Plan
    queues: dict[str, QueueState]
    tasks: TaskSet
    inbox: Inbox | None
    observer: Observer
    services: Services

    @property
    def accepting(self) -> bool: ...


@dataclass(slots=True, eq=False)
class _Member:
    delivery: Delivery
    prepared: Prepared
    entry: BatchEntry[Any]
    future: asyncio.Future[Execution]
    attempts: int = 0
    replays: int = 0
    reconciliations: int = 0


@dataclass(slots=True, eq=False)
class _Forming:
    route: HandlerRoute
    members: list[_Member] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None


class Batcher:
    """The batches of one engine: forming per batch handler, running within each queue's concurrency."""

    def __init__(self, engine: BatchEngine) -> None:
        self._engine = engine
        self._forming: dict[str, _Forming] = {}  # by handler id
        self._slots: dict[str, asyncio.Semaphore] = {}  # by queue: its concurrency, in batches
        self._running: set[asyncio.Task[Any]] = set()
        self._forced = False
        permits: dict[str, int] = {}
        for route in engine.plan.handlers:
            if route.batch is not None:
                options = engine.queues[route.queue].options
                permits[route.queue] = max(permits.get(route.queue, 0), batch_permits(options, route.batch))
        for name, count in permits.items():
            # Deliveries held at once: the queue's running batches and one forming (docs/configuration.md).
            engine.queues[name].free_permits = count

    async def join(self, delivery: Delivery, prepared: Prepared) -> Execution:
        """Add a prepared delivery to its handler's forming batch; its execution once the batch ran."""
        route = prepared.route
        assert route.batch is not None
        envelope = prepared.delivery.envelope
        loop = asyncio.get_running_loop()
        member = _Member(
            delivery,
            prepared,
            BatchEntry(envelope.event_id, envelope.retry_count, prepared.payload, prepared.delivery),
            loop.create_future(),
        )
        forming = self._forming.get(route.handler_id)
        if forming is None:
            forming = self._forming[route.handler_id] = _Forming(route)
            forming.timer = loop.call_later(route.batch.max_wait, self._dispatch, route.handler_id)
        forming.members.append(member)
        if len(forming.members) >= route.batch.max_size or not self._engine.accepting:
            self._dispatch(route.handler_id)
        execution = await member.future
        delivery.stage = SETTLING
        return execution

    def flush(self) -> None:
        """Dispatch every forming batch now (intake stopped: nothing more will join them)."""
        for handler_id in list(self._forming):
            self._dispatch(handler_id)

    def force_notice(self) -> None:
        """The force notice: running batches are cancelled; their deliveries are deferred (``SHUTDOWN``)."""
        self._forced = True
        for task in list(self._running):
            task.cancel()

    def _dispatch(self, handler_id: str) -> None:
        forming = self._forming.pop(handler_id, None)
        if forming is None:
            return
        if forming.timer is not None:
            forming.timer.cancel()
        self._engine.tasks.spawn(self._run(forming.route, forming.members), name="lily-batch")

    def _slot(self, queue: str) -> asyncio.Semaphore:
        slot = self._slots.get(queue)
        if slot is None:
            slot = self._slots[queue] = asyncio.Semaphore(self._engine.queues[queue].options.concurrency)
        return slot

    async def _run(self, route: HandlerRoute, members: list[_Member]) -> None:
        """One batch: wait for a slot, execute under the deadline, hand each delivery its execution."""
        executions: list[Execution] | None = None
        try:
            async with self._slot(route.queue):
                started = time.monotonic()
                for member in members:
                    member.delivery.executing_since = started
                executions = await self._engine.observer.batch(
                    self._within_deadline(route, members),
                    route.queue,
                    len(members),
                    [member.delivery.trace for member in members],
                )
        finally:
            waiting = [m for m in members if not m.future.done()]
            options = self._engine.queues[route.queue].options
            barrier = SettleBarrier(len(waiting), options.deadline)
            for i, member in enumerate(members):
                if member.future.done():
                    continue
                if executions is None:  # this task was cancelled: the deliveries end unresolved
                    member.future.cancel()
                    continue
                member.delivery.barrier = barrier
                member.future.set_result(executions[i])

    async def _within_deadline(self, route: HandlerRoute, members: list[_Member]) -> list[Execution]:
        """The batch under the queue's deadline (docs/lifecycle.md, section 5, for the whole batch): cancelled
        past it, dropped past the cooperation window after that; every event then retries (timeout)."""
        qs = self._engine.queues[route.queue]
        options = qs.options
        task = self._engine.tasks.spawn(self._execute(route, members), name="lily-batch-run")
        self._running.add(task)
        try:
            done, _ = await asyncio.wait({task}, timeout=options.deadline)
            if not done:
                log.warning(
                    "batch of %d deliveries exceeded the delivery deadline of %g s; cancelled (queue=%s handler=%s)",
                    len(members),
                    options.deadline,
                    options.name,
                    route.handler_id,
                )
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=options.cooperation_window)
                if not done or task.cancelled() or task.exception() is not None:
                    if not done:
                        qs.counters.abandoned += len(members)
                    reason = f"batch of {len(members)} exceeded the delivery deadline of {options.deadline:g} s"
                    timeout = PipelineResult(Outcome.RETRYABLE, ErrorCode.HANDLER_TIMEOUT, reason)
                    return [Execution(timeout, attempts=max(m.attempts, 1)) for m in members]
            if task.cancelled() and self._forced:
                return await self._shut_down(route, members)
            if not task.cancelled() and task.exception() is not None:  # never expected: requeue, say why
                log.error("batch of %d deliveries failed unexpectedly", len(members), exc_info=task.exception())
                failed = PipelineResult(Outcome.RETRYABLE, ErrorCode.HANDLER_FAILED, repr(task.exception())[:300])
                return [Execution(failed, attempts=max(m.attempts, 1)) for m in members]
            executions: list[Execution] = task.result()
            return executions
        finally:
            self._running.discard(task)

    async def _shut_down(self, route: HandlerRoute, members: list[_Member]) -> list[Execution]:
        """A forced shutdown cancelled the batch: every event is requeued, its deferral counted in its record."""
        reason = "cancelled by a forced shutdown"
        counts: Sequence[int | None] = [None] * len(members)
        inbox = self._engine.inbox
        if route.guarantee == "inbox" and inbox is not None:
            counts = await inbox.batches.count_deferrals(route, [m.entry for m in members], inbox.wait_for(route.queue))
        shutdown = PipelineResult(Outcome.DEFERRED, ErrorCode.SHUTDOWN, reason)
        return [
            Execution(shutdown, attempts=max(m.attempts, 1), deferrals=c or 0)
            for m, c in zip(members, counts, strict=True)
        ]

    # -- each event's verdict -------------------------------------------------------------------

    async def _execute(self, route: HandlerRoute, members: list[_Member]) -> list[Execution]:
        """Run the batch to a verdict per event: sets of entries in transactions, bisected on failure."""
        results: dict[int, PipelineResult] = {}
        leaders: dict[uuid.UUID, int] = {}
        followers: list[tuple[int, int]] = []
        for i, member in enumerate(members):
            leader = leaders.setdefault(member.entry.event_id, i)
            if leader != i:
                followers.append((i, leader))  # a second copy in the same batch: the first decides
        contended: list[int] = []
        sets = [list(leaders.values())]
        until = asyncio.get_running_loop().time() + self._engine.queues[route.queue].options.deadline
        while sets:
            subset = sets.pop()
            run = await self._run_once(route, members, subset, until)
            for i in subset:
                members[i].attempts += run.attempts
                members[i].replays += run.transient_replays
                members[i].reconciliations += run.reconciliations
            for j, verdict in run.verdicts.items():
                results[subset[j]] = verdict
            for j, error in run.failed.items():
                results[subset[j]] = self._verdict_of(route, error)
            contended += [subset[j] for j in run.contended]
            again = [subset[j] for j in run.unconfirmed]  # duplicates an aborted transaction showed
            rest = [i for i in subset if i not in results and i not in contended and i not in again]
            sets += self._next_sets(route, members, rest, run, results)
            if again:
                sets.append(again)
        executions = {i: self._execution(members[i], results[i]) for i in results}
        executions |= await self._leased(route, members, contended)
        for i, leader in followers:
            first = executions[leader].result.outcome
            if first is Outcome.SUCCESS or first is Outcome.DUPLICATE:
                executions[i] = self._execution(members[i], _DUPLICATE)
            else:
                reason = (
                    f"another copy of this event in the same batch did not commit ({executions[leader].result.code})"
                )
                executions[i] = self._execution(
                    members[i], PipelineResult(Outcome.DEFERRED, ErrorCode.LEASE_HELD, reason)
                )
        await self._count_deferrals(route, members, executions)
        return [executions[i] for i in range(len(members))]

    def _next_sets(
        self,
        route: HandlerRoute,
        members: list[_Member],
        rest: list[int],
        run: BatchRun,
        results: dict[int, PipelineResult],
    ) -> list[list[int]]:
        """What runs next after a run left ``rest`` without a verdict (a failure, or a split)."""
        if not rest:
            return []
        failure = run.failure
        if run.split or failure is None:
            return _halves(rest) if len(rest) > 1 else [rest]
        error = failure.exception
        if isinstance(error, BatchItemFailed):
            named = next((i for i in rest if members[i].entry.event_id == error.entry.event_id), None)
            if named is not None:
                results[named] = self._verdict_of(route, error.error)
                return [[i for i in rest if i != named]] if len(rest) > 1 else []
        if len(rest) == 1 or error is None or isinstance(error, QueueHandlerError):
            for i in rest:  # a verdict for the whole batch, or a poison event isolated
                results[i] = failure
            return []
        return _halves(rest)  # an exception naming no entry: bisect

    async def _run_once(self, route: HandlerRoute, members: list[_Member], subset: list[int], until: float) -> BatchRun:
        """One set of entries: in one transaction (inbox), or one call (at least once)."""
        options = self._engine.queues[route.queue].options
        first = members[subset[0]].prepared.delivery
        inbox = self._engine.inbox
        unknown: Literal["retryable", "permanent"] = options.unknown_errors
        entries = [self._entry(route, members[i]) for i in subset]
        if route.guarantee == "inbox" and inbox is not None:

            def call(attempt: int, scope: MongoScope, batch: Batch[Any]) -> Any:
                return invoke(
                    route,
                    first,
                    attempt=attempt,
                    scope=scope,
                    payload=batch,
                    unknown_errors=unknown,
                    passthrough=inbox.passthrough,
                    services=self._engine.services,
                )

            return await inbox.batches.run(route, entries, call, until=until)
        batch: Batch[Any] = Batch(entries)
        result = await invoke(
            route, first, attempt=1, payload=batch, unknown_errors=unknown, services=self._engine.services
        )
        run = BatchRun(attempts=1, handled=list(range(len(entries))))
        if result.outcome is not Outcome.SUCCESS:
            run.failure = result
            return run
        for j, entry in enumerate(entries):
            error = batch.failure_of(entry)
            if error is not None:
                run.failed[j] = error
            else:
                run.verdicts[j] = SUCCESS
        return run

    async def _leased(self, route: HandlerRoute, members: list[_Member], which: list[int]) -> dict[int, Execution]:
        """Events whose record is a lease or a counting record: the single-event lease path, as a batch of one."""
        inbox = self._engine.inbox
        if not which or inbox is None:
            return {}
        options = self._engine.queues[route.queue].options

        async def one(member: _Member) -> Execution:
            raw = member.prepared.delivery

            async def call(attempt: int, scope: MongoScope, payload: Any) -> PipelineResult:
                body = payload if payload is not NOT_DECODED else member.prepared.route.terminal.extractor.extract(raw)  # type: ignore[union-attr]
                batch: Batch[Any] = Batch([BatchEntry(member.entry.event_id, member.entry.retry_count, body, raw)])
                result = await invoke(
                    route,
                    raw,
                    attempt=attempt,
                    scope=scope,
                    payload=batch,
                    unknown_errors=options.unknown_errors,
                    passthrough=inbox.passthrough,
                    services=self._engine.services,
                )
                error = batch.failure_of(batch[0]) if result.outcome is Outcome.SUCCESS else None
                if isinstance(result.exception, BatchItemFailed):
                    error = result.exception.error
                return result if error is None else self._verdict_of(route, error)

            return await inbox.execute(route, raw, member.prepared.payload, call)

        done = await asyncio.gather(*(one(members[i]) for i in which))
        return dict(zip(which, done, strict=True))

    async def _count_deferrals(
        self, route: HandlerRoute, members: list[_Member], executions: Mapping[int, Execution]
    ) -> None:
        """Every deferral is counted in its event's record (docs/inbox.md, "Counting deferrals"): those the
        batch concluded, which no lease counted."""
        inbox = self._engine.inbox
        deferred = [
            i
            for i, execution in executions.items()
            if execution.result.outcome is Outcome.DEFERRED and not execution.deferrals and route.guarantee == "inbox"
        ]
        if not deferred or inbox is None:
            return
        counts = await inbox.batches.count_deferrals(
            route, [members[i].entry for i in deferred], inbox.wait_for(route.queue)
        )
        for i, count in zip(deferred, counts, strict=True):
            if count is not None:
                executions[i].deferrals = count

    @staticmethod
    def _entry(route: HandlerRoute, member: _Member) -> BatchEntry[Any]:
        """The member's entry for a run: after an earlier run (a bisection's half), its body decoded afresh, so a
        handler that mutated it cannot leak into the next call."""
        entry = member.entry
        if member.attempts == 0 or route.terminal is None or route.terminal.extractor is None:
            return entry
        return BatchEntry(
            entry.event_id, entry.retry_count, route.terminal.extractor.extract(entry.delivery), entry.delivery
        )

    @staticmethod
    def _execution(member: _Member, result: PipelineResult) -> Execution:
        return Execution(
            result,
            attempts=max(member.attempts, 1),
            transient_replays=member.replays,
            reconciliations=member.reconciliations,
        )

    def _verdict_of(self, route: HandlerRoute, error: BaseException) -> PipelineResult:
        """One entry's failure as a verdict, as a single handler's exception would be (docs/settlement.md)."""
        if isinstance(error, QueueHandlerError):
            outcome = Outcome.RETRYABLE if error.is_retryable else Outcome.PERMANENT
            return PipelineResult(outcome, truncate_utf8(error.code, BOUNDS.failure_code_bytes), error.message, error)
        unknown = self._engine.queues[route.queue].options.unknown_errors
        outcome = Outcome.RETRYABLE if unknown == "retryable" else Outcome.PERMANENT
        return PipelineResult(outcome, ErrorCode.HANDLER_FAILED, f"{type(error).__name__}: {error}", error)


def _halves(indices: list[int]) -> list[list[int]]:
    """Two halves, the first to run first (the caller pops from the end)."""
    middle = len(indices) // 2
    return [indices[middle:], indices[:middle]]
