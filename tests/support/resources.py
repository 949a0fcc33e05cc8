"""What handlers in a test record into: the lifespan's ``events`` resource, and a dependency that notes there
when it is set up and cleaned up (once per attempt)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from lily_mongo import Resource

Events = Annotated[list[str], Resource("events")]


async def per_attempt(events: Events) -> AsyncIterator[str]:
    """A generator dependency: ``set up`` before the attempt and ``clean up`` after it, in ``events``."""
    events.append("set up")
    try:
        yield "tenant-1"
    finally:
        events.append("clean up")
