"""Settlement of the original delivery against the real broker (docs/settlement.md), at_least_once guarantee.

One test (or a pair) per row of the decision table. Every test asserts what the
broker holds afterwards: the depth of ``Q``, ``Q.retry.<n>`` and ``Q.dlq`` and
the headers of the copies. Depths are read after shutdown, when the consumer's
channels are closed, so an unacknowledged delivery would be back in ``Q``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import aio_pika.abc
import pamqp.decode
import pydantic
import pytest
from pamqp.common import FieldTable

from lily_mongo import (
    EventId,
    Json,
    QueueHandlerError,
    Redelivered,
    RetryCount,
    RetryPolicy,
    ShutdownReport,
    TerminalObservation,
    queue,
)
from tests.support.broker import Broker, headers_of
from tests.support.consumers import running, wait_observations
from tests.support.polling import eventually

LONG_DELAY = 30.0  # long enough to inspect a retry copy in its bucket before the TTL sends it back


class Order(pydantic.BaseModel):
    id: int


# -- helpers ------------------------------------------------------------------------------------


def assert_recent_timestamp(text: object) -> None:
    assert isinstance(text, str)
    when = datetime.datetime.fromisoformat(text)
    assert when.tzinfo is not None
    assert abs((datetime.datetime.now(datetime.UTC) - when).total_seconds()) < 60


def lily_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lily_mongo" and r.levelno >= logging.ERROR]


@dataclass
class Calls:
    """What a test handler saw, one entry per invocation."""

    ids: list[int] = field(default_factory=list)
    event_ids: list[uuid.UUID] = field(default_factory=list)
    retry_counts: list[int] = field(default_factory=list)
    redelivered: list[bool] = field(default_factory=list)


def recording_handler(
    q: str, calls: Calls, behaviour: Callable[[int], Awaitable[None]]
) -> Callable[..., Awaitable[None]]:
    """A json v1 handler on ``q`` that records each call, then runs ``behaviour(call_number)`` (1-based)."""

    @queue(q, version=1, content="json")
    async def handle(order: Json[Order], event_id: EventId, retry: RetryCount, redelivered: Redelivered) -> None:
        calls.ids.append(order.id)
        calls.event_ids.append(event_id)
        calls.retry_counts.append(retry)
        calls.redelivered.append(redelivered)
        await behaviour(len(calls.ids))

    return handle


def raising(error: BaseException | None = None, *, times: int | None = None) -> Callable[[int], Awaitable[None]]:
    """Raise ``error`` on every call (or on the first ``times`` calls); succeed otherwise."""

    async def behaviour(call: int) -> None:
        if error is not None and (times is None or call <= times):
            raise error

    return behaviour


def retries(count: int, delay: float) -> RetryPolicy:
    """``count`` retries, each waiting ``delay`` seconds in the one retry bucket."""
    return RetryPolicy(max_retries=count, delays=(delay,))


def orders(*ids: int) -> list[dict[str, int]]:
    return [{"id": i} for i in ids]


@dataclass
class Settled:
    """One run of the recording handler on a fresh queue: what it saw and how each delivery ended."""

    q: str
    calls: Calls
    event_ids: list[uuid.UUID]
    observations: list[TerminalObservation]
    report: ShutdownReport

    @property
    def event_id(self) -> uuid.UUID:
        """The event id of the one order published."""
        [event_id] = self.event_ids
        return event_id


async def settle(
    broker: Broker,
    base: str,
    behaviour: Callable[[int], Awaitable[None]],
    *,
    ends: int,
    ids: tuple[int, ...] = (7,),
    publish: dict[str, Any] | None = None,
    started: Callable[[str], Awaitable[None]] | None = None,
    **options: Any,
) -> Settled:
    """Consume a fresh queue with the recording handler running ``behaviour``, publish the orders ``ids``
    (``publish`` holds publish options), wait until ``ends`` deliveries ended, then shut down.

    ``started(q)`` runs once the consumer is up, before the publish; ``options`` configure the consumer.
    """
    q = broker.queue(base)
    calls = Calls()
    consumer = broker.consumer(q, recording_handler(q, calls, behaviour), **options)
    async with running(consumer, expect_clean=False) as managed:
        if started is not None:
            await started(q)
        event_ids = await broker.publish_all(q, orders(*ids), **(publish or {}))
        observations = await wait_observations(managed, ends)
        report = await managed.shutdown()
    return Settled(q, calls, event_ids, observations, report)


# -- ACK ---------------------------------------------------------------------------------------------


async def test_success_acks_the_original(broker: Broker) -> None:
    run = await settle(broker, "ok", raising(), ends=1, retry=retries(2, 0.2))
    [obs] = run.observations
    assert (obs.outcome, obs.ack_sent, obs.handoff_confirmed, obs.broker_native) == ("acked", True, False, False)
    assert obs.event_id == run.event_id
    assert obs.code is None
    assert run.calls.ids == [7]
    assert run.calls.retry_counts == [0]
    assert run.report.succeeded
    assert await broker.topology_depths(run.q) == [0, 0, 0]


@pytest.mark.parametrize("ack_delay", [0.0, 0.001, 0.02])
async def test_out_of_order_completions_mixed_with_handoffs_settle_each_delivery_once(
    broker: Broker, ack_delay: float
) -> None:
    # Handlers finish in a shuffled order; every seventh fails permanently (copy to the DLQ,
    # then ACK), every fifth other one retryably (copy to the retry bucket, then ACK). With
    # ACKs sharing frames or not, each delivery ends exactly once, every copy is confirmed
    # before its original's ACK, and the broker holds nothing of the queue unacknowledged.
    q = broker.queue(f"coalesce-{int(ack_delay * 1000)}")
    count = 60
    seen: list[int] = []

    @queue(q, version=1, content="json")
    async def handle(order: Json[Order]) -> None:
        seen.append(order.id)
        await asyncio.sleep((order.id * 7919 % 13) / 1000)
        if order.id % 7 == 0:
            raise QueueHandlerError.permanent("ORDER_INVALID", "no lines")
        if order.id % 5 == 0:
            raise QueueHandlerError.retryable("PAYMENT_DOWN", "gateway 503")

    retry = retries(1, LONG_DELAY)
    consumer = broker.consumer(q, handle, concurrency=16, prefetch=32, ack_delay=ack_delay, retry=retry)
    async with running(consumer, expect_clean=False) as managed:
        await broker.publish_all(q, orders(*range(1, count + 1)))
        observations = await wait_observations(managed, count)
        report = await managed.shutdown()
    dead = [i for i in range(1, count + 1) if i % 7 == 0]
    retried = [i for i in range(1, count + 1) if i % 5 == 0 and i % 7 != 0]
    expected = ["dead_lettered"] * len(dead) + ["retried"] * len(retried)
    assert sorted(o.outcome for o in observations) == sorted(expected + ["acked"] * (count - len(expected)))
    assert all(o.ack_sent for o in observations)
    assert all(o.handoff_confirmed for o in observations if o.outcome != "acked")
    assert sorted(seen) == list(range(1, count + 1))
    assert report.succeeded, report.render()
    assert await broker.topology_depths(q) == [0, len(retried), len(dead)]


# -- retry handoff ---------------------------------------------------------------------------------------


async def test_retryable_failure_hands_a_copy_to_the_retry_bucket(broker: Broker) -> None:
    busy = raising(QueueHandlerError.retryable("APP_BUSY", "stock service down"))
    tenant = {"headers": {"x-tenant": "acme"}}
    run = await settle(broker, "retry", busy, ends=1, publish=tenant, retry=retries(3, LONG_DELAY))
    [obs] = run.observations
    assert (obs.outcome, obs.handoff_confirmed, obs.ack_sent) == ("retried", True, True)
    assert obs.code == "APP_BUSY"
    assert run.calls.ids == [7]
    # The original is ACKed; exactly one copy waits in the first bucket.
    q = run.q
    assert await broker.topology_depths(q) == [0, 1, 0]
    [copy] = await broker.drain(f"{q}.retry.0")
    headers = copy.headers
    assert headers["x-retry-count"] == 1
    assert headers["x-lily-event-id"] == str(run.event_id)
    assert headers["x-lily-schema-version"] == "1"
    assert headers["x-lily-content-kind"] == "json"
    assert headers["x-tenant"] == "acme"
    assert headers["x-lily-failure-code"] == "APP_BUSY"
    assert headers["x-lily-failure-reason"] == "stock service down"
    assert headers["x-lily-failed-queue"] == q
    assert_recent_timestamp(headers["x-lily-failed-at"])
    assert copy.body == b'{"id":7}'
    assert copy.content_type == "application/json"


async def test_retry_copy_returns_after_its_ttl_with_the_count_incremented(broker: Broker) -> None:
    run = await settle(
        broker, "retry-ttl", raising(QueueHandlerError.retryable("APP_BUSY"), times=2), ends=3, retry=retries(3, 0.2)
    )
    assert [o.outcome for o in run.observations] == ["retried", "retried", "acked"]
    assert run.calls.retry_counts == [0, 1, 2]
    assert run.calls.event_ids == [run.event_id] * 3
    assert [o.event_id for o in run.observations] == [run.event_id] * 3
    assert run.calls.redelivered == [False, False, False]  # a retry copy is a new message, not a redelivery
    assert await broker.topology_depths(run.q) == [0, 0, 0]


async def test_retry_count_is_written_as_long_int_on_the_wire(broker: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    run = await settle(
        broker, "retry-wire", raising(QueueHandlerError.retryable("APP_BUSY")), ends=1, retry=retries(3, LONG_DELAY)
    )

    # Record the raw bytes of every top-level field table this process decodes
    # (content header "headers" property included) while reading the bucket copy.
    raw_tables: list[bytes] = []
    decode_table = pamqp.decode.METHODS["table"]

    def recording_table(value: bytes) -> tuple[int, Any]:
        consumed, table = decode_table(value)
        raw_tables.append(bytes(value[:consumed]))
        return consumed, table

    monkeypatch.setitem(pamqp.decode.METHODS, "table", recording_table)
    [copy] = await broker.drain(f"{run.q}.retry.0")
    monkeypatch.undo()
    assert copy.headers["x-retry-count"] == 1
    with_count = [raw for raw in raw_tables if b"\x0dx-retry-count" in raw]
    assert len(with_count) == 1
    # Key (short string), then type tag "I" (signed 32-bit) and the big-endian value.
    assert b"\x0dx-retry-countI\x00\x00\x00\x01" in with_count[0]


# -- DLQ handoff -----------------------------------------------------------------------------------------


async def test_retries_exhausted_go_to_the_dlq(broker: Broker) -> None:
    busy = raising(QueueHandlerError.retryable("APP_BUSY", "still down"))
    run = await settle(broker, "exhausted", busy, ends=3, retry=retries(2, 0.1))
    observations = run.observations
    assert [o.outcome for o in observations] == ["retried", "retried", "dead_lettered"]
    assert observations[-1].code == "QUEUE_RETRIES_EXHAUSTED"
    assert observations[-1].handoff_confirmed
    assert run.calls.retry_counts == [0, 1, 2]
    assert await broker.topology_depths(run.q) == [0, 0, 1]
    [copy] = await broker.drain(f"{run.q}.dlq")
    assert copy.headers["x-lily-failure-code"] == "QUEUE_RETRIES_EXHAUSTED"
    assert copy.headers["x-lily-event-id"] == str(run.event_id)
    assert copy.headers["x-retry-count"] == 2
    assert copy.headers["x-lily-failed-queue"] == run.q
    reason = copy.headers["x-lily-failure-reason"]
    assert isinstance(reason, str)
    assert 0 < len(reason.encode()) <= 512
    assert_recent_timestamp(copy.headers["x-lily-failed-at"])
    assert copy.body == b'{"id":7}'


async def test_permanent_failure_goes_to_the_dlq_with_the_handler_code(broker: Broker) -> None:
    error = QueueHandlerError.permanent("ORDER_UNKNOWN", "no order 7 in the catalogue")
    run = await settle(broker, "permanent", raising(error), ends=1, retry=retries(3, 0.1))
    [obs] = run.observations
    assert (obs.outcome, obs.code, obs.handoff_confirmed, obs.ack_sent) == (
        "dead_lettered",
        "ORDER_UNKNOWN",
        True,
        True,
    )
    assert run.calls.ids == [7]
    assert await broker.topology_depths(run.q) == [0, 0, 1]
    [copy] = await broker.drain(f"{run.q}.dlq")
    assert copy.headers["x-lily-failure-code"] == "ORDER_UNKNOWN"
    assert copy.headers["x-lily-failure-reason"] == "no order 7 in the catalogue"
    assert copy.headers["x-lily-event-id"] == str(run.event_id)
    assert copy.headers["x-lily-failed-queue"] == run.q
    assert copy.headers["x-retry-count"] == 0
    assert "x-death" not in copy.headers  # published by the framework, not dead-lettered by the broker


async def test_unknown_exception_is_retryable_by_default(broker: Broker) -> None:
    run = await settle(broker, "unknown-retry", raising(ValueError("boom")), ends=2, retry=retries(1, 0.1))
    assert [(o.outcome, o.code) for o in run.observations] == [
        ("retried", "QUEUE_HANDLER_FAILED"),
        ("dead_lettered", "QUEUE_RETRIES_EXHAUSTED"),
    ]
    assert run.calls.retry_counts == [0, 1]
    assert await broker.topology_depths(run.q) == [0, 0, 1]
    [copy] = await broker.drain(f"{run.q}.dlq")
    assert copy.headers["x-lily-failure-code"] == "QUEUE_RETRIES_EXHAUSTED"


async def test_unknown_exception_is_permanent_when_configured(broker: Broker) -> None:
    boom = raising(ValueError("boom"))
    run = await settle(broker, "unknown-permanent", boom, ends=1, retry=retries(3, 0.1), unknown_errors="permanent")
    [obs] = run.observations
    assert (obs.outcome, obs.code) == ("dead_lettered", "QUEUE_HANDLER_FAILED")
    assert run.calls.ids == [7]
    assert await broker.topology_depths(run.q) == [0, 0, 1]
    [copy] = await broker.drain(f"{run.q}.dlq")
    assert copy.headers["x-lily-failure-code"] == "QUEUE_HANDLER_FAILED"
    reason = copy.headers["x-lily-failure-reason"]
    assert isinstance(reason, str)
    assert "ValueError" in reason


# -- handoff failure: bounded requeue ----------------------------------------------------------------------


@pytest.mark.parametrize("how", ["unroutable", "nacked"])
async def test_handoff_failure_requeues_then_the_broker_dead_letters(broker: Broker, how: str) -> None:
    async def break_bucket(q: str) -> None:
        bucket = f"{q}.retry.0"
        await broker.channel.queue_delete(bucket)
        if how == "nacked":
            # A bucket that refuses every message: the broker answers the publish with basic.nack.
            refusing: FieldTable = {"x-max-length": 0, "x-overflow": "reject-publish"}
            await broker.channel.declare_queue(bucket, durable=True, arguments=refusing)

    run = await settle(
        broker,
        f"handoff-{how}",
        raising(QueueHandlerError.retryable("APP_BUSY")),
        ends=6,
        ids=(1, 2, 3),
        started=break_bucket,
        retry=retries(3, LONG_DELAY),
        max_handoff_failures=2,
    )
    q, observations = run.q, run.observations
    assert run.report.succeeded, run.report.render()
    # Each message: one failed handoff (bounded requeue), then the bound is reached and
    # the broker dead-letters the original through Q's dead-letter exchange.
    assert sorted(run.calls.ids) == [1, 1, 2, 2, 3, 3]
    for event_id in run.event_ids:
        mine = [o for o in observations if o.event_id == event_id]
        assert [o.outcome for o in mine] == ["handoff_failed", "broker_dead_lettered"]
        assert [o.code for o in mine] == ["APP_BUSY", "APP_BUSY"]  # the application failure is preserved
        assert [o.handoff_confirmed for o in mine] == [False, False]
        assert mine[1].broker_native
    # Nothing lost: 3 in, 3 in the DLQ, none left in Q.
    assert await broker.depths(q, f"{q}.dlq") == [0, 3]
    if how == "nacked":
        assert await broker.depth(f"{q}.retry.0") == 0
    copies = await broker.drain(f"{q}.dlq")
    assert sorted(headers_of(c)["x-lily-event-id"] for c in copies) == sorted(str(e) for e in run.event_ids)
    for copy in copies:
        assert "x-lily-failure-code" not in copy.headers  # the original itself, dead-lettered by the broker
        [death] = headers_of(copy)["x-death"]
        assert death["reason"] == "rejected"
        assert death["queue"] == q


class Relay:
    """A TCP relay to the broker that can hold back the broker-to-client direction or sever every connection."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._server: asyncio.Server | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._writers: list[asyncio.StreamWriter] = []
        self._pipes: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def hold(self) -> None:
        self._flowing.clear()

    def release(self) -> None:
        self._flowing.set()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        broker_reader, broker_writer = await asyncio.open_connection(*self._target)
        self._writers += [client_writer, broker_writer]
        for pipe in (
            self._pipe(client_reader, broker_writer, gated=False),
            self._pipe(broker_reader, client_writer, gated=True),
        ):
            task = asyncio.get_running_loop().create_task(pipe)
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, gated: bool) -> None:
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                if gated:
                    await self._flowing.wait()
                writer.write(chunk)
                await writer.drain()
        writer.close()

    async def sever(self) -> None:
        """Drop every relayed connection (new ones are still accepted)."""
        writers, self._writers = self._writers, []
        for writer in writers:
            writer.close()
        for writer in writers:
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def close(self) -> None:
        self.release()
        if self._server is not None:
            self._server.close()
        await self.sever()
        for task in list(self._pipes):
            task.cancel()
        if self._pipes:
            await asyncio.wait(self._pipes)
        if self._server is not None:
            await self._server.wait_closed()


