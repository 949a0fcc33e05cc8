"""Runtime features against the real broker (docs/contracts.md, docs/settlement.md), at_least_once guarantee.

Middleware and guards around the handler, admission (permits, local buffer,
per-queue prefetch), quorum and passive topology, topology mismatches, and the
extractors a handler can ask for. Every test asserts broker-side state (queue
depths by passive declare, DLQ headers) as well as what the handler saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import aio_pika
import aio_pika.abc
import aiormq.exceptions
import pydantic
import pytest

from lily_mongo import (
    Bytes,
    ConfigError,
    Consumer,
    CustomPublishContent,
    DeliveryContext,
    EventId,
    Extractor,
    Json,
    ManagedConsumer,
    Publisher,
    QueueHandlerError,
    QueueOptions,
    RawDelivery,
    Redelivered,
    RetryCount,
    RetryPolicy,
    TerminalObservation,
    Text,
    queue,
)
from lily_mongo._plan.routes import Guard, Middleware
from lily_mongo._topology import declare_topology
from tests.support.broker import Broker, queue_exists
from tests.support.consumers import new_tasks, outcomes, running
from tests.support.polling import eventually

CallNext = Callable[[], Awaitable[None]]
PARKED = RetryPolicy(max_retries=1, delays=(30,))  # a retry copy would stay in its bucket for the whole test


class Order(pydantic.BaseModel):
    n: int


class KeyValues(Extractor):
    """An application's terminal extractor for ``custom.v1`` bodies: ``k=v;k=v`` in ASCII."""

    terminal = True

    def extract(self, delivery: RawDelivery) -> dict[str, str]:
        pairs = [item.split("=", 1) for item in delivery.body.decode("ascii").split(";")]
        if any(len(pair) != 2 for pair in pairs):
            raise ValueError("body is not a list of key=value pairs")
        return {key: value for key, value in pairs}


KV = Annotated[dict[str, str], KeyValues()]
KV_CONTENT: CustomPublishContent[dict[str, str]] = CustomPublishContent(
    kind="custom.v1",
    content_type="application/x-key-values",
    encode=lambda value: ";".join(f"{k}={v}" for k, v in value.items()).encode("ascii"),
)
RAW_KV: CustomPublishContent[bytes] = CustomPublishContent("custom.v1", "application/x-key-values", bytes)
RAW_TEXT: CustomPublishContent[bytes] = CustomPublishContent("text", "text/plain", bytes)


# -- helpers --------------------------------------------------------------------------------------


def by_event(managed: ManagedConsumer) -> dict[uuid.UUID | None, TerminalObservation]:
    return {o.event_id: o for o in managed.delivery_terminal_observations()}


async def dlq_codes(broker: Broker, q: str) -> dict[str, str]:
    """Event id -> failure code of every copy in ``q.dlq`` (drained)."""
    return {
        str(m.headers["x-lily-event-id"]): str(m.headers["x-lily-failure-code"]) for m in await broker.drain(f"{q}.dlq")
    }


# -- middleware and guards ------------------------------------------------------------------------


def layered_consumer(
    broker: Broker,
    q: str,
    seen: list[tuple[str, uuid.UUID]],
    outer: Middleware,
    inner: Middleware,
    consumer_guard: Guard,
    handler_guard: Guard,
    *,
    name: str,
    prefetch: int,
) -> Consumer:
    """A consumer of ``q`` (one permit, retries parked) with ``outer`` and ``consumer_guard`` consumer-wide, whose
    handler ``<q>/h``, wrapped in ``inner`` and ``handler_guard``, notes ``("handler", event id)`` in ``seen``
    (the layers in the order they run, outermost first)."""

    @queue(q, version=1, handler_id=f"{q}/h", middleware=[inner], guards=[handler_guard])
    async def handle(order: Json[Order], event_id: EventId) -> None:
        seen.append(("handler", event_id))

    return broker.consumer(
        q,
        handle,
        name=name,
        middleware=[outer],
        guards=[consumer_guard],
        concurrency=1,
        prefetch=prefetch,
        retry=PARKED,
    )


