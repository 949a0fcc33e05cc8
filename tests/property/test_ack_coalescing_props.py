"""Settlement through the ACK coalescer, over interleavings of many deliveries (docs/settlement.md section 2).

Each example runs a batch of deliveries of one queue through the shipped
:func:`lily_mongo._engine.settlement.settle` loop, their writes going through the shipped
:class:`lily_mongo._amqp.AckCoalescer` of their channel, against a model of the
broker's side of that channel (:class:`BrokerChannel`: the set of unacknowledged
delivery tags and RabbitMQ's rules for ``basic.ack``, ``basic.nack`` and
``basic.reject``). Generated: each delivery's outcome (ACK, a handoff then ACK,
NACK with requeue, reject) and how long its handler runs (so completions come out
of order), the coalescing delay, whether and when the channel is lost (the later
deliveries then arrive on a new channel: a new transport generation), and
whether and when settlement authority is revoked (a forced shutdown). A graceful
end flushes what is pending. The model checks:

(a) every frame names a tag the broker still holds unacknowledged on that channel
    (a multiple ACK's own tag included: RabbitMQ closes the channel otherwise), so
    nothing is settled twice;
(b) every tag an ACK frame settles (multiple or not) belongs to a delivery whose
    settlement asked for ACK before the frame, after its handoff was confirmed
    when it needed one;
(c) nothing is written on a lost channel, and nothing after authority was revoked;
(d) a delivery reported ACKed (or NACKed, rejected) was settled so by the broker
    before the settlement loop saw the write succeed;
(e) every delivery reaches a terminal step; one of a lost channel, or one still
    pending when authority was revoked, ends unresolved unless its frame was
    written before, and the broker requeues every tag nobody settled.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import os
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiormq.exceptions
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lily_mongo._amqp import AckCoalescer
from lily_mongo._engine.settlement import Budget, Evidence, SettleState, Step, StepKind, settle
from lily_mongo._verdicts import Outcome, PipelineResult

EXAMPLES = settings(
    max_examples=int(os.environ.get("LILY_MODEL_EXAMPLES", 250)),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class Want(enum.Enum):
    """What a delivery's settlement should be, were nothing to go wrong."""

    ACK = "ack"
    HANDOFF_ACK = "handoff_ack"  # a retry copy, confirmed, then ACK
    NACK = "nack"
    REJECT = "reject"


RESULTS = {
    Want.ACK: PipelineResult(Outcome.SUCCESS),
    Want.HANDOFF_ACK: PipelineResult(Outcome.RETRYABLE, "PAYMENT_DOWN", "gateway 503"),
    Want.NACK: PipelineResult(Outcome.DEFERRED, None, "lease held elsewhere"),
    Want.REJECT: PipelineResult(Outcome.BODY_TOO_LARGE, "QUEUE_BODY_TOO_LARGE", "too large"),
}
BUDGET = Budget(retry_count=0, max_retries=3)
WRITTEN = {StepKind.ACK: "ack", StepKind.NACK_REQUEUE: "nack", StepKind.REJECT: "reject"}


class BrokerChannel:
    """The broker's side of one consuming channel: unacknowledged tags and RabbitMQ's rules."""

    def __init__(self, generation: int, world: World) -> None:
        self.generation = generation
        self.world = world
        self.is_closed = False
        self.unacked: set[int] = set()
        self.settled: dict[int, str] = {}  # tag -> ack / nack / reject / requeued (by the loss)
        self.next_tag = 0

    def deliver(self) -> int:
        self.next_tag += 1
        self.unacked.add(self.next_tag)
        return self.next_tag

    def lose(self) -> None:
        """The channel dies: the broker requeues every tag still unacknowledged."""
        self.is_closed = True
        for tag in sorted(self.unacked):
            self.settled[tag] = "requeued"
        self.unacked.clear()

    def _frame(self, what: str, tag: int) -> None:
        if self.is_closed:
            raise aiormq.exceptions.ChannelInvalidStateError("closed")
        if self.world.revoked:
            self.world.violations.append(f"(c) {what} {tag} written after authority was revoked")
        if tag not in self.unacked:
            self.world.violations.append(f"(a) {what} names tag {tag}, not unacknowledged (gen {self.generation})")
            self.lose()  # PRECONDITION_FAILED closes the channel
            raise aiormq.exceptions.ChannelInvalidStateError("precondition failed")

    def _settle(self, tag: int, how: str) -> None:
        self.unacked.discard(tag)
        self.settled[tag] = how
        if how == "ack":
            wanted = self.world.acks_asked.get((self.generation, tag))
            if wanted is None:
                self.world.violations.append(f"(b) tag {tag} ACKed without its settlement asking for ACK")
            elif wanted is Want.HANDOFF_ACK and (self.generation, tag) not in self.world.confirmed:
                self.world.violations.append(f"(b) tag {tag} ACKed before its handoff was confirmed")

    async def _drain(self, wait: bool) -> None:
        if wait:
            await asyncio.sleep(0)  # the writer's turn
            if self.is_closed:
                raise aiormq.exceptions.ChannelInvalidStateError("closed while writing")

    async def basic_ack(self, delivery_tag: int, multiple: bool = False, wait: bool = True) -> None:
        self._frame("ack", delivery_tag)  # the frame is queued in order at once; the drain follows
        for tag in sorted(t for t in self.unacked if t <= delivery_tag) if multiple else [delivery_tag]:
            self._settle(tag, "ack")
        self.world.frames += 1
        await self._drain(wait)

    async def basic_nack(self, delivery_tag: int, requeue: bool = True) -> None:
        self._frame("nack", delivery_tag)
        self._settle(delivery_tag, "nack")
        await self._drain(True)

    async def basic_reject(self, delivery_tag: int, requeue: bool = False) -> None:
        self._frame("reject", delivery_tag)
        self._settle(delivery_tag, "reject")
        await self._drain(True)


