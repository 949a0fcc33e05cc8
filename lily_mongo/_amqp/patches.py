"""Every reach into aiormq's, aio-pika's and asyncio's internals, behind one version check.

Two patches make consuming cheaper; both are installed only where the suite ran
(:data:`TESTED`: the aiormq and pamqp versions of the lock file, up to their next
minor release), and :func:`active` says which path this process takes:

* **the fast receiver** ("fast"): aiormq builds each connection's frame receiver
  from its module global ``aiormq.connection.FrameReceiver``, with no parameter for
  it. The global is replaced, once, by :class:`_ReceiverChoice`, a subclass of
  aiormq's receiver that gives a connection read through a
  :class:`LenientFrameReader` (only the connections this package opens) lily's
  :class:`FastFrameReceiver`, and every other connection aiormq's own receiver
  (the subclass adds nothing else, so type checks and subclasses of the global keep
  working; a subclass of aiormq's Connection would have to copy its whole connect()).
  :class:`FastFrameReceiver` relies on aiormq's receiver attributes ``started`` and
  ``lock``; its decoding builds pamqp's objects without their ``__init__``.
  Measured alone (the queue bounded): about 60 µs of CPU per delivery less
  (58 and 63 µs, medians of two runs), 1.2 to 1.4 times the throughput.
* **the unbounded frame queue** (:func:`unbounded_frame_queue`): aiormq's connection
  reader task puts every frame into its channel's queue, which the channel's own
  reader task empties; aio-pika opens channels with aiormq's default bound of 10
  frames. At full speed that queue is always full, so the two tasks hand over to
  each other every frame or so (a future resolved and a loop turn per frame, and the
  consumer's work split into small slices). Unbounded, the connection reader moves a
  whole socket read's frames at once. What the queue can hold stays bounded by the
  channel's prefetch: the broker sends no delivery past it. aio-pika offers no way to
  pass aiormq's ``frame_buffer_size`` when it opens a channel, so the bound of this
  one queue (``asyncio.Queue._maxsize``) is lifted in place. Measured alone (aiormq's
  receiver): 43 and 65 µs of CPU per delivery less, 1.2 to 1.3 times the throughput.

Together they save more than the sum: 142 and 134 µs per delivery (stock 246 and
272 µs, fast 106 and 126 µs), 2.0 to 2.2 times the throughput: lily's receiver hands
on a whole socket read's frames at once, and only an unbounded queue takes them
without a hand-over per frame. Under cProfile (both against neither), pamqp's own
time falls from 117 to 2 µs per delivery and reading frames (the receiver's
``get_frame``, the lenient check included) from 259 to 52 µs.
Figures: ``benchmarks/bench_frame_paths.py``, two runs of 5 rounds of 10,000
deliveries, prefetch 64, an at-least-once consumer on 2 cores shared with the broker
(medians of the per-round paired differences); rerun it before widening :data:`TESTED`.

On any other version ("stock") neither is installed: aiormq's own receiver and pamqp
decode every frame and the queue keeps its bound, and one INFO line on the
``lily_mongo`` logger says so. The lenient reading works on both paths: the reader
is a transport (:func:`set_transport_factory`), and aiormq's receiver reads it
through the stream calls it makes on any transport. docs/contracts.md, section 5,
describes both paths; tests/integration/test_frame_paths.py shows which one runs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Final, Literal, cast

import aio_pika
import aiormq.abc
import aiormq.connection

from .._versions import VersionRange, installed_version
from .lenient import LenientFrameReader
from .receiver import FrameDecoder, ReceivedFrame

__all__ = [
    "TESTED",
    "FastFrameReceiver",
    "FramePath",
    "active",
    "connection_unblocked",
    "set_transport_factory",
    "transport_factory",
    "unbounded_frame_queue",
]

log = logging.getLogger("lily_mongo")

FramePath = Literal["fast", "stock"]

# The versions the suite runs on (uv.lock), up to the next minor release: a new minor
# release takes the stock path until the suite has run on it and the range is widened.
TESTED: Final = (
    VersionRange("aiormq", (7, 2, 4), (7, 3)),
    VersionRange("pamqp", (4, 0, 1), (4, 1)),
)


@functools.cache
def active() -> FramePath:
    """The frame path of this process, decided at its first connection: "fast" on the tested
    versions (the fast receiver installed), else "stock" (said once, at INFO)."""
    outside = [
        f"{tested.distribution} {version or 'not installed'} (tested: {tested})"
        for tested in TESTED
        if not tested.covers(version := installed_version(tested.distribution))
    ]
    if outside:
        log.info(
            "AMQP frames are read by aiormq's own receiver and pamqp, not lily's faster one: %s; "
            "lenient reading is unchanged (docs/contracts.md, section 5)",
            "; ".join(outside),
        )
        return "stock"
    aiormq.connection.FrameReceiver = _ReceiverChoice  # type: ignore[misc]
    return "fast"


class FastFrameReceiver(aiormq.connection.FrameReceiver):
    """aiormq's frame receiver for a connection read through a :class:`LenientFrameReader`.

    Once the connection has started (its first frame read by aiormq, which checks it for a
    protocol header), each frame comes whole from the reader and decoded by a
    :class:`FrameDecoder`; when the stream holds no frame (it ended, a read failed, it is
    not frames), aiormq's own reading runs as before, with its error mapping. aiormq reads
    frames from one task at a time (the connection handshake, then its reader task); the
    lock is still honoured.
    """

    def __init__(self, reader: LenientFrameReader) -> None:
        super().__init__(cast(asyncio.StreamReader, reader))
        self._decoder = FrameDecoder(reader)
        reader.receiver = "fast"

    async def get_frame(self) -> ReceivedFrame:
        if self.started and not self.lock.locked():
            frame = await self._decoder.next_frame(self.lock)
            if frame is not None:
                return frame
        return await super().get_frame()


class _ReceiverChoice(aiormq.connection.FrameReceiver):
    """What ``aiormq.connection.FrameReceiver(reader)`` builds once installed: lily's receiver
    for a :class:`LenientFrameReader` while the fast path is active, else aiormq's own (this
    class, which adds nothing)."""

    def __new__(cls, reader: asyncio.StreamReader) -> aiormq.connection.FrameReceiver:  # type: ignore[misc]
        if isinstance(reader, LenientFrameReader) and active() == "fast":
            # Not an instance of cls: Python does not run cls.__init__ on it again.
            return FastFrameReceiver(reader)
        return super().__new__(cls)


def unbounded_frame_queue(channel: aiormq.abc.AbstractChannel) -> None:
    """On the fast path, let a consuming channel's incoming frame queue grow past aiormq's
    10 frames (see the module's docstring); on the stock path leave it bounded."""
    frames = channel.frames
    if active() == "fast" and isinstance(frames, asyncio.Queue) and hasattr(frames, "_maxsize"):
        frames._maxsize = 0


def set_transport_factory(connection: aio_pika.Connection, factory: aiormq.connection.TransportFactory) -> None:
    """Have every aiormq connection ``connection`` opens (reconnects too) use ``factory``.

    aio-pika hands its keyword arguments to each aiormq connection it opens; it keeps only
    the ones it knows from a constructor call, so the factory is set in them afterwards.
    """
    connection.kwargs["transport_factory"] = factory


def transport_factory(connection: object) -> Any:
    """The transport factory :func:`set_transport_factory` gave ``connection``, or None."""
    kwargs = getattr(connection, "kwargs", None)
    return kwargs.get("transport_factory") if isinstance(kwargs, dict) else None


def connection_unblocked(channel: aiormq.abc.AbstractChannel) -> asyncio.Event | None:
    """The event aiormq clears on ``connection.blocked`` and sets on ``connection.unblocked``, for the
    connection of ``channel`` (aiormq keeps it private and offers no property), or None where it is not."""
    event = getattr(channel.connection, "_Connection__connection_unblocked", None)
    return event if isinstance(event, asyncio.Event) else None
