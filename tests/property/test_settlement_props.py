"""Properties of settlement (docs/settlement.md), through the loop the runtime ships.

:func:`lily_mongo._engine.settlement.settle` is the loop every delivery goes through. Here
it runs against a simulated world (:class:`World`, its ``SettleEffects``): each
generated effect decides whether a handoff publish confirms, whether a settlement
write succeeds, and whether authority over the delivery is lost before the next
decision or during the step. The loop asks :func:`decide` (watched through its
injectable ``decide``) until the step is DONE or UNRESOLVED. Over every outcome,
budget and effect sequence:

(a) no ACK before a required handoff confirm;
(b) at most one settlement write (ACK / NACK / REJECT) per delivery;
(c) a confirmed handoff is never published again (at most one publish per delivery);
(d) infrastructure failures never become application retries: PUBLISH_RETRY only for a
    retryable outcome with retries left, carrying exactly retry_count + 1;
(e) SUCCESS and DUPLICATE never hand off;
(f) BODY_TOO_LARGE only ever REJECTs;
(g) without authority no settlement write (and no publish) is issued;
(h) the loop terminates within four decisions.

The expected steps of each decision-table row are also written out literally.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Coroutine, Generator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lily_mongo._engine.settlement import (
    Budget,
    Evidence,
    HandoffState,
    SettleState,
    Step,
    StepKind,
    Terminal,
    decide,
    settle,
)
from lily_mongo._verdicts import Outcome, PipelineResult

FAST = settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
MACHINE = settings(
    max_examples=200, stateful_step_count=8, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)

# Stable codes (docs/settlement.md), spelled out.
RETRIES_EXHAUSTED = "QUEUE_RETRIES_EXHAUSTED"
DEFERRALS_EXHAUSTED = "QUEUE_DEFERRALS_EXHAUSTED"
BODY_TOO_LARGE = "QUEUE_BODY_TOO_LARGE"
HANDLER_FAILED = "QUEUE_HANDLER_FAILED"

PUBLISH = frozenset({StepKind.PUBLISH_RETRY, StepKind.PUBLISH_DLQ})
WRITE = frozenset({StepKind.ACK, StepKind.NACK_REQUEUE, StepKind.REJECT})
END = frozenset({StepKind.DONE, StepKind.UNRESOLVED})
MAX_DECISIONS = 4  # publish, write, end — plus one spare
LOOP_GUARD = 12


class Loss(enum.Enum):
    """When the delivery's channel generation loses settlement authority, if at all."""

    NONE = "none"
    BEFORE_DECIDE = "before_decide"  # the channel closed before the runtime asked decide()
    BEFORE_EFFECT = "before_effect"  # closed between the decision and the write / during the backoff


@dataclass(frozen=True, slots=True)
class Effect:
    """What the world does to one step."""

    loss: Loss
    publish_confirms: bool  # the broker confirms the handoff copy (else return/nack/timeout/closed)
    write_succeeds: bool  # ack/nack/reject reaches a live channel without error


@dataclass(slots=True)
class Decision:
    step: Step
    seen: Evidence  # the evidence decide() was given


class _NeedEffect:
    """Yielded by the world when the loop needs the next effect: the driver supplies one."""

    def __await__(self) -> Generator[_NeedEffect, None, None]:
        yield self