@contextlib.asynccontextmanager
async def relayed(amqp: str, query: str = "") -> AsyncIterator[tuple[Relay, str]]:
    """A :class:`Relay` to the broker of ``amqp`` and the AMQP URL that goes through it."""
    url = urllib.parse.urlsplit(amqp)
    relay = Relay(url.hostname or "127.0.0.1", url.port or 5672)
    await relay.start()
    userinfo = url.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@127.0.0.1:{relay.port}" if userinfo else f"127.0.0.1:{relay.port}"
    try:
        yield relay, urllib.parse.urlunsplit((url.scheme, netloc, url.path, query, ""))
    finally:
        await relay.close()


async def test_handoff_confirm_timeout_requeues_the_original(broker: Broker) -> None:
    q = broker.queue("handoff-timeout")
    calls = Calls()
    async with relayed(broker.url) as (relay, relayed_url):

        async def behaviour(call: int) -> None:
            if call == 1:
                relay.hold()  # the broker's confirm for the coming handoff cannot reach the consumer
            raise QueueHandlerError.retryable("APP_BUSY")

        retry = retries(3, LONG_DELAY)
        consumer = broker.consumer(
            q, recording_handler(q, calls, behaviour), amqp_url=relayed_url, confirm_timeout=0.5, retry=retry
        )
        async with running(consumer, expect_clean=False) as managed:
            await broker.publish_all(q, orders(7))
            [first] = await wait_observations(managed, 1)
            relay.release()
            observations = await wait_observations(managed, 2)
            report = await managed.shutdown()
    assert report.succeeded, report.render()
    assert (first.outcome, first.code, first.handoff_confirmed) == ("handoff_failed", "APP_BUSY", False)
    assert observations[1].outcome == "retried"
    assert calls.ids == [7, 7]
    assert calls.redelivered == [False, True]
    assert calls.retry_counts == [0, 0]  # a requeue after a failed handoff is not an application retry
    # The timed-out publish did reach the bucket (only its confirm was late): at least
    # once means two copies now, and the original is settled.
    assert await broker.topology_depths(q) == [0, 2, 0]
    copies = await broker.drain(f"{q}.retry.0")
    assert [c.headers["x-retry-count"] for c in copies] == [1, 1]


