"""The engine without servers: the deadline path of one delivery, the engine's phases and the
consumer's lifecycle state, through the engine's in-process transport.

docs/lifecycle.md, section 5: past its deadline a handler is cancelled; one that ends within the
cooperation window gets the timeout verdict (a retry copy), one that returns normally keeps its own
verdict, and one that ignores the cancellation is dropped: its delivery is settled from another
task (counted ``abandoned``) and what it returns later is discarded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import pytest

from lily_mongo import ConfigError, Consumer, Json, LilyError, RetryPolicy, TerminalObservation, queue
from lily_mongo._engine.engine import Engine, Phase
from lily_mongo._engine.message import InboundMessage
from lily_mongo._lifecycle import ManagedConsumer
from lily_mongo._supervision import Lifecycle, State
from lily_mongo._tasks import TaskSet
from lily_mongo.publisher import JSON, prepare_publication

Q = "engine.paths"
DEADLINE = 0.05
WINDOW = 0.1


class _Channel:
    is_closed = False


class Message:
    """A received delivery that records how it was settled."""

    content_type = "application/json"
    redelivered = False
    routing_key = Q
    exchange = ""
    message_id = None
    malformed = None
    channel = _Channel()

    def __init__(self) -> None:
        publication = prepare_publication(JSON, Q, {"n": 1}, version=1)
        self.headers = dict(publication.headers)
        self.body = publication.body
        self.settled: list[str] = []

    async def ack(self) -> None:
        self.settled.append("ack")

    async def nack(self, *, requeue: bool = True) -> None:
        self.settled.append("nack_requeue" if requeue else "reject")

    async def reject(self, *, requeue: bool = False) -> None:
        self.settled.append("reject")


def make_engine(handler: Callable[[Any], Awaitable[None]], deadline: float = DEADLINE) -> tuple[Engine, list[str]]:
    """An engine for one handler (cooperation window 100 ms), and the routing keys it handed off to."""
    consumer = Consumer(amqp_url="amqp://unused/", name="t", telemetry=False)
    consumer.configure_queue(
        Q, deadline=deadline, cooperation_window=WINDOW, retry=RetryPolicy(max_retries=1, delays=(30,))
    )
    consumer.include(queue(Q, version=1)(handler))
    copies: list[str] = []

    async def handoff(_message: InboundMessage, routing_key: str, _headers: Mapping[str, Any]) -> None:
        copies.append(routing_key)

    engine = Engine(consumer.plan(), TaskSet(), inbox=None, handoff=handoff)
    engine.open()
    return engine, copies


async def until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    ends = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < ends, "the condition did not hold in time"
        await asyncio.sleep(0.005)


def only(engine: Engine) -> TerminalObservation:
    (observation,) = engine.observations.items()
    return observation


async def test_a_handler_that_stops_at_the_cancellation_is_retried_with_the_timeout_code() -> None:
    async def handler(body: Json[dict[str, Any]]) -> None:
        await asyncio.sleep(60)

    engine, copies = make_engine(handler)
    message = Message()
    await engine.deliver(Q, message)
    observation = only(engine)
    assert (observation.outcome, observation.code) == ("retried", "QUEUE_HANDLER_TIMEOUT")
    assert copies == [f"{Q}.retry.0"]
    assert message.settled == ["ack"]
    assert engine.snapshots()[0].abandoned == 0


async def test_a_handler_that_returns_within_the_window_keeps_its_own_verdict() -> None:
    async def handler(body: Json[dict[str, Any]]) -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            return  # it chose to finish

    engine, copies = make_engine(handler)
    message = Message()
    await engine.deliver(Q, message)
    assert only(engine).outcome == "acked"
    assert copies == []
    assert message.settled == ["ack"]


def stubborn(release: asyncio.Event, returned: asyncio.Event) -> Callable[[Any], Awaitable[None]]:
    """A handler that ignores every cancellation until ``release`` is set, then sets ``returned``."""

    async def handler(body: Json[dict[str, Any]]) -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # ignores every cancellation
        returned.set()

    return handler


async def test_a_handler_that_ignores_the_cancellation_is_dropped_and_its_late_result_discarded() -> None:
    release, returned = asyncio.Event(), asyncio.Event()
    engine, copies = make_engine(stubborn(release, returned))
    message = Message()
    delivering = asyncio.ensure_future(engine.deliver(Q, message))
    await until(lambda: len(engine.observations) == 1)
    observation = only(engine)
    assert (observation.outcome, observation.code) == ("retried", "QUEUE_HANDLER_TIMEOUT")
    assert "dropped" in observation.reason
    assert observation.duration >= DEADLINE + WINDOW
    assert engine.snapshots()[0].abandoned == 1
    assert engine.snapshots()[0].in_flight == 0  # its permit came back while the handler still runs
    assert not returned.is_set()
    assert not delivering.done()
    assert not engine.unsettled()

    release.set()
    await delivering
    assert returned.is_set()
    assert only(engine).outcome == "retried"  # the late success is discarded: one outcome, one copy
    assert copies == [f"{Q}.retry.0"]
    assert message.settled == ["ack"]


async def test_after_a_forced_shutdown_an_unsettled_delivery_is_recorded_unresolved_once() -> None:
    release = asyncio.Event()
    engine, _ = make_engine(stubborn(release, asyncio.Event()), deadline=60.0)
    delivering = asyncio.ensure_future(engine.deliver(Q, Message()))
    await until(lambda: bool(engine.unsettled()))
    engine.force_notice()
    engine.revoke()
    assert engine.abandon_unfinished() == 1
    assert engine.abandon_unfinished() == 0
    assert only(engine).outcome == "unresolved"
    release.set()
    await delivering
    assert only(engine).outcome == "unresolved"


async def test_the_engine_phase_only_moves_forward() -> None:
    async def handler(body: Json[dict[str, Any]]) -> None:
        pass

    engine, _ = make_engine(handler)
    first = engine.phase
    engine.revoke()
    engine.stop_accepting()
    await engine.return_buffered()
    engine.force_notice()
    assert (first, engine.phase) == (Phase.RUNNING, Phase.REVOKED)
    assert not engine.accepting


def test_the_lifecycle_state_only_moves_forward() -> None:
    lifecycle = Lifecycle()
    for state in (State.STARTING, State.RUNNING, State.DRAINING, State.STOPPED):  # a graceful shutdown: no forcing
        lifecycle.enter(state)
        assert lifecycle.state is state
    with pytest.raises(LilyError, match="cannot go back from stopped to running"):
        lifecycle.enter(State.RUNNING)
    with pytest.raises(LilyError, match="cannot go back from stopped to stopped"):
        lifecycle.enter(State.STOPPED)


async def test_a_consumer_and_the_managed_consumer_it_starts_read_one_state() -> None:
    async def handler(body: Json[dict[str, Any]]) -> None:
        pass

    consumer = Consumer(amqp_url="amqp://unused/", name="t", telemetry=False)
    consumer.include(queue(Q, version=1)(handler))
    lifecycle = consumer._lifecycle
    managed = ManagedConsumer(consumer.settings, consumer.plan(), lifecycle=lifecycle)
    lifecycle.enter(State.STARTING)
    assert consumer.state == managed.state == "starting"
    lifecycle.enter(State.DRAINING)
    assert consumer.state == managed.state == "draining"
    with pytest.raises(ConfigError, match="the consumer is draining"):
        consumer.configure_queue("late")