@dataclass(slots=True)
class World:
    """The simulated channel and handoff destination of one delivery (``SettleEffects``)."""

    budget: Budget
    authority_: bool = True
    queue: collections.deque[Effect] = field(default_factory=collections.deque)
    current: Effect | None = None  # the effect of the step being decided and performed
    publishes: list[tuple[StepKind, bool]] = field(default_factory=list)  # (kind, confirmed)
    writes: list[tuple[StepKind, bool, bool]] = field(default_factory=list)  # (kind, succeeded, authority)
    blind_writes: list[StepKind] = field(default_factory=list)  # issued after the loss was observable
    decided: Decision | None = None

    def begin(self, effect: Effect) -> None:
        """The effect of the next decision; a loss before it lands before the loop looks."""
        self.current = effect
        if effect.loss is Loss.BEFORE_DECIDE:
            self.authority_ = False

    async def _next(self) -> None:
        while not self.queue:
            await _NeedEffect()
        self.begin(self.queue.popleft())

    # -- SettleEffects ---------------------------------------------------------------------

    def authority(self) -> bool:
        return self.authority_

    async def handoff(self, step: Step, budget: Budget) -> bool:
        assert self.current is not None
        confirmed = self.current.publish_confirms  # on the separate confirming handoff channel
        self.publishes.append((step.kind, confirmed))
        await self._next()
        return confirmed

    def dead_letter_fallback(self) -> bool:
        return self.budget.dead_letter_fallback

    async def pause_before_requeue(self, budget: Budget, evidence: Evidence) -> None:
        assert self.current is not None
        if self.current.loss is Loss.BEFORE_EFFECT:
            self.authority_ = False  # lost during the backoff: the loop looks again
            await self._next()

    async def write(self, kind: StepKind) -> bool:
        assert self.current is not None
        decided_with = self.decided.seen.authority if self.decided is not None else self.authority_
        if not self.authority_:
            self.blind_writes.append(kind)  # the loop could have seen the channel was gone
        if self.current.loss is Loss.BEFORE_EFFECT:
            self.authority_ = False
        # A write on a closed channel fails (aiormq raises); the loop records FAILED.
        succeeded = self.current.write_succeeds and self.authority_
        self.writes.append((kind, succeeded, decided_with))
        await self._next()
        return succeeded


class Delivery:
    """One delivery settled by the shipped :func:`settle` loop in a :class:`World`."""

    def __init__(self, result: PipelineResult, budget: Budget) -> None:
        self.result = result
        self.budget = budget
        self.world = World(budget)
        self.decisions: list[Decision] = []
        self.final: Step | None = None
        self.evidence = Evidence()
        self._loop: Coroutine[Any, Any, tuple[Step, Evidence]] | None = None

    @property
    def authority(self) -> bool:
        return self.world.authority_

    @property
    def publishes(self) -> list[tuple[StepKind, bool]]:
        return self.world.publishes

    @property
    def writes(self) -> list[tuple[StepKind, bool, bool]]:
        return self.world.writes

    @property
    def finished(self) -> bool:
        return self.final is not None

    def _decide(self, result: PipelineResult, budget: Budget, evidence: Evidence) -> Step:
        step = decide(result, budget, evidence)
        self.world.decided = Decision(step, evidence)
        self.decisions.append(self.world.decided)
        return step

    def advance(self, effect: Effect) -> None:
        """Give the loop one effect and run it until it needs the next one (or ends)."""
        assert self.final is None
        if self._loop is None:
            self.world.begin(effect)
            self._loop = settle(self.result, self.budget, self.world, decide=self._decide)
        else:
            self.world.queue.append(effect)
        try:
            need = self._loop.send(None)
        except StopIteration as done:
            self.final, self.evidence = done.value
            self._loop = None
            return
        assert isinstance(need, _NeedEffect)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()


# -- strategies ----------------------------------------------------------------------------

codes = st.one_of(
    st.none(),
    st.sampled_from(
        ["PAYMENT_DOWN", "ORDER_INVALID", HANDLER_FAILED, "QUEUE_HANDLER_TIMEOUT", "QUEUE_ENVELOPE_INVALID"]
    ),
)
results = st.builds(
    PipelineResult, outcome=st.sampled_from(Outcome), code=codes, reason=st.sampled_from(["", "boom", "gateway 503"])
)
budgets = st.builds(
    Budget,
    retry_count=st.integers(0, 100),
    max_retries=st.integers(0, 100),
    deferrals=st.integers(0, 40),
    max_deferrals=st.integers(0, 30),
    handoff_failures=st.integers(0, 12),
    max_handoff_failures=st.integers(0, 10),
)
effects = st.builds(
    Effect,
    loss=st.sampled_from(Loss),
    publish_confirms=st.booleans(),
    write_succeeds=st.booleans(),
)
# Effects that mostly succeed, so the long paths are reached often.
kind_effects = st.builds(
    Effect,
    loss=st.sampled_from([Loss.NONE] * 6 + [Loss.BEFORE_DECIDE, Loss.BEFORE_EFFECT]),
    publish_confirms=st.sampled_from([True, True, True, False]),
    write_succeeds=st.sampled_from([True, True, True, False]),
)


