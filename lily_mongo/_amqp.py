"""AMQP wire details the rest of the package relies on.

* :class:`LilyProperties` encodes ``x-retry-count`` as AMQP LongInt (type tag
  ``I``) whatever its value. pamqp picks the narrowest integer type for table
  values (``b`` for 0..127) and offers no per-value choice; overriding the
  header table encoding on this one properties subclass keeps every other
  value, and every other publisher in the process, on pamqp's defaults.
* :func:`basic_publish` is the one place that publishes: mandatory, confirmed,
  bounded by a timeout, with aiormq's errors mapped to :class:`PublishError`.
* :class:`InboundMessage` is one consumed delivery as the runtime reads and
  settles it, built straight from aiormq's delivered frame.
* :class:`AckCoalescer` writes one consuming channel's ACKs, coalesced into
  ``basic.ack(multiple=True)`` frames where :func:`_acks.plan_flush` allows it.
* :class:`LenientFrameReader` stands between a connection's socket and aiormq's
  frame decoder, so that one delivery whose metadata is not valid AMQP cannot
  take the connection down (see its docstring).
* :class:`LenientFrameReceiver` is aiormq's frame receiver for such a connection:
  it takes each checked frame whole from the reader and decodes the frames of a
  delivery (basic.deliver, content header, body) and heartbeats directly into
  the objects pamqp builds, leaving every other frame to pamqp
  (:func:`unmarshal_frame`).
* :func:`unbounded_frame_queue` lifts aiormq's 10-frame bound between the
  connection's reader and a consuming channel's (the prefetch bounds it).
"""

from __future__ import annotations

import asyncio
import secrets
import struct
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, cast

import aio_pika.abc
import aiormq
import aiormq.abc
import aiormq.connection
import aiormq.exceptions
from pamqp import body as pamqp_body
from pamqp import commands as spec
from pamqp import common, decode, encode
from pamqp import exceptions as pamqp_exceptions
from pamqp import frame as pamqp_frame
from pamqp import header as pamqp_header
from pamqp.heartbeat import Heartbeat

from ._acks import TagState, plan_flush
from ._text import sanitize
from .bounds import RETRY_COUNT_HEADER
from .errors import PublishError

__all__ = [
    "LONG_INT_HEADERS",
    "MALFORMED_HEADER",
    "AckCoalescer",
    "InboundMessage",
    "LenientFrameReader",
    "LenientFrameReceiver",
    "LilyProperties",
    "basic_publish",
    "encode_headers_table",
    "publish_properties",
    "republish",
    "unbounded_frame_queue",
    "unmarshal_frame",
]

# Headers always written as signed 32-bit LongInt (SPEC section 2).
LONG_INT_HEADERS: frozenset[str] = frozenset({RETRY_COUNT_HEADER})
_LONG_INT = struct.Struct(">i")


def _field_value(value: Any) -> Any:
    """pamqp encodes byte arrays from ``bytearray`` only; ``bytes`` (what MongoDB and most
    callers hand back) becomes a byte array too, nested values included."""
    if isinstance(value, bytes):
        return bytearray(value)
    if isinstance(value, dict):
        return {k: _field_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_field_value(v) for v in value]
    return value


def encode_headers_table(headers: Mapping[str, Any]) -> bytes:
    """Encode an AMQP field table like pamqp does, but LongInt for :data:`LONG_INT_HEADERS`."""
    if not headers:
        return common.Struct.integer.pack(0)
    parts: list[bytes] = []
    for key, value in sorted(headers.items()):
        parts.append(encode.short_string(key))
        if key in LONG_INT_HEADERS and type(value) is int:
            parts.append(b"I" + _LONG_INT.pack(value))
        elif isinstance(value, bytes | dict | list | tuple):
            parts.append(encode.encode_table_value(_field_value(value)))
        else:
            parts.append(encode.encode_table_value(value))
    payload = b"".join(parts)
    return common.Struct.integer.pack(len(payload)) + payload


class LilyProperties(spec.Basic.Properties):
    """Basic.Properties whose header table writes ``x-retry-count`` as LongInt."""

    def encode_property(self, name: str, value: common.FieldValue) -> bytes:
        if name == "headers" and isinstance(value, dict):
            return encode_headers_table(value)
        return super().encode_property(name, value)


