"""One consuming channel's settlement frames: :class:`AckCoalescer`.

The decision which frames to write is pure (:func:`lily_mongo._acks.plan_flush`);
this module writes them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import aiormq.abc
import aiormq.exceptions

from .acks import TagState, plan_flush

__all__ = ["AckCoalescer", "Spawn"]


Spawn = Callable[[Coroutine[Any, Any, None]], Any]
"""Starts a background task owned by the caller's supervisor (:meth:`TaskSet.spawn`)."""


class AckCoalescer:
    """One consuming channel's settlement frames: ACKs coalesced, NACKs and rejects in order.

    Every delivery of the channel is registered when it arrives (:meth:`delivered`),
    so the ledger knows each tag a ``multiple`` ACK would reach. :meth:`ack` marks
    the tag and waits until a frame settling it was written: the "ACK sent" point
    (docs/settlement.md, section 2) stays where it was. A flush task writes what
    :func:`_acks.plan_flush` allows at the end of the event-loop turn in which the
    first mark came: the run of ACK-marked tags from the bottom of the ledger, as
    one frame. Marks blocked behind a delivery still running wait at most
    ``delay`` seconds for it, then get single ACKs. A NACK or reject
    (:meth:`alone`) first writes every pending ACK of the channel, then its own
    frame, holding the channel's settlement lock so no frame overtakes another.

    Bound to one channel object, so to one transport generation: nothing marked
    here is ever written on another channel. When a write fails (the channel
    closed) or authority is revoked (:meth:`drop`), every mark not yet written
    fails, and nothing more is written: those deliveries end unresolved.
    """

    __slots__ = (
        "_dropped",
        "_floor",
        "_flusher",
        "_lock",
        "_marked",
        "_since",
        "_spawn",
        "_stuck",
        "_tags",
        "_waiters",
        "channel",
        "delay",
    )

    def __init__(self, channel: aiormq.abc.AbstractChannel, delay: float, spawn: Spawn) -> None:
        self.channel = channel
        self.delay = delay
        self._spawn = spawn
        self._floor = 0  # every tag at or below it is settled
        self._tags: dict[int, TagState] = {}  # the tags above the floor delivered on this channel
        self._waiters: dict[int, asyncio.Future[None]] = {}  # marked tags -> their ack() waiting
        self._marked = 0  # tags MARKED and not written yet
        self._since = 0.0  # loop time of the oldest mark not written yet
        self._stuck = 0  # the running delivery that blocked the last forced flush
        self._flusher: object | None = None
        self._lock = asyncio.Lock()  # held while frames are written: they reach the socket in order
        self._dropped: BaseException | None = None

    def delivered(self, tag: int) -> None:
        """A delivery arrived on the channel: its tag is outstanding until it is settled."""
        self._tags[tag] = TagState.OUTSTANDING

    async def ack(self, tag: int) -> None:
        """Mark ``tag`` ACK; return once a frame settling it was written (raise if none will be)."""
        if self._dropped is not None or self.channel.is_closed:
            raise aiormq.exceptions.ChannelInvalidStateError(f"no ACK is written on this channel ({self._dropped})")
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._tags[tag] = TagState.MARKED
        self._waiters[tag] = waiter
        if not self._marked:
            self._since = loop.time()
        self._marked += 1
        if self._flusher is None:
            self._flusher = self._spawn(self._flush())
        await waiter

    async def alone(self, tag: int, write: Callable[[], Awaitable[None]]) -> None:
        """Write a NACK or reject of ``tag`` (``write`` writes it) after every pending ACK."""
        async with self._lock:
            if self._dropped is None:
                await self._write(forced=True)
            if self._dropped is not None:  # revoked or lost while the ACKs before it were written
                raise aiormq.exceptions.ChannelInvalidStateError(
                    f"no frame is written on this channel ({self._dropped})"
                )
            await write()
        # Settled only once written: until then no multiple ACK may reach past it.
        if tag > self._floor:
            self._tags[tag] = TagState.SETTLED

    async def flush(self) -> None:
        """Write every pending ACK now (graceful shutdown, before the channel closes)."""
        async with self._lock:
            if self._dropped is None:
                await self._write(forced=True)

    def drop(self, reason: str) -> None:
        """Write nothing more (authority revoked, channel lost): every pending mark fails."""
        if self._dropped is None:
            self._dropped = aiormq.exceptions.ChannelInvalidStateError(reason)
        waiters, self._waiters = self._waiters, {}
        self._marked = 0
        for waiter in waiters.values():
            if not waiter.done():
                waiter.set_exception(self._dropped)

    async def _flush(self) -> None:
        """The flush task: runs while marks are pending, then ends."""
        loop = asyncio.get_running_loop()
        try:
            while self._marked and self._dropped is None:
                async with self._lock:
                    # Forced once the oldest mark waited ``delay``, or at once when the delivery
                    # blocking the run already held up an earlier flush (a long handler: do not
                    # make every ACK behind it wait again).
                    forced = loop.time() - self._since >= self.delay or self._floor + 1 == self._stuck
                    written = await self._write(forced=forced)
                if self._marked and not written:
                    # Every pending mark is blocked behind a delivery still running: give it
                    # until the oldest mark is ``delay`` old, then ACK the marks one by one.
                    await asyncio.sleep(max(self._since + self.delay - loop.time(), 0.0))
        except BaseException:
            self.drop("the ACK flush was cancelled")  # its marks must not wait for a flush that never comes
            raise
        finally:
            self._flusher = None

    async def _write(self, *, forced: bool) -> bool:
        """Write the frames :func:`plan_flush` allows; True if any was written."""
        flush = plan_flush(self._floor, self._tags, forced=forced)
        tags = self._tags
        for tag in range(self._floor + 1, flush.floor + 1):
            del tags[tag]
        self._floor = flush.floor
        covered = flush.covered
        if not covered:
            return False
        for tag in covered:
            if tag in tags:
                tags[tag] = TagState.SETTLED
        self._marked -= len(covered)
        if flush.single and flush.single[-1] > flush.floor + 1:
            self._stuck = flush.floor + 1  # ACKs were written past a delivery still running
        waiters = [self._waiters.pop(tag) for tag in covered]
        channel = self.channel
        try:
            frames = [(flush.multiple, True)] if flush.multiple is not None else []
            frames.extend((tag, False) for tag in flush.single)
            last = len(frames) - 1
            for i, (tag, multiple) in enumerate(frames):
                # Only the last frame waits for the socket: the writer writes them in order.
                await channel.basic_ack(tag, multiple=multiple, wait=i == last)
        except BaseException as exc:
            # The channel failed (or this task was cancelled): whether the frames were
            # written is unknown, so none of these deliveries counts as ACKed.
            error = aiormq.exceptions.ChannelInvalidStateError(f"ACK write failed: {type(exc).__name__}")
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(error)
            self.drop(f"an ACK write failed: {type(exc).__name__}")
            if not isinstance(exc, Exception):
                raise
            return True
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        return True