# -- the oracle: stated from docs/settlement.md, not from the code ------------------------------


def needs_handoff(result: PipelineResult, budget: Budget) -> bool:
    """The documented rows whose path is publish → confirm → ACK."""
    if result.outcome in (Outcome.RETRYABLE, Outcome.PERMANENT):
        return True
    return result.outcome is Outcome.DEFERRED and budget.deferrals >= budget.max_deferrals


def check_delivery(d: Delivery) -> None:
    """Every property (a)-(h) on what has happened so far."""
    result, budget = d.result, d.budget
    write_steps = [x for x in d.decisions if x.step.kind in WRITE]
    publish_steps = [x for x in d.decisions if x.step.kind in PUBLISH]

    # (h) bounded
    assert len(d.decisions) <= MAX_DECISIONS, [x.step.kind for x in d.decisions]
    # (b) one settlement write per delivery, never a second one
    assert len(d.writes) <= 1, d.writes
    assert len(write_steps) <= 1, [x.step for x in write_steps]
    # (c) at most one publish; never after a confirm
    assert len(d.publishes) <= 1, d.publishes
    for x in publish_steps:
        assert x.seen.handoff is HandoffState.NONE, x
    for x in d.decisions:
        step, seen = x.step, x.seen
        # (a) no ACK before a required confirm
        if step.kind is StepKind.ACK and needs_handoff(result, budget):
            assert seen.handoff is HandoffState.CONFIRMED, x
        # (d) PUBLISH_RETRY only for a retryable outcome with retries left, counting exactly one more
        if step.kind is StepKind.PUBLISH_RETRY:
            assert result.outcome is Outcome.RETRYABLE
            assert budget.retry_count < budget.max_retries
            assert step.retry_count == budget.retry_count + 1
        else:
            assert step.retry_count is None, step
        # (e) SUCCESS / DUPLICATE never hand off and only ever ACK
        if result.outcome in (Outcome.SUCCESS, Outcome.DUPLICATE):
            assert step.kind in {StepKind.ACK} | END, step
        # (f) BODY_TOO_LARGE only ever REJECTs, with its code
        if result.outcome is Outcome.BODY_TOO_LARGE:
            assert step.kind in {StepKind.REJECT} | END, step
            assert step.code == BODY_TOO_LARGE
        # (g) without authority: nothing but DONE (already settled) or UNRESOLVED
        if not seen.authority:
            expected = StepKind.DONE if seen.settle is SettleState.SENT else StepKind.UNRESOLVED
            assert step.kind is expected, x
        # a handoff failure leads to one bounded requeue or, at the bound, a broker-native reject
        if seen.handoff is HandoffState.FAILED and seen.settle is SettleState.NONE and seen.authority:
            at_bound = budget.handoff_failures + 1 >= budget.max_handoff_failures
            assert step.kind is (StepKind.REJECT if at_bound else StepKind.NACK_REQUEUE), x
        # a failed write is never repeated: the delivery is unresolved
        if seen.settle is SettleState.FAILED:
            assert step.kind is StepKind.UNRESOLVED, x
    # (g) every write was decided with authority, and none issued once the loss was observable
    for _, _, authority in d.writes:
        assert authority
    assert not d.world.blind_writes, d.world.blind_writes
    if d.final is not None:
        check_final(d)


