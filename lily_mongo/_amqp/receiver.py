"""lily's frame receiver: whole frames from the lenient reader, the hot ones decoded directly.

aiormq's own receiver reads each frame with three awaited reads into a BytesIO under a
lock, then decodes it with pamqp's generic unmarshal (a table of types walked per
field). A delivery is three frames (basic.deliver, content header, body), so that is
most of the AMQP stack's cost per message. :class:`FrameDecoder` takes each frame whole
from the connection's :class:`LenientFrameReader` and decodes the four frames a consumer
sees all the time with the walkers of :mod:`lily_mongo._amqp.codec`; that decoding is
also the frame's check, so a content header is walked once. Every other frame, and any
frame the direct decoding does not read to the last byte, is checked by the reader
(rewritten if pamqp would refuse it) and decoded by pamqp as before. The objects are the
ones pamqp builds, attribute for attribute (tests/property/test_frame_decoding_props.py
compares them). It runs only where :mod:`lily_mongo._amqp.patches` installs it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiormq.exceptions
from pamqp import exceptions as pamqp_exceptions
from pamqp import frame as pamqp_frame

from .codec import FRAME_HEADER, Layouts, decode_frame
from .lenient import LenientFrameReader

__all__ = ["FrameDecoder", "unmarshal_frame"]

ReceivedFrame = tuple[int, int, Any]
"""What aiormq's receiver returns for a frame: (bytes consumed, channel, frame object)."""


def unmarshal_frame(frame: bytes, layouts: Layouts) -> ReceivedFrame:
    """``pamqp.frame.unmarshal(frame)`` for one whole frame, as aiormq's receiver calls it.

    Returns what pamqp returns and raises what aiormq raises for a frame pamqp refuses
    (``InvalidFrameError``); ``layouts`` is the connection's property-layout cache.
    """
    try:
        decoded = decode_frame(frame, layouts)
    except Exception:
        # Anything the direct reading did not expect (text that is not UTF-8, a length
        # past the end, a timestamp out of range, ...): pamqp reads the frame again and
        # its verdict, value or error, is the one aiormq gets.
        decoded = None
    if decoded is not None:
        return decoded
    try:
        return pamqp_frame.unmarshal(frame)
    except pamqp_exceptions.PAMQPException as exc:
        raise aiormq.exceptions.InvalidFrameError(str(exc)) from exc


class FrameDecoder:
    """The next frame of one connection, decoded: what lily's receiver returns."""

    __slots__ = ("_layouts", "_reader")

    def __init__(self, reader: LenientFrameReader) -> None:
        self._reader = reader
        self._layouts = reader.layouts

    async def next_frame(self, lock: asyncio.Lock) -> ReceivedFrame | None:
        """The next frame, decoded; None when the stream does not hold one (it ended, a read
        failed, or it is not frames): then aiormq's own reading judges it.

        ``lock`` (the receiver's) is held while the socket is read.
        """
        reader = self._reader
        frame = reader.take_frame()
        while frame is None:
            if not reader.incomplete():
                return None
            async with lock:
                if not await reader.fill():
                    return None
            frame = reader.take_frame()
        if frame[0] != FRAME_HEADER or not reader.pending:
            try:
                decoded = decode_frame(frame, self._layouts)
            except Exception:
                decoded = None
            if decoded is not None:
                return decoded
        # Refused by the direct decoding (or a content header a rewritten basic.deliver
        # marks): checked and, if pamqp would refuse it, rewritten; then decoded.
        return unmarshal_frame(reader.checked(frame), self._layouts)