# -- confirmed handoff, then the original's ACK fails -------------------------------------------------------


class _AfterConfirm:
    """Stands in for the runtime's handoff channel: every publish is real; after the
    first confirmed one, ``fault`` runs before control returns to the engine."""

    def __init__(self, channel: aio_pika.abc.AbstractChannel, fault: Callable[[], Awaitable[None]]) -> None:
        self.channel = channel
        self._fault: Callable[[], Awaitable[None]] | None = fault
        self.confirmed = 0

    @property
    def is_closed(self) -> bool:
        return self.channel.is_closed

    async def get_underlay_channel(self) -> Any:
        underlay = await self.channel.get_underlay_channel()
        hook = self

        class Underlay:
            async def basic_publish(self, body: bytes, **kwargs: Any) -> Any:
                confirmation = await underlay.basic_publish(body, **kwargs)
                hook.confirmed += 1
                if hook._fault is not None:
                    fault, hook._fault = hook._fault, None
                    await fault()
                return confirmation

        return Underlay()

    async def close(self) -> None:
        await self.channel.close()


@dataclass
class AckLostRun:
    observations: list[TerminalObservation]
    calls: Calls
    confirmed: int
    depths: list[int]
    bucket_copies: list[aio_pika.abc.AbstractIncomingMessage]
    report: ShutdownReport