async def basic_publish(
    channel: aiormq.abc.AbstractChannel,
    *,
    exchange: str,
    routing_key: str,
    body: bytes,
    headers: Mapping[str, Any],
    content_type: str | None,
    timeout: float,
    persistent: bool = True,
    expiration: str | None = None,
    properties: Mapping[str, Any] | None = None,
) -> None:
    """Publish mandatory on a confirming channel; return only once the broker confirmed.

    Raises :class:`PublishError` with kind ``unroutable`` (basic.return),
    ``nacked`` (basic.nack), ``timeout`` (no confirm in ``timeout`` seconds) or
    ``closed`` (the channel or connection failed).
    """
    frame_properties = LilyProperties(
        **(properties or {}),
        content_type=content_type,
        headers=dict(headers),
        delivery_mode=2 if persistent else 1,
        # A fresh id per publication: aiormq matches basic.return frames to
        # publishes by message_id, so copies of one event must not share it.
        message_id=uuid.uuid4().hex,
        expiration=expiration,
    )
    await publish_properties(
        channel, exchange=exchange, routing_key=routing_key, body=body, properties=frame_properties, timeout=timeout
    )


async def publish_properties(
    channel: aiormq.abc.AbstractChannel,
    *,
    exchange: str,
    routing_key: str,
    body: bytes,
    properties: LilyProperties,
    timeout: float,
) -> None:
    """:func:`basic_publish` with every AMQP property given: mandatory, confirmed, errors mapped."""
    frame_properties = properties
    where = f"exchange {exchange!r} routing key {routing_key!r}"
    try:
        frame_properties.marshal()  # encode now, so a bad header fails here, not in the writer
    except (TypeError, ValueError) as exc:
        raise PublishError("invalid", f"{where}: the message cannot be encoded as AMQP: {exc}"[:300]) from exc
    try:
        confirmation = await channel.basic_publish(
            body,
            exchange=exchange,
            routing_key=routing_key,
            properties=frame_properties,
            mandatory=True,
            timeout=timeout,
        )
    except aiormq.exceptions.PublishError as exc:
        raise PublishError("unroutable", f"{where}: returned by the broker as unroutable") from exc
    except aiormq.exceptions.DeliveryError as exc:
        raise PublishError("nacked", f"{where}: the broker nacked the message") from exc
    except TimeoutError as exc:
        raise PublishError("timeout", f"{where}: no publisher confirm within {timeout:g} s") from exc
    except (aiormq.exceptions.AMQPError, ConnectionError, asyncio.InvalidStateError, RuntimeError) as exc:
        raise PublishError("closed", f"{where}: channel failed ({type(exc).__name__})") from exc
    if not isinstance(confirmation, spec.Basic.Ack):
        raise PublishError("nacked", f"{where}: no publisher confirm (got {type(confirmation).__name__})")


