"""The engine: intake, admission, deadlines, and driving each delivery to its settlement.

One :class:`Runtime` per started consumer. Per physical queue it owns a
channel (so prefetch and admission are per queue and a slow queue never
starves another), a number of free admission permits and a local buffer.
The broker callback admits a delivery at once while a permit is free, and
buffers it otherwise. An admitted delivery starts an eager worker task of the
supervisor's :class:`TaskSet` (it runs at once, in the callback's turn of the
event loop, up to its first suspension); a worker runs one delivery at a time
and takes the next buffered one itself when it finishes, so a saturated queue
costs no task creation per delivery.

For each delivery the engine calls :func:`dispatch.prepare`, then runs the
handler (through the inbox for inbox handlers) under the delivery deadline,
then drives :func:`settlement.settle`, performing its steps on the delivery's
own channel: every ACK/NACK is written at most once, and only while that
channel is alive and authority has not been revoked by a forced shutdown.

Two small state machines, each moving only forward: the engine's :class:`Phase`
(changed only by :meth:`Runtime._enter`) and each delivery's :class:`Stage`.
The deadline path (docs/lifecycle.md, section 5) is one method,
:meth:`Runtime._enforce_deadline`. A delivery's state (:class:`_Delivery`) is
apart from the effects its settlement performs (:class:`_Effects`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import functools
import hashlib
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import aio_pika
import aio_pika.abc
import aiormq.abc

from .._amqp import AckCoalescer, InboundMessage, republish, unbounded_frame_queue
from .._backoff import backoff
from .._errors import ErrorCode, PublishError
from .._lru import LruCounter
from .._observer import NO_DELIVERY, NO_OBSERVER, DeliveryObserver, Observer
from .._plan.plan import Plan, QueueOptions
from .._snapshots import ObservationLog, QueueCounters, QueueSnapshot
from .._tasks import TaskSet
from .._text import truncate_utf8
from ..bounds import BOUNDS
from ..envelope import DELIVERY_COUNT_HEADER, Envelope
from .dispatch import NO_SERVICES, Inbound, Prepared, Services, invoke, prepare
from .failures import FailureLog
from .settlement import (
    NO_BUDGET,
    Budget,
    Evidence,
    Execution,
    HandoffState,
    Outcome,
    PipelineResult,
    SettleState,
    Step,
    StepKind,
    Terminal,
    handoff_headers,
    settle,
)

if TYPE_CHECKING:
    from .._inbox.inbox import Inbox, MongoScope
    from .._plan.extractors import RawDelivery

__all__ = ["Handoff", "Phase", "Received", "Runtime", "Stage"]

log = logging.getLogger("lily_mongo")

_COUNTER_MEMORY = 4096  # events remembered per queue for the handoff-failure and deferral counts
# The pause before a requeue (docs/settlement.md, section 4): 0.05 s doubling per deferral
# (or handoff failure) so far, capped at 2 s, at least half of that.
_REQUEUE_PAUSE_BASE = 0.05
_REQUEUE_PAUSE_CAP = 2.0
_UNRESOLVED = Terminal.UNRESOLVED.value
_ACKED = Terminal.ACKED.value
# Terminal outcomes an operator must hear about (one line each); the others are logged at DEBUG.
_WARNED = frozenset({Terminal.DEAD_LETTERED.value, Terminal.BROKER_DEAD_LETTERED.value, _UNRESOLVED})
_REASON_BYTES = BOUNDS.failure_reason_bytes


class _ChannelState(Protocol):
    @property
    def is_closed(self) -> bool: ...


class Received(Inbound, Protocol):
    """One received delivery as the engine reads and settles it (:class:`_amqp.InboundMessage`,
    or an in-process transport's message): each settlement method is called at most once."""

    @property
    def message_id(self) -> str | None: ...
    @property
    def channel(self) -> _ChannelState: ...
    async def ack(self) -> None: ...
    async def nack(self, *, requeue: bool = True) -> None: ...
    async def reject(self, *, requeue: bool = False) -> None: ...


Handoff = Callable[[Received, str, Mapping[str, Any]], Awaitable[None]]
"""``handoff(message, routing_key, headers)``: publish a retry or DLQ copy of ``message``,
mandatory and confirmed, raising :class:`PublishError` unless the destination accepted it."""


class Phase(enum.Enum):
    """Where the engine is in its life; each phase only ever moves forward."""

    NEW = 0
    RUNNING = 1  # consuming and admitting
    DRAINING = 2  # intake stopped; running deliveries finish and settle
    FORCING = 3  # the force notice: handlers are cancelled, deliveries may still settle
    REVOKED = 4  # settlement authority revoked: nothing more is written


class Stage(enum.Enum):
    """Where one delivery is; each stage only ever moves forward (docs/lifecycle.md, section 5).

    ``RECEIVED`` → ``EXECUTING`` → ``SETTLING`` → ``FINISHED`` is the usual path (a
    delivery refused while preparing goes straight to ``SETTLING``). Past its deadline an
    execution is ``CUT_OFF``: it was cancelled, and either ends within the cooperation window
    (``SETTLING``, in its own task) or is ``DROPPED`` and settled from another task. After a
    forced shutdown any stage may jump to ``FINISHED``, recorded unresolved.
    """

    RECEIVED = 0  # admitted: envelope, handler and payload are being prepared
    EXECUTING = 1  # the handler runs, under the delivery deadline
    CUT_OFF = 2  # past the deadline: its task was cancelled, the cooperation window runs
    SETTLING = 3  # the execution has its verdict: the delivery's own task settles it
    DROPPED = 4  # the handler ignored the cancellation: another task settles the delivery
    FINISHED = 5  # its permit came back and its terminal outcome was recorded


# The hot path reads these as globals (an enum member's attribute lookup costs more).
_RECEIVED, _EXECUTING, _CUT_OFF, _SETTLING, _DROPPED, _FINISHED = Stage
_RUNNING, _FORCING, _REVOKED = Phase.RUNNING, Phase.FORCING, Phase.REVOKED


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
        self.acks: AckCoalescer | None = None  # the current channel's ACK coalescer (ack_delay > 0)
        self.in_flight = 0
        self.counters = QueueCounters()
        self.handoff_failures: LruCounter[bytes] = LruCounter(_COUNTER_MEMORY)
        self.dlq_unroutable = False
        self.deferral_counts: LruCounter[bytes] = LruCounter(_COUNTER_MEMORY)

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
            handoff_failures=c.handoff_failures,
        )


