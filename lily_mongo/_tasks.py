"""Task ownership and small asyncio helpers shared by the supervisor and the adapters."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Coroutine
from typing import Any

__all__ = ["TaskSet", "raise_if_cancel_requested", "uncancellable"]

log = logging.getLogger("lily_mongo")


class TaskSet:
    """The supervisor's task group: every task it spawns is tracked until it ends.

    Unlike :class:`asyncio.TaskGroup`, one task's failure does not cancel the
    others, and shutdown can join with a window and observe what did not end.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(
        self, coro: Coroutine[Any, Any, Any], *, name: str | None = None, eager: bool = False
    ) -> asyncio.Task[Any]:
        """Start ``coro`` as a tracked task; ``eager`` runs it at once, up to its first suspension."""
        loop = asyncio.get_running_loop()
        if eager:
            task: asyncio.Task[Any] = asyncio.Task(coro, loop=loop, name=name, eager_start=True)
        else:
            task = loop.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("lily_mongo task %s failed", task.get_name(), exc_info=task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    def pending(self) -> set[asyncio.Task[Any]]:
        return set(self._tasks)

    async def join(self, tasks: set[asyncio.Task[Any]], timeout: float) -> set[asyncio.Task[Any]]:
        """Wait up to ``timeout`` for ``tasks``; return those still running."""
        if not tasks:
            return set()
        _, pending = await asyncio.wait(tasks, timeout=max(timeout, 0.0))
        return pending


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
