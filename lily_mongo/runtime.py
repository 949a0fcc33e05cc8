"""The delivery pipeline: intake, admission, envelope, dispatch, execution, settlement.

One :class:`Runtime` per started consumer. Per physical queue it owns a
channel (so prefetch and admission are per queue and a slow queue never
starves another), a local buffer fed by the broker callback, and an intake
loop that admits deliveries through the queue's permits. Each admitted
delivery runs in a task of the supervisor's :class:`TaskSet`.

Settlement follows :func:`settlement.decide`; every ACK/NACK is written at most
once, on the delivery's own channel, and only while that channel is alive and
authority has not been revoked by a forced shutdown.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import hashlib
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aio_pika
import aio_pika.abc
import aiormq.exceptions

from ._amqp import basic_publish
from ._text import truncate_utf8
from .bounds import BOUNDS
from .envelope import RETRY_COUNT_HEADER, Envelope, sanitize_headers, validate_envelope
from .errors import EnvelopeError, ErrorCode, PublishError, QueueHandlerError
from .extractors import PayloadDecodeError, RawDelivery
from .observe import ObservationLog, QueueCounters, QueueSnapshot, TerminalObservation
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

_HANDOFF_FAILURE_MEMORY = 4096


class TaskSet:
    """The supervisor's task group: every task it spawns is tracked until it ends.

    Unlike :class:`asyncio.TaskGroup`, one task's failure does not cancel the
    others, and shutdown can join with a window and observe what did not end.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
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


@dataclass(slots=True)
class _Prepared:
    route: HandlerRoute
    delivery: RawDelivery