@dataclass(slots=True, eq=False)
class _Delivery:
    """One admitted delivery's state: shared by its worker, the deadline sweeper and, once
    dropped, the task that settles it."""

    qr: QueueRuntime
    message: Received
    received_at: float = dataclasses.field(default_factory=time.time)
    started: float = dataclasses.field(default_factory=time.monotonic)
    stage: Stage = Stage.RECEIVED
    envelope: Envelope | None = None
    handler_id: str | None = None
    execution: Execution | None = None
    executing_since: float = 0.0  # time.monotonic() when the execution started (its deadline counts from it)
    settle_task: asyncio.Task[Any] | None = None  # set once dropped: the task settling it instead of its own
    failure_key: bytes = b""
    trace: DeliveryObserver = NO_DELIVERY
    event_id: uuid.UUID | None = None  # a refused delivery's event id (its header was valid); else the envelope's


class _Effects:
    """The :class:`settlement.SettleEffects` of one delivery: what :func:`settlement.settle`
    performs its steps through (the delivery's channel, the runtime's handoff channel)."""

    __slots__ = ("delivery", "runtime")

    def __init__(self, runtime: Runtime, delivery: _Delivery) -> None:
        self.runtime = runtime
        self.delivery = delivery

    def authority(self) -> bool:
        return self.runtime.phase is not _REVOKED and not self.delivery.message.channel.is_closed

    async def handoff(self, step: Step, budget: Budget) -> bool:
        delivery = self.delivery
        qr = delivery.qr
        try:
            await self.runtime.publish_handoff(delivery, step, budget)
        except PublishError as exc:
            to_dlq = step.kind is StepKind.PUBLISH_DLQ
            qr.counters.handoff_failures += 1
            event_id = delivery.envelope.event_id if delivery.envelope else delivery.event_id
            log.warning(
                "handoff to %s failed: %s (queue=%s handler=%s event_id=%s outcome=%s%s)",
                "the DLQ" if to_dlq else "a retry bucket",
                exc.kind,
                qr.options.name,
                delivery.handler_id,
                event_id,
                "handoff_failed",
                f" code={step.code}" if step.code is not None else "",
                extra=_log_fields(qr.options.name, delivery.handler_id, event_id, "handoff_failed", step.code),
            )
            qr.handoff_failures.bump(delivery.failure_key)
            if to_dlq and exc.kind == "unroutable":
                qr.dlq_unroutable = True
            return False
        qr.handoff_failures.forget(delivery.failure_key)
        if step.kind is StepKind.PUBLISH_DLQ:
            qr.dlq_unroutable = False
        return True

    def dead_letter_fallback(self) -> bool:
        return not self.delivery.qr.dlq_unroutable

    async def pause_before_requeue(self, budget: Budget, evidence: Evidence) -> None:
        """Short jittered pause before a requeue so a held lease does not cause a hot loop."""
        count = budget.deferrals if evidence.handoff is not HandoffState.FAILED else budget.handoff_failures
        delay = backoff(count, base=_REQUEUE_PAUSE_BASE, cap=_REQUEUE_PAUSE_CAP, jitter=random.random())
        execution = self.delivery.execution
        limit = execution.backoff_limit if execution is not None else None
        if limit is not None:
            delay = min(delay, max(limit, 0.0))
        await asyncio.sleep(float(min(delay, self.delivery.qr.options.cooperation_window)))

    async def write(self, kind: StepKind) -> bool:
        message = self.delivery.message
        try:
            if kind is StepKind.ACK:
                await message.ack()
            elif kind is StepKind.NACK_REQUEUE:
                await message.nack(requeue=True)
            else:
                await message.reject(requeue=False)
        except Exception as exc:
            log.warning("settlement %s failed: %s", kind.value, type(exc).__name__)
            return False
        return True


