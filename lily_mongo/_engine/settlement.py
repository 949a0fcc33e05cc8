"""Settlement (docs/settlement.md): a pure decision table and the loop that drives it.

:func:`decide` is the decision table. :func:`settle` is the loop every delivery
goes through: it asks :func:`decide` for the next step, performs it through
injected :class:`SettleEffects` (the runtime's channel writes and handoff
publishes, or a test's simulated ones), records what it observed in
:class:`Evidence`, and asks again until the step is terminal. Neither sees a
channel: both are tested exhaustively with hypothesis, the loop included.

Invariants (tested): no ACK before a required handoff confirm; nothing is
settled twice; a confirmed handoff is never repeated; an infrastructure
failure (handoff error, deferral, transport loss) never becomes an
application retry.
"""

from __future__ import annotations

import datetime
import enum
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from .._errors import ErrorCode
from .._headers import (
    BROKER_COUNT_HEADERS,
    FAILED_AT_HEADER,
    FAILED_QUEUE_HEADER,
    FAILURE_CODE_HEADER,
    FAILURE_REASON_HEADER,
    RETRY_COUNT_HEADER,
)
from .._text import sanitize, truncate_utf8
from .._verdicts import SUCCESS, Outcome, PipelineResult
from ..bounds import BOUNDS
from ..envelope import sanitize_headers

__all__ = [
    "Budget",
    "Evidence",
    "HandoffState",
    "SettleEffects",
    "SettleState",
    "Step",
    "StepKind",
    "Terminal",
    "decide",
    "handoff_headers",
    "settle",
]


@dataclass(frozen=True, slots=True)
class Budget:
    """Counters that bound the paths: application retries, deferrals, handoff failures."""

    retry_count: int = 0
    max_retries: int = 0
    deferrals: int = 0
    max_deferrals: int = 20
    handoff_failures: int = 0
    max_handoff_failures: int = 5
    # False when the DLQ itself refused a copy as unroutable: a broker-native
    # dead-letter would then be dropped, so the delivery keeps being requeued.
    dead_letter_fallback: bool = True


class HandoffState(enum.Enum):
    NONE = "none"
    CONFIRMED = "confirmed"  # the destination accepted the copy (publisher confirm)
    FAILED = "failed"  # returned, nacked, timed out or the channel failed


class SettleState(enum.Enum):
    NONE = "none"
    SENT = "sent"  # ack/nack/reject written on the delivery's own channel
    FAILED = "failed"  # the write failed or its outcome is unknown


@dataclass(frozen=True, slots=True)
class Evidence:
    """What has been observed so far for one delivery."""

    handoff: HandoffState = HandoffState.NONE
    settle: SettleState = SettleState.NONE
    authority: bool = True  # the delivery's channel generation is current and not revoked
    settled_with: StepKind | None = None


class StepKind(enum.Enum):
    ACK = "ack"
    NACK_REQUEUE = "nack_requeue"
    REJECT = "reject"  # nack(requeue=False): the broker dead-letters through the queue's DLX
    PUBLISH_RETRY = "publish_retry"
    PUBLISH_DLQ = "publish_dlq"
    DONE = "done"
    UNRESOLVED = "unresolved"


class Terminal(enum.Enum):
    """How a delivery ended, as reported in observations and counters."""

    ACKED = "acked"
    DUPLICATE = "duplicate"
    RETRIED = "retried"
    DEAD_LETTERED = "dead_lettered"
    DEFERRED = "deferred"
    HANDOFF_FAILED = "handoff_failed"
    BROKER_DEAD_LETTERED = "broker_dead_lettered"
    UNRESOLVED = "unresolved"


@dataclass(frozen=True, slots=True)
class Step:
    """The next action; ``terminal`` is set on DONE/UNRESOLVED."""

    kind: StepKind
    code: str | None = None
    reason: str = ""
    retry_count: int | None = None  # the x-retry-count the retry copy carries
    terminal: Terminal | None = None