@dataclass
class World:
    revoked: bool = False
    violations: list[str] = field(default_factory=list)
    acks_asked: dict[tuple[int, int], Want] = field(default_factory=dict)
    confirmed: set[tuple[int, int]] = field(default_factory=set)
    frames: int = 0


@dataclass
class Delivery:
    """One delivery: the ``SettleEffects`` of the runtime, writing through the coalescer."""

    world: World
    channel: BrokerChannel
    acks: AckCoalescer
    tag: int
    want: Want
    work: int  # event-loop turns its handler runs
    final: Step | None = None
    evidence: Evidence | None = None

    def authority(self) -> bool:
        return not self.world.revoked and not self.channel.is_closed

    async def handoff(self, step: Step, budget: Budget) -> bool:
        await asyncio.sleep(0)  # the confirm comes back
        self.world.confirmed.add((self.channel.generation, self.tag))
        return True

    def dead_letter_fallback(self) -> bool:
        return True

    async def pause_before_requeue(self, budget: Budget, evidence: Evidence) -> None:
        await asyncio.sleep(0)

    async def write(self, kind: StepKind) -> bool:
        channel, tag = self.channel, self.tag
        try:
            if kind is StepKind.ACK:
                self.world.acks_asked[(channel.generation, tag)] = self.want
                await self.acks.ack(tag)
                how = "ack"
            elif kind is StepKind.NACK_REQUEUE:
                await self.acks.alone(tag, functools.partial(channel.basic_nack, tag, requeue=True))
                how = "nack"
            else:
                await self.acks.alone(tag, functools.partial(channel.basic_reject, tag, requeue=False))
                how = "reject"
        except aiormq.exceptions.ChannelInvalidStateError:
            return False
        if channel.settled.get(tag) != how:
            self.world.violations.append(f"(d) tag {tag} reported {how} but the broker has {channel.settled.get(tag)}")
        return True

    async def run(self) -> None:
        for _ in range(self.work):
            await asyncio.sleep(0)
        self.final, self.evidence = await settle(RESULTS[self.want], BUDGET, self)


@dataclass(frozen=True)
class Scenario:
    wants: list[Want]
    works: list[int]
    delay: float
    lose_at: int | None  # after this many deliveries arrived, the channel is lost (new generation)
    lose_after: int  # turns after that arrival
    revoke_after: int | None  # turns after the start, authority is revoked
    stagger: int  # deliveries arriving per turn


scenarios = st.integers(1, 24).flatmap(
    lambda n: st.builds(
        Scenario,
        wants=st.lists(
            st.sampled_from([Want.ACK] * 5 + [Want.HANDOFF_ACK, Want.NACK, Want.REJECT]), min_size=n, max_size=n
        ),
        works=st.lists(st.integers(0, 6), min_size=n, max_size=n),
        delay=st.sampled_from([0.0002, 0.001, 0.005]),
        lose_at=st.none() | st.integers(1, n),
        lose_after=st.integers(0, 6),
        revoke_after=st.none() | st.integers(0, 12),
        stagger=st.integers(1, 8),
    )
)


