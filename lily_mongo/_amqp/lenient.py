"""Reading a connection's frames leniently: :class:`LenientFrameReader`.

aiormq decodes each frame with pamqp and, when one fails, drops the whole connection
(InvalidFrameError). RabbitMQ accepts some metadata that pamqp cannot decode: a header
name (a short string) or a short-string property (content_type, message_id, type, ...)
that is not valid UTF-8, and a routing key that is not (through an exchange that routes
it anyway). Such a delivery arrives first again after every reconnect, so one message
would stall its queue for good. The reader sits between one connection's socket and
the frame receiver: it hands frames through untouched, except a basic.deliver /
basic.get-ok or a content header that pamqp would refuse. Those it rewrites into what
a lenient decoder reads (undecodable text replaced), and it marks the delivery with a
header no producer can forge, so the consumer refuses it with a code instead of running
it. Nothing process-wide changes: pamqp's functions are untouched, and only connections
opened by this package (``connect_amqp``) use the reader. docs/contracts.md, section 5,
says what a producer sees.
"""

from __future__ import annotations

import asyncio
import secrets
import struct
from typing import Literal

from pamqp import commands as spec
from pamqp import encode
from pamqp import frame as pamqp_frame
from pamqp import header as pamqp_header

from .._text import sanitize
from .codec import (
    DELIVER,
    FRAME_BODY,
    FRAME_HEAD,
    FRAME_HEADER,
    FRAME_HEARTBEAT,
    FRAME_METHOD,
    FRAME_TYPES,
    GET_OK,
    PROPERTY_NAMES,
    Layouts,
    read_content_header,
    read_delivery,
)
from .properties import LilyProperties

__all__ = ["MALFORMED_HEADER", "LenientFrameReader"]

# The mark: a header name made of 128 random bits at import, so no message from the wire
# can carry it; AmqpMessage takes it out again before anything reads the headers.
MALFORMED_HEADER = f"x-lily-malformed-{secrets.token_hex(16)}"

_REASON_BYTES = 300
_PASS_THROUGH = 1 << 62  # "skip" for a stream that is not frames: everything goes to aiormq as it is
_PARSE_ERRORS = (IndexError, ValueError, TypeError, struct.error)