async def test_middleware_and_guards_wrap_the_handler_outermost_first(broker: Broker) -> None:
    q = broker.queue("mw")
    trace: list[tuple[str, uuid.UUID]] = []
    contexts: list[tuple[str, str, str, int, uuid.UUID, bool, str]] = []

    def note(step: str, ctx: DeliveryContext) -> None:
        trace.append((step, ctx.envelope.event_id))
        contexts.append(
            (
                step,
                ctx.queue,
                ctx.handler.handler_id,
                ctx.attempt,
                ctx.envelope.event_id,
                ctx.delivery.redelivered,
                str(ctx.items.get("outer", "")),
            )
        )

    async def outer(ctx: DeliveryContext, call_next: CallNext) -> None:
        assert not ctx.items, "the scratch dict is fresh for every delivery"
        ctx.items["outer"] = "set"
        note("outer:before", ctx)
        await call_next()
        note("outer:after", ctx)

    async def inner(ctx: DeliveryContext, call_next: CallNext) -> None:
        note("inner:before", ctx)
        await call_next()
        note("inner:after", ctx)

    async def consumer_guard(ctx: DeliveryContext) -> None:
        note("guard:consumer", ctx)

    async def handler_guard(ctx: DeliveryContext) -> None:
        note("guard:handler", ctx)

    consumer = layered_consumer(broker, q, trace, outer, inner, consumer_guard, handler_guard, name="mw", prefetch=2)
    async with running(consumer) as managed, Publisher(broker.url) as publisher:
        first = await publisher.publish_json(q, {"n": 1}, version=1)
        second = await publisher.publish_json(q, {"n": 2}, version=1)
        await eventually(lambda: outcomes(managed) == ["acked", "acked"], what="both deliveries")
    order = ["outer:before", "inner:before", "guard:consumer", "guard:handler", "handler", "inner:after", "outer:after"]
    assert trace == [(step, first) for step in order] + [(step, second) for step in order]
    for step, queue_name, handler_id, attempt, event_id, redelivered, items in contexts:
        assert (queue_name, handler_id, attempt, redelivered, items) == (q, f"{q}/h", 1, False, "set"), step
        assert event_id in (first, second)
    assert await broker.depth(q) == 0
    assert await broker.depth(f"{q}.dlq") == 0