class Runtime:
    """Runs the plan's queues on one AMQP connection; owned by the lifecycle supervisor."""

    def __init__(
        self,
        plan: Plan,
        connection: aio_pika.abc.AbstractConnection | None,
        tasks: TaskSet,
        *,
        inbox: Inbox | None,
        confirm_timeout: float,
        handoff: Handoff | None = None,
        observer: Observer = NO_OBSERVER,
        services: Services = NO_SERVICES,
    ) -> None:
        """``connection`` is the AMQP connection to consume from; None for an in-process
        transport, which feeds :meth:`deliver` and passes its own ``handoff``. ``observer``
        is what the engine reports to (a :class:`~lily_mongo.telemetry.Telemetry`, or nothing).
        ``services``: the database and lifespan resources handlers may ask for (docs/handlers.md)."""
        self.plan = plan
        self.services = services
        self.connection = connection
        self._handoff: Handoff = handoff or self._handoff_on_channel
        self.tasks = tasks
        self.inbox = inbox
        self.confirm_timeout = confirm_timeout
        self.observer = observer
        self.queues = {name: QueueRuntime(i, opts) for i, (name, opts) in enumerate(plan.queues.items())}
        self.observations = ObservationLog()
        self.handoff_channel: aio_pika.abc.AbstractChannel | None = None
        self.generation = 1
        self._transport: object | None = None  # the connection's transport the generation counts
        self.phase = Phase.NEW
        self.deliveries: dict[asyncio.Task[Any], _Delivery] = {}
        self.settled_during_shutdown: collections.Counter[str] = collections.Counter()
        self.failures = FailureLog()  # handler failures with their tracebacks, rate-limited per handler

    @property
    def accepting(self) -> bool:
        return self.phase is _RUNNING

    def _enter(self, phase: Phase) -> None:
        """Move on to ``phase``; a phase the engine is already at or past changes nothing."""
        if phase.value > self.phase.value:
            self.phase = phase

    # -- start / intake -----------------------------------------------------------------
    def open_in_process(self) -> None:
        """Accept deliveries through :meth:`deliver` (an in-process transport; no AMQP)."""
        self._enter(Phase.RUNNING)
        self.tasks.spawn(self._sweep_deadlines(), name="lily-deadlines")

    async def deliver(self, queue: str, message: Received) -> BaseException | None:
        """Run one delivery of ``queue`` to its end in this task, like a consumed one.

        For in-process transports: it takes one of the queue's permits (the caller keeps
        within the queue's concurrency) and records the outcome in the observations.
        Returns what its handler raised on the last attempt (None when nothing did).
        """
        qr = self.queues[queue]
        qr.counters.received += 1
        qr.free_permits -= 1
        qr.in_flight += 1
        delivery = _Delivery(qr, message)
        task = asyncio.current_task()
        assert task is not None
        self.deliveries[task] = delivery
        try:
            await self._deliver(delivery)
        finally:
            self.deliveries.pop(task, None)
        return delivery.execution.result.exception if delivery.execution is not None else None

    async def start(self) -> None:
        """Open the handoff channel and one consuming channel per queue; start intake."""
        assert self.connection is not None
        self._transport = getattr(self.connection, "transport", None)
        self.handoff_channel = await self.connection.channel(publisher_confirms=True, on_return_raises=True)
        self._enter(Phase.RUNNING)
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
        unbounded_frame_queue(underlay)
        # One coalescer per channel object: a reopened channel gets a fresh one, so no ACK
        # marked on the old channel is ever written on the new (docs/settlement.md, generations).
        acks = None
        if qr.options.ack_delay > 0:
            acks = AckCoalescer(underlay, qr.options.ack_delay, functools.partial(self.tasks.spawn, name="lily-acks"))
        qr.acks = acks
        consuming = await underlay.basic_consume(qr.options.name, self._callback(qr, acks), no_ack=False)
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
            log.info("AMQP connection re-established: transport generation %d", self.generation)

    def _callback(
        self, qr: QueueRuntime, acks: AckCoalescer | None
    ) -> Callable[[aiormq.abc.DeliveredMessage], Coroutine[Any, Any, None]]:
        async def on_message(delivered: aiormq.abc.DeliveredMessage) -> None:
            qr.counters.received += 1
            message = InboundMessage(delivered, acks)
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
        delivery: _Delivery | None = first
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
            delivery = self._take_buffered(qr)

    # -- shutdown steps (called by the lifecycle supervisor, in this order) ---------------

    async def stop_intake(self) -> list[BaseException]:
        """Cancel consumers, stop admission and return buffered (unstarted) deliveries."""
        errors: list[BaseException] = []
        self._enter(Phase.DRAINING)
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

    def force_notice(self) -> None:
        """The force notice: cancel running handlers; their deliveries may still settle."""
        self._enter(Phase.FORCING)
        for task, delivery in list(self.deliveries.items()):
            if delivery.stage is _EXECUTING or delivery.stage is _CUT_OFF:
                task.cancel()

    def revoke(self) -> None:
        """Revoke settlement authority: from now on no ACK, NACK or handoff is written."""
        self._enter(Phase.REVOKED)
        for qr in self.queues.values():
            if qr.acks is not None:  # ACKs marked but not written are not written now
                qr.acks.drop("settlement authority revoked")

    async def close_channels(self) -> bool:
        """Write pending ACKs (unless revoked), then close the consuming and handoff channels;
        True once all of them are closed."""
        if self.phase is not _REVOKED:
            for qr in self.queues.values():
                if qr.acks is not None and qr.channel is not None and not qr.channel.is_closed:
                    try:
                        await qr.acks.flush()
                    except Exception as exc:  # the channel failed: its marks failed with it
                        log.warning("writing pending ACKs of %s failed: %s", qr.options.name, type(exc).__name__)
        channels = [qr.channel for qr in self.queues.values() if qr.channel is not None]
        if self.handoff_channel is not None:
            channels.append(self.handoff_channel)
        for channel in channels:
            if not channel.is_closed:
                await channel.close()
        return all(channel.is_closed for channel in channels)

    def channels_open(self) -> bool:
        """True while every consuming channel and the handoff channel is open."""
        channels = [qr.channel for qr in self.queues.values()] + [self.handoff_channel]
        return all(channel is not None and not channel.is_closed for channel in channels)

    def unsettled(self) -> set[asyncio.Task[Any]]:
        """Delivery tasks whose delivery has not reached a terminal outcome yet (zombies excluded)."""
        pending: set[asyncio.Task[Any]] = set()
        for task, delivery in self.deliveries.items():
            if delivery.stage is not _FINISHED:
                # A dropped delivery is being settled by a task of its own; wait for that one.
                pending.add(delivery.settle_task if delivery.settle_task is not None else task)
        return pending

    def abandon_unfinished(self) -> int:
        """After a forced shutdown: record every delivery that could not settle as unresolved.

        Its task, if it ever goes on, finds the delivery finished and discards what it returns.
        """
        count = 0
        for delivery in list(self.deliveries.values()):
            if delivery.stage is not _FINISHED:
                self._finish(delivery, None, None)
                count += 1
        return count

    # -- one delivery -------------------------------------------------------------------

    async def _deliver(self, delivery: _Delivery) -> None:
        """One delivery: prepare, execute (inline, under the deadline), settle, observe."""
        qr = delivery.qr
        step: Step | None = None
        evidence: Evidence | None = None
        try:
            delivery.trace = self.observer.delivery_started(qr.options.name, delivery.message.headers)
            prepared = prepare(self.plan, qr.options, delivery.message)
            if isinstance(prepared, Prepared):
                delivery.envelope, delivery.handler_id = prepared.delivery.envelope, prepared.route.handler_id
                execution = await self._execute(delivery, prepared)
                if delivery.stage is not _SETTLING:
                    return  # dropped (or abandoned): settled elsewhere, this late result is discarded
                delivery.execution = execution
                delivery.trace.executed(delivery.executing_since)
            else:
                delivery.stage = _SETTLING
                delivery.execution = Execution(prepared.result)
                delivery.envelope, delivery.event_id = prepared.envelope, prepared.event_id
            step, evidence = await self._settle(delivery)
        finally:
            if delivery.settle_task is None:  # not dropped: this task finishes it
                self._finish(delivery, step, evidence)
            delivery.trace.detach()

    async def _execute(self, delivery: _Delivery, prepared: Prepared) -> Execution:
        """Run the handler in this task (``EXECUTING``), to its verdict (``SETTLING``).

        Past its deadline it is cancelled (:meth:`_enforce_deadline`): the cancellation it
        lets through becomes the timeout verdict; at a force notice, the shutdown verdict.
        """
        options = delivery.qr.options
        delivery.executing_since = time.monotonic()
        delivery.stage = _EXECUTING
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
            cut_off = delivery.stage is _CUT_OFF
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
            if delivery.stage is _EXECUTING or delivery.stage is _CUT_OFF:  # not dropped meanwhile
                delivery.stage = _SETTLING

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

    async def _settle(self, delivery: _Delivery) -> tuple[Step, Evidence]:
        """Drive :func:`settlement.settle` with this delivery's budget and its effects."""
        execution = delivery.execution
        assert execution is not None
        result = execution.result
        effects = _Effects(self, delivery)
        if result.outcome is Outcome.SUCCESS or result.outcome is Outcome.DUPLICATE:
            return await settle(result, NO_BUDGET, effects)  # the budget only shapes failure paths
        qr, options, envelope = delivery.qr, delivery.qr.options, delivery.envelope
        delivery.failure_key = key = _failure_key(delivery.message, envelope)
        deferrals = execution.deferrals
        if result.outcome is Outcome.DEFERRED:
            qr.counters.deferrals += 1
            # The inbox counts every deferral in the event's record (docs/settlement.md, section 4);
            # where MongoDB could not count it, this process's count is the fallback, and on a
            # quorum queue before RabbitMQ 4.3 the broker's x-delivery-count bounds it as well.
            local = qr.deferral_counts.bump(key)
            delivery_count = delivery.message.headers.get(DELIVERY_COUNT_HEADER)
            broker = delivery_count if type(delivery_count) is int else 0
            deferrals = max(deferrals, local, broker)
        budget = Budget(
            retry_count=envelope.retry_count if envelope else 0,
            max_retries=options.retry.max_retries,
            deferrals=deferrals,
            max_deferrals=options.max_deferrals,
            handoff_failures=qr.handoff_failures.get(key, 0),
            max_handoff_failures=options.max_handoff_failures,
            dead_letter_fallback=not qr.dlq_unroutable,
        )
        return await settle(result, budget, effects)

    async def publish_handoff(self, delivery: _Delivery, step: Step, budget: Budget) -> None:
        """Publish the retry or DLQ copy of a delivery (on the confirming handoff channel, or the
        in-process transport's), in a ``PRODUCER`` span whose ``traceparent`` the copy carries."""
        options, message, envelope = delivery.qr.options, delivery.message, delivery.envelope
        if step.kind is StepKind.PUBLISH_RETRY:
            assert step.retry_count is not None
            routing_key = options.bucket_name(options.retry.bucket_for(budget.retry_count))
            retry_count: int | None = step.retry_count
        else:
            routing_key = options.dlq_name
            retry_count = envelope.retry_count if envelope is not None else None
        headers = handoff_headers(message.headers, step, retry_count=retry_count, failed_queue=options.name)
        await delivery.trace.handoff(
            functools.partial(self._handoff, message, routing_key),
            routing_key,
            headers,
            dead_letter=step.kind is StepKind.PUBLISH_DLQ,
            code=step.code,
        )

    async def _handoff_on_channel(self, message: Received, routing_key: str, headers: Mapping[str, Any]) -> None:
        """The AMQP handoff: a copy through the default exchange on the confirming handoff channel."""
        assert isinstance(message, InboundMessage)
        channel = self.handoff_channel
        if channel is None or channel.is_closed:
            raise PublishError("closed", "the handoff channel is closed")
        try:
            underlay = await channel.get_underlay_channel()
        except Exception as exc:
            raise PublishError("closed", f"the handoff channel is unavailable ({type(exc).__name__})") from exc
        await republish(underlay, message, routing_key=routing_key, headers=headers, timeout=self.confirm_timeout)

    def _finish(self, delivery: _Delivery, step: Step | None, evidence: Evidence | None) -> None:
        """Release the permit and record the terminal observation: exactly once per delivery."""
        if delivery.stage is _FINISHED:
            return
        delivery.stage = _FINISHED
        qr = delivery.qr
        qr.in_flight -= 1
        qr.free_permits += 1  # a worker takes buffered work itself; the drop path kicks
        evidence = evidence or Evidence()
        execution = delivery.execution or Execution(PipelineResult(Outcome.RETRYABLE, ErrorCode.HANDLER_FAILED, ""))
        terminal = step.terminal.value if step is not None and step.terminal else _UNRESOLVED
        counters = qr.counters
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
            queue=qr.options.name,
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
            _log_terminal(qr.options.name, delivery.handler_id, event_id, terminal, code, duration)

    def _report_failure(self, delivery: _Delivery, execution: Execution, terminal: str, event_id: Any) -> None:
        """What the handler raised, to the failure log (docs/handlers.md, section 5)."""
        result = execution.result
        assert result.exception is not None
        envelope = delivery.envelope
        self.failures.report(
            result.exception,
            queue=delivery.qr.options.name,
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
                if delivery.stage is _EXECUTING and now - delivery.executing_since >= delivery.qr.options.deadline:
                    self.tasks.spawn(self._enforce_deadline(delivery, task), name="lily-deadline", eager=True)

    async def _enforce_deadline(self, delivery: _Delivery, task: asyncio.Task[Any]) -> None:
        """One delivery past its cutoff, in order (docs/lifecycle.md, section 5):

        1. cut off: its task is cancelled; the cancellation the handler lets through becomes
           the timeout verdict (:meth:`_execute`), and its own task settles it;
        2. the handler gets the cooperation window to end;
        3. one that has not ended (it ignores the cancellation) is dropped: the delivery is
           settled here, from this task, and its handler's late result is discarded.
        """
        qr = delivery.qr
        delivery.stage = _CUT_OFF
        task.cancel()
        await asyncio.sleep(qr.options.cooperation_window)
        if delivery.stage is not _CUT_OFF or task.done():
            return  # it ended within the window
        delivery.stage = _DROPPED
        delivery.settle_task = asyncio.current_task()
        qr.counters.abandoned += 1
        reason = f"handler exceeded the delivery deadline of {qr.options.deadline:g} s and was dropped"
        delivery.execution = Execution(PipelineResult(Outcome.RETRYABLE, ErrorCode.HANDLER_TIMEOUT, reason), attempts=1)
        step: Step | None = None
        evidence: Evidence | None = None
        try:
            step, evidence = await self._settle(delivery)
        finally:
            self._finish(delivery, step, evidence)
            self._kick(qr)  # its permit came back outside a worker

    def snapshots(self) -> tuple[QueueSnapshot, ...]:
        return tuple(qr.snapshot() for qr in self.queues.values())


def _log_fields(
    queue: str, handler_id: str | None, event_id: object, outcome: str, code: str | None, duration: float | None = None
) -> dict[str, Any]:
    """The structured fields of a delivery's log line (read by JSON formatters); never payloads.

    ``code`` and ``duration_ms`` only when there is one (docs/observability.md, section 3).
    """
    fields: dict[str, Any] = {
        "queue": queue,
        "handler": handler_id,
        "event_id": str(event_id) if event_id is not None else None,
        "outcome": outcome,
    }
    if code is not None:
        fields["code"] = code
    if duration is not None:
        fields["duration_ms"] = round(duration * 1000, 3)
    return fields


def _log_terminal(
    queue: str, handler_id: str | None, event_id: object, outcome: str, code: str | None, duration: float
) -> None:
    """One line per delivery: WARNING for dead letters and unresolved outcomes, DEBUG for the rest.

    ``duration`` is receipt to terminal outcome, in seconds (the line says milliseconds).
    """
    level = logging.WARNING if outcome in _WARNED else logging.DEBUG
    if log.isEnabledFor(level):
        extra = _log_fields(queue, handler_id, event_id, outcome, code, duration)
        if code is None:
            message = "delivery %s: queue=%s handler=%s event_id=%s duration_ms=%.3f"
            log.log(level, message, outcome, queue, handler_id, event_id, extra["duration_ms"], extra=extra)
        else:
            message = "delivery %s: queue=%s handler=%s event_id=%s code=%s duration_ms=%.3f"
            log.log(level, message, outcome, queue, handler_id, event_id, code, extra["duration_ms"], extra=extra)


def _channel_alive(message: Received) -> bool:
    """True while the delivery's own channel (its transport generation) is open."""
    return not message.channel.is_closed


def _failure_key(message: Received, envelope: Envelope | None) -> bytes:
    """Identity of a delivery across redeliveries, for the handoff-failure and deferral counters."""
    if envelope is not None:
        return envelope.event_id.bytes
    digest = hashlib.blake2b(message.body, digest_size=16)
    digest.update(message.routing_key.encode())
    digest.update((message.message_id or "").encode())
    return digest.digest()
