"""Waiting, bounded, for a condition to hold."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable


async def eventually(
    predicate: Callable[[], bool] | Callable[[], Awaitable[bool]],
    *,
    timeout: float = 10.0,
    what: str = "condition",
    interval: float = 0.02,
) -> None:
    """Poll ``predicate`` (sync, or returning an awaitable) every ``interval`` s until it holds.

    Raises AssertionError("timed out after <timeout> s waiting for <what>") once ``timeout`` s have passed.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)