class InboundMessage:
    """One consumed delivery: the fields the pipeline reads, and its settlement on its own channel.

    Built from aiormq's delivered frame in the consumer callback. aio-pika's
    ``IncomingMessage`` would set some thirty attributes through a Python
    ``__setattr__`` and run each callback in a second task; on a busy queue that
    costs about as much CPU as the whole delivery pipeline. The values are the
    same ones aio-pika exposes (headers, timestamp, ... as pamqp decoded them).
    A delivery is settled at most once: a second ACK/NACK/reject raises. Given the
    :class:`AckCoalescer` of its channel, it settles through it (its ACK may then
    share a frame with others); otherwise each settlement is a frame of its own.

    ``malformed`` is ``None``, or says which part of the delivery's metadata was not
    valid AMQP when it arrived (see :class:`LenientFrameReader`); the fields then
    hold the lenient reading, and the delivery is refused before anything else.
    Built from a ``basic.deliver`` (consuming) or a ``basic.get-ok`` (the DLQ tools).
    """

    __slots__ = (
        "_acks",
        "_properties",
        "_settled",
        "body",
        "channel",
        "content_type",
        "delivery_tag",
        "exchange",
        "headers",
        "malformed",
        "redelivered",
        "routing_key",
    )

    def __init__(self, delivered: aiormq.abc.DeliveredMessage, acks: AckCoalescer | None = None) -> None:
        properties = delivered.header.properties
        delivery = delivered.delivery
        assert isinstance(delivery, spec.Basic.Deliver | spec.Basic.GetOk)
        self._properties = properties
        self._settled = False
        self.body: bytes = delivered.body
        self.channel: aiormq.abc.AbstractChannel = delivered.channel
        self.content_type: str | None = properties.content_type
        self.delivery_tag: int = delivery.delivery_tag or 0
        self.exchange: str = delivery.exchange or ""
        headers: dict[str, Any] = properties.headers or {}
        self.headers = headers
        # The lenient reader's mark: a key no producer can know (see MALFORMED_HEADER).
        self.malformed: str | None = headers.pop(MALFORMED_HEADER, None)
        self.redelivered: bool = bool(delivery.redelivered)
        self.routing_key: str = delivery.routing_key or ""
        # Only the coalescer of this very channel: a delivery never settles on another one.
        if acks is not None and acks.channel is delivered.channel:
            acks.delivered(self.delivery_tag)
            self._acks: AckCoalescer | None = acks
        else:
            self._acks = None

    def __repr__(self) -> str:
        return f"<InboundMessage tag={self.delivery_tag} routing_key={self.routing_key!r} body={len(self.body)} bytes>"

    # Read only on failure paths (handoff copies, failure keys): straight from the frame.
    @property
    def message_id(self) -> str | None:
        return self._properties.message_id

    @property
    def correlation_id(self) -> str | None:
        return self._properties.correlation_id

    @property
    def reply_to(self) -> str | None:
        return self._properties.reply_to

    @property
    def app_id(self) -> str | None:
        return self._properties.app_id

    @property
    def content_encoding(self) -> str | None:
        return self._properties.content_encoding

    @property
    def priority(self) -> int | None:
        return self._properties.priority

    @property
    def timestamp(self) -> Any:
        return self._properties.timestamp

    @property
    def type(self) -> str | None:
        return self._properties.message_type

    @property
    def user_id(self) -> str | None:
        return self._properties.user_id

    def properties_with(self, headers: Mapping[str, Any], *, drop: tuple[str, ...] = ()) -> LilyProperties:
        """Every AMQP property of this delivery as it arrived, with ``headers`` as the header table
        and the properties named in ``drop`` left out (for a faithful copy of the message)."""
        values = {name: getattr(self._properties, name) for name in spec.Basic.Properties.__slots__}
        values["headers"] = dict(headers)
        for name in drop:
            values[name] = None
        values["cluster_id"] = values.get("cluster_id") or ""  # pamqp encodes only an empty one
        return LilyProperties(**values)

    def _claim(self, what: str) -> None:
        if self._settled:
            raise RuntimeError(f"delivery {self.delivery_tag} is already settled; refusing a second {what}")
        self._settled = True

    async def ack(self) -> None:
        """ACK; returns once a frame settling this delivery was written."""
        self._claim("ack")
        if self._acks is not None:
            await self._acks.ack(self.delivery_tag)
        else:
            await self.channel.basic_ack(self.delivery_tag)

    async def nack(self, *, requeue: bool = True) -> None:
        self._claim("nack")
        if self._acks is not None:
            await self._acks.alone(
                self.delivery_tag, lambda: self.channel.basic_nack(self.delivery_tag, requeue=requeue)
            )
        else:
            await self.channel.basic_nack(self.delivery_tag, requeue=requeue)

    async def reject(self, *, requeue: bool = False) -> None:
        self._claim("reject")
        if self._acks is not None:
            await self._acks.alone(
                self.delivery_tag, lambda: self.channel.basic_reject(self.delivery_tag, requeue=requeue)
            )
        else:
            await self.channel.basic_reject(self.delivery_tag, requeue=requeue)


Spawn = Callable[[Coroutine[Any, Any, None]], Any]
"""Starts a background task owned by the caller's supervisor (:meth:`TaskSet.spawn`)."""