def _target(result: PipelineResult, budget: Budget) -> Step:
    """Where the delivery should go, ignoring what has been done so far."""
    outcome = result.outcome
    if outcome in (Outcome.SUCCESS, Outcome.DUPLICATE):
        return Step(StepKind.ACK)
    if outcome is Outcome.BODY_TOO_LARGE:
        return Step(StepKind.REJECT, ErrorCode.BODY_TOO_LARGE, result.reason)
    if outcome is Outcome.DEFERRED:
        if budget.deferrals >= budget.max_deferrals:
            reason = f"deferred {budget.deferrals} times (bound {budget.max_deferrals}); last: {result.reason}"
            return Step(StepKind.PUBLISH_DLQ, ErrorCode.DEFERRALS_EXHAUSTED, reason)
        return Step(StepKind.NACK_REQUEUE, result.code, result.reason)
    code = result.code or ErrorCode.HANDLER_FAILED
    if outcome is Outcome.RETRYABLE:
        if budget.retry_count < budget.max_retries:
            return Step(StepKind.PUBLISH_RETRY, code, result.reason, retry_count=budget.retry_count + 1)
        reason = f"{budget.retry_count} retries used (bound {budget.max_retries}); last {code}: {result.reason}"
        return Step(StepKind.PUBLISH_DLQ, ErrorCode.RETRIES_EXHAUSTED, reason)
    return Step(StepKind.PUBLISH_DLQ, code, result.reason)


def _terminal_for(result: PipelineResult, target: Step, evidence: Evidence) -> Terminal:
    if evidence.settled_with is StepKind.REJECT:
        return Terminal.BROKER_DEAD_LETTERED
    if evidence.settled_with is StepKind.NACK_REQUEUE:
        return Terminal.HANDOFF_FAILED if evidence.handoff is HandoffState.FAILED else Terminal.DEFERRED
    if target.kind is StepKind.PUBLISH_RETRY:
        return Terminal.RETRIED
    if target.kind is StepKind.PUBLISH_DLQ:
        return Terminal.DEAD_LETTERED
    return Terminal.DUPLICATE if result.outcome is Outcome.DUPLICATE else Terminal.ACKED


def decide(result: PipelineResult, budget: Budget, evidence: Evidence) -> Step:
    """The next settlement step for one delivery (the decision table of docs/settlement.md section 1)."""
    target = _target(result, budget)
    if evidence.settle is SettleState.SENT:
        return Step(StepKind.DONE, target.code, target.reason, terminal=_terminal_for(result, target, evidence))
    if evidence.settle is SettleState.FAILED:
        why = "settlement write failed"
        if evidence.handoff is HandoffState.CONFIRMED:
            why += " after the handoff was confirmed (the confirmed copy is kept as evidence)"
        return Step(StepKind.UNRESOLVED, target.code, why, terminal=Terminal.UNRESOLVED)
    if not evidence.authority:
        why = "transport lost: the delivery's channel has no settlement authority"
        if evidence.handoff is HandoffState.CONFIRMED:
            why += " (handoff copy confirmed)"
        return Step(StepKind.UNRESOLVED, target.code, why, terminal=Terminal.UNRESOLVED)
    if target.kind in (StepKind.ACK, StepKind.REJECT, StepKind.NACK_REQUEUE):
        return target
    # A handoff target: publish, then ACK only after the confirm.
    if evidence.handoff is HandoffState.CONFIRMED:
        return Step(StepKind.ACK, target.code, target.reason)
    if evidence.handoff is HandoffState.FAILED:
        if budget.handoff_failures + 1 >= budget.max_handoff_failures and budget.dead_letter_fallback:
            # Repeated handoff failures: let the broker dead-letter the original
            # through the queue's DLX rather than loop forever (weaker evidence).
            return Step(StepKind.REJECT, target.code, f"handoff failed {budget.handoff_failures + 1} times")
        return Step(StepKind.NACK_REQUEUE, target.code, "handoff failed; bounded requeue")
    return target


def handoff_headers(
    original: Mapping[str, object], step: Step, *, retry_count: int | None, failed_queue: str
) -> dict[str, object]:
    """The header table of a retry or DLQ copy (docs/settlement.md section 7).

    The original headers that fit every bound (without the broker's delivery
    counters), the same event id, and the failure headers (bounded, sanitized).
    ``retry_count`` is what ``x-retry-count`` carries: the step's next count on a
    retry, the original's on a DLQ copy, None to drop it
    (a copy of a message whose envelope was invalid).
    """
    headers, _ = sanitize_headers(original)
    for name in BROKER_COUNT_HEADERS:  # a copy is a new message: the broker counts its deliveries afresh
        headers.pop(name, None)
    if retry_count is None:
        headers.pop(RETRY_COUNT_HEADER, None)
    else:
        headers[RETRY_COUNT_HEADER] = retry_count
    headers[FAILURE_CODE_HEADER] = truncate_utf8(step.code or "", BOUNDS.failure_code_bytes)
    headers[FAILURE_REASON_HEADER] = sanitize(step.reason, BOUNDS.failure_reason_bytes)
    headers[FAILED_QUEUE_HEADER] = failed_queue
    headers[FAILED_AT_HEADER] = datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")
    return headers


