"""A consumer the broker cancels consumes its queue again (docs/deployment.md, "Consumer timeout").

RabbitMQ answers a deleted queue with ``basic.cancel`` on every version, and a quorum
queue's consumer timeout too from 4.3 on (tests/brokers/test_broker_cancel.py). The
consumer counts the cancel, says which queue and why in one warning, is not ready while
the queue has no consumer, declares the queue again when it declares its topology (or
waits, with backoff, until someone else does), and consumes it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lily_mongo import EventId, ManagedConsumer, QueueOptions, RetryPolicy, queue
from lily_mongo._cli.probes import ProbeServer
from lily_mongo._plan.options import QueueType
from tests.brokers.tier import declare_work_queue
from tests.integration.test_runtime_features import declare_or_refusal
from tests.support.broker import Broker, consumer_count
from tests.support.consumers import running
from tests.support.polling import eventually

CANCEL_METRIC = "lily_consumer_cancels"
RESUMED_WITHIN = 10.0  # seconds from the cancel to a consumer on the queue again


@dataclass
class Readiness:
    """What ``/readyz`` answered while a test ran, as it changed: (monotonic time, HTTP status) per change."""

    server: ProbeServer
    changes: list[tuple[float, int]] = field(default_factory=list)

    @property
    def statuses(self) -> list[int]:
        return [status for _, status in self.changes]

    def not_ready_spans(self) -> list[float]:
        """Seconds of each stretch of 503 that ended in a 200."""
        spans = []
        for (since, status), (until, _) in zip(self.changes, self.changes[1:], strict=False):
            if status == 503:
                spans.append(until - since)
        return spans

    def metric(self, family: str, q: str) -> float:
        """The value of the counter ``family`` for queue ``q`` on ``/metrics``."""
        text = generate_latest(self.server._registry).decode()
        for parsed in text_string_to_metric_families(text):
            if parsed.name == family:
                return next(s.value for s in parsed.samples if s.labels == {"queue": q})
        raise AssertionError(f"no metric {family} on /metrics")


@contextlib.asynccontextmanager
async def watching_readiness(managed: ManagedConsumer, every: float = 0.002) -> AsyncIterator[Readiness]:
    """Ask ``/readyz`` of ``managed`` every ``every`` seconds and record each change of its answer."""
    server = ProbeServer("127.0.0.1", 0)
    server.attach(managed)
    readiness = Readiness(server)

    async def watch() -> None:
        while True:
            status = (await server._readyz(None)).status  # type: ignore[arg-type]  # the handler reads no request
            if not readiness.changes or readiness.changes[-1][1] != status:
                readiness.changes.append((time.monotonic(), status))
            await asyncio.sleep(every)

    task = asyncio.create_task(watch())
    try:
        yield readiness
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await server.stop()


def cancel_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "lily_mongo" and r.levelno == logging.WARNING and "cancelled the consumer" in r.getMessage()
    ]


async def consumed_again(broker: Broker, q: str, since: float) -> float:
    """Wait until ``q`` has one consumer again; the seconds since ``since`` (monotonic)."""

    async def consuming() -> bool:
        return await consumer_count(broker.connection, q) == 1

    await eventually(consuming, timeout=RESUMED_WITHIN + 5.0, what=f"a consumer on {q} again", interval=0.05)
    return time.monotonic() - since


def recording(q: str, seen: list[Any]) -> Any:
    @queue(q, version=1)
    async def handle(event_id: EventId) -> None:
        seen.append(event_id)

    return handle


async def deleted_queue_is_declared_again(
    broker: Broker, queue_type: QueueType, caplog: pytest.LogCaptureFixture
) -> None:
    """The scenario: a consumer that declares its topology sees its queue deleted."""
    caplog.set_level(logging.INFO, logger="lily_mongo")
    q = broker.queue("deleted")
    seen: list[Any] = []
    consumer = broker.consumer(q, recording(q, seen), name="deleted", concurrency=1, queue_type=queue_type)
    async with running(consumer) as managed, watching_readiness(managed) as readiness:
        first = await broker.publish(q)
        await eventually(lambda: seen == [first], what="the first event")
        deleted_at = time.monotonic()
        await broker.channel.queue_delete(q)
        took = await consumed_again(broker, q, deleted_at)
        later = await broker.publish(q)
        await eventually(lambda: seen == [first, later], what="the event published after the cancel")
        assert managed.snapshot().queues[0].broker_cancels == 1
        assert readiness.metric(CANCEL_METRIC, q) == 1
        await eventually(lambda: managed.ready, what="ready again")
    assert took < RESUMED_WITHIN, took
    assert readiness.statuses == [200, 503, 200], readiness.changes
    [warning] = cancel_warnings(caplog)
    assert q in warning, warning
    assert "the queue was deleted; declaring it again" in warning, warning
    # Declared again as the consumer declares it: with its dead-letter arguments.
    dead_letters = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": f"{q}.dlq"}
    if queue_type == "quorum":
        dead_letters["x-queue-type"] = "quorum"
    assert await declare_or_refusal(broker.connection, q, dead_letters) is None


async def test_a_deleted_queue_is_declared_again_and_consumed(broker: Broker, caplog: pytest.LogCaptureFixture) -> None:
    await deleted_queue_is_declared_again(broker, "classic", caplog)


async def test_a_queue_the_consumer_does_not_declare_is_consumed_again_once_declared(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """With ``passive=True`` the consumer waits, not ready, until the queue's owner declares it again."""
    q = broker.queue("owned")
    options = QueueOptions(name=q, retry=RetryPolicy(max_retries=1, delays=(0.2,)))
    await declare_work_queue(broker.channel, options)
    seen: list[Any] = []
    consumer = broker.consumer(q, recording(q, seen), name="owned", passive=True, retry=options.retry)
    async with running(consumer) as managed, watching_readiness(managed) as readiness:
        await broker.channel.queue_delete(q)
        await eventually(lambda: readiness.statuses[-1] == 503, what="/readyz not ready")
        await asyncio.sleep(1.0)  # several tries to consume it, each refused
        assert readiness.statuses == [200, 503]
        answer = await readiness.server._readyz(None)  # type: ignore[arg-type]  # the handler reads no request
        assert answer.text in (
            f"not ready: queue {q} has no consumer\n",
            f"not ready: the channel of queue {q} is not open\n",
        )
        assert await consumer_count(broker.connection, q) is None  # not declared by the consumer
        declared_at = time.monotonic()
        await declare_work_queue(broker.channel, options)
        took = await consumed_again(broker, q, declared_at)
        event = await broker.publish(q)
        await eventually(lambda: seen == [event], what="the event published after the queue came back")
        await eventually(lambda: readiness.statuses[-1] == 200, what="/readyz ready again")
        assert managed.snapshot().queues[0].broker_cancels == 1
    assert took < RESUMED_WITHIN, took
    assert readiness.statuses == [200, 503, 200]
    [warning] = cancel_warnings(caplog)
    assert q in warning, warning
    assert "the queue was deleted" in warning, warning
    assert "declaring it again" not in warning, warning
