"""lily's frame decoding gives exactly what aiormq gets from pamqp (no broker).

:func:`lily_mongo._amqp.receiver.unmarshal_frame` decodes basic.deliver, content headers, bodies
and heartbeats directly and leaves every other frame to ``pamqp.frame.unmarshal``. For
generated frames (hot ones with random fields, property subsets and header tables of
every field type; other methods; and all of them damaged: cut short, lengthened, with a
wrong frame end) it must return the same (bytes consumed, channel, frame object), object
for object and attribute for attribute, or raise what aiormq's receiver raises. Read as a
connection reads them (:class:`FastFrameReceiver` over a :class:`LenientFrameReader`),
a stream of such frames split at any byte across two socket reads decodes to the same.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import aiormq.exceptions
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands as spec
from pamqp import exceptions as pamqp_exceptions
from pamqp import frame as pamqp_frame

from lily_mongo._amqp.codec import decode_frame
from lily_mongo._amqp.lenient import LenientFrameReader
from lily_mongo._amqp.patches import FastFrameReceiver
from lily_mongo._amqp.receiver import unmarshal_frame
from tests.support.equality import same
from tests.support.frames import short_bytes


def wire(channel: int, kind: int, payload: bytes, end: bytes = b"\xce") -> bytes:
    return bytes((kind,)) + channel.to_bytes(2) + len(payload).to_bytes(4) + payload + end


def pamqp_verdict(frame: bytes) -> tuple[int, int, Any] | BaseException:
    """What aiormq's FrameReceiver returns or raises for ``frame``."""
    try:
        return pamqp_frame.unmarshal(frame)
    except pamqp_exceptions.PAMQPException as exc:
        return aiormq.exceptions.InvalidFrameError(str(exc))
    except Exception as exc:  # aiormq lets anything else through as it is
        return exc


def lily_verdict(frame: bytes) -> tuple[int, int, Any] | BaseException:
    try:
        return unmarshal_frame(frame, {})
    except Exception as exc:
        return exc


# -- generated frames -------------------------------------------------------------------------------

channels = st.integers(0, 65535)
# Short-string bytes: mostly text (ASCII or not), sometimes bytes that are not UTF-8.
texts = st.text(max_size=40).map(lambda text: text.encode()[:255]) | st.binary(max_size=30)
utf8_texts = st.text(max_size=40).map(lambda text: text.encode()[:255]).filter(lambda raw: _utf8(raw))


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


def _packed(fmt: str, values: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    return values.map(lambda value: struct.pack(fmt, value))


def _long(raw: bytes) -> bytes:
    return len(raw).to_bytes(4) + raw


def field_values(keys: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """One tagged header table value, of any field type pamqp knows (tables and arrays nested)."""
    leaves = st.one_of(
        (texts | st.binary(max_size=20)).map(lambda raw: b"S" + _long(raw)),
        _packed(">b", st.integers(-128, 127)).map(lambda raw: b"b" + raw),
        _packed(">B", st.integers(0, 255)).map(lambda raw: b"B" + raw),
        _packed(">h", st.integers(-(2**15), 2**15 - 1)).map(lambda raw: b"s" + raw),
        _packed(">H", st.integers(0, 2**16 - 1)).map(lambda raw: b"u" + raw),
        _packed(">l", st.integers(-(2**31), 2**31 - 1)).map(lambda raw: b"I" + raw),
        _packed(">L", st.integers(0, 2**32 - 1)).map(lambda raw: b"i" + raw),
        _packed(">q", st.integers(-(2**63), 2**63 - 1)).map(lambda raw: b"l" + raw),
        _packed(">q", st.integers(-(2**63), 2**63 - 1)).map(lambda raw: b"L" + raw),
        st.integers(0, 255).map(lambda octet: b"t" + bytes((octet,))),
        st.binary(min_size=4, max_size=4).map(lambda raw: b"f" + raw),
        st.binary(min_size=8, max_size=8).map(lambda raw: b"d" + raw),
        st.binary(min_size=5, max_size=5).map(lambda raw: b"D" + raw),
        _packed(">Q", st.integers(0, 2**42) | st.integers(0, 2**64 - 1)).map(lambda raw: b"T" + raw),
        st.just(b"V"),
        st.just(b"\x00"),
        st.binary(max_size=10).map(lambda raw: b"x" + _long(raw)),
    )
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4).map(lambda items: b"A" + _long(b"".join(items))),
            st.lists(st.tuples(keys, inner), max_size=4).map(
                lambda entries: b"F" + _long(b"".join(short_bytes(k) + v for k, v in entries))
            ),
        ),
        max_leaves=8,
    )