def check_final(d: Delivery) -> None:
    """The terminal outcome matches the evidence that was gathered."""
    final = d.final
    assert final is not None
    assert final.terminal is not None
    sent = [kind for kind, ok, _ in d.writes if ok]
    confirmed = [kind for kind, ok in d.publishes if ok]
    failed_publish = [kind for kind, ok in d.publishes if not ok]
    if final.kind is StepKind.UNRESOLVED:
        assert final.terminal.value == "unresolved"
        assert not sent
        return
    assert len(sent) == 1
    terminal = final.terminal.value
    if sent == [StepKind.ACK]:
        if confirmed == [StepKind.PUBLISH_RETRY]:
            assert terminal == "retried"
        elif confirmed == [StepKind.PUBLISH_DLQ]:
            assert terminal == "dead_lettered"
        else:
            assert not d.publishes
            assert terminal == ("duplicate" if d.result.outcome is Outcome.DUPLICATE else "acked")
            assert d.result.outcome in (Outcome.SUCCESS, Outcome.DUPLICATE)
    elif sent == [StepKind.NACK_REQUEUE]:
        assert terminal == ("handoff_failed" if failed_publish else "deferred")
        if not failed_publish:
            assert d.result.outcome is Outcome.DEFERRED
    else:
        assert sent == [StepKind.REJECT]
        assert terminal == "broker_dead_lettered"
        assert failed_publish or d.result.outcome is Outcome.BODY_TOO_LARGE


def run(result: PipelineResult, budget: Budget, draw: list[Effect] | st.DataObject) -> Delivery:
    d = Delivery(result, budget)
    for i in range(LOOP_GUARD):
        if d.finished:
            break
        effect = draw[i] if isinstance(draw, list) else draw.draw(effects, label=f"effect {i}")
        d.advance(effect)
        check_delivery(d)
    assert d.finished, f"no terminal step after {LOOP_GUARD} decisions: {[x.step.kind for x in d.decisions]}"
    return d


# -- properties ----------------------------------------------------------------------------


@FAST
@given(result=results, budget=budgets, data=st.data())
def test_every_effect_sequence_satisfies_the_settlement_properties(
    result: PipelineResult, budget: Budget, data: st.DataObject
) -> None:
    d = run(result, budget, data)
    assert len(d.decisions) <= MAX_DECISIONS


@FAST
@given(result=results, budget=budgets)
def test_with_every_effect_succeeding_the_target_path_is_taken(result: PipelineResult, budget: Budget) -> None:
    ok = Effect(Loss.NONE, publish_confirms=True, write_succeeds=True)
    d = run(result, budget, [ok] * LOOP_GUARD)
    kinds = [x.step.kind for x in d.decisions]
    assert kinds[-1] is StepKind.DONE
    outcome = result.outcome
    if outcome in (Outcome.SUCCESS, Outcome.DUPLICATE):
        assert kinds == [StepKind.ACK, StepKind.DONE]
    elif outcome is Outcome.BODY_TOO_LARGE:
        assert kinds == [StepKind.REJECT, StepKind.DONE]
    elif outcome is Outcome.DEFERRED and budget.deferrals < budget.max_deferrals:
        assert kinds == [StepKind.NACK_REQUEUE, StepKind.DONE]
        assert d.final is not None
        assert d.final.terminal is not None
        assert d.final.terminal.value == "deferred"
    elif outcome is Outcome.DEFERRED:
        assert kinds == [StepKind.PUBLISH_DLQ, StepKind.ACK, StepKind.DONE]
        assert d.decisions[0].step.code == DEFERRALS_EXHAUSTED
    elif outcome is Outcome.RETRYABLE and budget.retry_count < budget.max_retries:
        assert kinds == [StepKind.PUBLISH_RETRY, StepKind.ACK, StepKind.DONE]
        assert d.decisions[0].step.code == (result.code or HANDLER_FAILED)
    elif outcome is Outcome.RETRYABLE:
        assert kinds == [StepKind.PUBLISH_DLQ, StepKind.ACK, StepKind.DONE]
        assert d.decisions[0].step.code == RETRIES_EXHAUSTED
    else:
        assert outcome is Outcome.PERMANENT
        assert kinds == [StepKind.PUBLISH_DLQ, StepKind.ACK, StepKind.DONE]
        assert d.decisions[0].step.code == (result.code or HANDLER_FAILED)


