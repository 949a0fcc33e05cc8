"""What settling one delivery performs: the :class:`~lily_mongo._engine.settlement.SettleEffects` of a
delivery (its channel's ACK/NACK, the handoff publish, the pause before a requeue).

:func:`~lily_mongo._engine.settlement.settle` decides each step; these effects perform it and report
what they observed (docs/settlement.md).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from typing import Protocol

from .._backoff import backoff
from .._errors import PublishError
from .delivery import Delivery
from .logs import log_fields
from .message import Handoff
from .settlement import Budget, Evidence, HandoffState, Step, StepKind, handoff_headers

__all__ = ["DeliveryEffects", "Settling"]

log = logging.getLogger("lily_mongo")

# The pause before a requeue (docs/settlement.md, section 4): 0.05 s doubling per deferral
# (or handoff failure) so far, capped at 2 s, at least half of that.
_REQUEUE_PAUSE_BASE = 0.05
_REQUEUE_PAUSE_CAP = 2.0


class Settling(Protocol):
    """What a delivery's effects need of the engine that settles it."""

    @property
    def has_authority(self) -> bool: ...
    @property
    def handoff(self) -> Handoff: ...


class DeliveryEffects:
    """The settlement effects of one delivery: its own channel, the engine's handoff."""

    __slots__ = ("delivery", "engine")

    def __init__(self, engine: Settling, delivery: Delivery) -> None:
        self.engine = engine
        self.delivery = delivery

    def authority(self) -> bool:
        held = self.engine.has_authority and not self.delivery.message.channel.is_closed
        if not held and self.delivery.barrier is not None:
            self.delivery.barrier.arrive(self.delivery)  # it writes nothing: its batch's ACKs need not wait
        return held

    async def handoff(self, step: Step, budget: Budget) -> bool:
        delivery = self.delivery
        qs = delivery.qs
        try:
            await self._publish_copy(step, budget)
        except PublishError as exc:
            to_dlq = step.kind is StepKind.PUBLISH_DLQ
            qs.counters.handoff_failures += 1
            event_id = delivery.envelope.event_id if delivery.envelope else delivery.event_id
            log.warning(
                "handoff to %s failed: %s (queue=%s handler=%s event_id=%s outcome=%s%s)",
                "the DLQ" if to_dlq else "a retry bucket",
                exc.kind,
                qs.options.name,
                delivery.handler_id,
                event_id,
                "handoff_failed",
                f" code={step.code}" if step.code is not None else "",
                extra=log_fields(qs.options.name, delivery.handler_id, event_id, "handoff_failed", step.code),
            )
            qs.handoff_failures.bump(delivery.failure_key)
            if to_dlq and exc.kind == "unroutable":
                qs.dlq_unroutable = True
            return False
        qs.handoff_failures.forget(delivery.failure_key)
        if step.kind is StepKind.PUBLISH_DLQ:
            qs.dlq_unroutable = False
        return True

    async def _publish_copy(self, step: Step, budget: Budget) -> None:
        """Publish the retry or DLQ copy (through the engine's handoff), in a ``PRODUCER`` span whose
        ``traceparent`` the copy carries."""
        delivery = self.delivery
        options, message, envelope = delivery.qs.options, delivery.message, delivery.envelope
        if step.kind is StepKind.PUBLISH_RETRY:
            assert step.retry_count is not None
            routing_key = options.bucket_name(options.retry.bucket_for(budget.retry_count))
            retry_count: int | None = step.retry_count
        else:
            routing_key = options.dlq_name
            retry_count = envelope.retry_count if envelope is not None else None
        headers = handoff_headers(message.headers, step, retry_count=retry_count, failed_queue=options.name)
        await delivery.trace.handoff(
            functools.partial(self.engine.handoff, message, routing_key),
            routing_key,
            headers,
            dead_letter=step.kind is StepKind.PUBLISH_DLQ,
            code=step.code,
        )

    def dead_letter_fallback(self) -> bool:
        return not self.delivery.qs.dlq_unroutable

    async def pause_before_requeue(self, budget: Budget, evidence: Evidence) -> None:
        """Short jittered pause before a requeue so a held lease does not cause a hot loop."""
        if self.delivery.barrier is not None:
            self.delivery.barrier.arrive(self.delivery)  # its batch's ACKs do not wait for its pause
        count = budget.deferrals if evidence.handoff is not HandoffState.FAILED else budget.handoff_failures
        delay = backoff(count, base=_REQUEUE_PAUSE_BASE, cap=_REQUEUE_PAUSE_CAP, jitter=random.random())
        execution = self.delivery.execution
        limit = execution.backoff_limit if execution is not None else None
        if limit is not None:
            delay = min(delay, max(limit, 0.0))
        await asyncio.sleep(float(min(delay, self.delivery.qs.options.cooperation_window)))

    async def write(self, kind: StepKind) -> bool:
        message, barrier = self.delivery.message, self.delivery.barrier
        if barrier is not None:  # a batch's ACKs go together, after its handoffs (docs/handlers.md)
            if kind is StepKind.ACK:
                await barrier.ready_to_ack(self.delivery)
            else:
                barrier.arrive(self.delivery)
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