async def test_refusals_dead_letter_and_dispatch_failures_skip_middleware_and_guards(broker: Broker) -> None:
    q = broker.queue("refuse")
    seen: list[tuple[str, uuid.UUID]] = []

    def mode(ctx: DeliveryContext) -> str:
        return str(ctx.delivery.headers.get("x-test-mode", ""))

    async def outer(ctx: DeliveryContext, call_next: CallNext) -> None:
        seen.append(("outer", ctx.envelope.event_id))
        try:
            await call_next()
        finally:
            seen.append(("outer:exit", ctx.envelope.event_id))

    async def inner(ctx: DeliveryContext, call_next: CallNext) -> None:
        seen.append(("inner", ctx.envelope.event_id))
        if mode(ctx) == "middleware":
            raise QueueHandlerError.permanent("MW_REFUSED", "refused by middleware")
        await call_next()

    async def consumer_guard(ctx: DeliveryContext) -> None:
        seen.append(("guard:consumer", ctx.envelope.event_id))
        if mode(ctx) == "consumer-guard":
            raise QueueHandlerError.permanent("GUARD_CONSUMER_NO", "tenant unknown")

    async def handler_guard(ctx: DeliveryContext) -> None:
        seen.append(("guard:handler", ctx.envelope.event_id))
        if mode(ctx) == "handler-guard":
            raise QueueHandlerError.permanent("GUARD_HANDLER_NO", "not allowed")

    consumer = layered_consumer(broker, q, seen, outer, inner, consumer_guard, handler_guard, name="refuse", prefetch=8)
    async with running(consumer) as managed, Publisher(broker.url) as publisher:
        ok = await publisher.publish_json(q, {"n": 1}, version=1)
        by_mw = await publisher.publish_json(q, {"n": 2}, version=1, headers={"x-test-mode": "middleware"})
        by_cg = await publisher.publish_json(q, {"n": 3}, version=1, headers={"x-test-mode": "consumer-guard"})
        by_hg = await publisher.publish_json(q, {"n": 4}, version=1, headers={"x-test-mode": "handler-guard"})
        no_version = await publisher.publish_json(q, {"n": 5}, version=2)
        no_content = await publisher.publish_text(q, "n=6", version=1)
        undecodable = await publisher.publish_json(q, {"n": "six"}, version=1)
        await eventually(lambda: len(outcomes(managed)) == 7, what="seven deliveries")
        assert await broker.wait_for_depth(f"{q}.dlq", 6) == 6
    observed = by_event(managed)
    assert observed[ok].outcome == "acked"
    codes = await dlq_codes(broker, q)
    assert codes == {
        str(by_mw): "MW_REFUSED",
        str(by_cg): "GUARD_CONSUMER_NO",
        str(by_hg): "GUARD_HANDLER_NO",
        str(no_version): "QUEUE_SCHEMA_VERSION_UNSUPPORTED",
        str(no_content): "QUEUE_CONTENT_KIND_UNSUPPORTED",
        str(undecodable): "QUEUE_PAYLOAD_INVALID",  # {"n": "six"}: JSON the model refuses
    }
    for event in (by_mw, by_cg, by_hg, no_version, no_content, undecodable):
        assert observed[event].outcome == "dead_lettered"

    def steps(event: uuid.UUID) -> list[str]:
        return [step for step, e in seen if e == event]

    assert steps(ok) == ["outer", "inner", "guard:consumer", "guard:handler", "handler", "outer:exit"]
    assert steps(by_mw) == ["outer", "inner", "outer:exit"]
    assert steps(by_cg) == ["outer", "inner", "guard:consumer", "outer:exit"]
    assert steps(by_hg) == ["outer", "inner", "guard:consumer", "guard:handler", "outer:exit"]
    # Dispatch and decode failures happen before any middleware, guard or handler code.
    assert steps(no_version) == steps(no_content) == steps(undecodable) == []
    assert await broker.depth(q) == 0


async def test_a_guard_returning_false_refuses_with_guard_rejected(broker: Broker) -> None:
    q = broker.queue("guard-false")
    called: list[int] = []

    async def only_even(ctx: DeliveryContext) -> bool:
        return int(ctx.delivery.headers.get("x-n", 0)) % 2 == 0

    @queue(q, version=1, guards=[only_even])
    async def handle(order: Json[Order]) -> None:
        called.append(order.n)

    consumer = broker.consumer(q, handle, name="guard-false", retry=PARKED)
    async with running(consumer) as managed, Publisher(broker.url) as publisher:
        even = await publisher.publish_json(q, {"n": 2}, version=1, headers={"x-n": 2})
        odd = await publisher.publish_json(q, {"n": 3}, version=1, headers={"x-n": 3})
        await eventually(lambda: len(outcomes(managed)) == 2, what="two deliveries")
    observed = by_event(managed)
    assert observed[even].outcome == "acked"
    assert observed[odd].outcome == "dead_lettered"
    assert called == [2]
    assert await dlq_codes(broker, q) == {str(odd): "QUEUE_GUARD_REJECTED"}


# -- admission ------------------------------------------------------------------------------------