# -- the settlement loop ---------------------------------------------------------------------


class SettleEffects(Protocol):
    """What :func:`settle` needs from the world for one delivery."""

    def authority(self) -> bool:
        """True while the delivery's channel generation is current and not revoked."""
        ...

    async def handoff(self, step: Step, budget: Budget) -> bool:
        """Publish the retry or DLQ copy ``step`` asks for; True once the broker confirmed it."""
        ...

    def dead_letter_fallback(self) -> bool:
        """After a failed handoff: may the broker dead-letter the original (its DLQ is routable)?"""
        ...

    async def pause_before_requeue(self, budget: Budget, evidence: Evidence) -> None:
        """The short backoff before a requeue (docs/settlement.md section 4: no hot redelivery loop)."""
        ...

    async def write(self, kind: StepKind) -> bool:
        """Write ACK, NACK(requeue) or REJECT on the delivery's channel; False if it failed."""
        ...


@functools.cache
def evidence_of(handoff: HandoffState, settle: SettleState, authority: bool, settled_with: StepKind | None) -> Evidence:
    """Evidence values are immutable and few: one shared instance per combination."""
    return Evidence(handoff, settle, authority, settled_with)


FRESH = evidence_of(HandoffState.NONE, SettleState.NONE, True, None)
NO_BUDGET = Budget()  # success and duplicate never consult a budget
_ACKED = evidence_of(HandoffState.NONE, SettleState.SENT, True, StepKind.ACK)
# The step kinds the loop tells apart, compared by identity: a frozenset membership test
# hashes the member in Python (``Enum.__hash__``), three times per delivery.
_DONE, _UNRESOLVED = StepKind.DONE, StepKind.UNRESOLVED
_PUBLISH_RETRY, _PUBLISH_DLQ = StepKind.PUBLISH_RETRY, StepKind.PUBLISH_DLQ
# The common path's two answers, computed once: decide() costs about 1 µs a call, and
# every successful delivery asks twice (bench_throughput.py, 3-4 k msgs/s on 2 cores).
_SUCCESS_FIRST = decide(SUCCESS, NO_BUDGET, FRESH)  # ACK
_SUCCESS_LAST = decide(SUCCESS, NO_BUDGET, _ACKED)  # DONE, acked


async def settle(
    result: PipelineResult,
    budget: Budget,
    effects: SettleEffects,
    *,
    decide: Callable[[PipelineResult, Budget, Evidence], Step] = decide,
) -> tuple[Step, Evidence]:
    """Drive one delivery to its terminal step; returns that step and the evidence gathered.

    Each settlement write happens at most once; once one was written (or failed),
    the decision rests on it alone. ``decide`` is injectable so tests can watch every
    decision of this very loop.
    """
    evidence = FRESH
    while True:
        if evidence.settle is SettleState.NONE and not effects.authority():
            evidence = evidence_of(evidence.handoff, evidence.settle, False, evidence.settled_with)
        if result is SUCCESS and evidence is FRESH and decide is _DECIDE:
            step = _SUCCESS_FIRST
        elif result is SUCCESS and evidence is _ACKED and decide is _DECIDE:
            step = _SUCCESS_LAST
        else:
            step = decide(result, budget, evidence)
        kind = step.kind
        if kind is _DONE or kind is _UNRESOLVED:
            return step, evidence
        if kind is _PUBLISH_RETRY or kind is _PUBLISH_DLQ:
            if await effects.handoff(step, budget):
                evidence = evidence_of(HandoffState.CONFIRMED, evidence.settle, True, evidence.settled_with)
            else:
                evidence = evidence_of(HandoffState.FAILED, evidence.settle, True, evidence.settled_with)
                budget = replace(budget, dead_letter_fallback=effects.dead_letter_fallback())
            continue
        if kind is StepKind.NACK_REQUEUE:
            await effects.pause_before_requeue(budget, evidence)
            if not effects.authority():
                continue  # lost during the pause: decide() now says unresolved
        if await effects.write(kind):
            evidence = (
                _ACKED
                if evidence is FRESH and kind is StepKind.ACK
                else (evidence_of(evidence.handoff, SettleState.SENT, evidence.authority, kind))
            )
        else:
            evidence = evidence_of(evidence.handoff, SettleState.FAILED, evidence.authority, kind)


_DECIDE = decide
