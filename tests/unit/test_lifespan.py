"""The consumer's lifespan and TestConsumer's view of handler failures, without servers.

At-least-once handlers run in-process through ``TestConsumer`` (no MongoDB, no broker);
a started consumer points at a closed AMQP port, so its start fails after the lifespan
was entered. Expected orders and messages are written out here.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Annotated, Any

import pytest

from lily_mongo import (
    ConfigError,
    Consumer,
    Depends,
    Json,
    QueueHandlerError,
    Resource,
    RetryPolicy,
    TransportError,
    queue,
)
from lily_mongo.testing import TestConsumer
from tests.support.resources import Events, per_attempt

CLOSED_PORT = "amqp://guest:guest@127.0.0.1:1/"
QUEUE = "notes"


def lifespan_recording(events: list[str], **resources: Any) -> Any:
    @contextlib.asynccontextmanager
    async def lifespan(consumer: Consumer) -> AsyncIterator[Mapping[str, Any]]:
        events.append(f"enter {consumer.name}")
        try:
            yield {"events": events, **resources}
        finally:
            events.append("exit")

    return lifespan


@queue(QUEUE, version=1, guarantee="at_least_once")
async def note_taker(
    note: Json[dict[str, Any]], events: Events, greeting: Annotated[str, Resource("greeting")]
) -> None:
    events.append(f"{greeting} {note['text']}")


@queue(QUEUE, version=1, guarantee="at_least_once")
async def buggy(note: Json[dict[str, Any]], r: Annotated[str, Depends(per_attempt)]) -> None:
    if note.get("refuse"):
        raise QueueHandlerError.permanent("NOTE_REFUSED", "no thanks")
    raise RuntimeError(f"unexpected bug {note['n']}")


def consumer_of(handler: Any, lifespan: Any = None, **options: Any) -> Consumer:
    consumer = Consumer(amqp_url=CLOSED_PORT, name="notes", lifespan=lifespan)
    consumer.configure_queue(QUEUE, **options)
    consumer.include(handler)
    return consumer


# -- lifespan ----------------------------------------------------------------------------------------


async def test_the_lifespan_resources_are_injected_and_it_exits_after_the_test_consumer() -> None:
    events: list[str] = []
    consumer = consumer_of(note_taker, lifespan_recording(events, greeting="hello"))
    async with TestConsumer(consumer) as tc:
        result = await tc.publish_json(QUEUE, {"text": "world"}, version=1)
        events.append("last delivery done")
    assert result.outcome == "acked"
    assert events == ["enter notes", "hello world", "last delivery done", "exit"]


async def test_a_resource_the_lifespan_does_not_yield_fails_start_naming_it_and_the_lifespan_exits() -> None:
    events: list[str] = []
    consumer = consumer_of(note_taker, lifespan_recording(events))  # no "greeting"
    with pytest.raises(ConfigError) as info:
        await consumer.start()
    assert str(info.value) == (
        f"handler '{QUEUE}/v1/json/note_taker': parameter 'greeting' asks for Resource('greeting'), which the "
        "consumer's lifespan does not provide (it yielded 'events')"
    )
    assert events == ["enter notes", "exit"]
    assert consumer.state == "stopped"


async def test_a_resource_without_any_lifespan_fails_the_test_consumer_too() -> None:
    with pytest.raises(ConfigError, match=r"Resource\('events'\).*the consumer has no lifespan"):
        async with TestConsumer(consumer_of(note_taker)):
            pass


async def test_the_lifespan_exits_after_a_failed_start() -> None:
    events: list[str] = []
    consumer = consumer_of(note_taker, lifespan_recording(events, greeting="hi"))
    with pytest.raises(TransportError):  # nothing listens on the AMQP port
        await consumer.start()
    assert events == ["enter notes", "exit"]


@pytest.mark.parametrize(
    ("lifespan", "says"),
    [
        (lambda consumer: None, "lifespan(consumer) must return an async context manager"),
        (
            contextlib.asynccontextmanager(lambda consumer: _yielding(["not", "a", "mapping"])),
            "the lifespan must yield a mapping of resource names to values (or nothing), got list",
        ),
    ],
)
async def test_a_lifespan_of_the_wrong_shape_is_refused_at_start(lifespan: Any, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        async with TestConsumer(consumer_of(buggy, lifespan)):
            pass
    assert says in str(info.value)


async def _yielding(value: object) -> AsyncIterator[object]:
    yield value


def test_a_lifespan_that_is_not_callable_is_refused_at_construction() -> None:
    with pytest.raises(ConfigError) as info:
        Consumer(amqp_url=CLOSED_PORT, name="notes", lifespan=42)  # type: ignore[arg-type]
    assert str(info.value) == (
        "lifespan must be a function of the consumer returning an async context manager "
        "(an @asynccontextmanager function), got int 42"
    )


# -- what a TestConsumer shows of a handler failure --------------------------------------------------


async def test_the_result_holds_the_handlers_exception_and_a_one_line_repr() -> None:
    events: list[str] = []
    consumer = consumer_of(buggy, lifespan_recording(events), retry=RetryPolicy(max_retries=1, delays=(1.0,)))
    async with TestConsumer(consumer) as tc:
        result = await tc.publish_json(QUEUE, {"n": 1}, version=1)
        assert (result.outcome, result.code) == ("retried", "QUEUE_HANDLER_FAILED")
        assert isinstance(result.exception, RuntimeError)
        assert str(result.exception) == "unexpected bug 1"
        assert repr(result) == (
            "DeliveryResult(outcome='retried', code='QUEUE_HANDLER_FAILED', exception=RuntimeError('unexpected bug 1'))"
        )
        [retried] = await tc.deliver_retries()
        assert (retried.outcome, retried.code) == ("dead_lettered", "QUEUE_RETRIES_EXHAUSTED")
        assert str(retried.exception) == "unexpected bug 1"
        refused = await tc.publish_json(QUEUE, {"refuse": True}, version=1)
        assert isinstance(refused.exception, QueueHandlerError)
        assert refused.exception.code == "NOTE_REFUSED"
    # The Depends factory ran once per attempt, each time cleaned up after the failure.
    assert events == ["enter notes", *["set up", "clean up"] * 3, "exit"]


async def test_a_successful_delivery_has_no_exception() -> None:
    events: list[str] = []
    async with TestConsumer(consumer_of(note_taker, lifespan_recording(events, greeting="hi"))) as tc:
        result = await tc.publish_json(QUEUE, {"text": "x"}, version=1)
    assert (result.outcome, result.exception) == ("acked", None)
    assert repr(result) == "DeliveryResult(outcome='acked', code=None, exception=None)"


async def test_raise_handler_errors_re_raises_an_unexpected_exception_once_settled() -> None:
    events: list[str] = []
    async with TestConsumer(consumer_of(buggy, lifespan_recording(events)), raise_handler_errors=True) as tc:
        with pytest.raises(RuntimeError, match="unexpected bug 7"):
            await tc.publish_json(QUEUE, {"n": 7}, version=1)
        assert [m.kind for m in tc.published] == ["retry"]  # it settled first, as it would have
        # A QueueHandlerError is the handler's decision, not a bug: it is returned.
        refused = await tc.publish_json(QUEUE, {"refuse": True}, version=1)
        assert (refused.outcome, refused.code) == ("dead_lettered", "NOTE_REFUSED")
