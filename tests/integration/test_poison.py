"""Bad input from a raw producer (plain aio-pika, no Lily publisher) against the real broker.

Each poison message must end in ``Q.dlq`` with the right ``x-lily-failure-code``
and a bounded reason that does not echo the offending value; the handler never
sees it, the consumer keeps running, and no message is lost.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aio_pika
import aio_pika.abc
import pydantic
import pytest

from lily_mongo import Consumer, Json, RetryPolicy, queue
from lily_mongo.bounds import BOUNDS
from tests.support.broker import Broker
from tests.support.consumers import wait_observations

SECRET = "SECRET-VALUE-"  # marks oversized header values; must never be echoed back


class Order(pydantic.BaseModel):
    id: int
    sku: str


def envelope(**overrides: Any) -> dict[str, Any]:
    headers: dict[str, Any] = {
        "x-lily-event-id": str(uuid.uuid4()),
        "x-lily-schema-version": "1",
        "x-lily-content-kind": "json",
    }
    for key, value in overrides.items():
        name = key.replace("_", "-")
        if value is None:
            headers.pop(name, None)
        else:
            headers[name] = value
    return headers


def oversized(n: int, marker: str = SECRET) -> str:
    return (marker * (n // len(marker) + 1))[:n]


@dataclass(frozen=True)
class Poison:
    name: str
    code: str
    headers: Callable[[], dict[str, Any] | None] = envelope
    body: bytes = b'{"id": 1, "sku": "A-1"}'


INVALID = "QUEUE_ENVELOPE_INVALID"
TOO_MUCH = "QUEUE_METADATA_BOUNDS_EXCEEDED"
UNDECODABLE = "QUEUE_PAYLOAD_DECODE_FAILED"
REFUSED = "QUEUE_PAYLOAD_INVALID"

POISON = [
    Poison("no-headers", INVALID, lambda: None),
    Poison("missing-event-id", INVALID, lambda: envelope(x_lily_event_id=None)),
    Poison("missing-content-kind", INVALID, lambda: envelope(x_lily_content_kind=None)),
    Poison("invalid-event-id", INVALID, lambda: envelope(x_lily_event_id="order-7")),
    Poison("uppercase-event-id", INVALID, lambda: envelope(x_lily_event_id=str(uuid.uuid4()).upper())),
    Poison("integer-schema-version", INVALID, lambda: envelope(x_lily_schema_version=1)),
    Poison("nil-event-id", INVALID, lambda: envelope(x_lily_event_id="00000000-0000-0000-0000-000000000000")),
    Poison("string-retry-count", INVALID, lambda: envelope(x_retry_count="1")),
    Poison("retry-count-out-of-range", INVALID, lambda: envelope(x_retry_count=101)),
    Poison("unsupported-version", "QUEUE_SCHEMA_VERSION_UNSUPPORTED", lambda: envelope(x_lily_schema_version="2")),
    Poison("unsupported-content-kind", "QUEUE_CONTENT_KIND_UNSUPPORTED", lambda: envelope(x_lily_content_kind="text")),
    Poison("broken-json", UNDECODABLE, body=b'{"id": 1, "sku": '),
    Poison("validation-failure", REFUSED, body=b'{"id": "seven", "sku": "A-1"}'),
    Poison("oversize-header-value", TOO_MUCH, lambda: {**envelope(), "x-note": oversized(9 * 1024)}),
    # Each value is within its own bound, so a bounded subset may be carried on the copy.
    Poison(
        "oversize-metadata-aggregate",
        TOO_MUCH,
        lambda: {**envelope(), **{f"x-note-{i}": oversized(8000, "filler-") for i in range(4)}},
    ),
    Poison("too-many-headers", TOO_MUCH, lambda: {**envelope(), **{f"x-h{i}": "v" for i in range(70)}}),
]


async def publish_raw(
    channel: aio_pika.abc.AbstractChannel, q: str, body: bytes, headers: dict[str, Any] | None, marker: str
) -> None:
    message = aio_pika.Message(
        body, headers=headers, content_type="application/json", message_id=marker, delivery_mode=2
    )
    await channel.default_exchange.publish(message, routing_key=q, mandatory=True)


def make_consumer(broker: Broker, q: str, seen: list[Order]) -> Consumer:
    @queue(q, version=1, content="json")
    async def handle(order: Json[Order]) -> None:
        seen.append(order)

    return broker.consumer(q, handle, retry=RetryPolicy(max_retries=2, delays=(0.2,)))


def assert_bounded_reason(reason: object) -> None:
    assert isinstance(reason, str)
    assert 0 < len(reason.encode()) <= 512
    assert SECRET not in reason


def assert_bounded_copy(headers: dict[str, Any]) -> None:
    """The copy's metadata fits the bounds and carries no value that broke a bound."""
    assert len(headers) <= BOUNDS.header_entries
    total = 0
    for key, value in headers.items():
        assert not (isinstance(value, str) and SECRET in value), f"header {key!r} echoes an oversized value"
        size = len(value.encode()) if isinstance(value, str) else 8
        assert size <= BOUNDS.header_value_bytes
        total += len(key.encode()) + size
    assert total <= BOUNDS.metadata_aggregate_bytes


