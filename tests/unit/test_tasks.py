"""``raise_if_cancel_requested``: a cancellation some library absorbed still stops a multi-step operation."""

from __future__ import annotations

import asyncio

import pytest

from lily_mongo._tasks import raise_if_cancel_requested


async def swallow_a_cancel(entered: asyncio.Event, *, uncancel: bool) -> str:
    try:
        entered.set()
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if uncancel and task is not None:
            task.uncancel()  # the well-behaved way to absorb one
    raise_if_cancel_requested()
    return "went on"


async def test_an_absorbed_cancel_is_raised_at_the_next_check() -> None:
    entered = asyncio.Event()
    task = asyncio.create_task(swallow_a_cancel(entered, uncancel=False))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_withdrawn_cancel_lets_the_operation_go_on() -> None:
    entered = asyncio.Event()
    task = asyncio.create_task(swallow_a_cancel(entered, uncancel=True))
    await entered.wait()
    task.cancel()
    assert await task == "went on"


async def test_no_cancel_no_raise() -> None:
    raise_if_cancel_requested()