async def _run_ack_lost_after_confirm(broker: Broker, q: str) -> AckLostRun:
    calls = Calls()
    # First attempt fails (retry handoff), the broker's redelivery then succeeds.
    handler = recording_handler(q, calls, raising(QueueHandlerError.retryable("APP_BUSY"), times=1))
    consumer = broker.consumer(q, handler, retry=retries(3, LONG_DELAY))
    async with running(consumer, expect_clean=False) as managed:
        intake = managed._intake
        assert intake is not None
        assert intake.handoff_channel is not None
        consuming = intake.consumers[q].channel
        assert consuming is not None

        async def close_consuming_channel() -> None:
            # Closes only the current AMQP channel: the robust channel reopens and
            # consumes again, the broker requeues what the closed one held.
            await (await consuming.get_underlay_channel()).close()

        hook = _AfterConfirm(intake.handoff_channel, close_consuming_channel)
        intake.handoff_channel = hook  # type: ignore[assignment]
        try:
            await broker.publish_all(q, orders(7))
            observations = await wait_observations(managed, 2)
        finally:
            intake.handoff_channel = hook.channel
        report = await managed.shutdown()
    found = await broker.topology_depths(q)
    return AckLostRun(observations, calls, hook.confirmed, found, await broker.drain(f"{q}.retry.0"), report)


