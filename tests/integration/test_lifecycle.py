"""Lifecycle against the real broker: cancellation, shutdown, deadlines, reconnects, observation (docs/lifecycle.md)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Mapping
from typing import Any

import aio_pika
import aio_pika.abc
import pytest
import yarl
from pymongo import AsyncMongoClient
from pymongo.errors import InvalidOperation

from lily_mongo import (
    Consumer,
    EventId,
    Json,
    ManagedConsumer,
    MongoScope,
    Publisher,
    Redelivered,
    RetryPolicy,
    ShutdownReport,
    TerminalObservation,
    queue,
)
from tests.support.broker import Broker, consumer_count, queue_exists
from tests.support.consumers import new_tasks
from tests.support.handlers import accepting
from tests.support.mongo import MongoDB
from tests.support.polling import eventually
from tests.support.processes import run

Body = Json[dict[str, Any]]

needs_rabbitmqctl = pytest.mark.skipif(
    shutil.which("rabbitmqctl") is None, reason="needs rabbitmqctl for the broker under test"
)


# -- helpers ------------------------------------------------------------------------------------


def _with_query(url: str, **params: str) -> str:
    """The URL with extra query parameters (aio-pika reads ``name`` and ``reconnect_interval`` from it)."""
    return str(yarl.URL(url).update_query(params))


def _connection_name() -> str:
    return f"lily-lifecycle-{uuid.uuid4().hex[:10]}"


async def _rabbitmqctl(*args: str) -> str:
    done = await run(["rabbitmqctl", *args], timeout=60)
    assert done.returncode == 0, done.describe()
    return done.stdout


async def _broker_connection_pids(connection_name: str) -> list[str]:
    """Broker-side pids of the connections whose client-provided name is ``connection_name``."""
    out = await _rabbitmqctl("list_connections", "-q", "--no-table-headers", "pid", "client_properties")
    marker = f'{{"connection_name","{connection_name}"}}'
    return [line.split("\t", 1)[0] for line in out.splitlines() if marker in line]


async def _close_from_the_broker(connection_name: str) -> None:
    """The broker closes the (one) connection named ``connection_name``, as an operator or a failover would."""
    [pid] = await _broker_connection_pids(connection_name)
    await _rabbitmqctl("close_connection", pid, "lifecycle test")


async def _reconnect_under_a_held_handler(managed: ManagedConsumer, gate: Gate, connection_name: str) -> None:
    """Once a handler holds at ``gate``, the broker closes the consumer's connection; wait for the reconnect."""
    await eventually(lambda: gate.entered == 1, what="the held handler")
    await _close_from_the_broker(connection_name)
    await eventually(lambda: managed.snapshot().transport_generation == 2, what="the reconnect")


def _outcomes(managed: ManagedConsumer, event_id: uuid.UUID) -> list[str]:
    return [o.outcome for o in managed.delivery_terminal_observations() if o.event_id == event_id]


def _observation(managed: ManagedConsumer, event_id: uuid.UUID) -> TerminalObservation:
    [observation] = [o for o in managed.delivery_terminal_observations() if o.event_id == event_id]
    return observation


async def _close_leaked_connections(before: set[asyncio.Task[Any]]) -> None:
    """Test hygiene only: close AMQP connections whose tasks outlived a cancelled start."""
    for task in new_tasks(before):
        frame = getattr(task.get_coro(), "cr_frame", None)
        owner = frame.f_locals.get("self") if frame is not None else None
        if isinstance(owner, aio_pika.abc.AbstractConnection) and not owner.is_closed:
            await owner.close()


