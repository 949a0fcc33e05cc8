"""Small asyncio helpers shared by the supervisor and the connection code."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

__all__ = ["raise_if_cancel_requested", "uncancellable"]


async def uncancellable[T](awaitable: Awaitable[T]) -> T:
    """Await to completion even if the awaiting task is cancelled meanwhile; re-deliver the cancel after."""
    task = asyncio.ensure_future(awaitable)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
            continue
        if cancelled:
            current = asyncio.current_task()
            if current is not None:
                current.cancel()
        return result


def raise_if_cancel_requested() -> None:
    """Raise ``CancelledError`` when the current task has a cancellation request pending.

    A library that catches ``CancelledError`` without ``Task.uncancel()`` leaves the
    request counted (``Task.cancelling()``) but lets the task run on; a multi-step
    operation checks this between steps so a cancelled start stops there.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