@FAST
@given(result=results, budget=budgets, settle=st.sampled_from(SettleState), handoff=st.sampled_from(HandoffState))
def test_authority_lost_means_no_write_and_no_publish(
    result: PipelineResult, budget: Budget, settle: SettleState, handoff: HandoffState
) -> None:
    kind = StepKind.ACK if settle is not SettleState.NONE else None
    step = decide(result, budget, Evidence(handoff=handoff, settle=settle, authority=False, settled_with=kind))
    assert step.kind is (StepKind.DONE if settle is SettleState.SENT else StepKind.UNRESOLVED)
    if step.kind is StepKind.UNRESOLVED:
        assert step.terminal is not None
        assert step.terminal.value == "unresolved"


@FAST
@given(result=results, budget=budgets, data=st.data())
def test_decide_is_pure(result: PipelineResult, budget: Budget, data: st.DataObject) -> None:
    evidence = Evidence(
        handoff=data.draw(st.sampled_from(HandoffState)),
        settle=data.draw(st.sampled_from(SettleState)),
        authority=data.draw(st.booleans()),
        settled_with=data.draw(st.sampled_from([None, *WRITE])),
    )
    assert decide(result, budget, evidence) == decide(result, budget, evidence)


# -- across redeliveries: the counters bound every requeue path ------------------------------


@FAST
@given(
    max_handoff_failures=st.integers(1, 10),
    outcome=st.sampled_from([Outcome.RETRYABLE, Outcome.PERMANENT]),
    retry_count=st.integers(0, 5),
)
def test_handoff_failures_requeue_a_bounded_number_of_times_then_the_broker_dead_letters(
    max_handoff_failures: int, outcome: Outcome, retry_count: int
) -> None:
    # The destination keeps refusing the copy. The runtime counts failures per event and
    # passes the count in the next delivery's budget (a confirm resets it).
    failing = Effect(Loss.NONE, publish_confirms=False, write_succeeds=True)
    failures = 0
    deliveries = 0
    while True:
        deliveries += 1
        assert deliveries <= max_handoff_failures
        budget = Budget(
            retry_count=retry_count,
            max_retries=5,
            handoff_failures=failures,
            max_handoff_failures=max_handoff_failures,
        )
        d = run(PipelineResult(outcome, "PAYMENT_DOWN"), budget, [failing] * LOOP_GUARD)
        failures += 1
        assert d.final is not None
        assert d.final.terminal is not None
        if d.final.terminal.value == "handoff_failed":
            assert [w[0] for w in d.writes] == [StepKind.NACK_REQUEUE]
            continue  # requeued: the original comes back unchanged (same x-retry-count)
        assert d.final.terminal.value == "broker_dead_lettered"
        assert [w[0] for w in d.writes] == [StepKind.REJECT]
        break
    assert deliveries == max_handoff_failures


@FAST
@given(max_deferrals=st.integers(1, 30), retry_count=st.integers(0, 5))
def test_deferrals_requeue_a_bounded_number_of_times_then_dead_letter_without_a_retry(
    max_deferrals: int, retry_count: int
) -> None:
    ok = Effect(Loss.NONE, publish_confirms=True, write_succeeds=True)
    deferrals = 0
    terminals: list[str] = []
    while True:
        budget = Budget(retry_count=retry_count, max_retries=5, deferrals=deferrals, max_deferrals=max_deferrals)
        d = run(PipelineResult(Outcome.DEFERRED, None, "lease held elsewhere"), budget, [ok] * LOOP_GUARD)
        assert d.final is not None
        assert d.final.terminal is not None
        terminals.append(d.final.terminal.value)
        assert all(kind is not StepKind.PUBLISH_RETRY for kind, _ in d.publishes)
        if terminals[-1] != "deferred":
            break
        deferrals += 1  # kept in the lease document
    assert terminals == ["deferred"] * max_deferrals + ["dead_lettered"]
    assert d.publishes == [(StepKind.PUBLISH_DLQ, True)]
    assert d.decisions[0].step.code == DEFERRALS_EXHAUSTED