class QueueRuntime:
    """Per physical queue state: options, channel, buffer, permits, counters."""

    def __init__(self, index: int, options: QueueOptions) -> None:
        self.index = index
        self.options = options
        self.permits = asyncio.Semaphore(options.concurrency)
        self.buffer: collections.deque[aio_pika.abc.AbstractIncomingMessage] = collections.deque()
        self.wakeup = asyncio.Event()
        self.channel: aio_pika.abc.AbstractChannel | None = None
        self.queue: aio_pika.abc.AbstractQueue | None = None
        self.consumer_tag: str | None = None
        self.in_flight = 0
        self.counters = QueueCounters()
        self.handoff_failures: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.dlq_unroutable = False

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
        self.accepting = False
        self.revoked = False
        self.forcing = False
        self.delivery_tasks: set[asyncio.Task[Any]] = set()
        self.execution_tasks: set[asyncio.Task[Any]] = set()
        self._intake_tasks: list[asyncio.Task[Any]] = []
        self.settled_during_shutdown: collections.Counter[str] = collections.Counter()
        self.shutting_down = False

    # -- start / stop -----------------------------------------------------------------

    async def start(self) -> None:
        """Open the handoff channel and one consuming channel per queue; start intake."""
        self.handoff_channel = await self.connection.channel(publisher_confirms=True, on_return_raises=True)
        self.accepting = True
        for qr in self.queues.values():
            channel = await self.connection.channel(publisher_confirms=False)
            await channel.set_qos(prefetch_count=qr.options.effective_prefetch)
            qr.channel = channel
            qr.queue = await channel.declare_queue(qr.options.name, passive=True)
            qr.consumer_tag = await qr.queue.consume(self._callback(qr), no_ack=False)
            self._intake_tasks.append(self.tasks.spawn(self._intake(qr), name=f"lily-intake-{qr.index}"))

    def on_reconnect(self) -> None:
        """A new transport generation: old deliveries have lost settlement authority."""
        self.generation += 1

    def _callback(self, qr: QueueRuntime) -> Callable[[aio_pika.abc.AbstractIncomingMessage], Awaitable[None]]:
        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            qr.counters.received += 1
            if not self.accepting:
                # Intake stopped: give it back at once (it was never started).
                await self._return_unstarted(message)
                return
            qr.buffer.append(message)
            qr.wakeup.set()

        return on_message

    async def _return_unstarted(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        if _channel_alive(message):
            try:
                await message.nack(requeue=True)
            except Exception:  # the channel died meanwhile: the broker requeues it anyway
                log.debug("returning an unstarted delivery failed", exc_info=True)

    async def _intake(self, qr: QueueRuntime) -> None:
        while self.accepting:
            if not qr.buffer:
                qr.wakeup.clear()
                await qr.wakeup.wait()
                continue
            await qr.permits.acquire()
            if not self.accepting or not qr.buffer:
                qr.permits.release()
                continue
            message = qr.buffer.popleft()
            task = self.tasks.spawn(self._deliver(qr, message, self.generation), name="lily-delivery")
            self.delivery_tasks.add(task)
            task.add_done_callback(self.delivery_tasks.discard)

    async def stop_intake(self) -> list[BaseException]:
        """Cancel consumers, stop the intake loops and return buffered (unstarted) deliveries."""
        errors: list[BaseException] = []
        self.accepting = False
        for qr in self.queues.values():
            qr.wakeup.set()
            if qr.queue is not None and qr.consumer_tag is not None and qr.channel and not qr.channel.is_closed:
                try:
                    await qr.queue.cancel(qr.consumer_tag)
                except Exception as exc:
                    errors.append(exc)
        for task in self._intake_tasks:
            task.cancel()
        if self._intake_tasks:
            await asyncio.wait(self._intake_tasks)
        for qr in self.queues.values():
            while qr.buffer:
                await self._return_unstarted(qr.buffer.popleft())
        return errors

    # -- one delivery -------------------------------------------------------------------

    async def _deliver(self, qr: QueueRuntime, message: aio_pika.abc.AbstractIncomingMessage, generation: int) -> None:
        received_at = time.time()
        started = time.monotonic()
        qr.in_flight += 1
        envelope: Envelope | None = None
        route: HandlerRoute | None = None
        execution = Execution(PipelineResult(Outcome.RETRYABLE, ErrorCode.HANDLER_FAILED, "not run"))
        evidence = Evidence()
        step: Step | None = None
        try:
            prepared = self._prepare(qr, message)
            if isinstance(prepared, _Prepared):
                envelope, route = prepared.delivery.envelope, prepared.route
                execution = await self._execute_with_deadline(qr, prepared)
            else:
                execution = Execution(prepared[0])
                envelope = prepared[1]
            step, evidence = await self._settle(qr, message, envelope, execution)
        finally:
            qr.in_flight -= 1
            qr.permits.release()
            terminal = step.terminal.value if step is not None and step.terminal else Terminal.UNRESOLVED.value
            if step is None:
                qr.counters.unresolved += 1
            qr.counters.outcomes[terminal] += 1
            if self.shutting_down:
                self.settled_during_shutdown[terminal] += 1
            qr.counters.transient_replays += execution.transient_replays
            qr.counters.reconciliations += execution.reconciliations
            self.observations.append(
                TerminalObservation(
                    queue=qr.options.name,
                    handler_id=route.handler_id if route else None,
                    event_id=envelope.event_id if envelope else None,
                    outcome=terminal,
                    code=(step.code if step is not None else None) or execution.result.code,
                    reason=truncate_utf8(
                        step.reason if step is not None and step.reason else execution.result.reason,
                        BOUNDS.failure_reason_bytes,
                    ),
                    handoff_confirmed=evidence.handoff is HandoffState.CONFIRMED,
                    ack_sent=evidence.settled_with is StepKind.ACK and evidence.settle is SettleState.SENT,
                    broker_native=evidence.settled_with is StepKind.REJECT,
                    attempts=execution.attempts,
                    transient_replays=execution.transient_replays,
                    reconciliations=execution.reconciliations,
                    received_at=received_at,
                    duration=time.monotonic() - started,
                )
            )

    def _prepare(
        self, qr: QueueRuntime, message: aio_pika.abc.AbstractIncomingMessage
    ) -> _Prepared | tuple[PipelineResult, Envelope | None]:
        """Envelope, dispatch and payload decode: all before any scope or middleware opens."""
        options = qr.options
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
        delivery = RawDelivery(
            queue=options.name,
            headers=message.headers,
            body=message.body,
            content_type=message.content_type,
            redelivered=bool(message.redelivered),
            envelope=envelope,
            routing_key=message.routing_key or "",
            exchange=message.exchange or "",
        )
        terminal = target.terminal
        if terminal is not None and terminal.extractor is not None:
            try:
                terminal.extractor.extract(delivery)
            except PayloadDecodeError as exc:
                return PipelineResult(Outcome.PERMANENT, ErrorCode.PAYLOAD_DECODE_FAILED, str(exc)), envelope
            except Exception as exc:
                reason = f"{type(exc).__name__}: {exc}"
                return PipelineResult(Outcome.PERMANENT, ErrorCode.PAYLOAD_DECODE_FAILED, reason), envelope
        return _Prepared(target, delivery)

    async def _execute_with_deadline(self, qr: QueueRuntime, prepared: _Prepared) -> Execution:
        """Run the execution under the delivery cutoff; on cutoff cancel, cooperate, then drop."""
        options = qr.options
        task = self.tasks.spawn(self._execute(qr, prepared), name="lily-execution")
        self.execution_tasks.add(task)
        task.add_done_callback(self.execution_tasks.discard)
        try:
            done, _ = await asyncio.wait({task}, timeout=options.deadline)
            if not done:
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=options.cooperation_window)
                if not done:
                    qr.counters.abandoned += 1
                reason = f"handler exceeded the delivery deadline of {options.deadline:g} s"
                return Execution(PipelineResult(Outcome.RETRYABLE, ErrorCode.HANDLER_TIMEOUT, reason), attempts=1)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task.cancelled():
            if self.forcing:
                # A forced shutdown is an infrastructure event, not an application failure:
                # requeue without spending a retry.
                reason = "cancelled by a forced shutdown"
                return Execution(PipelineResult(Outcome.DEFERRED, "SHUTDOWN", reason), attempts=1)
            reason = "execution was cancelled"
            return Execution(PipelineResult(Outcome.RETRYABLE, ErrorCode.HANDLER_TIMEOUT, reason), attempts=1)
        execution: Execution = task.result()
        return execution

    async def _execute(self, qr: QueueRuntime, prepared: _Prepared) -> Execution:
        route = prepared.route
        if route.guarantee == "inbox":
            assert self.inbox is not None
            return await self.inbox.execute(self, qr, prepared.route, prepared.delivery)
        result = await self.run_attempt(qr, route, prepared.delivery, attempt=1, scope=None)
        return Execution(result, attempts=1)

    async def run_attempt(
        self,
        qr: QueueRuntime,
        route: HandlerRoute,
        delivery: RawDelivery,
        *,
        attempt: int,
        scope: MongoScope | None,
    ) -> PipelineResult:
        """One fresh middleware/guards/handler invocation; exceptions become a verdict.

        Exceptions the inbox must see itself (database errors carrying
        transaction labels) are re-raised through :meth:`Inbox.reraise`.
        """
        ctx = DeliveryContext(qr.options.name, route, delivery, attempt)
        try:
            await self._invoke(ctx, scope)
        except QueueHandlerError as exc:
            outcome = Outcome.RETRYABLE if exc.is_retryable else Outcome.PERMANENT
            return PipelineResult(outcome, truncate_utf8(exc.code, BOUNDS.failure_code_bytes), exc.message)
        except Exception as exc:
            if self.inbox is not None and scope is not None:
                self.inbox.reraise_transaction_error(exc)
            outcome = Outcome.RETRYABLE if qr.options.unknown_errors == "retryable" else Outcome.PERMANENT
            return PipelineResult(outcome, ErrorCode.HANDLER_FAILED, f"{type(exc).__name__}: {exc}")
        return PipelineResult(Outcome.SUCCESS)

    async def _invoke(self, ctx: DeliveryContext, scope: MongoScope | None) -> None:
        route = ctx.handler
        delivery = ctx.delivery

        async def call_handler() -> None:
            for guard in route.guards:
                await guard(ctx)
            kwargs = {
                p.name: (scope if p.extractor is None else p.extractor.extract(delivery)) for p in route.parameters
            }
            await route.fn(**kwargs)

        call: Callable[[], Awaitable[None]] = call_handler
        for middleware in reversed(route.middleware):
            call = _bind_middleware(middleware, ctx, call)
        await call()

    # -- settlement ---------------------------------------------------------------------

    def _authority(self, message: aio_pika.abc.AbstractIncomingMessage) -> bool:
        return not self.revoked and _channel_alive(message)

    async def _settle(
        self,
        qr: QueueRuntime,
        message: aio_pika.abc.AbstractIncomingMessage,
        envelope: Envelope | None,
        execution: Execution,
    ) -> tuple[Step, Evidence]:
        options = qr.options
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
        evidence = Evidence()
        result = execution.result
        if result.outcome is Outcome.DEFERRED:
            qr.counters.deferrals += 1
        while True:
            step = decide(result, budget, dataclasses.replace(evidence, authority=self._authority(message)))
            if step.kind in (StepKind.DONE, StepKind.UNRESOLVED):
                if step.kind is StepKind.UNRESOLVED:
                    qr.counters.unresolved += 1
                return step, evidence
            if step.kind in (StepKind.PUBLISH_RETRY, StepKind.PUBLISH_DLQ):
                try:
                    await self._handoff(qr, message, envelope, step, budget)
                    evidence = dataclasses.replace(evidence, handoff=HandoffState.CONFIRMED)
                    qr.handoff_failures.pop(key, None)
                    if step.kind is StepKind.PUBLISH_DLQ:
                        qr.dlq_unroutable = False
                except PublishError as exc:
                    to_dlq = step.kind is StepKind.PUBLISH_DLQ
                    log.warning("handoff to %s failed: %s", "the DLQ" if to_dlq else "a retry bucket", exc.kind)
                    evidence = dataclasses.replace(evidence, handoff=HandoffState.FAILED)
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
        failures = qr.handoff_failures
        failures[key] = failures.get(key, 0) + 1
        failures.move_to_end(key)
        while len(failures) > _HANDOFF_FAILURE_MEMORY:
            failures.popitem(last=False)

    def _requeue_backoff(self, qr: QueueRuntime, execution: Execution, budget: Budget, evidence: Evidence) -> float:
        """Short jittered pause before a requeue so a held lease does not cause a hot loop."""
        count = budget.deferrals if evidence.handoff is not HandoffState.FAILED else budget.handoff_failures
        delay = min(0.05 * (2 ** min(count, 6)), 2.0) * random.uniform(0.5, 1.0)
        if execution.backoff_limit is not None:
            delay = min(delay, max(execution.backoff_limit, 0.0))
        return float(min(delay, qr.options.cooperation_window))

    async def _write_settlement(
        self, message: aio_pika.abc.AbstractIncomingMessage, kind: StepKind, evidence: Evidence
    ) -> Evidence:
        try:
            if kind is StepKind.ACK:
                await message.ack()
            elif kind is StepKind.NACK_REQUEUE:
                await message.nack(requeue=True)
            else:
                await message.reject(requeue=False)
        except Exception as exc:
            log.warning("settlement %s failed: %s", kind.value, type(exc).__name__)
            return dataclasses.replace(evidence, settle=SettleState.FAILED, settled_with=kind)
        return dataclasses.replace(evidence, settle=SettleState.SENT, settled_with=kind)

    async def _handoff(
        self,
        qr: QueueRuntime,
        message: aio_pika.abc.AbstractIncomingMessage,
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
        headers["x-lily-failure-reason"] = truncate_utf8(_printable(step.reason), BOUNDS.failure_reason_bytes)
        headers["x-lily-failed-queue"] = options.name
        headers["x-lily-failed-at"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")
        channel = self.handoff_channel
        if channel is None or channel.is_closed:
            raise PublishError("closed", "the handoff channel is closed")
        try:
            underlay = await channel.get_underlay_channel()
        except Exception as exc:
            raise PublishError("closed", f"the handoff channel is unavailable ({type(exc).__name__})") from exc
        await basic_publish(
            underlay,
            exchange="",
            routing_key=routing_key,
            body=message.body,
            headers=headers,
            content_type=message.content_type,
            timeout=self.confirm_timeout,
        )

    def snapshots(self) -> tuple[QueueSnapshot, ...]:
        return tuple(qr.snapshot() for qr in self.queues.values())


def _channel_alive(message: aio_pika.abc.AbstractIncomingMessage) -> bool:
    """True while the delivery's own channel is open (aio-pika raises once it is closed)."""
    try:
        return not message.channel.is_closed
    except (aiormq.exceptions.AMQPError, aiormq.exceptions.ChannelInvalidStateError):
        return False


def _failure_key(message: aio_pika.abc.AbstractIncomingMessage, envelope: Envelope | None) -> bytes:
    """Identity of a delivery across redeliveries, for the handoff-failure counter."""
    if envelope is not None:
        return envelope.event_id.bytes
    digest = hashlib.blake2b(message.body, digest_size=16)
    digest.update((message.routing_key or "").encode())
    digest.update((message.message_id or "").encode())
    return digest.digest()


def _printable(text: str) -> str:
    return "".join(ch if ch.isprintable() else "?" for ch in text[: BOUNDS.failure_reason_bytes])


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