async def test_a_blocked_queue_never_starves_another(broker: Broker) -> None:
    qa, qb = broker.queue("slow"), broker.queue("fast")
    gate = asyncio.Event()
    started_a: list[uuid.UUID] = []
    done_b: list[uuid.UUID] = []

    @queue(qa, version=1)
    async def slow(event_id: EventId) -> None:
        started_a.append(event_id)
        await gate.wait()

    @queue(qb, version=1)
    async def fast(event_id: EventId) -> None:
        done_b.append(event_id)

    consumer = Consumer(amqp_url=broker.url, name="admission")
    consumer.configure_queue(qa, concurrency=1, prefetch=4, retry=PARKED)
    consumer.configure_queue(qb, concurrency=2, prefetch=8, retry=PARKED)
    consumer.include(slow, fast)
    async with running(consumer, release=gate) as managed, Publisher(broker.url) as publisher:
        await publisher.publish_json(qa, {}, version=1)
        await eventually(lambda: len(started_a) == 1, what="A's first handler running")
        for _ in range(5):
            await publisher.publish_json(qa, {}, version=1)
        for _ in range(3):
            await publisher.publish_json(qb, {}, version=1)
        await eventually(lambda: len(done_b) == 3, what="B's handlers ran while A is blocked")
        await eventually(
            lambda: managed.snapshot().queues[1].outcomes.get("acked") == 3, what="B acked while A is blocked"
        )
        # prefetch 4 on A: one running, three waiting in the local buffer, two left on the broker.
        await eventually(lambda: managed.snapshot().queues[0].buffered == 3, what="A's buffer filled")
        snap_a, snap_b = managed.snapshot().queues
        assert (snap_a.permits, snap_a.in_flight, snap_a.buffered, snap_a.received) == (1, 1, 3, 4)
        assert (snap_b.in_flight, snap_b.buffered, snap_b.outcomes.get("acked")) == (0, 0, 3)
        assert len(started_a) == 1
        assert await broker.depth(qa) == 2
        assert await broker.depth(qb) == 0
        gate.set()
        await eventually(lambda: outcomes(managed).count("acked") == 9, what="every delivery acked")
        assert managed.snapshot().queues[0].outcomes.get("acked") == 6
    assert len(started_a) == 6
    assert await broker.depth(qa) == 0


async def test_local_buffer_bounds_what_the_broker_pushes(broker: Broker) -> None:
    q = broker.queue("buffer")
    gate = asyncio.Event()
    started: list[uuid.UUID] = []

    @queue(q, version=1)
    async def handle(event_id: EventId) -> None:
        started.append(event_id)
        await gate.wait()

    consumer = broker.consumer(q, handle, name="buffer", concurrency=2, prefetch=16, buffer=1, retry=PARKED)
    async with running(consumer, release=gate) as managed, Publisher(broker.url) as publisher:
        for _ in range(6):
            await publisher.publish_json(q, {}, version=1)
        # Two permits plus a buffer of one: three unacknowledged deliveries at most, three stay on the broker.
        await eventually(lambda: managed.snapshot().queues[0].buffered == 1, what="the buffer filled")
        await eventually(lambda: len(started) == 2, what="two handlers running")
        assert await broker.wait_for_depth(q, 3) == 3
        await asyncio.sleep(0.2)
        snapshot = managed.snapshot().queues[0]
        assert (snapshot.in_flight, snapshot.buffered, snapshot.received, len(started)) == (2, 1, 3, 2)
        gate.set()
        await eventually(lambda: outcomes(managed) == ["acked"] * 6, what="all six acked")
    assert await broker.depth(q) == 0


async def test_concurrency_bounds_running_handlers(broker: Broker) -> None:
    q = broker.queue("bound")
    gate = asyncio.Event()
    running_now = 0
    most = 0

    @queue(q, version=1)
    async def handle(event_id: EventId) -> None:
        nonlocal running_now, most
        running_now += 1
        most = max(most, running_now)
        try:
            await gate.wait()
            await asyncio.sleep(0.02)  # keep overlapping after the gate opens
        finally:
            running_now -= 1

    consumer = broker.consumer(q, handle, name="bound", concurrency=3, prefetch=16, retry=PARKED)
    async with running(consumer, release=gate) as managed, Publisher(broker.url) as publisher:
        for _ in range(10):
            await publisher.publish_json(q, {}, version=1)
        await eventually(lambda: managed.snapshot().queues[0].buffered == 7, what="seven deliveries buffered")
        await asyncio.sleep(0.2)  # time for a fourth handler to start, if admission let it
        snapshot = managed.snapshot().queues[0]
        assert (running_now, most, snapshot.in_flight, snapshot.buffered) == (3, 3, 3, 7)
        gate.set()
        await eventually(lambda: outcomes(managed) == ["acked"] * 10, what="all ten acked")
    assert most == 3
    assert await broker.depth(q) == 0


