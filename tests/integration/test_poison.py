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
from tests.support import BrokerNames, drain, queue_depth, wait_observations

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
    headers: Callable[[], dict[str, Any] | None]
    body: bytes
    code: str


GOOD_BODY = b'{"id": 1, "sku": "A-1"}'

POISON = [
    Poison("no-headers", lambda: None, GOOD_BODY, "QUEUE_ENVELOPE_INVALID"),
    Poison("missing-event-id", lambda: envelope(x_lily_event_id=None), GOOD_BODY, "QUEUE_ENVELOPE_INVALID"),
    Poison("missing-content-kind", lambda: envelope(x_lily_content_kind=None), GOOD_BODY, "QUEUE_ENVELOPE_INVALID"),
    Poison("invalid-event-id", lambda: envelope(x_lily_event_id="order-7"), GOOD_BODY, "QUEUE_ENVELOPE_INVALID"),
    Poison(
        "uppercase-event-id",
        lambda: envelope(x_lily_event_id=str(uuid.uuid4()).upper()),
        GOOD_BODY,
        "QUEUE_ENVELOPE_INVALID",
    ),
    Poison("integer-schema-version", lambda: envelope(x_lily_schema_version=1), GOOD_BODY, "QUEUE_ENVELOPE_INVALID"),
    Poison(
        "nil-event-id",
        lambda: envelope(x_lily_event_id="00000000-0000-0000-0000-000000000000"),
        GOOD_BODY,
        "QUEUE_ENVELOPE_INVALID",
    ),
    Poison("string-retry-count", lambda: envelope(x_retry_count="1"), GOOD_BODY, "QUEUE_ENVELOPE_INVALID"),
    Poison("retry-count-out-of-range", lambda: envelope(x_retry_count=101), GOOD_BODY, "QUEUE_ENVELOPE_INVALID"),
    Poison(
        "unsupported-version",
        lambda: envelope(x_lily_schema_version="2"),
        GOOD_BODY,
        "QUEUE_SCHEMA_VERSION_UNSUPPORTED",
    ),
    Poison(
        "unsupported-content-kind",
        lambda: envelope(x_lily_content_kind="text"),
        GOOD_BODY,
        "QUEUE_CONTENT_KIND_UNSUPPORTED",
    ),
    Poison("broken-json", envelope, b'{"id": 1, "sku": ', "QUEUE_PAYLOAD_DECODE_FAILED"),
    Poison("validation-failure", envelope, b'{"id": "seven", "sku": "A-1"}', "QUEUE_PAYLOAD_DECODE_FAILED"),
    Poison(
        "oversize-header-value",
        lambda: {**envelope(), "x-note": oversized(9 * 1024)},
        GOOD_BODY,
        "QUEUE_METADATA_BOUNDS_EXCEEDED",
    ),
    Poison(
        "oversize-metadata-aggregate",
        # Each value is within its own bound, so a bounded subset may be carried on the copy.
        lambda: {**envelope(), **{f"x-note-{i}": oversized(8000, "filler-") for i in range(4)}},
        GOOD_BODY,
        "QUEUE_METADATA_BOUNDS_EXCEEDED",
    ),
    Poison(
        "too-many-headers",
        lambda: {**envelope(), **{f"x-h{i}": "v" for i in range(70)}},
        GOOD_BODY,
        "QUEUE_METADATA_BOUNDS_EXCEEDED",
    ),
]


async def publish_raw(
    channel: aio_pika.abc.AbstractChannel, q: str, body: bytes, headers: dict[str, Any] | None, marker: str
) -> None:
    message = aio_pika.Message(
        body, headers=headers, content_type="application/json", message_id=marker, delivery_mode=2
    )
    await channel.default_exchange.publish(message, routing_key=q, mandatory=True)


def make_consumer(amqp: str, q: str, seen: list[Order]) -> Consumer:
    @queue(q, version=1, content="json")
    async def handle(order: Json[Order]) -> None:
        seen.append(order)

    consumer = Consumer(amqp_url=amqp, name="t")
    consumer.configure_queue(q, retry=RetryPolicy(max_retries=2, delays=(0.2,)))
    consumer.include(handle)
    return consumer


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
async def test_poison_message_is_dead_lettered_and_the_consumer_keeps_running(
    amqp: str, amqp_channel: aio_pika.abc.AbstractChannel, names: BrokerNames, poison: Poison
) -> None:
    q = names.queue("poison")
    seen: list[Order] = []
    consumer = make_consumer(amqp, q, seen)
    managed = await consumer.start()
    try:
        await publish_raw(amqp_channel, q, poison.body, poison.headers(), "poison")
        [rejected] = await wait_observations(managed, 1)
        valid = envelope()
        await publish_raw(amqp_channel, q, b'{"id": 2, "sku": "B-2"}', valid, "valid")
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
    assert [await queue_depth(amqp_channel, n) for n in (q, f"{q}.retry.0", f"{q}.dlq")] == [0, 0, 1]
    [copy] = await drain(amqp_channel, f"{q}.dlq")
    headers = dict(copy.headers)
    assert headers["x-lily-failure-code"] == poison.code
    assert_bounded_reason(headers["x-lily-failure-reason"])
    assert headers["x-lily-failed-queue"] == q
    assert isinstance(headers["x-lily-failed-at"], str)
    assert "x-death" not in headers
    assert_bounded_copy(headers)
    assert copy.body == poison.body


async def test_mixed_stream_loses_nothing(
    amqp: str, amqp_channel: aio_pika.abc.AbstractChannel, names: BrokerNames
) -> None:
    q = names.queue("poison-mix")
    seen: list[Order] = []
    consumer = make_consumer(amqp, q, seen)
    managed = await consumer.start()
    try:
        for i, poison in enumerate(POISON):
            await publish_raw(amqp_channel, q, poison.body, poison.headers(), f"poison-{poison.name}")
            await publish_raw(amqp_channel, q, f'{{"id": {i}, "sku": "S"}}'.encode(), envelope(), f"valid-{i}")
        observations = await wait_observations(managed, 2 * len(POISON))
        await managed.shutdown()
    finally:
        await managed.shutdown()
    outcomes = sorted(o.outcome for o in observations)
    assert outcomes == sorted(["acked"] * len(POISON) + ["dead_lettered"] * len(POISON))
    assert sorted(o.id for o in seen) == list(range(len(POISON)))
    assert [await queue_depth(amqp_channel, n) for n in (q, f"{q}.retry.0", f"{q}.dlq")] == [0, 0, len(POISON)]
    copies = await drain(amqp_channel, f"{q}.dlq")
    assert Counter(c.headers.get("x-lily-failure-code") for c in copies) == Counter(p.code for p in POISON)
    assert sorted(c.body for c in copies) == sorted(p.body for p in POISON)
    for copy in copies:
        assert_bounded_reason(copy.headers["x-lily-failure-reason"])
        assert_bounded_copy(dict(copy.headers))