@FAST
@given(
    max_retries=st.integers(0, 100),
    start=st.integers(0, 100),
    data=st.data(),
)
def test_only_a_confirmed_retry_copy_increments_the_retry_count(
    max_retries: int, start: int, data: st.DataObject
) -> None:
    # A chain of deliveries of one event with arbitrary outcomes and effects. The next
    # delivery is the retry copy (retry_count from the step) after a confirmed
    # PUBLISH_RETRY + ACK, the same original after any requeue or unresolved end.
    retry_count = start
    for _ in range(data.draw(st.integers(1, 12), label="deliveries")):
        outcome = data.draw(st.sampled_from([Outcome.RETRYABLE, Outcome.DEFERRED, Outcome.RETRYABLE]), label="outcome")
        budget = Budget(
            retry_count=retry_count,
            max_retries=max_retries,
            deferrals=data.draw(st.integers(0, 3), label="deferrals"),
            max_deferrals=3,
        )
        d = run(PipelineResult(outcome, "PAYMENT_DOWN"), budget, data)
        retried = [x.step for x in d.decisions if x.step.kind is StepKind.PUBLISH_RETRY]
        confirmed_retry = (StepKind.PUBLISH_RETRY, True) in d.publishes
        if retried and confirmed_retry:
            assert retried[0].retry_count == retry_count + 1
            retry_count += 1
        elif d.final is not None and d.final.terminal is not None and d.final.terminal.value == "dead_lettered":
            break
        if start <= max_retries:
            assert retry_count <= max_retries
    assert retry_count >= start


# -- the same properties as a hypothesis state machine ---------------------------------------


class SettlementMachine(RuleBasedStateMachine):
    """One delivery; each rule applies one generated effect to the step decide() chose."""

    delivery: Delivery

    @initialize(result=results, budget=budgets)
    def receive(self, result: PipelineResult, budget: Budget) -> None:
        self.delivery = Delivery(result, budget)

    @precondition(lambda self: not self.delivery.finished)
    @rule(effect=effects)
    def advance(self, effect: Effect) -> None:
        self.delivery.advance(effect)

    @precondition(lambda self: not self.delivery.finished)
    @rule(effect=kind_effects)
    def advance_mostly_ok(self, effect: Effect) -> None:
        self.delivery.advance(effect)

    @precondition(lambda self: self.delivery.finished)
    @rule()
    def ask_again(self) -> None:
        # Asking again after the end never issues another write or publish.
        d = self.delivery
        step = decide(d.result, d.budget, dataclasses.replace(d.evidence, authority=d.authority))
        assert d.final is not None
        assert step.kind is d.final.kind
        assert step.terminal is d.final.terminal

    @invariant()
    def properties(self) -> None:
        check_delivery(self.delivery)


SettlementMachine.TestCase.settings = MACHINE
test_settlement_state_machine = SettlementMachine.TestCase


# -- one literal example per row of the decision table (docs/settlement.md section 1) ------------------------

OK = Effect(Loss.NONE, publish_confirms=True, write_succeeds=True)
PUBLISH_FAILS = Effect(Loss.NONE, publish_confirms=False, write_succeeds=True)
WRITE_FAILS = Effect(Loss.NONE, publish_confirms=True, write_succeeds=False)
LOST = Effect(Loss.BEFORE_DECIDE, publish_confirms=True, write_succeeds=True)

Row = tuple[str, str | None, int | None, str | None]  # (step kind, code, x-retry-count, terminal)


def steps_of(result: PipelineResult, budget: Budget, effects_: list[Effect]) -> list[Row]:
    d = run(result, budget, [*effects_, *([OK] * LOOP_GUARD)])
    return [
        (x.step.kind.value, x.step.code, x.step.retry_count, x.step.terminal.value if x.step.terminal else None)
        for x in d.decisions
    ]


