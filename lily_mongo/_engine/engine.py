"""The delivery engine: admission, deadlines, and driving each delivery to its settlement.

One :class:`Engine` per started consumer, whatever feeds it: the AMQP intake
(:mod:`.intake`) or an in-process transport (:meth:`Engine.deliver`). Per physical
queue it keeps a number of free admission permits and a local buffer
(:class:`~.queues.QueueState`). A message is admitted at once while a permit is
free, and buffered otherwise. An admitted delivery starts an eager worker task of
the supervisor's :class:`TaskSet` (it runs at once, in the caller's turn of the
event loop, up to its first suspension); a worker runs one delivery at a time and
takes the next buffered one itself when it finishes, so a saturated queue costs no
task creation per delivery.

For each delivery the engine calls :func:`~.dispatch.prepare`, then runs the handler
(through the inbox for inbox handlers) under the delivery deadline, then drives
:func:`~.settlement.settle`, performing its steps on the delivery's own channel
(:class:`~.effects.DeliveryEffects`): every ACK/NACK is written at most once, and only
while that channel is alive and authority has not been revoked by a forced shutdown.

Two small state machines, each moving only forward: the engine's :class:`Phase`
(changed only by :meth:`Engine._enter`) and each delivery's :class:`~.delivery.Stage`.
The deadline path (docs/lifecycle.md, section 5) is one method,
:meth:`Engine._enforce_deadline`.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import functools
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from .._errors import ErrorCode
from .._headers import DELIVERY_COUNT_HEADER
from .._observer import NO_OBSERVER, Observer
from .._plan.options import QueueOptions
from .._plan.plan import Plan
from .._snapshots import ObservationLog, QueueSnapshot
from .._tasks import TaskSet
from .._text import truncate_utf8
from .._verdicts import Execution, Outcome, PipelineResult
from ..bounds import BOUNDS
from .batches import Batcher
from .delivery import CUT_OFF, DROPPED, EXECUTING, FINISHED, SETTLING, Delivery, failure_key
from .dispatch import NO_SERVICES, Prepared, Services, invoke, prepare
from .effects import DeliveryEffects
from .failures import FailureLog
from .logs import log_terminal
from .message import Handoff, InboundMessage
from .queues import QueueState
from .settlement import NO_BUDGET, Budget, Evidence, HandoffState, SettleState, Step, StepKind, Terminal, settle

if TYPE_CHECKING:
    from .._inbox import Inbox, MongoScope
    from .._plan.extractors import RawDelivery

__all__ = ["Engine", "Phase"]

log = logging.getLogger("lily_mongo")

_UNRESOLVED = Terminal.UNRESOLVED.value
_ACKED = Terminal.ACKED.value
_REASON_BYTES = BOUNDS.failure_reason_bytes


class Phase(enum.Enum):
    """Where the engine is in its life; each phase only ever moves forward."""

    NEW = 0
    RUNNING = 1  # consuming and admitting
    DRAINING = 2  # intake stopped; running deliveries finish and settle
    FORCING = 3  # the force notice: handlers are cancelled, deliveries may still settle
    REVOKED = 4  # settlement authority revoked: nothing more is written


_RUNNING, _FORCING, _REVOKED = Phase.RUNNING, Phase.FORCING, Phase.REVOKED


class Engine:
    """Runs the plan's deliveries to their settlement; owned by the lifecycle supervisor."""

    def __init__(
        self,
        plan: Plan,
        tasks: TaskSet,
        *,
        inbox: Inbox | None,
        handoff: Handoff,
        observer: Observer = NO_OBSERVER,
        services: Services = NO_SERVICES,
    ) -> None:
        """``handoff`` publishes the retry and DLQ copies (the AMQP intake's confirming channel, or
        an in-process transport's). ``observer`` is what the engine reports to (a
        :class:`~lily_mongo.telemetry.Telemetry`, or nothing). ``services``: the database and
        lifespan resources handlers may ask for (docs/handlers.md)."""
        self.plan = plan
        self.services = services
        self.handoff = handoff
        self.tasks = tasks
        self.inbox = inbox
        self.observer = observer
        self.queues = {name: QueueState(i, opts) for i, (name, opts) in enumerate(plan.queues.items())}
        self.observations = ObservationLog()
        self.generation = 1  # the transport generation: one more each time the intake's connection is new
        self.phase = Phase.NEW
        self.deliveries: dict[asyncio.Task[Any], Delivery] = {}
        self.settled_during_shutdown: collections.Counter[str] = collections.Counter()
        self.failures = FailureLog()  # handler failures with their tracebacks, rate-limited per handler
        self.batches = Batcher(self)  # batch handlers' batches (docs/handlers.md, "Batch handlers")

    @property
    def accepting(self) -> bool:
        return self.phase is _RUNNING

    @property
    def has_authority(self) -> bool:
        """False once settlement authority is revoked (a forced shutdown): nothing more is written."""
        return self.phase is not _REVOKED

    def _enter(self, phase: Phase) -> None:
        """Move on to ``phase``; a phase the engine is already at or past changes nothing."""
        if phase.value > self.phase.value:
            self.phase = phase

    # -- admission ----------------------------------------------------------------------

    def open(self) -> None:
        """Start admitting deliveries (and the deadline sweeper)."""
        self._enter(Phase.RUNNING)
        self.tasks.spawn(self._sweep_deadlines(), name="lily-deadlines")

    def receive(self, qs: QueueState, message: InboundMessage) -> None:
        """One message from the transport: admitted at once while a permit is free, buffered otherwise (what
        arrives while the engine is not accepting, the caller gives back: :meth:`return_unstarted`)."""
        if qs.free_permits > 0 and not qs.buffer:
            qs.free_permits -= 1
            self._admit(qs, message)
        else:
            qs.buffer.append(message)

    async def deliver(self, queue: str, message: InboundMessage) -> BaseException | None:
        """Run one delivery of ``queue`` to its end in this task, like a consumed one.

        For in-process transports: it takes one of the queue's permits (the caller keeps
        within the queue's concurrency) and records the outcome in the observations.
        Returns what its handler raised on the last attempt (None when nothing did).
        """
        qs = self.queues[queue]
        qs.counters.received += 1
        qs.free_permits -= 1
        qs.in_flight += 1
        delivery = Delivery(qs, message)
        task = asyncio.current_task()
        assert task is not None
        self.deliveries[task] = delivery
        try:
            await self._deliver(delivery)
        finally:
            self.deliveries.pop(task, None)
        return delivery.execution.result.exception if delivery.execution is not None else None

    @staticmethod
    async def return_unstarted(message: InboundMessage) -> None:
        """Give a message that never started back to the broker (while its channel lives)."""
        if not message.channel.is_closed:
            try:
                await message.nack(requeue=True)
            except Exception:  # the channel died meanwhile: the broker requeues it anyway
                log.debug("returning an unstarted delivery failed", exc_info=True)

    def _admit(self, qs: QueueState, message: InboundMessage) -> None:
        """Start a delivery on a permit the caller has taken, in a worker of its own.

        The worker starts eagerly: it runs in the caller's turn of the event loop up to its
        first suspension (the handler's first wait, or the ACK write) instead of a turn later.
        It is still a task of its own: the AMQP library cancelling its consumer callbacks
        when a channel closes never reaches a running handler.
        """
        qs.in_flight += 1
        self.tasks.spawn(self._worker(qs, Delivery(qs, message)), name="lily-worker", eager=True)

    def _take_buffered(self, qs: QueueState) -> Delivery | None:
        """A buffered delivery with a permit taken for it, or None."""
        if not (self.accepting and qs.buffer and qs.free_permits > 0):
            return None
        qs.free_permits -= 1
        qs.in_flight += 1
        return Delivery(qs, qs.buffer.popleft())

    def _kick(self, qs: QueueState) -> None:
        """Admit buffered work after a permit came back outside a worker (a dropped delivery)."""
        while self.accepting and qs.buffer and qs.free_permits > 0:
            qs.free_permits -= 1
            self._admit(qs, qs.buffer.popleft())

    async def _worker(self, qs: QueueState, first: Delivery) -> None:
        """Runs deliveries of one queue one after another, in this task.

        After its delivery a worker takes buffered work itself (a permit came free) and ends
        when there is none. At most ``concurrency`` workers hold permits; a worker whose
        handler was dropped at its deadline ends once the handler returns (its permit went
        on without it).
        """
        task = asyncio.current_task()
        assert task is not None
        delivery: Delivery | None = first
        while delivery is not None:
            self.deliveries[task] = delivery
            try:
                await self._deliver(delivery)
            except Exception:  # never expected: _deliver settles or records every outcome
                log.exception("lily_mongo delivery failed unexpectedly")
            finally:
                self.deliveries.pop(task, None)
            if delivery.settle_task is not None:
                return  # dropped at its deadline: its permit went on without this worker
            delivery = self._take_buffered(qs)

    # -- shutdown steps (called by the lifecycle supervisor, in this order) ---------------

    def stop_accepting(self) -> None:
        """Stop admission: what arrives from now on, and what is buffered, goes back unstarted; forming batches run."""
        self._enter(Phase.DRAINING)
        self.batches.flush()

    async def return_buffered(self) -> None:
        """Give the buffered (unstarted) deliveries back."""
        for qs in self.queues.values():
            while qs.buffer:
                await self.return_unstarted(qs.buffer.popleft())

    def force_notice(self) -> None:
        """The force notice: cancel running handlers; their deliveries may still settle."""
        self._enter(Phase.FORCING)
        self.batches.force_notice()
        for task, delivery in list(self.deliveries.items()):
            if delivery.stage is EXECUTING or delivery.stage is CUT_OFF:
                task.cancel()

    def revoke(self) -> None:
        """Revoke settlement authority: from now on no ACK, NACK or handoff is written."""
        self._enter(Phase.REVOKED)

    def unsettled(self) -> set[asyncio.Task[Any]]:
        """Delivery tasks whose delivery has not reached a terminal outcome yet (zombies excluded)."""
        pending: set[asyncio.Task[Any]] = set()
        for task, delivery in self.deliveries.items():
            if delivery.stage is not FINISHED:
                # A dropped delivery is being settled by a task of its own; wait for that one.
                pending.add(delivery.settle_task if delivery.settle_task is not None else task)
        return pending

    def abandon_unfinished(self) -> int:
        """After a forced shutdown: record every delivery that could not settle as unresolved.

        Its task, if it ever goes on, finds the delivery finished and discards what it returns.
        """
        count = 0
        for delivery in list(self.deliveries.values()):
            if delivery.stage is not FINISHED:
                self._finish(delivery, None, None)
                count += 1
        return count

    # -- one delivery -------------------------------------------------------------------

    async def _deliver(self, delivery: Delivery) -> None:
        """One delivery: prepare, execute (inline, under the deadline), settle, observe."""
        qs = delivery.qs
        step: Step | None = None
        evidence: Evidence | None = None
        try:
            delivery.trace = self.observer.delivery_started(qs.options.name, delivery.message.headers)
            prepared = prepare(self.plan, qs.options, delivery.message)
            if isinstance(prepared, Prepared):
                delivery.envelope, delivery.handler_id = prepared.delivery.envelope, prepared.route.handler_id
                if prepared.route.batch is None:
                    execution = await self._execute(delivery, prepared)
                else:  # its batch runs it, under the batch's deadline
                    execution = await self.batches.join(delivery, prepared)
                if delivery.stage is not SETTLING:
                    return  # dropped (or abandoned): settled elsewhere, this late result is discarded
                delivery.execution = execution
                delivery.trace.executed(delivery.executing_since)
            else:
                delivery.stage = SETTLING
                delivery.execution = Execution(prepared.result)
                delivery.envelope, delivery.event_id = prepared.envelope, prepared.event_id
            step, evidence = await self._settle(delivery)
        finally:
            if delivery.settle_task is None:  # not dropped: this task finishes it
                self._finish(delivery, step, evidence)
            delivery.trace.detach()

    async def _execute(self, delivery: Delivery, prepared: Prepared) -> Execution:
        """Run the handler in this task (``EXECUTING``), to its verdict (``SETTLING``).

        Past its deadline it is cancelled (:meth:`_enforce_deadline`): the cancellation it
        lets through becomes the timeout verdict; at a force notice, the shutdown verdict.
        """
        options = delivery.qs.options
        delivery.executing_since = time.monotonic()
        delivery.stage = EXECUTING
        try:
            route, raw, payload = prepared.route, prepared.delivery, prepared.payload
            if route.guarantee == "inbox":
                assert self.inbox is not None
                return await self.inbox.execute(
                    route, raw, payload, functools.partial(self._inbox_attempt, route, raw, options)
                )
            result = await invoke(
                route, raw, attempt=1, payload=payload, unknown_errors=options.unknown_errors, services=self.services
            )
            return Execution(result, attempts=1)
        except asyncio.CancelledError:
            cut_off = delivery.stage is CUT_OFF
            if self.phase is _REVOKED or not (cut_off or self.phase is _FORCING):
                raise
            task = asyncio.current_task()
            if task is None or task.uncancel() > 0:
                raise  # cancelled by someone else as well
            if cut_off:
                reason = f"handler exceeded the delivery deadline of {options.deadline:g} s"
                return Execution(PipelineResult(Outcome.RETRYABLE, ErrorCode.HANDLER_TIMEOUT, reason), attempts=1)
            # A forced shutdown is an infrastructure event, not an application failure:
            # requeue without spending a retry, counted in the inbox record where there is one.
            reason = "cancelled by a forced shutdown"
            execution = Execution(PipelineResult(Outcome.DEFERRED, ErrorCode.SHUTDOWN, reason), attempts=1)
            if route.guarantee == "inbox" and self.inbox is not None:
                execution.deferrals = await self.inbox.count_deferral(route, raw) or 0
            return execution
        finally:
            if delivery.stage is EXECUTING or delivery.stage is CUT_OFF:  # not dropped meanwhile
                delivery.stage = SETTLING

    def _inbox_attempt(
        self, route: Any, delivery: RawDelivery, options: QueueOptions, attempt: int, scope: MongoScope, payload: Any
    ) -> Coroutine[Any, Any, PipelineResult]:
        """One attempt of an inbox handler, as the inbox calls it (``Invoke``)."""
        assert self.inbox is not None
        return invoke(
            route,
            delivery,
            attempt=attempt,
            scope=scope,
            payload=payload,
            unknown_errors=options.unknown_errors,
            passthrough=self.inbox.passthrough,
            services=self.services,
        )

    async def _settle(self, delivery: Delivery) -> tuple[Step, Evidence]:
        """Drive :func:`~.settlement.settle` with this delivery's budget and its effects."""
        execution = delivery.execution
        assert execution is not None
        result = execution.result
        effects = DeliveryEffects(self, delivery)
        if result.outcome is Outcome.SUCCESS or result.outcome is Outcome.DUPLICATE:
            return await settle(result, NO_BUDGET, effects)  # the budget only shapes failure paths
        qs, options, envelope = delivery.qs, delivery.qs.options, delivery.envelope
        delivery.failure_key = key = failure_key(delivery.message, envelope)
        deferrals = execution.deferrals
        if result.outcome is Outcome.DEFERRED:
            qs.counters.deferrals += 1
            # The inbox counts every deferral in the event's record (docs/settlement.md, section 4);
            # where MongoDB could not count it, this process's count is the fallback, and on a
            # quorum queue before RabbitMQ 4.3 the broker's x-delivery-count bounds it as well.
            local = qs.deferral_counts.bump(key)
            delivery_count = delivery.message.headers.get(DELIVERY_COUNT_HEADER)
            broker = delivery_count if type(delivery_count) is int else 0
            deferrals = max(deferrals, local, broker)
        budget = Budget(
            retry_count=envelope.retry_count if envelope else 0,
            max_retries=options.retry.max_retries,
            deferrals=deferrals,
            max_deferrals=options.max_deferrals,
            handoff_failures=qs.handoff_failures.get(key, 0),
            max_handoff_failures=options.max_handoff_failures,
            dead_letter_fallback=not qs.dlq_unroutable,
        )
        return await settle(result, budget, effects)

    def _finish(self, delivery: Delivery, step: Step | None, evidence: Evidence | None) -> None:
        """Release the permit and record the terminal observation: exactly once per delivery."""
        if delivery.stage is FINISHED:
            return
        delivery.stage = FINISHED
        qs = delivery.qs
        qs.in_flight -= 1
        qs.free_permits += 1  # a worker takes buffered work itself; the drop path kicks
        evidence = evidence or Evidence()
        execution = delivery.execution or Execution(PipelineResult(Outcome.RETRYABLE, ErrorCode.HANDLER_FAILED, ""))
        terminal = step.terminal.value if step is not None and step.terminal else _UNRESOLVED
        counters = qs.counters
        if terminal == _UNRESOLVED:
            counters.unresolved += 1
        counters.outcomes[terminal] += 1
        if self.phase is not _RUNNING:
            self.settled_during_shutdown[terminal] += 1
        counters.transient_replays += execution.transient_replays
        counters.reconciliations += execution.reconciliations
        if step is not None and step.reason:
            reason = step.reason
        elif step is None and execution.result.outcome is Outcome.SUCCESS:
            reason = "not settled: settlement authority was lost or revoked"
        else:
            reason = execution.result.reason
        event_id = delivery.envelope.event_id if delivery.envelope else delivery.event_id
        code = (step.code if step is not None else None) or execution.result.code
        duration = time.monotonic() - delivery.started
        self.observations.record(
            queue=qs.options.name,
            handler_id=delivery.handler_id,
            event_id=event_id,
            outcome=terminal,
            code=code,
            reason=truncate_utf8(reason, _REASON_BYTES),
            handoff_confirmed=evidence.handoff is HandoffState.CONFIRMED,
            ack_sent=evidence.settled_with is StepKind.ACK and evidence.settle is SettleState.SENT,
            broker_native=evidence.settled_with is StepKind.REJECT,
            attempts=execution.attempts,
            transient_replays=execution.transient_replays,
            reconciliations=execution.reconciliations,
            received_at=delivery.received_at,
            duration=duration,
        )
        delivery.trace.finish(delivery.handler_id, event_id, terminal, code, execution)
        if execution.result.exception is not None:  # before the delivery's own line: the cause, then the outcome
            self._report_failure(delivery, execution, terminal, event_id)
        if terminal != _ACKED or log.isEnabledFor(logging.DEBUG):
            log_terminal(qs.options.name, delivery.handler_id, event_id, terminal, code, duration)

    def _report_failure(self, delivery: Delivery, execution: Execution, terminal: str, event_id: Any) -> None:
        """What the handler raised, to the failure log (docs/handlers.md, section 5)."""
        result = execution.result
        assert result.exception is not None
        envelope = delivery.envelope
        self.failures.report(
            result.exception,
            queue=delivery.qs.options.name,
            handler_id=delivery.handler_id,
            event_id=event_id,
            attempt=execution.attempts,
            retry_count=envelope.retry_count if envelope is not None else None,
            outcome=terminal,
            code=result.code,
        )

    # -- the deadline path ----------------------------------------------------------------

    async def _sweep_deadlines(self) -> None:
        """One timer for every delivery: each tick starts the deadline path of executions past their cutoff.

        A tick every quarter of the shortest deadline (at most 0.25 s) costs less than a
        timer per delivery; a cutoff fires at most one tick late.
        """
        shortest = min(q.options.deadline for q in self.queues.values())
        interval = min(max(shortest / 4, 0.005), 0.25)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for task, delivery in list(self.deliveries.items()):
                if delivery.stage is EXECUTING and now - delivery.executing_since >= delivery.qs.options.deadline:
                    self.tasks.spawn(self._enforce_deadline(delivery, task), name="lily-deadline", eager=True)

    async def _enforce_deadline(self, delivery: Delivery, task: asyncio.Task[Any]) -> None:
        """One delivery past its cutoff, in order (docs/lifecycle.md, section 5):

        1. cut off: its task is cancelled; the cancellation the handler lets through becomes
           the timeout verdict (:meth:`_execute`), and its own task settles it;
        2. the handler gets the cooperation window to end;
        3. one that has not ended (it ignores the cancellation) is dropped: the delivery is
           settled here, from this task, and its handler's late result is discarded.
        """
        qs = delivery.qs
        delivery.stage = CUT_OFF
        task.cancel()
        await asyncio.sleep(qs.options.cooperation_window)
        if delivery.stage is not CUT_OFF or task.done():
            return  # it ended within the window
        delivery.stage = DROPPED
        delivery.settle_task = asyncio.current_task()
        qs.counters.abandoned += 1
        reason = f"handler exceeded the delivery deadline of {qs.options.deadline:g} s and was dropped"
        delivery.execution = Execution(PipelineResult(Outcome.RETRYABLE, ErrorCode.HANDLER_TIMEOUT, reason), attempts=1)
        step: Step | None = None
        evidence: Evidence | None = None
        try:
            step, evidence = await self._settle(delivery)
        finally:
            self._finish(delivery, step, evidence)
            self._kick(qs)  # its permit came back outside a worker

    def snapshots(self) -> tuple[QueueSnapshot, ...]:
        return tuple(qs.snapshot() for qs in self.queues.values())