class LenientFrameReader:
    """One connection's incoming byte stream, checked frame by frame.

    Two readers take frames from it, and each frame is checked exactly once:

    * aiormq's own frame receiver reads each frame in three calls (1 byte, 6 bytes,
      then the payload and the frame end: :meth:`readexactly`). Those calls are served
      from frames :meth:`checked` before they are handed out (body frames and
      heartbeats pass straight through).
    * lily's receiver (:mod:`lily_mongo._amqp.receiver`) takes each frame whole
      (:meth:`take_frame`, :meth:`fill`) and checks it while decoding it: only a frame
      its direct decoding refuses goes through :meth:`checked`.

    The socket is read in large chunks either way: fewer calls than three reads per
    frame from the socket's stream (about three deliveries arrive per chunk at full
    speed; bench_peers.py). RabbitMQ parses a header table when it accepts a message
    (an unknown field type closes the publisher's connection), so a table's structure
    is sound; only its text can be undecodable.
    """

    __slots__ = ("_error", "_out", "_pos", "_reader", "_rest", "_skip", "_unread", "layouts", "pending", "receiver")

    _CHUNK = 256 * 1024

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self._out = b""  # checked bytes for aiormq's reads, not handed out yet from offset _unread
        self._unread = 0
        self._rest = b""  # bytes read from the socket, not handed out in any way yet from offset _pos
        self._pos = 0
        self._skip = 0  # bytes of the current body frame (or of a stream we do not parse) to pass through
        self._error: Exception | None = None  # a failed socket read, raised by aiormq's next read
        self.pending: dict[int, str] = {}  # channel -> what its rewritten basic.deliver held
        self.layouts: Layouts = {}  # the connection's property-layout cache
        self.receiver: Literal["fast", "stock"] = "stock"  # lily's receiver sets "fast" when it takes the reader

    # -- aiormq's reading ----------------------------------------------------------------------

    def at_eof(self) -> bool:
        return (
            self._unread == len(self._out)
            and self._pos == len(self._rest)
            and self._error is None
            and self._reader.at_eof()
        )

    async def read(self, n: int = -1) -> bytes:
        if self._unread < len(self._out) or self._pos < len(self._rest):
            self._check()
            data, self._out, self._unread = self._out[self._unread :], b"", 0
            if self._pos < len(self._rest):  # an incomplete frame: hand it out as it is
                data += self._rest[self._pos :]
                self._rest, self._pos, self._skip = b"", 0, 0
            return data
        self._raise_error()
        return await self._reader.read(n)

    async def readexactly(self, n: int) -> bytes:
        start = self._unread
        end = start + n
        if end <= len(self._out):
            self._unread = end
            return self._out[start:end]
        while True:
            self._check()
            if n <= len(self._out) - self._unread:
                return await self.readexactly(n)
            self._raise_error()
            chunk = await self._reader.read(self._CHUNK)
            if not chunk:
                partial = self._out[self._unread :] + self._rest[self._pos :]
                self._out, self._unread, self._rest, self._pos = b"", 0, b"", 0
                raise asyncio.IncompleteReadError(partial, n)
            self._append(chunk)

    # -- lily's reading ------------------------------------------------------------------------

    def take_frame(self) -> bytes | None:
        """The next frame, whole, when the reader holds it; else None (nothing taken).

        Frames aiormq's reading has already had checked come first, then frames straight
        from the socket's bytes: not checked (the caller's decoding checks them). Only
        frames of the four AMQP frame types are taken: anything else is left to aiormq's
        own reading, which judges it.
        """
        if self._unread < len(self._out) or self._skip:
            return self._take_checked()
        start = self._pos
        frame = _whole_frame(self._rest, start)
        if frame is not None:
            self._pos = start + len(frame)
        return frame

    def incomplete(self) -> bool:
        """True when the next frame is not whole yet: more of the socket's bytes complete it."""
        if self._skip:
            return self._skip < _PASS_THROUGH
        if self._unread < len(self._out):
            return False
        rest, start = self._rest, self._pos
        if len(rest) - start < FRAME_HEAD:
            return True
        return rest[start] in FRAME_TYPES and len(rest) < start + 8 + int.from_bytes(rest[start + 3 : start + 7])

    async def fill(self) -> bool:
        """Read the socket once more. False at its end, or when the read failed: aiormq's
        next read raises that failure, inside aiormq's own error mapping."""
        try:
            chunk = await self._reader.read(self._CHUNK)
        except Exception as exc:
            self._error = exc
            return False
        if not chunk:
            return False
        self._append(chunk)
        return True

    # -- checking ------------------------------------------------------------------------------

    def checked(self, frame: bytes) -> bytes:
        """``frame`` as pamqp can read it: itself, or its lenient rewrite (marked)."""
        kind = frame[0]
        if kind == FRAME_METHOD:
            method = frame[7:11]
            if method in (DELIVER, GET_OK):
                return self._delivery(frame)
            return frame
        if kind == FRAME_HEADER:
            return self._content_header(frame)
        return frame

    def _delivery(self, frame: bytes) -> bytes:
        problems: list[str] = []
        try:
            method = read_delivery(frame, problems)
        except _PARSE_ERRORS:
            return frame  # not a frame we can read either: leave the verdict to aiormq
        if not problems:
            return frame
        self.pending[int.from_bytes(frame[1:3])] = "; ".join(problems)
        # Encoded here rather than by pamqp: pamqp refuses to encode exchange names it decodes.
        # (read_delivery sets every field: the defaults below are for the type checker.)
        parts = [frame[7:11]]
        if isinstance(method, spec.Basic.Deliver):
            parts.append(encode.short_string(method.consumer_tag or ""))
        parts.append((method.delivery_tag or 0).to_bytes(8, signed=True))
        parts.append(b"\x01" if method.redelivered else b"\x00")
        parts.append(encode.short_string(method.exchange or ""))
        parts.append(encode.short_string(method.routing_key or ""))
        if isinstance(method, spec.Basic.GetOk):
            parts.append((method.message_count or 0).to_bytes(4, signed=True))
        payload = b"".join(parts)
        return b"".join((frame[:3], len(payload).to_bytes(4), payload, frame[-1:]))

    def _content_header(self, frame: bytes) -> bytes:
        channel = int.from_bytes(frame[1:3])
        problem = self.pending.pop(channel, None) if self.pending else None
        if problem is None:
            try:
                read_content_header(frame, self.layouts)
                return frame  # read directly: pamqp reads it alike
            except Exception:
                pass
            try:
                pamqp_header.ContentHeader().unmarshal(frame[7:-1])
                return frame  # pamqp reads it: nothing to repair
            except _PARSE_ERRORS:
                pass
        try:
            return _rewritten_header(frame, channel, problem, self.layouts)
        except _PARSE_ERRORS:
            return frame

    # -- buffers -------------------------------------------------------------------------------

    def _append(self, chunk: bytes) -> None:
        if self._pos == len(self._rest):
            self._rest = chunk
        else:
            self._rest = self._rest[self._pos :] + chunk
        self._pos = 0

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _take_checked(self) -> bytes | None:
        out, start = self._out, self._unread
        if len(out) - start < FRAME_HEAD or len(out) < start + 8 + int.from_bytes(out[start + 3 : start + 7]):
            if self._pos == len(self._rest):
                return None
            self._check()
            out, start = self._out, self._unread
        frame = _whole_frame(out, start)
        if frame is not None:
            self._unread = start + len(frame)
        return frame

    def _check(self) -> None:
        """Move every complete frame of the socket's bytes (checked, rewritten if needed) to ``_out``."""
        data, offset = self._rest, self._pos
        size = len(data)
        if offset == size:
            return
        parts = [self._out[self._unread :]]
        while offset < size:
            if self._skip:
                take = min(self._skip, size - offset)
                parts.append(data[offset : offset + take])
                offset += take
                self._skip -= take
                continue
            if size - offset < FRAME_HEAD:
                break
            kind = data[offset]
            if kind in (FRAME_METHOD, FRAME_HEADER):
                end = offset + FRAME_HEAD + int.from_bytes(data[offset + 3 : offset + 7]) + 1
                if end > size:
                    break
                parts.append(self.checked(data[offset:end]))
                offset = end
            elif kind in (FRAME_BODY, FRAME_HEARTBEAT):
                self._skip = FRAME_HEAD + int.from_bytes(data[offset + 3 : offset + 7]) + 1
            else:
                # Not a frame (the broker's protocol header, say): hand the rest through as it
                # is and leave the verdict to aiormq.
                self._skip = _PASS_THROUGH
        if offset == size:
            self._rest, self._pos = b"", 0
        else:
            self._pos = offset
        self._out, self._unread = b"".join(parts), 0