@pytest.mark.parametrize(
    ("result", "budget", "effects_", "expected"),
    [
        pytest.param(
            PipelineResult(Outcome.SUCCESS),
            Budget(),
            [OK],
            [("ack", None, None, None), ("done", None, None, "acked")],
            id="success-ack",
        ),
        pytest.param(
            PipelineResult(Outcome.RETRYABLE, "PAYMENT_DOWN", "gateway 503"),
            Budget(retry_count=1, max_retries=3),
            [OK, OK],
            [
                ("publish_retry", "PAYMENT_DOWN", 2, None),
                ("ack", "PAYMENT_DOWN", None, None),
                ("done", "PAYMENT_DOWN", None, "retried"),
            ],
            id="retryable-with-retries-left",
        ),
        pytest.param(
            PipelineResult(Outcome.PERMANENT, "ORDER_INVALID", "no lines"),
            Budget(retry_count=0, max_retries=3),
            [OK, OK],
            [
                ("publish_dlq", "ORDER_INVALID", None, None),
                ("ack", "ORDER_INVALID", None, None),
                ("done", "ORDER_INVALID", None, "dead_lettered"),
            ],
            id="permanent-dlq",
        ),
        pytest.param(
            PipelineResult(Outcome.RETRYABLE, "PAYMENT_DOWN"),
            Budget(retry_count=3, max_retries=3),
            [OK, OK],
            [
                ("publish_dlq", "QUEUE_RETRIES_EXHAUSTED", None, None),
                ("ack", "QUEUE_RETRIES_EXHAUSTED", None, None),
                ("done", "QUEUE_RETRIES_EXHAUSTED", None, "dead_lettered"),
            ],
            id="retries-exhausted-dlq",
        ),
        pytest.param(
            PipelineResult(Outcome.PERMANENT),
            Budget(),
            [OK, OK],
            [
                ("publish_dlq", "QUEUE_HANDLER_FAILED", None, None),
                ("ack", "QUEUE_HANDLER_FAILED", None, None),
                ("done", "QUEUE_HANDLER_FAILED", None, "dead_lettered"),
            ],
            id="permanent-without-code",
        ),
        pytest.param(
            PipelineResult(Outcome.RETRYABLE, "PAYMENT_DOWN"),
            Budget(retry_count=0, max_retries=3, handoff_failures=0, max_handoff_failures=5),
            [PUBLISH_FAILS, OK],
            [
                ("publish_retry", "PAYMENT_DOWN", 1, None),
                ("nack_requeue", "PAYMENT_DOWN", None, None),
                ("done", "PAYMENT_DOWN", None, "handoff_failed"),
            ],
            id="handoff-failed-bounded-requeue",
        ),
        pytest.param(
            PipelineResult(Outcome.PERMANENT, "ORDER_INVALID"),
            Budget(handoff_failures=4, max_handoff_failures=5),
            [PUBLISH_FAILS, OK],
            [
                ("publish_dlq", "ORDER_INVALID", None, None),
                ("reject", "ORDER_INVALID", None, None),
                ("done", "ORDER_INVALID", None, "broker_dead_lettered"),
            ],
            id="handoff-failed-at-the-bound-broker-dead-letter",
        ),
        pytest.param(
            PipelineResult(Outcome.PERMANENT, "ORDER_INVALID"),
            Budget(),
            [OK, WRITE_FAILS],
            [
                ("publish_dlq", "ORDER_INVALID", None, None),
                ("ack", "ORDER_INVALID", None, None),
                ("unresolved", "ORDER_INVALID", None, "unresolved"),
            ],
            id="confirmed-but-ack-failed-unresolved",
        ),
        pytest.param(
            PipelineResult(Outcome.DEFERRED, None, "lease held elsewhere"),
            Budget(retry_count=2, max_retries=3, deferrals=3, max_deferrals=20),
            [OK],
            [("nack_requeue", None, None, None), ("done", None, None, "deferred")],
            id="deferred-requeue",
        ),
        pytest.param(
            PipelineResult(Outcome.DEFERRED, None, "lease held elsewhere"),
            Budget(retry_count=2, max_retries=3, deferrals=20, max_deferrals=20),
            [OK, OK],
            [
                ("publish_dlq", "QUEUE_DEFERRALS_EXHAUSTED", None, None),
                ("ack", "QUEUE_DEFERRALS_EXHAUSTED", None, None),
                ("done", "QUEUE_DEFERRALS_EXHAUSTED", None, "dead_lettered"),
            ],
            id="deferrals-exhausted-dlq",
        ),
        pytest.param(
            PipelineResult(Outcome.DUPLICATE),
            Budget(),
            [OK],
            [("ack", None, None, None), ("done", None, None, "duplicate")],
            id="duplicate-ack",
        ),
        pytest.param(
            PipelineResult(Outcome.BODY_TOO_LARGE, "QUEUE_BODY_TOO_LARGE", "body is 2000000 bytes"),
            Budget(),
            [OK],
            [
                ("reject", "QUEUE_BODY_TOO_LARGE", None, None),
                ("done", "QUEUE_BODY_TOO_LARGE", None, "broker_dead_lettered"),
            ],
            id="body-too-large-reject",
        ),
        pytest.param(
            PipelineResult(Outcome.SUCCESS),
            Budget(),
            [LOST],
            [("unresolved", None, None, "unresolved")],
            id="transport-lost-before-ack",
        ),
        pytest.param(
            PipelineResult(Outcome.RETRYABLE, "PAYMENT_DOWN"),
            Budget(retry_count=0, max_retries=3),
            [OK, LOST],
            [("publish_retry", "PAYMENT_DOWN", 1, None), ("unresolved", "PAYMENT_DOWN", None, "unresolved")],
            id="transport-lost-after-confirm",
        ),
        pytest.param(
            PipelineResult(Outcome.DEFERRED, None, "lease held elsewhere"),
            Budget(deferrals=0, max_deferrals=20),
            [Effect(Loss.BEFORE_EFFECT, publish_confirms=True, write_succeeds=True)],
            [("nack_requeue", None, None, None), ("unresolved", None, None, "unresolved")],
            id="transport-lost-during-requeue-backoff",
        ),
    ],
)
def test_decision_table_row(
    result: PipelineResult, budget: Budget, effects_: list[Effect], expected: list[Row]
) -> None:
    assert steps_of(result, budget, effects_) == expected