def tables(keys: st.SearchStrategy[bytes] = texts) -> st.SearchStrategy[bytes]:
    entries = st.lists(st.tuples(keys, field_values(keys)), max_size=8)
    return entries.map(lambda entries: _long(b"".join(short_bytes(k) + v for k, v in entries)))


def property_fields(keys: st.SearchStrategy[bytes], strings: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """The flags and values of a random subset of the properties (AMQP 0-9-1 order)."""
    by_type = {
        "shortstr": strings.map(short_bytes),
        "octet": st.integers(0, 255).map(lambda octet: bytes((octet,))),
        "timestamp": _packed(">Q", st.integers(0, 2**42) | st.integers(0, 2**64 - 1)),
        "table": tables(keys),
    }
    props = spec.Basic.Properties
    layout = [(props.flags[name], props.amqp_type(name)) for name in props.__slots__]

    @st.composite
    def build(draw: st.DrawFn) -> bytes:
        present = draw(st.lists(st.booleans(), min_size=len(layout), max_size=len(layout)))
        flags, parts = 0, []
        for (bit, kind), chosen in zip(layout, present, strict=True):
            if chosen:
                flags |= bit
                parts.append(draw(by_type[kind]))
        return flags.to_bytes(2) + b"".join(parts)

    return build()


def deliver_payloads(strings: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    return st.builds(
        lambda ctag, tag, bit, exchange, key: (
            b"\x00\x3c\x00\x3c"
            + short_bytes(ctag)
            + tag.to_bytes(8)
            + bytes((bit,))
            + short_bytes(exchange)
            + short_bytes(key)
        ),
        strings,
        st.integers(0, 2**64 - 1),
        st.integers(0, 255),
        strings,
        strings,
    )


def header_payloads(keys: st.SearchStrategy[bytes], strings: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    return st.builds(
        lambda class_id, weight, size, fields: class_id.to_bytes(2) + weight.to_bytes(2) + size.to_bytes(8) + fields,
        st.sampled_from([60, 0, 10]),
        st.sampled_from([0, 0, 1]),
        st.integers(0, 2**64 - 1),
        property_fields(keys, strings),
    )


def other_methods(strings: st.SearchStrategy[str]) -> st.SearchStrategy[bytes]:
    """Frames of methods the direct decoding leaves to pamqp, marshalled by pamqp."""
    methods = st.one_of(
        st.builds(spec.Basic.ConsumeOk, consumer_tag=strings),
        st.builds(spec.Basic.CancelOk, consumer_tag=strings),
        st.builds(spec.Basic.Ack, delivery_tag=st.integers(0, 2**63 - 1), multiple=st.booleans()),
        st.builds(spec.Basic.Nack, delivery_tag=st.integers(0, 2**63 - 1), requeue=st.booleans()),
        st.builds(spec.Basic.QosOk),
        st.builds(spec.Confirm.SelectOk),
        st.builds(
            spec.Queue.DeclareOk,
            queue=st.from_regex(r"[a-zA-Z0-9_.:-]{0,40}", fullmatch=True),
            message_count=st.integers(0, 2**31),
            consumer_count=st.integers(0, 2**31),
        ),
        st.builds(
            spec.Channel.Close,
            reply_code=st.integers(0, 999),
            reply_text=strings,
            class_id=st.integers(0, 100),
            method_id=st.integers(0, 100),
        ),
        st.builds(
            spec.Basic.GetOk,
            delivery_tag=st.integers(0, 2**63 - 1),
            redelivered=st.booleans(),
            exchange=st.just("amq.direct"),
            routing_key=strings,
            message_count=st.integers(0, 2**31),
        ),
    )
    return st.tuples(methods, channels).map(lambda pair: pamqp_frame.marshal(pair[0], pair[1]))


short_text = st.text(max_size=30).filter(lambda text: len(text.encode()) <= 255)


def frames(keys: st.SearchStrategy[bytes], strings: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """One whole frame of any kind a consumer sees."""
    return st.one_of(
        st.tuples(channels, deliver_payloads(strings)).map(lambda pair: wire(pair[0], 1, pair[1])),
        st.tuples(channels, header_payloads(keys, strings)).map(lambda pair: wire(pair[0], 2, pair[1])),
        st.tuples(channels, st.binary(min_size=1, max_size=300)).map(lambda pair: wire(pair[0], 3, pair[1])),
        st.just(wire(0, 8, b"")),
        other_methods(short_text),
    )


@st.composite
def damaged(draw: st.DrawFn, frame: bytes) -> bytes:
    """``frame`` as it is, or with its payload cut or lengthened, or its frame end or type changed."""
    how = draw(st.sampled_from(["as is", "cut", "lengthen", "end", "type", "size"]))
    payload = frame[7:-1]
    if how == "cut":
        return wire(int.from_bytes(frame[1:3]), frame[0], payload[: draw(st.integers(0, len(payload)))])
    if how == "lengthen":
        return wire(int.from_bytes(frame[1:3]), frame[0], payload + draw(st.binary(min_size=1, max_size=8)))
    if how == "end":
        return frame[:-1] + bytes((draw(st.integers(0, 255).filter(lambda b: b != 0xCE)),))
    if how == "type":
        return bytes((draw(st.sampled_from([0, 1, 2, 3, 4, 8, 65])),)) + frame[1:]
    if how == "size":
        return frame[:3] + draw(st.integers(0, len(payload) + 2)).to_bytes(4) + frame[7:]
    return frame


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_frame_decodes_as_pamqp_decodes_it(data: st.DataObject) -> None:
    frame = data.draw(frames(texts, texts))
    frame = data.draw(damaged(frame))
    expected, got = pamqp_verdict(frame), lily_verdict(frame)
    assert same(got, expected), (frame, got, expected)


# Frames pamqp reads (its objects, not an error).
readable = frames(utf8_texts, utf8_texts).filter(lambda frame: not isinstance(pamqp_verdict(frame), BaseException))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(readable)
def test_pamqp_objects_compare_equal(frame: bytes) -> None:
    expected, got = pamqp_verdict(frame), lily_verdict(frame)
    assert same(got, expected)
    assert isinstance(got, tuple)
    assert isinstance(expected, tuple)
    if hasattr(expected[2], "properties"):
        assert same(got[2].properties, expected[2].properties)  # a NaN header value is not == itself
    # Read directly, not handed to pamqp: every well-formed hot frame.
    hot = frame[0] in (2, 3, 8) or frame[7:11] == spec.Basic.Deliver.index.to_bytes(4)
    assert (decode_frame(frame, {}) is not None) == hot


class Pieces:
    """A socket's stream that returns the given pieces, one per read."""

    def __init__(self, pieces: list[bytes]) -> None:
        self._pieces = [piece for piece in pieces if piece]

    async def read(self, n: int = -1) -> bytes:
        return self._pieces.pop(0) if self._pieces else b""

    def at_eof(self) -> bool:
        return not self._pieces


async def receive(pieces: list[bytes], count: int) -> list[tuple[int, int, Any]]:
    receiver = FastFrameReceiver(LenientFrameReader(Pieces(pieces)))  # type: ignore[arg-type]
    return [await receiver.get_frame() for _ in range(count)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.lists(readable, min_size=1, max_size=4))
def test_a_stream_split_at_any_byte_decodes_alike(stream_frames: list[bytes]) -> None:
    # A heartbeat first: aiormq's own reading takes a connection's first frame (it checks
    # for a protocol header there); the rest come through the direct path when they can.
    stream_frames = [wire(0, 8, b""), *stream_frames]
    data = b"".join(stream_frames)
    expected = [pamqp_frame.unmarshal(frame) for frame in stream_frames]
    for cut in range(len(data) + 1):
        got = asyncio.run(receive([data[:cut], data[cut:]], len(stream_frames)))
        assert same(got, expected), cut