def _walk(value: Any) -> Iterator[Any]:
    """Every leaf (and every key) of a dataclass / mapping / sequence tree."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield f.name
            yield from _walk(getattr(value, f.name))
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _walk(key)
            yield from _walk(item)
    elif isinstance(value, list | tuple | set | frozenset):
        for item in value:
            yield from _walk(item)
    else:
        yield value


class Gate:
    """Lets a test hold handlers inside their call and release them, with bounded waits."""

    def __init__(self) -> None:
        self.entered = 0
        self.finished = 0
        self.cancelled = 0
        self.release = asyncio.Event()

    async def hold(self, limit: float = 10.0) -> None:
        self.entered += 1
        try:
            async with asyncio.timeout(limit):
                await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.finished += 1


class Stubborn:
    """A handler body that ignores cancellation, counting the cancels it swallows, until the test
    gives up on it (and at most 8 s, so a test cannot hang on it)."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.done = asyncio.Event()
        self.give_up = asyncio.Event()
        self.cancels = 0

    async def run(self) -> None:
        self.entered.set()
        loop = asyncio.get_running_loop()
        until = loop.time() + 8.0
        try:
            while not self.give_up.is_set() and loop.time() < until:
                try:
                    await asyncio.sleep(0.05)
                except asyncio.CancelledError:
                    self.cancels += 1
        finally:
            self.done.set()

    async def end(self) -> None:
        """Let it return, and wait until it has."""
        self.give_up.set()
        async with asyncio.timeout(10):
            await self.done.wait()


