"""Consumers in a test: run for a block and shut down, what ended, the tasks they leave, one event for them."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from lily_mongo import Consumer, ManagedConsumer, RetryPolicy, TerminalObservation
from tests.support.broker import Broker
from tests.support.polling import eventually

NO_RETRIES = RetryPolicy(max_retries=0, delays=())


@contextlib.asynccontextmanager
async def running(
    consumer: Consumer, *, expect_clean: bool = True, release: asyncio.Event | None = None
) -> AsyncIterator[ManagedConsumer]:
    """Start ``consumer`` and shut it down on the way out.

    On the way out ``release`` (if given) is set first, so blocked handlers can end; with ``expect_clean`` the
    shutdown report must leave no delivery unresolved. ``shutdown()`` returns the same report when the test already
    shut the consumer down.
    """
    managed = await consumer.start()
    try:
        yield managed
    finally:
        if release is not None:
            release.set()
        report = await managed.shutdown()
        if expect_clean:
            assert report.unresolved == 0, report.render()


def outcomes(managed: ManagedConsumer) -> list[str]:
    """The outcome of every ended delivery, oldest first."""
    return [o.outcome for o in managed.delivery_terminal_observations()]


async def wait_observations(managed: ManagedConsumer, count: int, timeout: float = 10.0) -> list[TerminalObservation]:
    """Wait until ``count`` deliveries have ended; return their observations, oldest first."""
    try:
        await eventually(
            lambda: len(managed.delivery_terminal_observations()) >= count,
            timeout=timeout,
            what=f"{count} terminal observations",
        )
    except AssertionError as error:
        raise AssertionError(f"{error} (have {outcomes(managed)})") from None
    return list(managed.delivery_terminal_observations())


def new_tasks(before: set[asyncio.Task[Any]]) -> set[asyncio.Task[Any]]:
    """Unfinished tasks started since ``before`` was taken (``asyncio.all_tasks()``), except the current one."""
    current = asyncio.current_task()
    return {t for t in asyncio.all_tasks() - before if t is not current and not t.done()}


class OneEvent(NamedTuple):
    """A fresh queue, the id of the handler a test links to it, a new event id and that event's inbox record key."""

    q: str
    handler_id: str
    event: uuid.UUID
    key: str


def one_event(broker: Broker, base: str) -> OneEvent:
    q = broker.queue(base)
    handler_id, event = f"{q}/{base}", uuid.uuid4()
    return OneEvent(q, handler_id, event, f"{handler_id}|{event}")