@pytest.mark.parametrize("poison", POISON, ids=[p.name for p in POISON])
async def test_poison_message_is_dead_lettered_and_the_consumer_keeps_running(broker: Broker, poison: Poison) -> None:
    q = broker.queue("poison")
    seen: list[Order] = []
    consumer = make_consumer(broker, q, seen)
    managed = await consumer.start()
    try:
        await publish_raw(broker.channel, q, poison.body, poison.headers(), "poison")
        [rejected] = await wait_observations(managed, 1)
        valid = envelope()
        await publish_raw(broker.channel, q, b'{"id": 2, "sku": "B-2"}', valid, "valid")
        observations = await wait_observations(managed, 2)
        report = await managed.shutdown()
    finally:
        await managed.shutdown()
    assert (rejected.outcome, rejected.code) == ("dead_lettered", poison.code)
    assert rejected.handoff_confirmed
    assert_bounded_reason(rejected.reason)
    # The consumer went on: the valid message published afterwards was handled and ACKed.
    assert observations[1].outcome == "acked"
    assert str(observations[1].event_id) == valid["x-lily-event-id"]
    assert seen == [Order(id=2, sku="B-2")]
    assert report.succeeded
    # Count in (2) = count out: one ACKed, one in the DLQ, nothing left or retried.
    assert await broker.topology_depths(q) == [0, 0, 1]
    [copy] = await broker.drain(f"{q}.dlq")
    headers = dict(copy.headers)
    assert headers["x-lily-failure-code"] == poison.code
    assert_bounded_reason(headers["x-lily-failure-reason"])
    assert headers["x-lily-failed-queue"] == q
    assert isinstance(headers["x-lily-failed-at"], str)
    assert "x-death" not in headers
    assert_bounded_copy(headers)
    assert copy.body == poison.body


async def test_mixed_stream_loses_nothing(broker: Broker) -> None:
    q = broker.queue("poison-mix")
    seen: list[Order] = []
    consumer = make_consumer(broker, q, seen)
    managed = await consumer.start()
    try:
        for i, poison in enumerate(POISON):
            await publish_raw(broker.channel, q, poison.body, poison.headers(), f"poison-{poison.name}")
            await publish_raw(broker.channel, q, f'{{"id": {i}, "sku": "S"}}'.encode(), envelope(), f"valid-{i}")
        observations = await wait_observations(managed, 2 * len(POISON))
        await managed.shutdown()
    finally:
        await managed.shutdown()
    outcomes = sorted(o.outcome for o in observations)
    assert outcomes == sorted(["acked"] * len(POISON) + ["dead_lettered"] * len(POISON))
    assert sorted(o.id for o in seen) == list(range(len(POISON)))
    assert await broker.topology_depths(q) == [0, 0, len(POISON)]
    copies = await broker.drain(f"{q}.dlq")
    assert Counter(c.headers.get("x-lily-failure-code") for c in copies) == Counter(p.code for p in POISON)
    assert sorted(c.body for c in copies) == sorted(p.body for p in POISON)
    for copy in copies:
        assert_bounded_reason(copy.headers["x-lily-failure-reason"])
        assert_bounded_copy(dict(copy.headers))