class Sleeper:
    """A handler body that takes ``seconds`` per delivery, noting that it entered and which events it finished."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.entered = asyncio.Event()
        self.finished: list[uuid.UUID] = []

    async def run(self, event_id: uuid.UUID) -> None:
        self.entered.set()
        await asyncio.sleep(self.seconds)
        self.finished.append(event_id)

    async def wait_entered(self) -> None:
        async with asyncio.timeout(10):
            await self.entered.wait()


def one_at_a_time(broker: Broker, q: str, body: Callable[[uuid.UUID], Awaitable[None]], **options: Any) -> Consumer:
    """A consumer of ``q`` with one permit and prefetch 1 whose handler awaits ``body(event_id)``."""

    @queue(q, version=1)
    async def handler(payload: Body, event_id: EventId) -> None:
        await body(event_id)

    return broker.consumer(q, handler, concurrency=1, prefetch=1, **options)


def sleeper_on(broker: Broker, base: str, seconds: float) -> tuple[str, Sleeper, Consumer]:
    """A fresh queue, a :class:`Sleeper` taking ``seconds`` per delivery, and its one-at-a-time consumer."""
    q = broker.queue(base)
    sleeper = Sleeper(seconds)
    return q, sleeper, one_at_a_time(broker, q, sleeper.run)


async def in_background[T](consumer: Consumer, run: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """``run`` (the consumer's ``run()`` or ``run_with_cancellation()``) in a task, once the consumer runs."""
    task = asyncio.create_task(run)
    await eventually(lambda: consumer.state == "running", what="the consumer to run")
    return task


async def assert_settled_and_detached(broker: Broker, q: str) -> None:
    """Nothing is back in ``q`` (an unacked delivery would be) and no consumer is attached to it."""
    assert await broker.depth(q) == 0
    assert await consumer_count(broker.connection, q) == 0


# -- cancellation rules -------------------------------------------------------------------------


@needs_rabbitmqctl
async def test_cancel_start_while_connecting_leaves_nothing_running(broker: Broker) -> None:
    q = broker.queue("cancel-connect")
    connection_name = _connection_name()
    consumer = broker.consumer(q, accepting(q), amqp_url=_with_query(broker.url, name=connection_name))
    before = asyncio.all_tasks()
    try:
        task = asyncio.create_task(consumer.start())
        await asyncio.sleep(0)  # the task is inside connect_amqp now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.5)  # long enough for a leaked background connect to finish
        assert await _broker_connection_pids(connection_name) == []
        assert new_tasks(before) == set()
        assert await consumer_count(broker.connection, q) in (None, 0)
        assert consumer.state == "stopped"
    finally:
        await _close_leaked_connections(before)


@needs_rabbitmqctl
async def test_cancel_start_while_declaring_a_large_topology_tears_down(broker: Broker) -> None:
    # Four queues with 32 retry buckets each: 136 declarations, each on its own channel.
    queues = [broker.queue(f"cancel-declare-{i}") for i in range(4)]
    connection_name = _connection_name()
    consumer = Consumer(amqp_url=_with_query(broker.url, name=connection_name), name="t")
    for q in queues:
        consumer.configure_queue(q, retry=RetryPolicy(max_retries=32, delays=tuple(1.0 + i for i in range(32))))
        consumer.include(accepting(q))
    before = asyncio.all_tasks()
    try:
        task = asyncio.create_task(consumer.start())
        # Cancel once the second queue is declared: the topology is half done.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not await queue_exists(broker.connection, queues[1]):
            assert not task.done(), "start() finished before the test could cancel it"
            assert loop.time() < deadline
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not await queue_exists(broker.connection, f"{queues[3]}.dlq"), "start() got further than expected"
        assert await _broker_connection_pids(connection_name) == []
        assert new_tasks(before) == set()
        for q in queues:
            assert await consumer_count(broker.connection, q) in (None, 0)
        assert consumer.state == "stopped"
        with pytest.raises(ValueError, match="stopped"):
            await consumer.start()
    finally:
        await _close_leaked_connections(before)


@pytest.mark.parametrize("cancels", [1, 2], ids=["cancel-once", "cancel-twice"])
async def test_cancel_run_drains_in_flight_work_before_propagating(cancels: int, broker: Broker) -> None:
    q, handler, consumer = sleeper_on(broker, "cancel-run", 0.8)
    run = await in_background(consumer, consumer.run())
    event_id = await broker.publish(q)
    await handler.wait_entered()
    run.cancel()
    if cancels == 2:
        await asyncio.sleep(0.1)
        run.cancel()  # a second cancel while shutting down does not cut the shutdown short
    with pytest.raises(asyncio.CancelledError):
        await run
    # Graceful shutdown completed before the cancellation surfaced.
    assert handler.finished == [event_id]
    await assert_settled_and_detached(broker, q)
    assert consumer.state == "stopped"


async def test_run_with_cancellation_event_returns_a_successful_report(broker: Broker) -> None:
    q, handler, consumer = sleeper_on(broker, "run-event", 0.0)
    stop = asyncio.Event()
    run = await in_background(consumer, consumer.run_with_cancellation(stop))
    event_id = await broker.publish(q)
    await eventually(lambda: handler.finished == [event_id], what="the delivery")
    stop.set()
    async with asyncio.timeout(10):
        report = await run
    assert isinstance(report, ShutdownReport)
    assert report.succeeded is True
    assert report.forced is False
    assert report.unresolved == 0
    await assert_settled_and_detached(broker, q)


async def test_cancel_run_with_cancellation_after_the_event_still_waits_for_the_shutdown(broker: Broker) -> None:
    q, handler, consumer = sleeper_on(broker, "run-event-cancel", 0.8)
    stop = asyncio.Event()
    run = await in_background(consumer, consumer.run_with_cancellation(stop))
    event_id = await broker.publish(q)
    await handler.wait_entered()
    stop.set()
    await asyncio.sleep(0.1)  # the graceful shutdown is draining the held delivery
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    finished_when_cancel_surfaced = list(handler.finished)
    stopped_when_cancel_surfaced = consumer.state == "stopped"
    # Hygiene: let a shutdown that went on in the background finish before asserting.
    await eventually(lambda: consumer.state == "stopped", what="the shutdown to end")
    assert finished_when_cancel_surfaced == [event_id]
    assert stopped_when_cancel_surfaced
    await assert_settled_and_detached(broker, q)


async def test_cancelling_wait_does_not_stop_the_consumer(broker: Broker) -> None:
    q, handler, consumer = sleeper_on(broker, "cancel-wait", 0.0)
    managed = await consumer.start()
    try:
        waiter = asyncio.create_task(managed.wait())
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert managed.state == "running"
        event_id = await broker.publish(q)
        await eventually(lambda: _outcomes(managed, event_id) == ["acked"], what="the ACK")
        assert handler.finished == [event_id]
        assert await broker.depth(q) == 0
    finally:
        report = await managed.shutdown()
    assert report.succeeded is True


async def test_cancelling_shutdown_does_not_cancel_the_supervisor(broker: Broker) -> None:
    q = broker.queue("cancel-shutdown")
    gate = Gate()
    consumer = one_at_a_time(broker, q, lambda _: gate.hold())
    managed = await consumer.start()
    event_id = await broker.publish(q)
    await eventually(lambda: gate.entered == 1, what="the handler")
    shutdown = asyncio.create_task(managed.shutdown())
    await asyncio.sleep(0.1)
    shutdown.cancel()
    with pytest.raises(asyncio.CancelledError):
        await shutdown
    assert managed.state == "draining"  # still draining the held delivery
    gate.release.set()
    async with asyncio.timeout(10):
        report = await managed.wait()
    assert report.succeeded is True
    assert dict(report.settled) == {"acked": 1}
    assert _outcomes(managed, event_id) == ["acked"]
    assert gate.finished == 1
    assert managed.state == "stopped"
    await assert_settled_and_detached(broker, q)


# -- graceful and forced shutdown ---------------------------------------------------------------


async def test_graceful_shutdown_waits_for_eight_slow_handlers(broker: Broker) -> None:
    q = broker.queue("graceful")
    entered: list[uuid.UUID] = []
    finished: list[uuid.UUID] = []

    @queue(q, version=1)
    async def handler(body: Body, event_id: EventId) -> None:
        entered.append(event_id)
        await asyncio.sleep(1.0)
        finished.append(event_id)

    consumer = broker.consumer(q, handler, concurrency=8, prefetch=8)
    managed = await consumer.start()
    event_ids = set(await broker.publish_all(q, [{"n": n} for n in range(8)]))
    await eventually(lambda: len(entered) == 8, what="eight handlers in flight")
    started = time.monotonic()
    report = await managed.shutdown()
    took = time.monotonic() - started
    assert took >= 0.5  # it waited for the handlers (each sleeps 1 s)
    assert set(finished) == event_ids
    assert report.succeeded is True
    assert report.forced is False
    assert report.unresolved == 0
    assert dict(report.settled) == {"acked": 8}
    observations = managed.delivery_terminal_observations()
    assert sorted(o.outcome for o in observations) == ["acked"] * 8
    assert {o.event_id for o in observations} == event_ids
    assert all(o.ack_sent for o in observations)
    assert await broker.depth(q) == 0


async def test_forced_shutdown_reports_a_stubborn_delivery_unresolved_and_the_broker_redelivers_it(
    broker: Broker,
) -> None:
    q = broker.queue("forced")
    graceful, force = 0.5, 0.5
    stubborn = Stubborn()
    options = {"graceful_timeout": graceful, "force_timeout": force, "deadline": 60.0}
    consumer = one_at_a_time(broker, q, lambda _: stubborn.run(), **options)
    managed = await consumer.start()
    try:
        event_id = await broker.publish(q)
        async with asyncio.timeout(10):
            await stubborn.entered.wait()
        started = time.monotonic()
        report = await managed.shutdown()
        took = time.monotonic() - started
        assert graceful <= took <= graceful + 2 * force + 1.5
        assert stubborn.cancels >= 1  # the force notice reached the handler
        assert report.forced is True
        assert report.succeeded is False
        assert report.unresolved >= 1
        assert report.settled.get("acked", 0) == 0
        assert _outcomes(managed, event_id) == ["unresolved"]
        forced = report.action("force")
        assert forced.ok is True
        assert forced.observed is False  # the stubborn task did not end
        assert report.action("drain").observed is False
        assert managed.state == "stopped"
        # The connection is closed: the unacked delivery is back in the queue.
        assert await broker.wait_for_depth(q, 1) == 1
    finally:
        await stubborn.end()

    seen: list[tuple[uuid.UUID, bool]] = []

    @queue(q, version=1)
    async def handler(body: Body, event_id: EventId, redelivered: Redelivered) -> None:
        seen.append((event_id, redelivered))

    second = broker.consumer(q, handler, name="t2", concurrency=1, prefetch=1)
    managed2 = await second.start()
    try:
        await eventually(lambda: _outcomes(managed2, event_id) == ["acked"], what="the redelivery")
    finally:
        report2 = await managed2.shutdown()
    assert seen == [(event_id, True)]
    assert report2.succeeded is True
    assert await broker.depth(q) == 0


async def test_signals_first_requests_graceful_shutdown_a_burst_counts_once_a_later_one_forces(
    broker: Broker,
) -> None:
    q = broker.queue("signals")
    retry = RetryPolicy(max_retries=1, delays=(30.0,))
    gate = Gate()
    consumer = one_at_a_time(broker, q, lambda _: gate.hold(), graceful_timeout=30.0, force_timeout=1.0, retry=retry)
    managed = await consumer.start()
    uninstall = managed.install_signal_handlers()
    try:
        event_id = await broker.publish(q)
        await eventually(lambda: gate.entered == 1, what="the handler")
        first = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        await eventually(lambda: managed.state == "draining", what="a graceful shutdown")
        os.kill(os.getpid(), signal.SIGINT)  # the same burst (a launcher forwarding the key press)
        await asyncio.sleep(0.3)
        assert managed.state == "draining"  # neither the first signal nor its burst forces
        assert gate.cancelled == 0
        await asyncio.sleep(max(0.0, first + 1.2 - time.monotonic()))
        os.kill(os.getpid(), signal.SIGINT)  # over a second later: forces
        async with asyncio.timeout(10):
            report = await managed.wait()
    finally:
        uninstall()
    assert report.forced is True
    assert gate.cancelled == 1  # the force notice cancelled the handler
    assert report.action("force").observed is True
    assert report.unresolved == 0
    assert report.succeeded is True
    # A handler cut short by the force notice is an infrastructure event, not an application
    # failure: the delivery is requeued (still with authority) without spending a retry.
    observation = _observation(managed, event_id)
    assert (observation.outcome, observation.code) == ("deferred", "SHUTDOWN")
    assert observation.handoff_confirmed is False
    assert dict(report.settled) == {"deferred": 1}
    assert await broker.depth(f"{q}.retry.0") == 0
    [message] = await broker.drain(q)
    assert message.headers["x-lily-event-id"] == str(event_id)
    assert message.headers.get("x-retry-count", 0) == 0


# -- the delivery deadline ----------------------------------------------------------------------


async def test_delivery_deadline_cancels_the_handler_and_hands_off_a_retry(broker: Broker) -> None:
    q = broker.queue("deadline")
    cancelled = asyncio.Event()

    @queue(q, version=1)
    async def handler(body: Body) -> None:
        try:
            await asyncio.sleep(5.0)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    retry = RetryPolicy(max_retries=2, delays=(30.0,))
    consumer = broker.consumer(q, handler, concurrency=1, prefetch=1, deadline=0.3, cooperation_window=0.2, retry=retry)
    managed = await consumer.start()
    try:
        event_id = await broker.publish(q)
        await eventually(lambda: bool(_outcomes(managed, event_id)), what="the terminal outcome")
    finally:
        report = await managed.shutdown()
    observation = _observation(managed, event_id)
    assert observation.outcome == "retried"
    assert observation.code == "QUEUE_HANDLER_TIMEOUT"
    assert observation.handoff_confirmed is True
    assert observation.ack_sent is True
    assert 0.3 <= observation.duration < 2.0
    assert cancelled.is_set()
    assert managed.snapshot().queues[0].abandoned == 0  # it cooperated within the window
    assert report.succeeded is True
    assert await broker.depth(q) == 0
    [copy] = await broker.drain(f"{q}.retry.0")
    assert copy.headers["x-lily-failure-code"] == "QUEUE_HANDLER_TIMEOUT"
    assert copy.headers["x-retry-count"] == 1
    assert copy.headers["x-lily-event-id"] == str(event_id)


async def test_delivery_deadline_drops_a_handler_that_ignores_cancellation(broker: Broker) -> None:
    q = broker.queue("deadline-drop")
    stubborn = Stubborn()
    retry = RetryPolicy(max_retries=2, delays=(30.0,))
    consumer = one_at_a_time(broker, q, lambda _: stubborn.run(), deadline=0.3, cooperation_window=0.2, retry=retry)
    managed = await consumer.start()
    try:
        event_id = await broker.publish(q)
        await eventually(lambda: bool(_outcomes(managed, event_id)), what="the terminal outcome")
        observation = _observation(managed, event_id)
        # Deadline (0.3 s) + cooperation window (0.2 s), then the task is dropped.
        assert 0.5 <= observation.duration < 2.0
        assert (observation.outcome, observation.code) == ("retried", "QUEUE_HANDLER_TIMEOUT")
        assert managed.snapshot().queues[0].abandoned == 1
        assert not stubborn.done.is_set()  # dropped, not finished
    finally:
        await stubborn.end()
        await managed.shutdown()
    assert await broker.depth(q) == 0
    assert await broker.depth(f"{q}.retry.0") == 1


async def test_shutdown_report_does_not_claim_success_while_a_dropped_handler_still_runs(broker: Broker) -> None:
    q = broker.queue("deadline-leftover")
    retry = RetryPolicy(max_retries=1, delays=(30.0,))
    stubborn = Stubborn()
    consumer = one_at_a_time(
        broker, q, lambda _: stubborn.run(), force_timeout=0.3, deadline=0.2, cooperation_window=0.1, retry=retry
    )
    managed = await consumer.start()
    try:
        event_id = await broker.publish(q)
        await eventually(lambda: _outcomes(managed, event_id) == ["retried"], what="the deadline")
        report = await managed.shutdown()
        assert not stubborn.done.is_set()  # the dropped handler outlived the shutdown
        assert report.succeeded is False
        assert any(not action.observed for action in report.actions)
    finally:
        await stubborn.end()


# -- transport loss -----------------------------------------------------------------------------


@needs_rabbitmqctl
async def test_broker_closed_connection_leaves_old_deliveries_unresolved_and_consuming_resumes(broker: Broker) -> None:
    q = broker.queue("conn-close")
    connection_name = _connection_name()
    gate = Gate()
    calls: list[tuple[uuid.UUID, bool]] = []

    @queue(q, version=1)
    async def handler(body: Body, event_id: EventId, redelivered: Redelivered) -> None:
        calls.append((event_id, redelivered))
        if not redelivered and body.get("hold"):
            await gate.hold()

    url = _with_query(broker.url, name=connection_name, reconnect_interval="0.2")
    consumer = broker.consumer(q, handler, amqp_url=url, concurrency=2, prefetch=2)
    managed = await consumer.start()
    try:
        assert managed.snapshot().transport_generation == 1
        async with Publisher(broker.url) as publisher:
            held = await publisher.publish_json(q, {"hold": True}, version=1)
            await eventually(lambda: gate.entered == 1, what="the held handler")
            await _close_from_the_broker(connection_name)
            # The broker requeues the unacked delivery; the robust connection reconnects
            # and the redelivery reaches the handler while the first call still runs.
            await eventually(lambda: (held, True) in calls, what="the redelivery")
            assert managed.snapshot().transport_generation == 2
            # The redelivery is settled on the new channel while the old call still runs.
            await eventually(lambda: _outcomes(managed, held) == ["acked"], what="the redelivery's ACK")
            gate.release.set()
            await eventually(lambda: len(_outcomes(managed, held)) == 2, what="the old delivery to end")
            fresh = await publisher.publish_json(q, {"n": 2}, version=1)
            await eventually(lambda: _outcomes(managed, fresh) == ["acked"], what="a new delivery")
        old = [o for o in managed.delivery_terminal_observations() if o.event_id == held][-1]
        assert old.outcome == "unresolved"
        assert old.ack_sent is False
        assert calls.count((held, False)) == 1
        assert managed.snapshot().queues[0].unresolved == 1
        assert await broker.depth(q) == 0
    finally:
        gate.release.set()
        report = await managed.shutdown()
    assert report.succeeded is True


@needs_rabbitmqctl
async def test_transport_loss_is_settled_by_the_decision_table_not_by_a_crash(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    q = broker.queue("conn-close-reason")
    connection_name = _connection_name()
    gate = Gate()

    @queue(q, version=1)
    async def handler(body: Body, redelivered: Redelivered) -> None:
        if not redelivered:
            await gate.hold()

    url = _with_query(broker.url, name=connection_name, reconnect_interval="0.2")
    consumer = broker.consumer(q, handler, amqp_url=url, concurrency=2, prefetch=2)
    managed = await consumer.start()
    try:
        event_id = await broker.publish(q)
        await _reconnect_under_a_held_handler(managed, gate, connection_name)
        caplog.clear()
        gate.release.set()
        await eventually(lambda: "unresolved" in _outcomes(managed, event_id), what="the old delivery to end")
    finally:
        gate.release.set()
        await managed.shutdown()
    [old] = [o for o in managed.delivery_terminal_observations() if o.outcome == "unresolved"]
    assert "transport lost" in old.reason
    crashed = [r for r in caplog.records if r.name == "lily_mongo" and r.levelno >= logging.ERROR]
    assert crashed == []


@needs_rabbitmqctl
async def test_broker_closed_connection_with_the_inbox_applies_the_effect_once(
    broker: Broker, mongodb: MongoDB
) -> None:
    q = broker.queue("conn-close-inbox")
    connection_name = _connection_name()
    gate = Gate()
    runs: list[uuid.UUID] = []

    @queue(q, version=1)
    async def handler(body: Body, event_id: EventId, mongo: MongoScope) -> None:
        runs.append(event_id)
        await mongo.database["effects"].insert_one({"event": str(event_id)}, session=mongo.session)
        if len(runs) == 1:
            await gate.hold()

    url = _with_query(broker.url, name=connection_name, reconnect_interval="0.2")
    consumer = broker.consumer(q, handler, amqp_url=url, mongodb=mongodb, concurrency=1, prefetch=1)
    managed = await consumer.start()
    try:
        event_id = await broker.publish(q)
        await _reconnect_under_a_held_handler(managed, gate, connection_name)
        gate.release.set()
        await eventually(
            lambda: bool(_outcomes(managed, event_id)) and _outcomes(managed, event_id)[-1] in ("acked", "duplicate"),
            timeout=20,
            what="the redelivery to be settled",
        )
        assert "unresolved" in _outcomes(managed, event_id)  # the old generation's delivery
        assert await broker.wait_for_depth(q, 0) == 0
    finally:
        gate.release.set()
        report = await managed.shutdown()
    database = mongodb.db
    assert await database["effects"].count_documents({"event": str(event_id)}) == 1
    assert await database["lily_inbox"].count_documents({"event_id": str(event_id)}) == 1
    assert report.unresolved == 0


# -- observation --------------------------------------------------------------------------------


@pytest.fixture
async def broker_user() -> AsyncIterator[tuple[str, str]]:
    """A throwaway broker user with a distinctive password (guest's password equals its name)."""
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("needs rabbitmqctl for the broker under test")
    user = f"lily-priv-{uuid.uuid4().hex[:8]}"
    password = f"Pw-{uuid.uuid4().hex}"
    await _rabbitmqctl("add_user", user, password)
    try:
        await _rabbitmqctl("set_permissions", "-p", "/", user, ".*", ".*", ".*")
        yield user, password
    finally:
        await _rabbitmqctl("delete_user", user)


async def test_snapshot_and_reprs_never_expose_ids_names_endpoints_or_credentials(
    broker: Broker, broker_user: tuple[str, str]
) -> None:
    user, password = broker_user
    parsed = yarl.URL(broker.url)
    url = str(parsed.with_user(user).with_password(password))
    host_port = f"{parsed.host}:{parsed.port}"
    q = broker.queue("privacy-zebra-queue")
    consumer = broker.consumer(q, accepting(q), amqp_url=url, concurrency=2, prefetch=4)
    managed = await consumer.start()
    event_ids = [uuid.uuid4() for _ in range(3)]
    try:
        for event_id in event_ids:
            await broker.publish(q, event_id=event_id)
        await eventually(lambda: len(managed.delivery_terminal_observations()) == 3, what="three outcomes")
        snapshot = managed.snapshot()
        texts = [repr(snapshot), str(snapshot)]
        texts += [repr(leaf) for leaf in _walk(snapshot)] + [str(leaf) for leaf in _walk(snapshot)]
        secrets = [q, host_port, password, *(str(e) for e in event_ids), *(e.hex for e in event_ids)]
        for text in texts:
            for secret in secrets:
                assert secret not in text
        for text in (repr(consumer), repr(managed)):
            assert password not in text
        assert "***" in repr(consumer)  # the endpoint is shown, its password redacted
        assert snapshot.state == "running"
        assert snapshot.queues[0].outcomes == {"acked": 3}
        assert snapshot.queues[0].received == 3
        # Observations are the diagnostic record: they do carry the event ids.
        assert {o.event_id for o in managed.delivery_terminal_observations()} == set(event_ids)
    finally:
        report = await managed.shutdown()
    for text in (repr(consumer), repr(managed), report.render(), repr(report)):
        assert password not in text


async def test_terminal_observations_keep_the_last_4096(broker: Broker) -> None:
    q = broker.queue("cap")
    managed = await broker.consumer(q, accepting(q), concurrency=2, prefetch=4).start()
    try:
        real = await broker.publish_all(q, [{"n": n} for n in range(3)])
        await eventually(lambda: len(managed.delivery_terminal_observations()) == 3, what="three outcomes")
        engine = managed._engine
        assert engine is not None
        for n in range(5000):
            engine.observations.record(
                queue="synthetic",
                handler_id=None,
                event_id=None,
                outcome="acked",
                code=None,
                reason="",
                handoff_confirmed=False,
                ack_sent=True,
                broker_native=False,
                attempts=n,
                transient_replays=0,
                reconciliations=0,
                received_at=0.0,
                duration=0.0,
            )
        observations = managed.delivery_terminal_observations()
        assert len(observations) == 4096
        assert not {o.event_id for o in observations} & set(real)  # the oldest (the real ones) were dropped
        assert [o.attempts for o in observations] == list(range(5000 - 4096, 5000))  # oldest first
    finally:
        await managed.shutdown()


# -- the shutdown report ------------------------------------------------------------------------


async def test_shutdown_report_lists_each_step_with_ok_and_observed(broker: Broker) -> None:
    q = broker.queue("report")
    managed = await broker.consumer(q, accepting(q)).start()
    report = await managed.shutdown()
    steps = ["stop_intake", "drain", "channel_close", "connection_close", "tasks_join"]
    assert [a.name for a in report.actions] == steps
    for action in report.actions:
        assert (action.name, action.ok, action.observed, action.error) == (action.name, True, True, None)
        assert action.duration >= 0.0
    with pytest.raises(KeyError):
        report.action("force")
    assert report.forced is False
    assert report.unresolved == 0
    assert dict(report.settled) == {}
    assert report.succeeded is True
    assert report.render().startswith("shutdown succeeded; unresolved deliveries: 0")
    # The supervisor's result is kept: later waits return the same report.
    assert await managed.wait() is report
    assert await managed.shutdown() is report


async def test_shutdown_leaves_a_caller_owned_mongo_client_open(broker: Broker, mongodb: MongoDB) -> None:
    q = broker.queue("report-inbox")

    @queue(q, version=1)
    async def handler(body: Body, event_id: EventId, mongo: MongoScope) -> None:
        await mongo.database["effects"].insert_one({"event": str(event_id)}, session=mongo.session)

    consumer = broker.consumer(q, handler, mongodb=mongodb, concurrency=1, prefetch=1)
    managed = await consumer.start()
    try:
        event_id = await broker.publish(q)
        await eventually(lambda: _outcomes(managed, event_id) == ["acked"], timeout=20, what="the ACK")
    finally:
        report = await managed.shutdown()
    assert [a.name for a in report.actions] == [
        "stop_intake",
        "drain",
        "relay_stop",
        "channel_close",
        "connection_close",
        "tasks_join",
    ]
    assert all(a.ok and a.observed for a in report.actions)
    assert report.succeeded is True
    # Caller-owned: still usable after shutdown.
    assert await mongodb.db["effects"].count_documents({"event": str(event_id)}) == 1


async def test_shutdown_closes_an_owned_mongo_client(broker: Broker, mongodb: MongoDB) -> None:
    client: AsyncMongoClient[Any] = AsyncMongoClient(mongodb.uri, serverSelectionTimeoutMS=10_000)
    q = broker.queue("report-owned")

    @queue(q, version=1)
    async def handler(body: Body, mongo: MongoScope) -> None:
        pass

    owned = MongoDB(mongodb.uri, client, mongodb.name)
    consumer = broker.consumer(q, handler, mongodb=owned, owns_mongo_client=True, concurrency=1, prefetch=1)
    try:
        managed = await consumer.start()
        report = await managed.shutdown()
        assert report.actions[-1].name == "mongo_client_close"
        assert (report.actions[-1].ok, report.actions[-1].observed) == (True, True)
        assert report.succeeded is True
        with pytest.raises(InvalidOperation):
            await client[mongodb.name]["effects"].find_one({})
    finally:
        await client.close()