def _whole_frame(buf: bytes, start: int) -> bytes | None:
    """The whole frame at ``start`` of ``buf``; None when it is not whole yet, or not a frame."""
    if len(buf) - start < FRAME_HEAD:
        return None
    end = start + 8 + int.from_bytes(buf[start + 3 : start + 7])
    if end > len(buf) or buf[start] not in FRAME_TYPES:
        return None
    return buf[start:end]


def _rewritten_header(frame: bytes, channel: int, problem: str | None, layouts: Layouts) -> bytes:
    """The content header as a lenient decoder reads it, marked with :data:`MALFORMED_HEADER`."""
    _, weight, body_size = struct.unpack_from(">HHQ", frame, 7)
    problems = [problem] if problem else []
    values: dict[str, object]
    try:
        properties = read_content_header(frame, layouts, problems).properties
        values = {name: getattr(properties, name) for name in PROPERTY_NAMES}
    except _PARSE_ERRORS:
        problems.append("the message properties cannot be parsed")
        values = {}
    reason = sanitize("; ".join(problems) or "the message properties cannot be decoded", _REASON_BYTES)
    headers = values.get("headers")
    values["headers"] = {**(headers if isinstance(headers, dict) else {}), MALFORMED_HEADER: reason}
    try:
        marked = LilyProperties(**values)  # type: ignore[arg-type]
        return pamqp_frame.marshal(pamqp_header.ContentHeader(weight, body_size, marked), channel)
    except (ValueError, TypeError, struct.error):
        # The lenient reading does not encode again (a delivery mode pamqp refuses, say):
        # keep only the mark.
        marked = LilyProperties(headers={MALFORMED_HEADER: reason})
        return pamqp_frame.marshal(pamqp_header.ContentHeader(weight, body_size, marked), channel)