def test_unresolved_after_a_confirm_says_the_copy_is_kept() -> None:
    confirmed = Evidence(handoff=HandoffState.CONFIRMED, settle=SettleState.FAILED, settled_with=StepKind.ACK)
    step = decide(PipelineResult(Outcome.PERMANENT, "ORDER_INVALID"), Budget(), confirmed)
    assert step.kind is StepKind.UNRESOLVED
    assert "confirmed" in step.reason
    lost = Evidence(handoff=HandoffState.CONFIRMED, authority=False)
    step = decide(PipelineResult(Outcome.RETRYABLE, "X"), Budget(max_retries=1), lost)
    assert step.kind is StepKind.UNRESOLVED
    assert "transport lost" in step.reason
    assert "confirmed" in step.reason


def test_exhausted_reasons_name_the_counts() -> None:
    step = decide(
        PipelineResult(Outcome.RETRYABLE, "PAYMENT_DOWN", "503"), Budget(retry_count=5, max_retries=5), Evidence()
    )
    assert step.kind is StepKind.PUBLISH_DLQ
    assert step.code == RETRIES_EXHAUSTED
    assert "5 retries used (bound 5)" in step.reason
    assert "PAYMENT_DOWN" in step.reason
    step = decide(PipelineResult(Outcome.DEFERRED, None, "held"), Budget(deferrals=7, max_deferrals=7), Evidence())
    assert step.code == DEFERRALS_EXHAUSTED
    assert "deferred 7 times (bound 7)" in step.reason


@pytest.mark.parametrize("outcome", [Outcome.SUCCESS, Outcome.DUPLICATE])
def test_the_loop_without_a_watched_decide_takes_the_same_steps(outcome: Outcome) -> None:
    # The shipped loop answers the common path from precomputed decisions: same steps.
    from lily_mongo._verdicts import SUCCESS

    result = SUCCESS if outcome is Outcome.SUCCESS else PipelineResult(outcome)
    for watched in (True, False):
        world = World(Budget())
        world.begin(OK)
        world.queue.extend([OK] * LOOP_GUARD)
        loop = settle(result, Budget(), world) if not watched else settle(result, Budget(), world, decide=decide)
        with pytest.raises(StopIteration) as done:
            loop.send(None)
        step, _ = done.value.value
        assert (step.kind, step.terminal) == (
            StepKind.DONE,
            Terminal.ACKED if outcome is Outcome.SUCCESS else Terminal.DUPLICATE,
        )
        assert world.writes == [(StepKind.ACK, True, True)]