async def test_handlers_run_in_worker_tasks_that_end_when_the_queue_is_idle(broker: Broker) -> None:
    """Each handler runs in a task of the consumer's own (not the AMQP library's callback task), and
    workers do not linger once there is no work: only the consumer's long-lived tasks remain."""
    q = broker.queue("workers")
    seen: list[str] = []

    @queue(q, version=1)
    async def handle(event_id: EventId) -> None:
        task = asyncio.current_task()
        assert task is not None
        seen.append(task.get_name())
        await asyncio.sleep(0.01)

    consumer = broker.consumer(q, handle, name="workers", concurrency=4, prefetch=8)
    async with running(consumer) as managed, Publisher(broker.url) as publisher:
        idle = new_tasks(set())
        for _ in range(12):
            await publisher.publish_json(q, {}, version=1)
        await eventually(lambda: outcomes(managed) == ["acked"] * 12, what="all twelve acked")
        assert seen == ["lily-worker"] * 12
        await eventually(
            lambda: not any(t.get_name() == "lily-worker" for t in new_tasks(idle)), what="the workers to end"
        )


# -- topology -------------------------------------------------------------------------------------


async def declare_or_refusal(
    connection: aio_pika.abc.AbstractConnection, name: str, arguments: dict[str, Any]
) -> str | None:
    """Re-declare ``name`` with ``arguments``; None if the broker agrees, else the refusal's class name."""
    channel = await connection.channel()
    try:
        await channel.declare_queue(name, durable=True, arguments=arguments)
    except aiormq.exceptions.AMQPError as exc:
        return type(exc).__name__
    finally:
        if not channel.is_closed:
            await channel.close()
    return None