async def test_ack_failure_after_a_confirmed_handoff_is_unresolved_and_not_repeated(broker: Broker) -> None:
    run = await _run_ack_lost_after_confirm(broker, broker.queue("ack-lost"))
    assert [o.outcome for o in run.observations] == ["unresolved", "acked"]
    assert not run.observations[0].ack_sent
    assert run.confirmed == 1  # no second handoff for the same attempt
    assert run.calls.ids == [7, 7]
    assert run.calls.redelivered == [False, True]  # the broker redelivered the unsettled original
    assert run.calls.retry_counts == [0, 0]
    # Exactly one retry copy (the confirmed one), nothing left in Q, nothing in the DLQ.
    assert run.depths == [0, 1, 0]
    assert [c.headers["x-retry-count"] for c in run.bucket_copies] == [1]
    assert run.report.succeeded, run.report.render()


async def test_ack_failure_after_a_confirmed_handoff_keeps_the_confirm_as_evidence(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    run = await _run_ack_lost_after_confirm(broker, broker.queue("ack-lost-evidence"))
    first = run.observations[0]
    assert first.outcome == "unresolved"
    assert first.handoff_confirmed
    assert lily_errors(caplog) == []


# -- body over the queue's max_body: broker-native dead-lettering -------------------------------------------


async def test_body_over_max_body_is_dead_lettered_by_the_broker(broker: Broker) -> None:
    q = broker.queue("too-large")
    calls = Calls()
    retry = retries(3, 0.1)
    consumer = broker.consumer(q, recording_handler(q, calls, raising()), retry=retry, max_body=64)
    async with running(consumer, expect_clean=False) as managed:
        big, small = await broker.publish_all(q, [{"id": 1, "pad": "x" * 100}, {"id": 2}])
        observations = await wait_observations(managed, 2)
        await managed.shutdown()
    [rejected] = [o for o in observations if o.event_id != small]
    assert (rejected.outcome, rejected.code) == ("broker_dead_lettered", "QUEUE_BODY_TOO_LARGE")
    assert rejected.broker_native
    assert not rejected.handoff_confirmed
    assert [o.outcome for o in observations if o.event_id == small] == ["acked"]
    assert calls.ids == [2]  # the handler never saw the oversized body
    assert await broker.topology_depths(q) == [0, 0, 1]
    [copy] = await broker.drain(f"{q}.dlq")
    assert copy.headers["x-lily-event-id"] == str(big)
    assert "x-lily-failure-code" not in copy.headers
    [death] = headers_of(copy)["x-death"]
    assert (death["reason"], death["queue"]) == ("rejected", q)
    assert len(copy.body) > 64


# -- transport lost ------------------------------------------------------------------------------------------


@dataclass
class TransportLostRun:
    observations: list[TerminalObservation]
    calls: Calls
    depths: list[int]
    generation: int
    report: ShutdownReport


async def _run_transport_lost(broker: Broker, q: str, *, lose: str) -> TransportLostRun:
    """Two deliveries are in the handler when their channel (or connection) dies; they are released after."""
    calls = Calls()
    release = asyncio.Event()

    async def behaviour(call: int) -> None:
        if call <= 2:
            await release.wait()

    async with relayed(broker.url, "reconnect_interval=0.2") as (relay, relayed_url):
        consumer = broker.consumer(
            q,
            recording_handler(q, calls, behaviour),
            amqp_url=relayed_url if lose == "connection" else broker.url,
            concurrency=4,  # permits for the two stuck deliveries and for their redeliveries
            retry=retries(3, 0.1),
        )
        async with running(consumer, expect_clean=False) as managed:
            intake = managed._intake
            assert intake is not None
            await broker.publish_all(q, orders(1, 2))
            await eventually(lambda: len(calls.ids) == 2, what="both deliveries in the handler")
            consuming = intake.consumers[q].channel
            assert consuming is not None
            if lose == "channel":
                await (await consuming.get_underlay_channel()).close()
            else:
                await relay.sever()
            try:
                # The broker requeues both; the restored consumer gets them again (and acks them).
                await eventually(lambda: len(calls.ids) == 4, what="both deliveries redelivered")
                await wait_observations(managed, 2)
            finally:
                release.set()
            observations = await wait_observations(managed, 4)
            generation = managed.snapshot().transport_generation
            report = await managed.shutdown()
    found = await broker.topology_depths(q)
    return TransportLostRun(observations, calls, found, generation, report)


@pytest.mark.parametrize("lose", ["channel", "connection"])
async def test_in_flight_deliveries_are_unresolved_and_redelivered_when_the_transport_is_lost(
    broker: Broker, lose: str
) -> None:
    run = await _run_transport_lost(broker, broker.queue(f"lost-{lose}"), lose=lose)
    assert [o.outcome for o in run.observations] == ["acked", "acked", "unresolved", "unresolved"]
    assert not any(o.ack_sent for o in run.observations[2:])
    assert sorted(run.calls.ids) == [1, 1, 2, 2]
    assert run.calls.redelivered == [False, False, True, True]
    first_ids = sorted(str(o.event_id) for o in run.observations[2:])
    assert sorted(str(o.event_id) for o in run.observations[:2]) == first_ids
    # Settled exactly once, by the redelivery: nothing left, nothing copied.
    assert run.depths == [0, 0, 0]
    if lose == "connection":
        assert run.generation == 2
    assert run.report.succeeded, run.report.render()


async def test_transport_lost_is_reported_as_such(broker: Broker, caplog: pytest.LogCaptureFixture) -> None:
    run = await _run_transport_lost(broker, broker.queue("lost-reason"), lose="channel")
    for obs in run.observations[2:]:
        assert obs.outcome == "unresolved"
        assert "transport lost" in obs.reason
    assert lily_errors(caplog) == []


async def test_dlq_copy_keeps_the_original_message_properties(broker: Broker) -> None:
    q = broker.queue("props")

    @queue(q, version=1)
    async def refuse(order: Json[Order]) -> None:
        raise QueueHandlerError.permanent("ORDER_INVALID", "no lines")

    consumer = broker.consumer(q, refuse, retry=RetryPolicy(max_retries=0, delays=()))
    sent_at = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    headers: aio_pika.abc.HeadersType = {
        "x-lily-event-id": str(uuid.uuid4()),
        "x-lily-schema-version": "1",
        "x-lily-content-kind": "json",
        "x-tenant": "acme",
    }
    async with running(consumer, expect_clean=False) as managed:
        await broker.channel.default_exchange.publish(
            aio_pika.Message(
                b'{"id": 1}',
                headers=headers,
                content_type="application/json",
                correlation_id="corr-42",
                reply_to="replies",
                app_id="orders-web",
                type="order.created",
                timestamp=sent_at,
                message_id="producer-id-1",
            ),
            routing_key=q,
        )
        [observation] = await wait_observations(managed, 1)
    assert observation.outcome == "dead_lettered"
    [copy] = await broker.drain(f"{q}.dlq")
    assert copy.correlation_id == "corr-42"
    assert copy.reply_to == "replies"
    assert copy.app_id == "orders-web"
    assert copy.type == "order.created"
    assert copy.timestamp == sent_at
    assert copy.content_type == "application/json"
    assert copy.body == b'{"id": 1}'
    assert copy.headers["x-tenant"] == "acme"
    assert copy.headers["x-lily-event-id"] == headers["x-lily-event-id"]
    assert copy.headers["x-lily-failure-code"] == "ORDER_INVALID"
    # A fresh message id: the client matches returned messages to publishes by it.
    assert copy.message_id != "producer-id-1"