class AckCoalescer:
    """One consuming channel's settlement frames: ACKs coalesced, NACKs and rejects in order.

    Every delivery of the channel is registered when it arrives (:meth:`delivered`),
    so the ledger knows each tag a ``multiple`` ACK would reach. :meth:`ack` marks
    the tag and waits until a frame settling it was written: the "ACK sent" point
    of SPEC section 3 stays where it was. A flush task writes what
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


# Properties a copy keeps from the original. Not message_id (a fresh one is
# needed, see above), not expiration (a retry copy must not expire on the way),
# not user_id (the broker checks it against the publishing connection's user).
_COPIED_PROPERTIES = ("correlation_id", "reply_to", "app_id", "content_encoding", "priority", "timestamp", "type")


async def republish(
    channel: aiormq.abc.AbstractChannel,
    message: aio_pika.abc.AbstractIncomingMessage | InboundMessage,
    *,
    routing_key: str,
    headers: Mapping[str, Any],
    timeout: float,
) -> None:
    """Publish a copy of ``message`` (same body and properties, given headers) through the default
    exchange to ``routing_key``, mandatory and confirmed: the retry/DLQ handoff and the DLQ replay."""
    kept = {name: getattr(message, name) for name in _COPIED_PROPERTIES if getattr(message, name, None) is not None}
    if "type" in kept:
        kept["message_type"] = kept.pop("type")
    await basic_publish(
        channel,
        exchange="",
        routing_key=routing_key,
        body=message.body,
        headers=headers,
        content_type=message.content_type,
        timeout=timeout,
        properties=kept,
    )


# -- reading frames leniently ------------------------------------------------------------------------
#
# aiormq decodes each frame with pamqp and, when one fails, drops the whole connection
# (InvalidFrameError). RabbitMQ accepts some metadata that pamqp cannot decode: a header
# name (a short string) or a short-string property (content_type, message_id, type, ...)
# that is not valid UTF-8, and a routing key that is not (through an exchange that routes
# it anyway). Such a delivery arrives first again after every reconnect, so one message
# would stall its queue for good. The reader below sits between one connection's socket
# and aiormq's frame receiver: it hands frames through untouched, except a basic.deliver /
# basic.get-ok or a content header that pamqp would refuse. Those it rewrites into what a
# lenient decoder reads (undecodable text replaced), and it marks the delivery with a
# header no producer can forge, so the consumer refuses it with a code instead of running
# it. Nothing process-wide changes: pamqp's functions are untouched, and only connections
# opened by this package (``connect_amqp``) use the reader.

# The mark: a header name made of 128 random bits at import, so no message from the wire
# can carry it; InboundMessage takes it out again before anything reads the headers.
MALFORMED_HEADER = f"x-lily-malformed-{secrets.token_hex(16)}"

_FRAME_HEAD = 7  # type (1), channel (2), payload size (4)
_FRAME_METHOD = 1
_FRAME_HEADER = 2
_FRAME_BODY = 3
_FRAME_HEARTBEAT = 8
_FRAME_TYPES = frozenset((_FRAME_METHOD, _FRAME_HEADER, _FRAME_BODY, _FRAME_HEARTBEAT))
_DELIVER = spec.Basic.Deliver.index.to_bytes(4)
_GET_OK = spec.Basic.GetOk.index.to_bytes(4)
# The Basic.Properties layout, in wire order: (name, flag bit, pamqp type).
_PROPERTIES = tuple(
    (name, spec.Basic.Properties.flags[name], getattr(spec.Basic.Properties, f"_{name}"))
    for name in spec.Basic.Properties.__slots__
)
_FIXED_WIDTH = {"octet": 1, "timestamp": 8}
# The short strings of basic.deliver and basic.get-ok, in wire order; None stands for the
# delivery tag and the redelivered bit (9 bytes). basic.get-ok ends with a message count.
_DELIVER_FIELDS = ("the consumer tag", None, "the exchange name", "the routing key")
_GET_OK_FIELDS = (None, "the exchange name", "the routing key")
_AMQP_NAMES = {"message_type": "type"}  # pamqp's attribute names that differ from the AMQP property names
_REASON_BYTES = 300


class LenientFrameReader:
    """One connection's incoming byte stream, as aiormq's frame receiver reads it.

    The receiver reads each frame in three calls (1 byte, 6 bytes, then the payload
    and the frame end). The reader reads the socket in large chunks instead and
    serves those calls from what it has checked: method frames and content
    headers are checked whole before they are handed out, body frames and
    heartbeats pass straight through. Reading in chunks also costs fewer calls
    than the receiver's three reads per frame from the socket's stream (about
    three deliveries arrive per chunk at full speed; bench_peers.py).

    Checking costs one scan per content header: the short strings and the header
    table are tested for plain ASCII (the common case: then pamqp decodes them).
    Only otherwise does pamqp itself try the frame, and only a frame that fails is
    rewritten. RabbitMQ parses a header table when it accepts a message (an unknown
    field type closes the publisher's connection), so a table's structure is sound;
    only its text can be undecodable.
    """

    __slots__ = ("_layouts", "_out", "_problems", "_reader", "_rest", "_skip", "_unread")

    _CHUNK = 256 * 1024

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self._out = b""  # checked bytes not handed out yet, from offset _unread
        self._unread = 0
        self._rest = b""  # bytes read from the socket, not checked yet
        self._skip = 0  # bytes of the current body frame (or of a stream we do not parse) to pass through
        self._problems: dict[int, str] = {}  # channel -> what its rewritten basic.deliver held
        self._layouts: dict[int, tuple[str, ...]] = {}  # property flags -> types present (a handful occur)

    def at_eof(self) -> bool:
        return self._unread == len(self._out) and not self._rest and self._reader.at_eof()

    async def read(self, n: int = -1) -> bytes:
        if self._unread < len(self._out) or self._rest:
            self._check()
            data, self._out, self._unread = self._out[self._unread :], b"", 0
            if self._rest:  # an incomplete frame: hand it out as it is
                data, self._rest, self._skip = data + self._rest, b"", 0
            return data
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
            chunk = await self._reader.read(self._CHUNK)
            if not chunk:
                partial = self._out[self._unread :] + self._rest
                self._out, self._unread, self._rest = b"", 0, b""
                raise asyncio.IncompleteReadError(partial, n)
            self._rest += chunk

    def take_frame(self) -> bytes | None:
        """The next frame, whole and checked, when the reader holds it; else None (nothing taken).

        Only frames of the four AMQP frame types are taken: anything else is left to
        aiormq's own reading, which judges it.
        """
        out, start = self._out, self._unread
        if len(out) - start < _FRAME_HEAD or len(out) < start + 8 + int.from_bytes(out[start + 3 : start + 7]):
            if not self._rest:
                return None
            self._check()
            out, start = self._out, self._unread
            if len(out) - start < _FRAME_HEAD:
                return None
        end = start + 8 + int.from_bytes(out[start + 3 : start + 7])
        if end > len(out) or out[start] not in _FRAME_TYPES:
            return None
        self._unread = end
        return out[start:end]

    def _check(self) -> None:
        """Move every complete frame of ``_rest`` (checked, rewritten if needed) to ``_out``."""
        data = self._rest
        if not data:
            return
        parts = [self._out[self._unread :]]
        offset, size = 0, len(data)
        while offset < size:
            if self._skip:
                take = min(self._skip, size - offset)
                parts.append(data[offset : offset + take])
                offset += take
                self._skip -= take
                continue
            if size - offset < _FRAME_HEAD:
                break
            kind = data[offset]
            if kind in (_FRAME_METHOD, _FRAME_HEADER):
                end = offset + _FRAME_HEAD + int.from_bytes(data[offset + 3 : offset + 7]) + 1
                if end > size:
                    break
                frame = data[offset:end]
                channel = int.from_bytes(data[offset + 1 : offset + 3])
                parts.append(
                    self._method(frame, channel) if kind == _FRAME_METHOD else self._content_header(frame, channel)
                )
                offset = end
            elif kind in (_FRAME_BODY, _FRAME_HEARTBEAT):
                self._skip = _FRAME_HEAD + int.from_bytes(data[offset + 3 : offset + 7]) + 1
            else:
                # Not a frame (the broker's protocol header, say): hand the rest through as it
                # is and leave the verdict to aiormq.
                self._skip = 1 << 62
        self._rest = data[offset:] if offset else data
        self._out, self._unread = b"".join(parts), 0

    def _method(self, frame: bytes, channel: int) -> bytes:
        method = frame[7:11]
        if method == _DELIVER:
            # Plain ASCII consumer tag, exchange and routing key (with their length bytes): readable.
            names = 12 + frame[11]
            if frame[12:names].isascii() and frame[names + 9 : -1].isascii():
                return frame
        elif method == _GET_OK:
            if frame[20:-5].isascii():
                return frame
        else:
            return frame
        try:
            problem, rewritten = _lenient_delivery(frame, channel, method == _DELIVER)
        except (IndexError, ValueError, TypeError, struct.error):
            return frame  # not a frame we can read either: leave the verdict to aiormq
        if problem is not None:
            self._problems[channel] = problem
            return rewritten
        return frame

    def _content_header(self, frame: bytes, channel: int) -> bytes:
        problem = self._problems.pop(channel, None) if self._problems else None
        payload = frame[7:-1]
        if problem is None:
            if _plain_properties(payload, self._layouts):
                return frame
            try:
                pamqp_header.ContentHeader().unmarshal(payload)
                return frame  # pamqp reads it: nothing to repair
            except (ValueError, TypeError, IndexError, struct.error):
                pass
        try:
            return _rewrite_content_header(payload, channel, problem)
        except (ValueError, TypeError, IndexError, struct.error):
            return frame


def _plain_properties(payload: bytes, layouts: dict[int, tuple[str, ...]]) -> bool:
    """True when every short string and the header table are ASCII and the layout fills the frame.

    ``layouts`` remembers, per property flags value, the types of the properties present.
    """
    try:
        flags = (payload[12] << 8) | payload[13]
        kinds = layouts.get(flags)
        if kinds is None:
            if flags & 1:
                return False  # a continuation flag word: let pamqp judge
            kinds = layouts[flags] = tuple(kind for _, bit, kind in _PROPERTIES if flags & bit)
        offset = 14
        for kind in kinds:
            if kind == "shortstr":
                end = offset + 1 + payload[offset]
                if not payload[offset + 1 : end].isascii():
                    return False
            elif kind == "table":
                end = offset + 4 + int.from_bytes(payload[offset : offset + 4])
                if not payload[offset + 4 : end].isascii():
                    return False
            else:
                end = offset + _FIXED_WIDTH[kind]
            offset = end
        return offset == len(payload)
    except (IndexError, KeyError):
        return False


def _lenient_text(raw: bytes, what: str, problems: list[str]) -> str:
    """``raw`` as text; undecodable bytes become U+FFFD (cut back to a short string's 255 bytes)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        problems.append(f"{what} is not valid UTF-8")
    text = raw.decode("utf-8", "replace")
    while len(text.encode("utf-8")) > 255:
        text = text[:-1]
    return text


def _lenient_delivery(frame: bytes, channel: int, deliver: bool) -> tuple[str | None, bytes]:
    """A basic.deliver / basic.get-ok whose exchange or routing key is not valid UTF-8, made readable.

    The frame is spliced rather than encoded again: pamqp refuses to encode exchange
    names it would happily decode.
    """
    problems: list[str] = []
    parts: list[bytes] = [frame[7:11]]
    offset = 11
    for what in _DELIVER_FIELDS if deliver else _GET_OK_FIELDS:
        if what is None:  # delivery tag (8 bytes) and the redelivered bit (1)
            parts.append(frame[offset : offset + 9])
            offset += 9
            continue
        size = frame[offset]
        raw = frame[offset + 1 : offset + 1 + size]
        offset += 1 + size
        if raw.isascii():
            parts.append(frame[offset - 1 - size : offset])
            continue
        text = _lenient_text(raw, what, problems)
        parts.append(encode.short_string(text))
    if not problems:
        return None, frame
    parts.append(frame[offset:-1])  # basic.get-ok's message count
    payload = b"".join(parts)
    return "; ".join(problems), b"".join(
        (bytes((_FRAME_METHOD,)), channel.to_bytes(2), len(payload).to_bytes(4), payload, frame[-1:])
    )


def _lenient_table(data: bytes, where: str, problems: list[str]) -> tuple[int, dict[str, Any]]:
    """pamqp's field table decoding, with undecodable names read leniently (nested ones too)."""
    end = 4 + int.from_bytes(data[0:4])
    if end > len(data):
        raise ValueError("field table length exceeds the frame")
    table: dict[str, Any] = {}
    offset = 4
    while offset < end:
        size = data[offset]
        name = _lenient_text(data[offset + 1 : offset + 1 + size], where, problems)
        offset += 1 + size
        consumed, value = _lenient_value(data[offset:], f"a nested header name in {sanitize(name, 40)!r}", problems)
        table[name] = value
        offset += consumed
    return end, table


def _lenient_value(data: bytes, where: str, problems: list[str]) -> tuple[int, Any]:
    tag = data[0:1]
    if tag == b"F":
        consumed, value = _lenient_table(data[1:], where, problems)
        return consumed + 1, value
    if tag == b"A":
        end = 5 + int.from_bytes(data[1:5])
        items: list[Any] = []
        offset = 5
        while offset < end:
            consumed, item = _lenient_value(data[offset:], where, problems)
            items.append(item)
            offset += consumed
        return end, items
    return decode.embedded_value(data)


def _rewrite_content_header(payload: bytes, channel: int, problem: str | None) -> bytes:
    """The content header as a lenient decoder reads it, marked with :data:`MALFORMED_HEADER`."""
    _, weight, body_size = struct.unpack(">HHQ", payload[0:12])
    problems = [problem] if problem else []
    values: dict[str, Any] = {}
    try:
        flags, offset, word = 0, 12, 0
        while True:
            part = int.from_bytes(payload[offset : offset + 2])
            flags |= part << (16 * word)
            offset, word = offset + 2, word + 1
            if not part & 1:
                break
        for name, bit, kind in _PROPERTIES:
            if not flags & bit:
                continue
            data = payload[offset:]
            if kind == "shortstr":
                values[name] = _lenient_text(data[1 : 1 + data[0]], f"property {_AMQP_NAMES.get(name, name)}", problems)
                consumed = 1 + data[0]
            elif kind == "table":
                consumed, values[name] = _lenient_table(data, "a header name", problems)
            else:
                consumed, values[name] = decode.by_type(data, kind)
            offset += consumed
    except (IndexError, ValueError, TypeError, struct.error):
        problems.append("the message properties cannot be parsed")
        values = {}
    reason = sanitize("; ".join(problems) or "the message properties cannot be decoded", _REASON_BYTES)
    headers = values.get("headers")
    values["headers"] = {**(headers if isinstance(headers, dict) else {}), MALFORMED_HEADER: reason}
    try:
        properties = LilyProperties(**values)
        return pamqp_frame.marshal(pamqp_header.ContentHeader(weight, body_size, properties), channel)
    except (ValueError, TypeError, struct.error):
        # The lenient reading does not encode again (a delivery mode pamqp refuses, say):
        # keep only the mark.
        properties = LilyProperties(headers={MALFORMED_HEADER: reason})
        return pamqp_frame.marshal(pamqp_header.ContentHeader(weight, body_size, properties), channel)


# -- decoding frames -----------------------------------------------------------------------------------
#
# aiormq's FrameReceiver reads each frame with three awaited reads into a BytesIO under a
# lock, then decodes it with pamqp's generic unmarshal (a table of types walked per field).
# A delivery is three frames (basic.deliver, content header, body), so that is most of the
# AMQP stack's cost per message. LenientFrameReceiver takes a frame the lenient reader has
# already checked whole in one step and decodes the four frames a consumer sees all the
# time directly; every other frame, and any frame the direct decoding does not read to
# the last byte, goes to pamqp as before. The objects are the ones pamqp builds, attribute
# for attribute (tests/property/test_frame_decoding_props.py compares them).

_Deliver = spec.Basic.Deliver
_Properties = spec.Basic.Properties
_new = object.__new__
_HEADER_HEAD = struct.Struct(">HHQ").unpack_from
_FRAME_END = 0xCE
# Header table values decoded here; the rest (arrays, floats, decimals, timestamps, byte
# arrays, unknown tags) go to pamqp's decoder.
_INT = {
    0x62: struct.Struct(">b").unpack_from,  # b
    0x42: struct.Struct(">B").unpack_from,  # B
    0x73: struct.Struct(">h").unpack_from,  # s
    0x75: struct.Struct(">H").unpack_from,  # u
    0x49: struct.Struct(">l").unpack_from,  # I
    0x69: struct.Struct(">L").unpack_from,  # i
    0x6C: struct.Struct(">q").unpack_from,  # l
    0x4C: struct.Struct(">q").unpack_from,  # L (pamqp reads it signed too)
}
_INT_WIDTH = {0x62: 1, 0x42: 1, 0x73: 2, 0x75: 2, 0x49: 4, 0x69: 4, 0x6C: 8, 0x4C: 8}


class _Unusual(Exception):
    """A frame the direct decoding leaves to pamqp."""


def unmarshal_frame(frame: bytes, layouts: dict[int, tuple[tuple[str, str], ...]]) -> tuple[int, int, Any]:
    """``pamqp.frame.unmarshal(frame)`` for one whole frame, as aiormq's receiver calls it.

    Returns what pamqp returns (bytes consumed, channel, frame object) and raises what
    aiormq raises for a frame pamqp refuses (``InvalidFrameError``). ``layouts`` caches,
    per property flags value, the (name, type) of the properties present.
    """
    try:
        decoded = _decode(frame, layouts)
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


def _decode(frame: bytes, layouts: dict[int, tuple[tuple[str, str], ...]]) -> tuple[int, int, Any] | None:
    size = len(frame)
    if frame[-1] != _FRAME_END or int.from_bytes(frame[3:7]) != size - 8:
        return None
    kind = frame[0]
    channel = (frame[1] << 8) | frame[2]
    if kind == _FRAME_BODY:
        return (size, channel, pamqp_body.ContentBody(frame[7:-1])) if size > 8 else None
    if kind == _FRAME_HEADER:
        return (size, channel, _content_header(frame, layouts)) if size > 8 else None
    if kind == _FRAME_METHOD:
        if frame[7:11] != _DELIVER:
            return None
        return size, channel, _deliver(frame)
    if kind == _FRAME_HEARTBEAT and size == 8:
        return 8, channel, Heartbeat()
    return None


def _deliver(frame: bytes) -> spec.Basic.Deliver:
    end = 12 + frame[11]
    consumer_tag = frame[12:end].decode()
    delivery_tag = int.from_bytes(frame[end : end + 8], signed=True)
    redelivered = bool(frame[end + 8] & 1)
    start = end + 10
    end = start + frame[start - 1]
    exchange = frame[start:end].decode()
    start = end + 1
    end = start + frame[start - 1]
    routing_key = frame[start:end].decode()
    if end != len(frame) - 1:
        raise _Unusual
    # pamqp's unmarshal builds the method with its defaults and then sets every field
    # without validating; so does this (no __init__: it would validate the defaults).
    method: spec.Basic.Deliver = _new(_Deliver)
    method.consumer_tag = consumer_tag
    method.delivery_tag = delivery_tag
    method.redelivered = redelivered
    method.exchange = exchange
    method.routing_key = routing_key
    return method


def _content_header(frame: bytes, layouts: dict[int, tuple[tuple[str, str], ...]]) -> pamqp_header.ContentHeader:
    class_id, weight, body_size = _HEADER_HEAD(frame, 7)
    flags = (frame[19] << 8) | frame[20]
    layout = layouts.get(flags)
    if layout is None:
        if flags & 1:
            raise _Unusual  # a second flag word: pamqp
        layout = layouts[flags] = tuple((name, kind) for name, bit, kind in _PROPERTIES if flags & bit)
    properties: spec.Basic.Properties = _new(_Properties)
    # Basic.Properties() without a property: what pamqp starts from.
    properties.content_type = properties.content_encoding = properties.headers = None
    properties.delivery_mode = properties.priority = properties.correlation_id = None
    properties.reply_to = properties.expiration = properties.message_id = None
    properties.timestamp = properties.message_type = properties.user_id = properties.app_id = None
    properties.cluster_id = ""
    offset, limit = 21, len(frame) - 1
    for name, kind in layout:
        value: Any
        if kind == "shortstr":
            start = offset + 1
            offset = start + frame[offset]
            value = frame[start:offset].decode()
        elif kind == "table":
            offset, value = _table(frame, offset, limit)
        elif kind == "octet":
            value = frame[offset]
            offset += 1
        else:
            consumed, value = decode.by_type(frame[offset:limit], kind)
            offset += consumed
        setattr(properties, name, value)
    if offset != limit:
        raise _Unusual
    header: pamqp_header.ContentHeader = _new(pamqp_header.ContentHeader)
    header.class_id = class_id
    header.weight = weight
    header.body_size = body_size
    header.properties = properties
    return header


def _table(frame: bytes, offset: int, bound: int) -> tuple[int, dict[str, Any]]:
    """The field table at ``offset``: (its end, its value). Every value must end inside the table.

    ``bound`` is where the enclosing table (or the frame's payload) ends.
    """
    limit = len(frame) - 1  # pamqp's decoders see the payload from the value on
    start = offset + 4
    end = start + int.from_bytes(frame[offset:start])
    if end > bound:
        raise _Unusual
    table: dict[str, Any] = {}
    offset = start
    while offset < end:
        start = offset + 1
        offset = start + frame[offset]
        key = frame[start:offset].decode()
        tag = frame[offset]
        offset += 1
        value: Any
        if tag == 0x53:  # S: long string, bytes when it is not UTF-8 (as pamqp reads it)
            start = offset + 4
            offset = start + int.from_bytes(frame[offset:start])
            raw = frame[start:offset]
            try:
                value = raw.decode()
            except UnicodeDecodeError:
                value = raw
        elif tag in _INT:
            value = _INT[tag](frame, offset)[0]
            offset += _INT_WIDTH[tag]
        elif tag == 0x74:  # t
            value = bool(frame[offset])
            offset += 1
        elif tag == 0x46:  # F
            offset, value = _table(frame, offset, end)
        elif tag == 0x56 or tag == 0:  # V and NUL: void
            value = None
        else:
            consumed, value = decode.embedded_value(frame[offset - 1 : limit])
            offset += consumed - 1
        if offset > end:
            raise _Unusual
        table[key] = value
    if offset != end:
        raise _Unusual
    return end, table


class LenientFrameReceiver(aiormq.connection.FrameReceiver):
    """aiormq's frame receiver for a connection read through a :class:`LenientFrameReader`.

    When the reader holds the next frame whole (checked), it is taken in one step and
    decoded with :func:`unmarshal_frame`; otherwise (the socket must be read, the
    protocol header, a stream that is not frames) aiormq's own reading runs as before,
    with its error mapping. aiormq reads frames from one task at a time (the connection
    handshake, then its reader task); the lock is still honoured.
    """

    def __init__(self, reader: LenientFrameReader) -> None:
        super().__init__(cast(asyncio.StreamReader, reader))
        self._frames = reader
        self._layouts: dict[int, tuple[tuple[str, str], ...]] = {}

    async def get_frame(self) -> tuple[int, int, Any]:
        if self.started and not self.lock.locked():
            frame = self._frames.take_frame()
            if frame is not None:
                return unmarshal_frame(frame, self._layouts)
        return await super().get_frame()


def unbounded_frame_queue(channel: aiormq.abc.AbstractChannel) -> None:
    """Let a consuming channel's incoming frame queue grow past aiormq's 10 frames.

    aiormq's connection reader task puts every frame into its channel's queue, which the
    channel's own reader task empties; aio-pika opens channels with aiormq's default bound
    of 10 frames. At full speed that queue is always full, so the two tasks hand over to
    each other every frame or so (a future resolved and a loop turn per frame, and the
    consumer's work split into small slices). Unbounded, the connection reader moves a
    whole socket read's frames at once. What the queue can hold stays bounded by the
    channel's prefetch: the broker sends no delivery past it, and the channel's reader
    turns each delivery into a message (a task) as fast as before anyway. aio-pika offers
    no way to pass aiormq's ``frame_buffer_size`` when it opens a channel, so the bound
    of this one queue is lifted in place.
    """
    frames = channel.frames
    if isinstance(frames, asyncio.Queue):
        frames._maxsize = 0  # type: ignore[attr-defined]  # asyncio.Queue keeps its bound here