async def test_quorum_topology_and_a_retry_then_success(broker: Broker) -> None:
    q = broker.queue("quorum")
    seen: list[int] = []

    @queue(q, version=1)
    async def handle(retries: RetryCount) -> None:
        seen.append(retries)
        if retries == 0:
            raise QueueHandlerError.retryable("TRY_AGAIN", "first attempt fails")

    consumer = broker.consumer(
        q, handle, name="quorum", queue_type="quorum", retry=RetryPolicy(max_retries=1, delays=(0.2,)), prefetch=4
    )
    async with running(consumer) as managed, Publisher(broker.url) as publisher:
        event = await publisher.publish_json(q, {}, version=1)
        await eventually(lambda: outcomes(managed) == ["retried", "acked"], what="retry then success")
    assert seen == [0, 1]
    assert {o.event_id for o in managed.delivery_terminal_observations()} == {event}
    expected: dict[str, dict[str, Any]] = {
        q: {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": f"{q}.dlq"},
        f"{q}.retry.0": {"x-message-ttl": 200, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": q},
        f"{q}.dlq": {},
    }
    for name, arguments in expected.items():
        # Same arguments as quorum: equivalent. As classic: the broker refuses (the type differs).
        assert await declare_or_refusal(broker.connection, name, {**arguments, "x-queue-type": "quorum"}) is None, name
        refusal = await declare_or_refusal(broker.connection, name, {**arguments, "x-queue-type": "classic"})
        assert refusal == "ChannelPreconditionFailed", name
    for name in expected:
        assert await broker.depth(name) == 0


async def test_passive_topology_requires_the_queues_to_exist(broker: Broker) -> None:
    q = broker.queue("passive")
    calls: list[uuid.UUID] = []

    @queue(q, version=1)
    async def handle(event_id: EventId) -> None:
        calls.append(event_id)

    def make(passive: bool) -> Consumer:
        consumer = broker.consumer(q, handle, name="passive", passive=passive, retry=PARKED)
        return consumer

    before = set(asyncio.all_tasks())
    with pytest.raises(ConfigError) as missing:
        await make(passive=True).start()
    assert q in str(missing.value)
    assert "does not exist" in str(missing.value)
    assert not new_tasks(before)
    # Passive verification declared nothing.
    for name in (q, f"{q}.retry.0", f"{q}.dlq"):
        assert not await queue_exists(broker.connection, name), name

    async with running(make(passive=False)):
        pass
    async with running(make(passive=True)) as managed, Publisher(broker.url) as publisher:
        event = await publisher.publish_json(q, {}, version=1)
        await eventually(lambda: outcomes(managed) == ["acked"], what="the delivery on the verified topology")
    assert calls == [event]
    assert await broker.depth(q) == 0


@pytest.mark.parametrize("existing", ["plain-queue", "other-retry-delay"])
async def test_topology_mismatch_fails_start_and_leaves_nothing_running(broker: Broker, existing: str) -> None:
    q = broker.queue("mismatch")
    if existing == "plain-queue":
        await broker.channel.declare_queue(q, durable=True)  # no dead-letter exchange
        refused = q
    else:
        # An earlier deployment used another retry delay: the bucket's TTL differs.
        await declare_topology(broker.connection, QueueOptions(name=q, retry=RetryPolicy(max_retries=1, delays=(10,))))
        refused = f"{q}.retry.0"
    async with Publisher(broker.url) as publisher:
        await publisher.publish_json(q, {}, version=1)
    calls: list[uuid.UUID] = []

    @queue(q, version=1)
    async def handle(event_id: EventId) -> None:
        calls.append(event_id)

    consumer = broker.consumer(q, handle, name="mismatch", retry=PARKED)
    before = set(asyncio.all_tasks())
    with pytest.raises(ConfigError) as mismatch:
        await consumer.start()
    assert repr(refused) in str(mismatch.value)
    await asyncio.sleep(0.1)
    assert not new_tasks(before)
    with pytest.raises(ConfigError):
        await consumer.start()  # a consumer starts once
    queue_state = await broker.channel.declare_queue(q, passive=True)
    assert queue_state.declaration_result.consumer_count == 0
    assert queue_state.declaration_result.message_count == 1  # untouched
    assert calls == []


# -- extractors -----------------------------------------------------------------------------------


async def test_redelivered_and_raw_delivery(broker: Broker) -> None:
    q = broker.queue("redelivered")
    await declare_topology(broker.connection, QueueOptions(name=q, retry=PARKED))
    async with Publisher(broker.url) as publisher:
        again = await publisher.publish_json(q, {"n": 1}, version=1)
        # Another consumer takes the first message and its channel closes without an ACK.
        channel = await broker.connection.channel()
        taken = await (await channel.declare_queue(q, passive=True)).get(no_ack=False)
        assert taken is not None
        assert taken.redelivered is False
        await channel.close()
        fresh = await publisher.publish_json(q, {"n": 2}, version=1)
    seen: dict[uuid.UUID, tuple[bool, RawDelivery]] = {}
    problems: list[str] = []

    @queue(q, version=1)
    async def handle(event_id: EventId, redelivered: Redelivered, raw: RawDelivery) -> None:
        seen[event_id] = (redelivered, raw)
        for name in ("ack", "nack", "reject", "channel"):
            if hasattr(raw, name):
                problems.append(f"RawDelivery has {name!r}")
        try:
            raw.body = b"changed"  # type: ignore[misc]
            problems.append("RawDelivery.body is writable")
        except dataclasses.FrozenInstanceError:
            pass

    consumer = broker.consumer(q, handle, name="redelivered", concurrency=1, prefetch=2, retry=PARKED)
    async with running(consumer) as managed:
        await eventually(lambda: outcomes(managed) == ["acked", "acked"], what="both deliveries")
    assert problems == []
    assert seen[again][0] is True
    assert seen[fresh][0] is False
    for event, n in ((again, 1), (fresh, 2)):
        raw = seen[event][1]
        assert raw.queue == q
        assert raw.body == b'{"n":%d}' % n
        assert raw.headers["x-lily-event-id"] == str(event)
        assert raw.headers["x-lily-schema-version"] == "1"
        assert raw.content_type == "application/json"
        assert raw.envelope.event_id == event
        assert raw.redelivered is seen[event][0]
    assert await broker.depth(q) == 0


async def test_raw_delivery_headers_cannot_change_the_dead_letter_copy(broker: Broker) -> None:
    """RawDelivery is a read-only view: a handler cannot rewrite the identity its DLQ copy carries."""
    q = broker.queue("readonly")
    forged = uuid.uuid4()

    @queue(q, version=1)
    async def handle(raw: RawDelivery) -> None:
        headers: Any = raw.headers
        with contextlib.suppress(TypeError):
            headers["x-lily-event-id"] = str(forged)
            headers["x-lily-schema-version"] = "99"
        raise QueueHandlerError.permanent("REFUSED", "after trying to rewrite the headers")

    consumer = broker.consumer(q, handle, name="readonly", concurrency=1, prefetch=2, retry=PARKED)
    async with running(consumer) as managed, Publisher(broker.url) as publisher:
        event = await publisher.publish_json(q, {}, version=1)
        await eventually(lambda: outcomes(managed) == ["dead_lettered"], what="the DLQ handoff")
    [copy] = await broker.drain(f"{q}.dlq")
    assert copy.headers["x-lily-failure-code"] == "REFUSED"
    assert copy.headers["x-lily-event-id"] == str(event)
    assert copy.headers["x-lily-schema-version"] == "1"


async def test_text_bytes_and_custom_extractors_end_to_end(broker: Broker) -> None:
    q = broker.queue("content")
    texts: list[str] = []
    blobs: list[bytes] = []
    custom: list[tuple[dict[str, str], str | None]] = []

    @queue(q, version=1, content="text")
    async def on_text(note: Text) -> None:
        texts.append(note)

    @queue(q, version=1, content="binary")
    async def on_binary(blob: Bytes) -> None:
        blobs.append(blob)

    @queue(q, version=1, content="custom.v1")
    async def on_custom(values: KV, raw: RawDelivery) -> None:
        custom.append((values, raw.content_type))

    consumer = broker.consumer(
        q, on_text, on_binary, on_custom, name="content", concurrency=1, prefetch=8, retry=PARKED
    )
    async with running(consumer) as managed, Publisher(broker.url) as publisher:
        await publisher.publish_text(q, "grüße, 世界", version=1)
        await publisher.publish_binary(q, b"\x00\xff\x10", version=1)
        await publisher.publish(KV_CONTENT, q, {"a": "1", "b": "2"}, version=1)
        bad_text = await publisher.publish(RAW_TEXT, q, b"\xff\xfe", version=1)
        bad_custom = await publisher.publish(RAW_KV, q, b"no pairs here", version=1)
        await eventually(lambda: len(outcomes(managed)) == 5, what="five deliveries")
        assert await broker.wait_for_depth(f"{q}.dlq", 2) == 2
    assert texts == ["grüße, 世界"]
    assert blobs == [b"\x00\xff\x10"]
    assert custom == [({"a": "1", "b": "2"}, "application/x-key-values")]
    assert outcomes(managed).count("acked") == 3
    assert await dlq_codes(broker, q) == {
        str(bad_text): "QUEUE_PAYLOAD_DECODE_FAILED",
        str(bad_custom): "QUEUE_PAYLOAD_DECODE_FAILED",
    }
    reasons = {o.event_id: o.reason for o in managed.delivery_terminal_observations()}
    assert "UTF-8" in reasons[bad_text]
    assert "key=value" in reasons[bad_custom]
    assert await broker.depth(q) == 0