async def play(scenario: Scenario) -> tuple[World, list[Delivery], list[BrokerChannel]]:
    world = World()
    loop = asyncio.get_running_loop()
    background: list[asyncio.Task[Any]] = []

    def spawn(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = loop.create_task(coro)
        background.append(task)
        return task

    channels = [BrokerChannel(1, world)]
    coalescers = [AckCoalescer(channels[0], scenario.delay, spawn)]  # type: ignore[arg-type]
    deliveries: list[Delivery] = []
    running: list[asyncio.Task[None]] = []

    async def lose_later(channel: BrokerChannel) -> None:
        for _ in range(scenario.lose_after):
            await asyncio.sleep(0)
        channel.lose()

    async def revoke_later(turns: int) -> None:
        for _ in range(turns):
            await asyncio.sleep(0)
        world.revoked = True
        for acks in coalescers:
            acks.drop("settlement authority revoked")

    if scenario.revoke_after is not None:
        spawn(revoke_later(scenario.revoke_after))
    for i, (want, work) in enumerate(zip(scenario.wants, scenario.works, strict=True)):
        if scenario.lose_at is not None and i == scenario.lose_at and len(channels) == 1:
            spawn(lose_later(channels[-1]))
            channels.append(BrokerChannel(2, world))  # the reopened channel: tags start at 1 again
            coalescers.append(AckCoalescer(channels[-1], scenario.delay, spawn))  # type: ignore[arg-type]
        channel, acks = channels[-1], coalescers[-1]
        if channel.is_closed:
            continue
        tag = channel.deliver()
        acks.delivered(tag)
        delivery = Delivery(world, channel, acks, tag, want, work)
        deliveries.append(delivery)
        running.append(loop.create_task(delivery.run()))
        if (i + 1) % scenario.stagger == 0:
            await asyncio.sleep(0)
    await wind_down(world, channels, coalescers, running, background)
    return world, deliveries, channels


async def wind_down(
    world: World,
    channels: list[BrokerChannel],
    coalescers: list[AckCoalescer],
    running: list[asyncio.Task[None]],
    background: list[asyncio.Task[Any]],
) -> None:
    """Every delivery ends; a graceful end writes what is pending; then the channels close."""
    async with asyncio.timeout(2):  # an example takes milliseconds: a hang is a failure
        await asyncio.gather(*running)
        # A graceful end: what is pending is written before the channels close.
        if not world.revoked:
            for channel, acks in zip(channels, coalescers, strict=True):
                if not channel.is_closed:
                    await acks.flush()
        await asyncio.gather(*background, return_exceptions=True)
    for channel in channels:
        if not channel.is_closed:
            channel.lose()  # closing at the end: the broker requeues what nobody settled


@EXAMPLES
@given(scenario=scenarios)
def test_coalesced_settlement_keeps_every_guarantee_over_interleavings(scenario: Scenario) -> None:
    world, deliveries, channels = asyncio.run(play(scenario))
    assert world.violations == []
    for d in deliveries:
        assert d.final is not None, "(e) every delivery ends"
        assert d.evidence is not None
        at_broker = d.channel.settled.get(d.tag)
        sent = d.evidence.settle is SettleState.SENT
        if d.final.kind is StepKind.DONE:
            assert sent
            assert d.evidence.settled_with is not None
            assert at_broker == WRITTEN[d.evidence.settled_with], (d.tag, at_broker)
        else:
            # (e) unresolved: only ever because the channel was lost or authority revoked;
            # the broker then requeued it, or holds the frame whose write was cut off.
            assert d.final.kind is StepKind.UNRESOLVED
            assert d.channel.is_closed or world.revoked
            if at_broker != "requeued":
                assert d.evidence.settle is SettleState.FAILED, (d.tag, at_broker)
                assert d.evidence.settled_with is not None
                assert at_broker == WRITTEN[d.evidence.settled_with], (d.tag, at_broker)
    for channel in channels:
        assert channel.unacked == set()


@EXAMPLES
@given(scenario=scenarios.filter(lambda s: s.lose_at is None and s.revoke_after is None))
def test_without_loss_every_delivery_settles_as_its_outcome_asks(scenario: Scenario) -> None:
    world, deliveries, _ = asyncio.run(play(scenario))
    assert world.violations == []
    expected = {Want.ACK: "ack", Want.HANDOFF_ACK: "ack", Want.NACK: "nack", Want.REJECT: "reject"}
    for d in deliveries:
        assert d.final is not None
        assert d.final.kind is StepKind.DONE
        assert d.channel.settled[d.tag] == expected[d.want]


def test_acks_completing_in_one_turn_share_one_frame() -> None:
    scenario = Scenario(
        wants=[Want.ACK] * 20, works=[0] * 20, delay=0.001, lose_at=None, lose_after=0, revoke_after=None, stagger=20
    )
    world, deliveries, _ = asyncio.run(play(scenario))
    assert world.violations == []
    assert all(d.channel.settled[d.tag] == "ack" for d in deliveries)
    assert world.frames == 1


def test_a_slow_lowest_delivery_holds_the_others_at_most_the_delay() -> None:
    # Tag 1 runs long; 2..10 finish at once and get single ACKs once the delay passed,
    # then tag 1 its own: never a multiple ACK reaching over tag 1 while it runs.
    scenario = Scenario(
        wants=[Want.ACK] * 10,
        works=[400] + [0] * 9,
        delay=0.0002,
        lose_at=None,
        lose_after=0,
        revoke_after=None,
        stagger=10,
    )
    world, deliveries, _ = asyncio.run(play(scenario))
    assert world.violations == []
    assert all(d.channel.settled[d.tag] == "ack" for d in deliveries)
    assert world.frames >= 2
