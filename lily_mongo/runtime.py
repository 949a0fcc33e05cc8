"""The delivery pipeline: intake, admission, envelope, dispatch, execution, settlement.

One :class:`Runtime` per started consumer. Per physical queue it owns a
channel (so prefetch and admission are per queue and a slow queue never
starves another), a number of free admission permits and a local buffer.
The broker callback admits a delivery at once while a permit is free, and
buffers it otherwise. An admitted delivery starts an eager worker task of the
supervisor's :class:`TaskSet` (it runs at once, in the callback's turn of the
event loop, up to its first suspension); a worker runs one delivery at a time
and takes the next buffered one itself when it finishes, so a saturated queue
costs no task creation per delivery.

Settlement follows :func:`settlement.decide`; every ACK/NACK is written at most
once, on the delivery's own channel, and only while that channel is alive and
authority has not been revoked by a forced shutdown.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import functools
import hashlib
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import aio_pika
import aio_pika.abc
import aiormq.abc

from ._amqp import InboundMessage, republish
from ._text import sanitize, truncate_utf8
from .bounds import BOUNDS
from .envelope import RETRY_COUNT_HEADER, Envelope, sanitize_headers, validate_envelope
from .errors import EnvelopeError, ErrorCode, PublishError, QueueHandlerError
from .extractors import NOT_DECODED, PayloadDecodeError, RawDelivery, new_raw_delivery
from .observe import ObservationLog, QueueCounters, QueueSnapshot
from .plan import HandlerRoute, Plan, QueueOptions, dispatch
from .settlement import (
    Budget,
    Evidence,
    HandoffState,
    Outcome,
    PipelineResult,
    SettleState,
    Step,
    StepKind,
    Terminal,
    decide,
)

if TYPE_CHECKING:
    from .inbox import Inbox, MongoScope

__all__ = ["DeliveryContext", "Execution", "Runtime", "TaskSet"]

log = logging.getLogger("lily_mongo")

_COUNTER_MEMORY = 4096


class TaskSet:
    """The supervisor's task group: every task it spawns is tracked until it ends.

    Unlike :class:`asyncio.TaskGroup`, one task's failure does not cancel the
    others, and shutdown can join with a window and observe what did not end.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(
        self, coro: Coroutine[Any, Any, Any], *, name: str | None = None, eager: bool = False
    ) -> asyncio.Task[Any]:
        """Start ``coro`` as a tracked task; ``eager`` runs it at once, up to its first suspension."""
        loop = asyncio.get_running_loop()
        if eager:
            task: asyncio.Task[Any] = asyncio.Task(coro, loop=loop, name=name, eager_start=True)
        else:
            task = loop.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("lily_mongo task %s failed", task.get_name(), exc_info=task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    def pending(self) -> set[asyncio.Task[Any]]:
        return set(self._tasks)

    async def join(self, tasks: set[asyncio.Task[Any]], timeout: float) -> set[asyncio.Task[Any]]:
        """Wait up to ``timeout`` for ``tasks``; return those still running."""
        if not tasks:
            return set()
        _, pending = await asyncio.wait(tasks, timeout=max(timeout, 0.0))
        return pending


@dataclass(slots=True)
class DeliveryContext:
    """What middleware and guards see for one attempt: read-only delivery data plus a scratch dict."""

    queue: str
    handler: HandlerRoute
    delivery: RawDelivery
    attempt: int
    items: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def envelope(self) -> Envelope:
        return self.delivery.envelope


@dataclass(slots=True)
class Execution:
    """What executing a delivery produced, beyond its verdict (counters for the budget)."""

    result: PipelineResult
    deferrals: int = 0
    attempts: int = 0
    transient_replays: int = 0
    reconciliations: int = 0
    backoff_limit: float | None = None  # e.g. the lease's remaining time


@dataclass(slots=True, eq=False)
class _Delivery:
    """The mutable record of one admitted delivery, shared by its task and the deadline timers."""

    qr: QueueRuntime
    message: InboundMessage
    received_at: float = dataclasses.field(default_factory=time.time)
    started: float = dataclasses.field(default_factory=time.monotonic)
    envelope: Envelope | None = None
    route: HandlerRoute | None = None
    execution: Execution | None = None
    executing: bool = False
    deadline_at: float = 0.0
    deadline_hit: bool = False
    dropped: bool = False
    finished: bool = False
    settle_task: asyncio.Task[Any] | None = None


@dataclass(slots=True)
class _Prepared:
    route: HandlerRoute
    delivery: RawDelivery
    payload: Any  # the terminal extractor's value, decoded once while preparing


class QueueRuntime:
    """Per physical queue state: options, channel, buffer, permits, counters."""

    def __init__(self, index: int, options: QueueOptions) -> None:
        self.index = index
        self.options = options
        self.free_permits = options.concurrency
        self.buffer: collections.deque[InboundMessage] = collections.deque()
        self.channel: aio_pika.abc.AbstractChannel | None = None
        self.queue: aio_pika.abc.AbstractQueue | None = None
        self.consumer_tag: str | None = None
        self.in_flight = 0
        self.counters = QueueCounters()
        self.handoff_failures: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.dlq_unroutable = False
        self.deferral_counts: collections.OrderedDict[bytes, int] = collections.OrderedDict()

    def snapshot(self) -> QueueSnapshot:
        c = self.counters
        return QueueSnapshot(
            queue_index=self.index,
            permits=self.options.concurrency,
            in_flight=self.in_flight,
            buffered=len(self.buffer),
            outcomes=dict(c.outcomes),
            received=c.received,
            transient_replays=c.transient_replays,
            reconciliations=c.reconciliations,
            deferrals=c.deferrals,
            unresolved=c.unresolved,
            abandoned=c.abandoned,
        )


class Runtime:
    """Runs the plan's queues on one AMQP connection; owned by the lifecycle supervisor."""

    def __init__(
        self,
        plan: Plan,
        connection: aio_pika.abc.AbstractConnection,
        tasks: TaskSet,
        *,
        inbox: Inbox | None,
        confirm_timeout: float,
    ) -> None:
        self.plan = plan
        self.connection = connection
        self.tasks = tasks
        self.inbox = inbox
        self.confirm_timeout = confirm_timeout
        self.queues = {name: QueueRuntime(i, opts) for i, (name, opts) in enumerate(plan.queues.items())}
        self.observations = ObservationLog()
        self.handoff_channel: aio_pika.abc.AbstractChannel | None = None
        self.generation = 1
        self._transport: object | None = None  # the connection's transport the generation counts
        self.accepting = False
        self.revoked = False
        self.forcing = False
        self.deliveries: dict[asyncio.Task[Any], _Delivery] = {}
        self.settled_during_shutdown: collections.Counter[str] = collections.Counter()
        self.shutting_down = False

    # -- start / stop -----------------------------------------------------------------

    async def start(self) -> None:
        """Open the handoff channel and one consuming channel per queue; start intake."""
        self._transport = getattr(self.connection, "transport", None)
        self.handoff_channel = await self.connection.channel(publisher_confirms=True, on_return_raises=True)
        self.accepting = True
        self.tasks.spawn(self._sweep_deadlines(), name="lily-deadlines")
        for qr in self.queues.values():
            channel = await self.connection.channel(publisher_confirms=False)
            await channel.set_qos(prefetch_count=qr.options.effective_prefetch)
            qr.channel = channel
            qr.queue = await channel.declare_queue(qr.options.name, passive=True)
            await self._consume(qr)
            if isinstance(channel, aio_pika.abc.AbstractRobustChannel):
                channel.reopen_callbacks.add(functools.partial(self._on_channel_reopened, qr))

    async def _consume(self, qr: QueueRuntime) -> None:
        """Consume ``qr``'s queue on its channel's current transport, straight through aiormq."""
        assert qr.channel is not None
        underlay = await qr.channel.get_underlay_channel()
        consuming = await underlay.basic_consume(qr.options.name, self._callback(qr), no_ack=False)
        qr.consumer_tag = consuming.consumer_tag
        underlay.on_consumer_cancel_callbacks.add(functools.partial(self._on_broker_cancel, qr))

    def _on_broker_cancel(self, qr: QueueRuntime, frame: Any) -> None:
        """The broker ended the consumer (the queue was deleted, for one): say so loudly."""
        if getattr(frame, "consumer_tag", None) == qr.consumer_tag and self.accepting:
            log.error(
                "the broker cancelled consuming from queue %s (deleted?); it receives nothing until the consumer "
                "is restarted",
                qr.options.name,
            )

    async def _on_channel_reopened(self, qr: QueueRuntime, _channel: object) -> None:
        """A robust channel came back (reconnect or channel error; QoS and the queue restored): consume again."""
        # Count a new connection transport before consuming on it: the connection's reconnect
        # callbacks run only after every channel is restored, and a delivery of the new
        # generation must not be seen while the snapshot still shows the old one.
        self._count_transport()
        if not self.accepting:
            return
        try:
            await self._consume(qr)
        except Exception as exc:
            log.warning("consuming %s again after a reconnect failed: %s", qr.options.name, type(exc).__name__)

    def on_reconnect(self) -> None:
        """The connection reconnected: a new transport generation (old deliveries have lost
        settlement authority). Counted once per transport, whichever callback sees it first."""
        self._count_transport()

    def _count_transport(self) -> None:
        transport = getattr(self.connection, "transport", None)
        if transport is not None and transport is not self._transport:
            self._transport = transport
            self.generation += 1

    def _callback(self, qr: QueueRuntime) -> Callable[[aiormq.abc.DeliveredMessage], Coroutine[Any, Any, None]]:
        async def on_message(delivered: aiormq.abc.DeliveredMessage) -> None:
            qr.counters.received += 1
            message = InboundMessage(delivered)
            if not self.accepting:
                # Intake stopped: give it back at once (it was never started).
                await self._return_unstarted(message)
                return
            if qr.free_permits > 0 and not qr.buffer:
                qr.free_permits -= 1
                self._admit(qr, message)
            else:
                qr.buffer.append(message)

        return on_message

    async def _return_unstarted(self, message: InboundMessage) -> None:
        if _channel_alive(message):
            try:
                await message.nack(requeue=True)
            except Exception:  # the channel died meanwhile: the broker requeues it anyway
                log.debug("returning an unstarted delivery failed", exc_info=True)

    def _admit(self, qr: QueueRuntime, message: InboundMessage) -> None:
        """Start a delivery on a permit the caller has taken, in a worker of its own.

        The worker starts eagerly: it runs in the caller's turn of the event loop up to its
        first suspension (the handler's first wait, or the ACK write) instead of a turn later.
        It is still a task of its own: the AMQP library cancelling its consumer callbacks
        when a channel closes never reaches a running handler.
        """
        qr.in_flight += 1
        self.tasks.spawn(self._worker(qr, _Delivery(qr, message)), name="lily-worker", eager=True)

    def _take_buffered(self, qr: QueueRuntime) -> _Delivery | None:
        """A buffered delivery with a permit taken for it, or None."""
        if not (self.accepting and qr.buffer and qr.free_permits > 0):
            return None
        qr.free_permits -= 1
        qr.in_flight += 1
        return _Delivery(qr, qr.buffer.popleft())

    def _kick(self, qr: QueueRuntime) -> None:
        """Admit buffered work after a permit came back outside a worker (a dropped delivery)."""
        while self.accepting and qr.buffer and qr.free_permits > 0:
            qr.free_permits -= 1
            self._admit(qr, qr.buffer.popleft())

    async def _worker(self, qr: QueueRuntime, first: _Delivery) -> None:
        """Runs deliveries of one queue one after another, in this task.

        After its delivery a worker takes buffered work itself (a permit came free) and ends
        when there is none. At most ``concurrency`` workers hold permits; a worker whose
        handler was dropped at its deadline ends once the handler returns (its permit went
        on without it).
        """
        task = asyncio.current_task()
        assert task is not None
        state: _Delivery | None = first
        while state is not None:
            self.deliveries[task] = state
            try:
                await self._deliver(state)
            except Exception:  # never expected: _deliver settles or records every outcome
                log.exception("lily_mongo delivery failed unexpectedly")
            finally:
                self.deliveries.pop(task, None)
            if state.dropped:
                return
            state = self._take_buffered(qr)

    async def stop_intake(self) -> list[BaseException]:
        """Cancel consumers, stop admission and return buffered (unstarted) deliveries."""
        errors: list[BaseException] = []
        self.accepting = False
        for qr in self.queues.values():
            if qr.consumer_tag is not None and qr.channel and not qr.channel.is_closed:
                try:
                    underlay = await qr.channel.get_underlay_channel()
                    await underlay.basic_cancel(qr.consumer_tag)
                except Exception as exc:
                    errors.append(exc)
        for qr in self.queues.values():
            while qr.buffer:
                await self._return_unstarted(qr.buffer.popleft())
        return errors

    # -- one delivery -------------------------------------------------------------------

    async def _deliver(self, state: _Delivery) -> None:
        """One delivery: prepare, execute (inline, under the deadline timer), settle, observe."""
        qr, message = state.qr, state.message
        step: Step | None = None
        evidence: Evidence | None = None
        try:
            prepared = self._prepare(qr, message)
            if isinstance(prepared, _Prepared):
                state.envelope, state.route = prepared.delivery.envelope, prepared.route
                state.execution = await self._execute_under_deadline(state, prepared)
                if state.dropped:
                    return  # the drop path settles it; this late result is discarded
            else:
                state.execution = Execution(prepared[0])
                state.envelope = prepared[1]
            step, evidence = await self._settle(qr, message, state.envelope, state.execution)
        finally:
            if not state.dropped:
                self._finish(state, step, evidence)

    def _finish(self, state: _Delivery, step: Step | None, evidence: Evidence | None) -> None:
        """Release the permit and record the terminal observation: exactly once per delivery."""
        if state.finished:
            return
        state.finished = True
        qr = state.qr
        qr.in_flight -= 1
        qr.free_permits += 1  # a worker takes buffered work itself; the drop path kicks
        evidence = evidence or Evidence()
        execution = state.execution or Execution(PipelineResult(Outcome.RETRYABLE, ErrorCode.HANDLER_FAILED, ""))
        terminal = step.terminal.value if step is not None and step.terminal else _UNRESOLVED
        if terminal == _UNRESOLVED:
            qr.counters.unresolved += 1
        qr.counters.outcomes[terminal] += 1
        if self.shutting_down:
            self.settled_during_shutdown[terminal] += 1
        qr.counters.transient_replays += execution.transient_replays
        qr.counters.reconciliations += execution.reconciliations
        if step is not None and step.reason:
            reason = step.reason
        elif step is None and execution.result.outcome is Outcome.SUCCESS:
            reason = "not settled: settlement authority was lost or revoked"
        else:
            reason = execution.result.reason
        self.observations.record(
            qr.options.name,
            state.route.handler_id if state.route else None,
            state.envelope.event_id if state.envelope else None,
            terminal,
            (step.code if step is not None else None) or execution.result.code,
            truncate_utf8(reason, _REASON_BYTES),
            evidence.handoff is HandoffState.CONFIRMED,
            evidence.settled_with is StepKind.ACK and evidence.settle is SettleState.SENT,
            evidence.settled_with is StepKind.REJECT,
            execution.attempts,
            execution.transient_replays,
            execution.reconciliations,
            state.received_at,
            time.monotonic() - state.started,
        )

    def unsettled(self) -> set[asyncio.Task[Any]]:
        """Delivery tasks whose delivery has not reached a terminal outcome yet (zombies excluded)."""
        pending: set[asyncio.Task[Any]] = set()
        for task, state in self.deliveries.items():
            if not state.finished:
                # A dropped delivery is being settled by its own task; wait for that one.
                pending.add(state.settle_task if state.settle_task is not None else task)
        return pending

    def abandon_unfinished(self) -> int:
        """After a forced shutdown: record every delivery that could not settle as unresolved."""
        count = 0
        for state in list(self.deliveries.values()):
            if not state.finished:
                state.dropped = True
                self._finish(state, None, None)
                count += 1
        return count

    def _prepare(self, qr: QueueRuntime, message: InboundMessage) -> _Prepared | tuple[PipelineResult, Envelope | None]:
        """Envelope, dispatch and payload decode: all before any scope or middleware opens."""
        options = qr.options
        if message.malformed is not None and len(message.body) <= options.max_body:
            # Metadata that was not valid AMQP, read leniently (_amqp.LenientFrameReader): refused.
            return PipelineResult(Outcome.PERMANENT, ErrorCode.ENVELOPE_INVALID, message.malformed), None
        try:
            envelope = validate_envelope(message.headers, len(message.body), max_body=options.max_body)
        except EnvelopeError as exc:
            outcome = Outcome.BODY_TOO_LARGE if exc.code == ErrorCode.BODY_TOO_LARGE else Outcome.PERMANENT
            return PipelineResult(outcome, exc.code, exc.reason), None
        target = dispatch(self.plan, options.name, envelope.schema_version, envelope.content_kind)
        if isinstance(target, str):
            reason = (
                f"queue has no handler for schema version {envelope.schema_version}"
                if target == ErrorCode.SCHEMA_VERSION_UNSUPPORTED
                else f"schema version {envelope.schema_version} has no handler for content kind "
                f"{envelope.content_kind!r}"
            )
            return PipelineResult(Outcome.PERMANENT, target, reason), envelope
        delivery = new_raw_delivery(
            options.name,
            MappingProxyType(message.headers),  # read-only: handoff copies use these
            message.body,
            message.content_type,
            message.redelivered,
            envelope,
            message.routing_key,
            message.exchange,
        )
        terminal = target.terminal
        payload: Any = NOT_DECODED
        if terminal is not None and terminal.extractor is not None:
            try:
                payload = terminal.extractor.extract(delivery)
            except PayloadDecodeError as exc:
                return PipelineResult(Outcome.PERMANENT, ErrorCode.PAYLOAD_DECODE_FAILED, str(exc)), envelope
            except Exception as exc:
                reason = f"{type(exc).__name__}: {exc}"
                return PipelineResult(Outcome.PERMANENT, ErrorCode.PAYLOAD_DECODE_FAILED, reason), envelope
        return _Prepared(target, delivery, payload)

    async def _execute_under_deadline(self, state: _Delivery, prepared: _Prepared) -> Execution:
        """Run the execution in this task; at the cutoff cancel it, then after the cooperation
        window drop it (settle from another task) if it ignores the cancellation."""
        options = state.qr.options
        # The deadline sweeper cancels this task once deadline_at has passed.
        state.deadline_at = asyncio.get_running_loop().time() + options.deadline
        state.executing = True
        try:
            route = prepared.route
            if route.guarantee == "inbox":
                assert self.inbox is not None
                return await self.inbox.execute(self, state.qr, route, prepared.delivery, prepared.payload)
            result = await self.run_attempt(state.qr, route, prepared.delivery, attempt=1, payload=prepared.payload)
            return Execution(result, attempts=1)
        except asyncio.CancelledError:
            if self.revoked or not (state.deadline_hit or self.forcing):
                raise
            task = asyncio.current_task()
            if task is None or task.uncancel() > 0:
                raise  # cancelled by someone else as well
            if state.deadline_hit:
                reason = f"handler exceeded the delivery deadline of {options.deadline:g} s"
                return Execution(PipelineResult(Outcome.RETRYABLE, ErrorCode.HANDLER_TIMEOUT, reason), attempts=1)
            # A forced shutdown is an infrastructure event, not an application failure:
            # requeue without spending a retry.
            reason = "cancelled by a forced shutdown"
            return Execution(PipelineResult(Outcome.DEFERRED, "SHUTDOWN", reason), attempts=1)
        finally:
            state.executing = False

    def interrupt_executions(self) -> None:
        """The force notice: cancel running handlers; their deliveries may still settle."""
        self.forcing = True
        for task, state in list(self.deliveries.items()):
            if state.executing:
                task.cancel()

    async def _sweep_deadlines(self) -> None:
        """One timer for every delivery: each tick cancels executions past their cutoff.

        A tick every quarter of the shortest deadline (at most 0.25 s) costs less than a
        timer per delivery; a cutoff fires at most one tick late.
        """
        shortest = min(q.options.deadline for q in self.queues.values())
        interval = min(max(shortest / 4, 0.005), 0.25)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            now = loop.time()
            for task, state in list(self.deliveries.items()):
                if state.executing and not state.deadline_hit and now >= state.deadline_at:
                    self._deadline_reached(state, task)

    def _deadline_reached(self, state: _Delivery, task: asyncio.Task[Any]) -> None:
        if task.done() or not state.executing:
            return
        state.deadline_hit = True
        task.cancel()
        asyncio.get_running_loop().call_later(state.qr.options.cooperation_window, self._cooperation_over, state, task)

    def _cooperation_over(self, state: _Delivery, task: asyncio.Task[Any]) -> None:
        if task.done() or not state.executing or state.dropped or state.finished:
            return
        # The handler ignores cancellation: drop it and settle the delivery elsewhere.
        state.dropped = True
        state.qr.counters.abandoned += 1
        reason = f"handler exceeded the delivery deadline of {state.qr.options.deadline:g} s and was dropped"
        state.execution = Execution(PipelineResult(Outcome.RETRYABLE, ErrorCode.HANDLER_TIMEOUT, reason), attempts=1)
        state.settle_task = self.tasks.spawn(self._settle_dropped(state), name="lily-dropped")

    async def _settle_dropped(self, state: _Delivery) -> None:
        step: Step | None = None
        evidence: Evidence | None = None
        try:
            assert state.execution is not None
            step, evidence = await self._settle(state.qr, state.message, state.envelope, state.execution)
        finally:
            self._finish(state, step, evidence)
            self._kick(state.qr)

    async def run_attempt(
        self,
        qr: QueueRuntime,
        route: HandlerRoute,
        delivery: RawDelivery,
        *,
        attempt: int,
        scope: MongoScope | None = None,
        payload: Any = NOT_DECODED,
    ) -> PipelineResult:
        """One fresh middleware/guards/handler invocation; exceptions become a verdict.

        Exceptions the inbox must see itself (database errors carrying
        transaction labels) are re-raised through :meth:`Inbox.reraise`.
        """
        try:
            if route.middleware or route.guards:
                await self._invoke(DeliveryContext(qr.options.name, route, delivery, attempt), scope, payload)
            else:
                await route.fn(**_arguments(route, delivery, scope, payload))
        except QueueHandlerError as exc:
            outcome = Outcome.RETRYABLE if exc.is_retryable else Outcome.PERMANENT
            return PipelineResult(outcome, truncate_utf8(exc.code, BOUNDS.failure_code_bytes), exc.message)
        except Exception as exc:
            if self.inbox is not None and scope is not None:
                self.inbox.reraise_transaction_error(exc)
            outcome = Outcome.RETRYABLE if qr.options.unknown_errors == "retryable" else Outcome.PERMANENT
            return PipelineResult(outcome, ErrorCode.HANDLER_FAILED, f"{type(exc).__name__}: {exc}")
        return _SUCCESS

    async def _invoke(self, ctx: DeliveryContext, scope: MongoScope | None, payload: Any) -> None:
        """Middleware (outermost first) around the guards and the handler."""
        route = ctx.handler

        async def call_handler() -> None:
            for guard in route.guards:
                if await guard(ctx) is False:
                    name = getattr(guard, "__qualname__", type(guard).__name__)
                    raise QueueHandlerError.permanent(ErrorCode.GUARD_REJECTED, f"guard {name} refused the delivery")
            await route.fn(**_arguments(route, ctx.delivery, scope, payload))

        call: Callable[[], Awaitable[None]] = call_handler
        for middleware in reversed(route.middleware):
            call = _bind_middleware(middleware, ctx, call)
        await call()

    # -- settlement ---------------------------------------------------------------------

    def _authority(self, message: InboundMessage) -> bool:
        return not self.revoked and _channel_alive(message)

    async def _settle(
        self,
        qr: QueueRuntime,
        message: InboundMessage,
        envelope: Envelope | None,
        execution: Execution,
    ) -> tuple[Step, Evidence]:
        options = qr.options
        result = execution.result
        evidence = _FRESH_EVIDENCE
        if result.outcome is Outcome.SUCCESS or result.outcome is Outcome.DUPLICATE:
            # The budget only shapes failure paths; the common path skips building one.
            key = b""
            budget = _SUCCESS_BUDGET
        else:
            key = _failure_key(message, envelope)
            budget = Budget(
                retry_count=envelope.retry_count if envelope else 0,
                max_retries=options.retry.max_retries,
                deferrals=execution.deferrals,
                max_deferrals=options.max_deferrals,
                handoff_failures=qr.handoff_failures.get(key, 0),
                max_handoff_failures=options.max_handoff_failures,
                dead_letter_fallback=not qr.dlq_unroutable,
            )
        if result.outcome is Outcome.DEFERRED:
            qr.counters.deferrals += 1
            # The lease document counts lease deferrals; deferrals that never reached a
            # lease (database unavailable, forced shutdown) are counted here, and a quorum
            # queue's x-delivery-count bounds them across processes too.
            local = _bump(qr.deferral_counts, key)
            delivery_count = message.headers.get("x-delivery-count")
            broker = delivery_count if type(delivery_count) is int else 0
            budget = dataclasses.replace(budget, deferrals=max(execution.deferrals, local, broker))
        while True:
            # Once a settlement was written (or failed), decide() ends on that alone.
            if evidence.settle is SettleState.NONE and not self._authority(message):
                evidence = _evidence(evidence.handoff, evidence.settle, False, evidence.settled_with)
            # The common path's two steps are decide()'s own answers, computed once at import.
            if result is _SUCCESS and evidence is _FRESH_EVIDENCE:
                step = _SUCCESS_FIRST_STEP
            elif result is _SUCCESS and evidence is _ACKED_EVIDENCE:
                step = _SUCCESS_LAST_STEP
            else:
                step = decide(result, budget, evidence)
            if step.kind in (StepKind.DONE, StepKind.UNRESOLVED):
                return step, evidence
            if step.kind in (StepKind.PUBLISH_RETRY, StepKind.PUBLISH_DLQ):
                try:
                    await self._handoff(qr, message, envelope, step, budget)
                    evidence = _evidence(HandoffState.CONFIRMED, evidence.settle, True, evidence.settled_with)
                    qr.handoff_failures.pop(key, None)
                    if step.kind is StepKind.PUBLISH_DLQ:
                        qr.dlq_unroutable = False
                except PublishError as exc:
                    to_dlq = step.kind is StepKind.PUBLISH_DLQ
                    log.warning("handoff to %s failed: %s", "the DLQ" if to_dlq else "a retry bucket", exc.kind)
                    evidence = _evidence(HandoffState.FAILED, evidence.settle, True, evidence.settled_with)
                    self._count_handoff_failure(qr, key)
                    if to_dlq and exc.kind == "unroutable":
                        qr.dlq_unroutable = True
                    budget = dataclasses.replace(budget, dead_letter_fallback=not qr.dlq_unroutable)
                continue
            if step.kind is StepKind.NACK_REQUEUE:
                await asyncio.sleep(self._requeue_backoff(qr, execution, budget, evidence))
                if not self._authority(message):
                    continue
            evidence = await self._write_settlement(message, step.kind, evidence)

    def _count_handoff_failure(self, qr: QueueRuntime, key: bytes) -> None:
        _bump(qr.handoff_failures, key)

    def _requeue_backoff(self, qr: QueueRuntime, execution: Execution, budget: Budget, evidence: Evidence) -> float:
        """Short jittered pause before a requeue so a held lease does not cause a hot loop."""
        count = budget.deferrals if evidence.handoff is not HandoffState.FAILED else budget.handoff_failures
        delay = min(0.05 * (2 ** min(count, 6)), 2.0) * random.uniform(0.5, 1.0)
        if execution.backoff_limit is not None:
            delay = min(delay, max(execution.backoff_limit, 0.0))
        return float(min(delay, qr.options.cooperation_window))

    async def _write_settlement(self, message: InboundMessage, kind: StepKind, evidence: Evidence) -> Evidence:
        try:
            if kind is StepKind.ACK:
                await message.ack()
            elif kind is StepKind.NACK_REQUEUE:
                await message.nack(requeue=True)
            else:
                await message.reject(requeue=False)
        except Exception as exc:
            log.warning("settlement %s failed: %s", kind.value, type(exc).__name__)
            return _evidence(evidence.handoff, SettleState.FAILED, evidence.authority, kind)
        if evidence is _FRESH_EVIDENCE and kind is StepKind.ACK:
            return _ACKED_EVIDENCE  # the common path, without a cache lookup
        return _evidence(evidence.handoff, SettleState.SENT, evidence.authority, kind)

    async def _handoff(
        self,
        qr: QueueRuntime,
        message: InboundMessage,
        envelope: Envelope | None,
        step: Step,
        budget: Budget,
    ) -> None:
        options = qr.options
        headers, _ = sanitize_headers(message.headers)
        if step.kind is StepKind.PUBLISH_RETRY:
            assert step.retry_count is not None
            routing_key = options.bucket_name(options.retry.bucket_for(budget.retry_count))
            headers[RETRY_COUNT_HEADER] = step.retry_count
        else:
            routing_key = options.dlq_name
            if envelope is not None:
                headers[RETRY_COUNT_HEADER] = envelope.retry_count
            else:
                headers.pop(RETRY_COUNT_HEADER, None)
        headers["x-lily-failure-code"] = truncate_utf8(step.code or "", BOUNDS.failure_code_bytes)
        headers["x-lily-failure-reason"] = sanitize(step.reason, BOUNDS.failure_reason_bytes)
        headers["x-lily-failed-queue"] = options.name
        headers["x-lily-failed-at"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")
        channel = self.handoff_channel
        if channel is None or channel.is_closed:
            raise PublishError("closed", "the handoff channel is closed")
        try:
            underlay = await channel.get_underlay_channel()
        except Exception as exc:
            raise PublishError("closed", f"the handoff channel is unavailable ({type(exc).__name__})") from exc
        await republish(underlay, message, routing_key=routing_key, headers=headers, timeout=self.confirm_timeout)

    def snapshots(self) -> tuple[QueueSnapshot, ...]:
        return tuple(qr.snapshot() for qr in self.queues.values())


@functools.cache
def _evidence(handoff: HandoffState, settle: SettleState, authority: bool, settled_with: StepKind | None) -> Evidence:
    """Evidence values are immutable and few: share one instance per combination."""
    return Evidence(handoff, settle, authority, settled_with)


_FRESH_EVIDENCE = _evidence(HandoffState.NONE, SettleState.NONE, True, None)
_ACKED_EVIDENCE = _evidence(HandoffState.NONE, SettleState.SENT, True, StepKind.ACK)
_SUCCESS_BUDGET = Budget()
_SUCCESS = PipelineResult(Outcome.SUCCESS)
_UNRESOLVED = Terminal.UNRESOLVED.value
_REASON_BYTES = BOUNDS.failure_reason_bytes
_SUCCESS_FIRST_STEP = decide(_SUCCESS, _SUCCESS_BUDGET, _FRESH_EVIDENCE)  # ACK
_SUCCESS_LAST_STEP = decide(_SUCCESS, _SUCCESS_BUDGET, _ACKED_EVIDENCE)  # DONE: acked


def _bump(counts: collections.OrderedDict[bytes, int], key: bytes) -> int:
    """Increment a bounded per-delivery counter (least recently used entries are forgotten)."""
    counts[key] = counts.get(key, 0) + 1
    counts.move_to_end(key)
    while len(counts) > _COUNTER_MEMORY:
        counts.popitem(last=False)
    return counts[key]


def _channel_alive(message: InboundMessage) -> bool:
    """True while the delivery's own channel (its transport generation) is open."""
    return not message.channel.is_closed


def _failure_key(message: InboundMessage, envelope: Envelope | None) -> bytes:
    """Identity of a delivery across redeliveries, for the handoff-failure counter."""
    if envelope is not None:
        return envelope.event_id.bytes
    digest = hashlib.blake2b(message.body, digest_size=16)
    digest.update(message.routing_key.encode())
    digest.update((message.message_id or "").encode())
    return digest.digest()


def _arguments(route: HandlerRoute, delivery: RawDelivery, scope: MongoScope | None, payload: Any) -> dict[str, Any]:
    """The handler's keyword arguments for one attempt."""
    kwargs: dict[str, Any] = {}
    for p in route.parameters:
        if p.extractor is None:
            kwargs[p.name] = scope
        elif p.extractor.terminal and payload is not NOT_DECODED:
            kwargs[p.name] = payload  # decoded once in _prepare (first attempt only)
        else:
            kwargs[p.name] = p.extractor.extract(delivery)
    return kwargs


def _bind_middleware(
    middleware: Callable[[DeliveryContext, Callable[[], Awaitable[None]]], Awaitable[None]],
    ctx: DeliveryContext,
    call_next: Callable[[], Awaitable[None]],
) -> Callable[[], Awaitable[None]]:
    async def call() -> None:
        await middleware(ctx, call_next)

    return call


def new_owner_id() -> str:
    """A unique owner id for lease documents: one per attempt."""
    return uuid.uuid4().hex
